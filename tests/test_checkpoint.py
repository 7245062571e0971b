"""Checkpoints (checkpoint.py): atomic directories, one-line errors, and the format of earlier versions."""

from pathlib import Path

import pytest
import torch

import train
from checkpoint import replace_dir
from conftest import assert_same_metrics, build_trainer, read_jsonl
from utils import UserError


def test_replace_dir_swaps_whole_directories(tmp_path):
    final = tmp_path / "LATEST"
    final.mkdir()
    (final / "policy.pt").write_text("old")
    (final / "only-in-old").write_text("x")
    new = tmp_path / "LATEST.tmp"
    new.mkdir()
    (new / "policy.pt").write_text("new")
    replace_dir(new, final)
    assert {p.name for p in final.iterdir()} == {"policy.pt"} and (final / "policy.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_replace_dir_after_a_crash_between_renames(tmp_path):
    # A crash after moving the old directory aside leaves LATEST.old complete and no LATEST.
    (tmp_path / "LATEST.old").mkdir()
    new = tmp_path / "LATEST.tmp"
    new.mkdir()
    (new / "policy.pt").write_text("new")
    replace_dir(new, tmp_path / "LATEST")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_save_ignores_leftovers_of_a_crashed_save(make_config):
    trainer = build_trainer(make_config())
    stale = trainer.run_dir / "step-8.tmp"
    stale.mkdir()
    (stale / "stale.bin").write_text("from a crashed save")
    trainer.save(trainer.run_dir / "step-8", {"loss/eval": 0.5}, export_hf=False)
    assert sorted(p.name for p in (trainer.run_dir / "step-8").iterdir()) == [
        "optimizer.pt",
        "policy.pt",
        "scheduler.pt",
    ]
    assert not stale.exists()


def test_resume_from_a_bad_checkpoint_is_one_clear_line(make_config, tmp_path):
    with pytest.raises(UserError, match=r"resume_from=.*: .*nowhere/policy.pt does not exist"):
        build_trainer(make_config(f"resume_from={tmp_path / 'nowhere'}"))
    config = make_config(f"local_run_dir={tmp_path / 'first'}", "n_examples=8")
    train.run(config)
    latest = tmp_path / "first" / "LATEST"
    with pytest.raises(UserError, match=r"examples seen is not a multiple of batch_size=16"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'second'}", "batch_size=16", f"resume_from={latest}"))
    optimizer = torch.load(latest / "optimizer.pt", weights_only=True)
    optimizer["state"]["param_groups"].append(optimizer["state"]["param_groups"][0])
    torch.save(optimizer, latest / "optimizer.pt")
    with pytest.raises(UserError, match=r"optimizer.pt does not fit this AdamW"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'third'}", f"resume_from={latest}"))


CHECKPOINT_419E2F5 = Path(__file__).parent / "assets" / "checkpoint-419e2f5"


def test_a_checkpoint_written_before_the_refactor_resumes_exactly(make_config):
    # Written by commit 419e2f5 (before checkpoint.py existed) on conftest's tiny run with eval_every=16: its
    # step-16 checkpoint, and beside it that run's metrics and final weights. Resumed by today's code, the run ends
    # where it did.
    config = make_config("eval_every=16", f"resume_from={CHECKPOINT_419E2F5 / 'step-16'}")
    train.run(config)
    expected = [r for r in read_jsonl(CHECKPOINT_419E2F5 / "metrics.jsonl") if r["step"] > 16]
    assert [r["step"] for r in expected] == [24, 32, 32, 40, 40]
    resumed = read_jsonl(Path(config.local_run_dir) / "metrics.jsonl")
    # nonfinite_steps came later: none here, and the records are otherwise the old ones
    assert [r.pop("nonfinite_steps") for r in resumed if "loss/train" in r] == [0.0, 0.0, 0.0]
    assert_same_metrics(expected, resumed)
    expected_weights = torch.load(CHECKPOINT_419E2F5 / "final-policy.pt", weights_only=True)["state"]
    weights = torch.load(Path(config.local_run_dir) / "LATEST" / "policy.pt", weights_only=True)["state"]
    assert weights.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)
