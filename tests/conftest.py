import json
import os
import subprocess
import sys
from pathlib import Path

# No test may reach the Hub: a stray lookup costs ~25 s of retries before failing.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"  # tests that exercise wandb set their own mode

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import pytest
import torch
from hydra import compose, initialize_config_dir

torch.set_num_threads(2)

TINY_DIR = REPO_ROOT / "assets" / "tiny-llama"
HH_TEST_FILE = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base" / "test.jsonl.gz"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def arithmetic_pairs(n: int) -> list[dict]:
    """A learnable preference set: the chosen answer is right and polite, the rejected one wrong and rude."""
    return [
        {"prompt": f"Q: {a} + {b}?\nA:", "chosen": f" {a + b}, glad to help.", "rejected": f" {a + b + 3}, go away."}
        for a, b in ((i % 7 + 1, i % 5 + 2) for i in range(n))
    ]


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_DIR)


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(48))


def tiny_run_overrides(tmp_path: Path, pairs_file: Path) -> list[str]:
    """A fast tiny-model run in tmp_path: 40 training pairs in 5 steps of 8, evals on 8 held-out pairs."""
    return [
        "model=tiny",
        f"datasets=[{pairs_file}]",
        "wandb.enabled=false",
        f"local_run_dir={tmp_path / 'run'}",
        f"local_dirs=[{tmp_path}]",
        "batch_size=8",
        "eval_batch_size=8",
        "eval_every=16",
        "n_eval_examples=8",
        "n_epochs=1",
        "lr=1e-3",
        "warmup_steps=0",
        "minimum_log_interval_secs=0",
    ]


@pytest.fixture
def make_config(tmp_path, pairs_file):
    """A composed config for a fast tiny-model run in tmp_path; extra Hydra overrides go last."""
    import train  # noqa: F401  (registers the repo_path resolver)

    def make(*overrides: str):
        with initialize_config_dir(str(REPO_ROOT / "config"), version_base="1.3"):
            return compose("config", overrides=tiny_run_overrides(tmp_path, pairs_file) + list(overrides))

    return make


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 300, launcher: tuple[str, ...] = (sys.executable,)) -> subprocess.CompletedProcess:
    """`train.py args` in a subprocess (with `launcher`, e.g. torchrun), offline; env_extra values of None unset."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run([*launcher, str(REPO_ROOT / "train.py"), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
