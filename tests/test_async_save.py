"""Checkpoints written in the background (save_async=true, checkpoint.save_in_background): training goes on while
the files are written, the checkpoint is taken for one only once every write is complete, it holds what a
synchronous save of the same step holds (a run resumed from it ends where the synchronous run did), and a kill -9
in the middle of the writing leaves the last complete checkpoint for resume_from=auto. FSDP on 2 processes:
test_distributed.py; storage faults: test_disk_faults.py; kills at seeded moments: test_crash_resume.py."""

import json
import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import train
import trainers
from conftest import MEASURED, arithmetic_pairs, read_jsonl, tiny_run_overrides, write_jsonl
from persistence import checkpoint
from persistence.checkpoint_parts import ModelWeights
from test_crash_resume import FAULTS_DIR, assert_equal_checkpoints
from utils import Interrupted

CHECKPOINTS = ("step-8", "step-16", "step-24", "step-32", "LATEST")  # a checkpoint every step of 5, and the last


def computed(run_dir: Path) -> list[dict]:
    """The run's records without what is measured (throughput, memory)."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in read_jsonl(run_dir / "metrics.jsonl")]


def fresh(directory: Path) -> Path:
    """A new empty directory (scratch space for assert_equal_checkpoints)."""
    directory.mkdir(parents=True)
    return directory


def assert_same_run(expected: Path, actual: Path, scratch: Path, names=CHECKPOINTS) -> None:
    """The same records, and checkpoints of the same steps holding the same markers, weights, optimizer states and
    schedulers, bit for bit."""
    assert computed(actual) == computed(expected)
    for name in names:
        assert json.loads((actual / name / checkpoint.MARKER).read_text()) == checkpoint.describe(expected / name)
        assert_equal_checkpoints(expected / name, actual / name, fresh(scratch / name))
        scheduler = [torch.load(d / name / "scheduler.pt", weights_only=True) for d in (expected, actual)]
        assert scheduler[0] == scheduler[1], name


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """(the synchronous run, in this process: a checkpoint after each of its 5 steps; its overrides)."""
    root = tmp_path_factory.mktemp("async")
    overrides = [*tiny_run_overrides(root, write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))), "save_every=8"]
    train.run(train.configuration.load([*overrides, f"local_run_dir={root / 'sync'}"]))
    return root / "sync", overrides


def test_training_goes_on_while_a_checkpoint_is_written_and_it_is_one_only_once_written(whole, tmp_path, monkeypatch):
    """The write of step-16's weights is held until training has taken the next step (the save after it waits for
    that write): training goes on meanwhile (a save that stopped it would wait for ever), step-16 is no checkpoint
    until its files are written (no step-16, no checkpoint.json in its temporary directory: resume_from=auto would
    take step-8), and it then holds step 16's state, not the state of the step taken meanwhile: every checkpoint
    and record as the synchronous run's."""
    sync_dir, overrides = whole
    run_dir, trained_on, seen = tmp_path / "async", threading.Event(), {}
    train_step = trainers.Trainer.train_step

    def counted_step(trainer, examples):
        metrics = train_step(trainer, examples)
        if trainer.batch_counter == 2:  # this step is the third, the one after the save at 16 examples
            trained_on.set()
        return metrics

    real_write = ModelWeights.write

    def held_write(part, state, directory, world_size, process_group=None):
        if directory.parent.name == "step-16.tmp":
            seen["trained on"] = trained_on.wait(timeout=120)
            seen["step-16"] = (run_dir / "step-16").exists()
            seen["marker"] = (directory.parent / checkpoint.MARKER).exists()
            seen["newest"] = checkpoint.newest(run_dir)
        if directory.parent.name == "step-24.tmp":  # one save at a time: the next one waited for step-16's
            seen["step-16 before step-24"] = checkpoint.describe(run_dir / "step-16") is not None
        real_write(part, state, directory, world_size, process_group)

    monkeypatch.setattr(ModelWeights, "write", held_write)
    monkeypatch.setattr(trainers.Trainer, "train_step", counted_step)
    train.run(train.configuration.load([*overrides, f"local_run_dir={run_dir}", "save_async=true"]))
    expected = {"trained on": True, "step-16": False, "marker": False, "newest": run_dir / "step-8"}
    assert seen == {**expected, "step-16 before step-24": True}
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == sorted(CHECKPOINTS)
    assert_same_run(sync_dir, run_dir, tmp_path)


