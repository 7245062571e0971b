"""This tree's training step against another version's (--versus GIT_REF [--rounds N]): each version runs its own
worker (bench.step's, or its bench.py's) in fresh processes, the two alternating, 2 rounds unless told: pairs/s, MFU,
the share of the machine's fastest matmul rate, peak RSS."""

import os
import tempfile
from pathlib import Path

import torch

from bench.common import HH_FILE, code_at, smollm2_dir, with_machine_rates, worker_subprocess, workload_overrides
from bench.step import lever_worker
from modeling.precision import REQUIRED_SPEEDUP, cpu_flags, cpu_matmul_flops, cpu_name
from utils import REPO_ROOT


def bench_versus(ref: str, warmup: int, steps: int, rounds: int) -> None:
    """This tree's training step against the code at `ref`, on the default configuration at 256 x 4 and 512 x 8 and
    in float32 (what `auto` picks on a CPU without fast bfloat16; measured separately only where the default is
    bfloat16) at 256 x 4: each run in a fresh process, the two versions alternating, `rounds` rounds (runs of one
    version vary by ~10% on a shared machine, so more rounds give a steadier ratio)."""
    model_dir = smollm2_dir()
    rates = cpu_matmul_flops(REPO_ROOT / ".cache")
    peak_dtype = max(rates, key=rates.get)
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
        f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; matmul {rates['float32'] / 1e9:.0f} GFLOP/s float32, "
        f"{rates['bfloat16'] / 1e9:.0f} bfloat16; torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"SmolLM2-135M-Instruct, first 48 pairs of {HH_FILE.name}, DPO beta 0.1, AdamW; {warmup} warm-up + {steps} "
        f"timed steps; {ref} against this tree, alternating, {rounds} rounds, each run in a fresh process; "
        f"'of peak': useful FLOP/s as a share of the faster matmul rate here ({peak_dtype})"
    )
    workloads = [("default", 256, 4, []), ("default", 512, 8, [])]
    if rates["bfloat16"] >= REQUIRED_SPEEDUP * rates["float32"]:  # else the default is the float32 path already
        workloads.append(("float32", 256, 4, ["model.fsdp_policy_mp=null"]))
    with code_at(ref) as old:
        for name, max_length, batch, extra in workloads:
            print(f"\n{name} at max_length {max_length} x {batch} pairs per step")
            print(f"{'code':12s} {'pairs/s':>8s} {'MFU':>6s} {'of peak':>8s} {'peak RSS':>9s}  precision")
            speeds = {ref: [], "this tree": []}
            for _ in range(rounds):
                for label, root in ((ref, old), ("this tree", REPO_ROOT)):
                    with tempfile.TemporaryDirectory() as tmp:
                        overrides = [*workload_overrides(model_dir, with_machine_rates(tmp), max_length, batch), *extra]
                        result = worker_subprocess(lever_worker, str(Path(tmp) / "result.json"), root,
                                                   overrides=overrides, warmup=warmup, steps=steps)  # fmt: skip
                    speeds[label].append(result["pairs_per_second"])
                    # MFU is against the compute dtype's rate; "of peak" against the machine's fastest one
                    of_peak = result["mfu"] * rates[result["precision"]] / rates[peak_dtype]
                    print(
                        f"{label:12s} {result['pairs_per_second']:8.3f} {result['mfu']:6.1%} {of_peak:8.1%} "
                        f"{result['peak_memory_gib']:7.2f} GiB  {result['precision']}",
                        flush=True,
                    )
            ratio = sum(speeds["this tree"]) / sum(speeds[ref])
            print(f"this tree / {ref}: {ratio:.2f}x pairs/s")
