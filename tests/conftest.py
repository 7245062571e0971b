import json
import os
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


@pytest.fixture
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_DIR)


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(48))


@pytest.fixture
def make_config(tmp_path, pairs_file):
    """A composed config for a fast tiny-model run in tmp_path; extra Hydra overrides go last."""
    import train  # noqa: F401  (registers the repo_path resolver)

    def make(*overrides: str):
        base = [
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
        with initialize_config_dir(str(REPO_ROOT / "config"), version_base="1.3"):
            return compose("config", overrides=base + list(overrides))

    return make


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]