def test_ctrl_c_while_a_checkpoint_is_written_in_the_background_completes_it_and_the_stops_own(
    whole, tmp_path, monkeypatch
):
    """Ctrl-C at the step after step-16's save, its write held until then: the run stops after that step (24
    examples) with step-16 complete and the stop's own checkpoint, step-24, written (in the background too) before
    the run ends; both as the synchronous run's. The same command again (resume_from=auto) continues from step-24
    and ends with the synchronous run's records and checkpoints."""
    sync_dir, overrides = whole
    run_dir, stopped = tmp_path / "async", threading.Event()
    command = [*overrides, f"local_run_dir={run_dir}", "save_async=true", "resume_from=auto"]
    train_step = trainers.Trainer.train_step

    def interrupted_step(trainer, examples):
        metrics = train_step(trainer, examples)
        if trainer.batch_counter == 2:  # this step is the third, the first after the save at 16 examples
            os.kill(os.getpid(), signal.SIGINT)
            stopped.set()
        return metrics

    real_write = ModelWeights.write

    def held_write(part, state, directory, world_size, process_group=None):
        if directory.parent.name == "step-16.tmp":
            assert stopped.wait(timeout=120)
        real_write(part, state, directory, world_size, process_group)

    with monkeypatch.context() as patched:
        patched.setattr(ModelWeights, "write", held_write)
        patched.setattr(trainers.Trainer, "train_step", interrupted_step)
        with pytest.raises(Interrupted, match="^stopped by SIGINT after 24 examples; the checkpoint is .*step-24"):
            train.run(train.configuration.load(command))
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["step-16", "step-24", "step-8"]
    for name in ("step-8", "step-16", "step-24"):
        assert_equal_checkpoints(sync_dir / name, run_dir / name, fresh(tmp_path / name))
    train.run(train.configuration.load(command))
    assert_same_run(sync_dir, run_dir, tmp_path / "resumed", names=CHECKPOINTS[3:])


@pytest.mark.slow  # three runs of the command line: ~35 s
@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_a_kill_during_an_async_write_leaves_the_last_checkpoint_and_resumes_exactly(warm_cli, tmp_path, pairs_file):
    """SIGKILL right after this process wrote step-16's weights, in the background (FAULT=shards:3: step-8's weights
    and optimizer state were the first two DCP saves), its optimizer state not yet: step-8 stays the newest
    complete checkpoint, the half-written step-16 is never taken for one, and resume_from=auto ends with the
    uninterrupted run's records, checkpoints and weights."""
    args = [*tiny_run_overrides(tmp_path, pairs_file), "save_every=8", "save_async=true", "resume_from=auto"]
    result = warm_cli(*args, f"local_run_dir={tmp_path / 'whole'}")
    assert result.returncode == 0, result.stderr[-3000:]
    crashed = tmp_path / "crashed"
    fault = {"PYTHONPATH": str(FAULTS_DIR), "FAULT": "shards:3"}
    result = warm_cli(*args, f"local_run_dir={crashed}", env_extra=fault)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert checkpoint.newest(crashed) == crashed / "step-8" and not (crashed / "step-16").exists()
    assert {p.name for p in (crashed / "step-16.tmp").iterdir()} == {"policy"}
    assert_equal_checkpoints(tmp_path / "whole" / "step-8", crashed / "step-8", fresh(tmp_path / "step-8"))
    result = warm_cli(*args, f"local_run_dir={crashed}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resume_from=auto: continuing from {crashed / 'step-8'}" in result.stdout
    assert not (crashed / "step-16.tmp").exists()
    assert_same_run(tmp_path / "whole", crashed, tmp_path / "compared")
