"""host_memory.py: a training process puts PyTorch's large CPU blocks on transparent huge pages."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

pytestmark = pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages in this kernel"
)

# A fresh process: `setup` runs first, then a 64 MiB tensor is allocated and freed 5 times (as a step frees and
# allocates again its activations); it prints the page faults of the last 4, and the huge-page memory while one is held.
PROBE = """
import json, resource, sys
sys.path.insert(0, {root!r})
{setup}
import torch
torch.ones(2**24).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    torch.ones(2**24).sum()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
held = torch.ones(2**24)
huge = [line for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHugePages")][0].split()[1]
print(json.dumps({{"faults": faults, "huge_kib": int(huge)}}))
"""


def probe(setup: str, **environment) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    code = PROBE.format(root=str(ROOT), setup=setup)
    out = subprocess.run([sys.executable, "-c", code], env={**env, **environment}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


TUNE = "from reporting.host_memory import use_huge_pages\nuse_huge_pages()"


def test_large_blocks_go_on_huge_pages_with_512_times_fewer_faults():
    untuned, tuned = probe(""), probe(TUNE)
    assert untuned["huge_kib"] == 0 and tuned["huge_kib"] >= 32 * 1024
    assert untuned["faults"] > 8000  # 64 MiB faulted in again at every allocation: 16k pages of 4 KiB
    assert tuned["faults"] < 1000  # 32 pages of 2 MiB


def test_train_py_sets_it_up_before_torch_allocates():
    assert probe("import train")["huge_kib"] >= 32 * 1024


def test_the_users_own_setting_wins():
    assert probe(TUNE, THP_MEM_ALLOC_ENABLE="0")["huge_kib"] == 0
