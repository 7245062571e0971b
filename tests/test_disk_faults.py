"""A run meets storage faults: a full disk at the first and at a later checkpoint (refused by the space check, or
filling while the files are written), while exporting, a read-only or deleted run directory, a metrics append that
fails half-way, and a full disk under rank 0 of a 2-process run. Each ends with one line (exit code 2 from the command
line), leaves no temporary file and the last complete checkpoint as it was, from which the run resumes to the
uninterrupted run's records and weights. The caches' faults are tokenized.py's and reference_cache.py's tests."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from ballast import fill

import export
import storage
import train
from conftest import MEASURED, policy_state, read_jsonl, records, tiny_run_overrides
from modeling.distributed import Topology
from persistence import checkpoint
from utils import UserError

FAULTS_DIR = Path(__file__).parent / "faults"  # sitecustomize.py: the FAULT=KIND:N hooks
CONTINUE = "To continue once that is fixed, run the same command with resume_from=auto local_run_dir={run}"


def temporary_files(run_dir: Path) -> list[str]:
    """What a failed write may have left: temporary files and directories anywhere under run_dir."""
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp" in p.name)


def files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def computed(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture
def whole(make_config, tmp_path) -> Path:
    """The uninterrupted run: 5 steps of 8, evals and checkpoints at 16 and 32 examples."""
    train.run(make_config(f"local_run_dir={tmp_path / 'whole'}"))
    return tmp_path / "whole"


def assert_resumes_to_the_whole_run(make_config, run_dir: Path, whole: Path) -> None:
    train.run(make_config(f"local_run_dir={run_dir}", "resume_from=auto"))
    assert computed(run_dir) == computed(whole)
    expected, actual = policy_state(whole / "LATEST"), policy_state(run_dir / "LATEST")
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


@pytest.mark.parametrize("checked", [True, False], ids=["refused-by-the-space-check", "filling-while-written"])
@pytest.mark.parametrize("at", ["step-16", "step-32"], ids=["first-save", "later-save"])
def test_a_full_disk_at_a_save_is_one_line_and_the_run_resumes_exactly(
    make_config, whole, small_disk, monkeypatch, at, checked
):
    """The disk fills (another job's ballast) just before a save. With the space check, the save is refused before
    anything is written; without it (the disk filling while the files are written), DCP's and torch's writers fail
    on a real ENOSPC. Either way: one line, no temporary file, the previous checkpoint byte for byte as it was; and
    once the ballast is gone, resume_from=auto ends where the uninterrupted run did, bit for bit."""
    assert_a_full_disk_is_one_line_and_resumes(make_config, whole, small_disk, monkeypatch, at, checked, False)


def test_a_disk_filling_while_a_checkpoint_is_written_in_the_background_is_one_line(
    make_config, whole, small_disk, monkeypatch
):
    """save_async=true: step-32's files fail to fit in the background, while training goes on; the failure stops
    the run at the next step with the same line, and the rest as above. (The test waits for the write to fail
    before training goes on, so that the full disk cannot fail a metrics line first.)"""
    assert_a_full_disk_is_one_line_and_resumes(make_config, whole, small_disk, monkeypatch, "step-32", False, True)


def assert_a_full_disk_is_one_line_and_resumes(make_config, whole, small_disk, monkeypatch, at, checked, in_background):
    run_dir = small_disk("32m") / "run"
    ballast, previous = [], {}
    name = "save_in_background" if in_background else "save"
    real_save = getattr(checkpoint, name)

    def save_on_a_full_disk(output_dir, *args, **kwargs):
        if output_dir.name == at:
            previous.update(files(run_dir / "step-16") if at == "step-32" else {})
            ballast.append(fill(run_dir.parent, leave=256 << 10))
        saving = real_save(output_dir, *args, **kwargs)
        if in_background and output_dir.name == at:
            saving.thread.join()
        return saving

    monkeypatch.setattr(checkpoint, name, save_on_a_full_disk)
    if not checked:
        monkeypatch.setattr(storage, "require_space", lambda *args: None)
    with pytest.raises(UserError) as error:
        train.run(make_config(f"local_run_dir={run_dir}", f"save_async={str(in_background).lower()}"))
    message = str(error.value)
    if checked:
        assert message.startswith(f"not enough space for the checkpoint {at} in {run_dir}: needs "), message
        assert "; nothing was written. Free space there (or raise the quota); " in message
    else:
        assert message.startswith(f"could not write {run_dir / at} (No space left on device: "), message
        assert " free); free space there or write elsewhere; " in message
    kept = "no checkpoint was written yet" if at == "step-16" else f"the last complete checkpoint, {run_dir}/step-16, "
    assert kept in message and message.endswith(CONTINUE.format(run=run_dir)), message
    if in_background:  # found failed after the step that followed it
        assert "; stopped after 40 examples, " in message
    assert temporary_files(run_dir) == []
    assert not (run_dir / at).exists()
    if at == "step-32":
        assert files(run_dir / "step-16") == previous
    monkeypatch.undo()
    ballast[0].unlink()
    assert_resumes_to_the_whole_run(make_config, run_dir, whole)


def test_a_checkpoint_that_cannot_fit_stops_the_command_with_exit_code_2(tmp_path, pairs_file, small_disk, run_main):
    run_dir = small_disk("4m") / "run"  # the first checkpoint's estimate (its tensors and 16 MiB for the rest) is more
    result = run_main(*tiny_run_overrides(tmp_path, pairs_file), f"local_run_dir={run_dir}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0] == result.stderr.strip().splitlines()[-1]
    assert errors[0].startswith(f"error: not enough space for the checkpoint step-16 in {run_dir}: needs ")
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "metrics.jsonl"]


@pytest.mark.parametrize("checked", [True, False], ids=["refused-by-the-space-check", "filling-while-written"])
def test_a_full_disk_while_exporting_leaves_nothing(whole, small_disk, monkeypatch, checked):
    out = small_disk("256k") / "export"  # the export's weights take 421 KiB
    if not checked:
        monkeypatch.setattr(storage, "require_space", lambda *args: None)
    with pytest.raises(UserError) as error:
        export.export_checkpoint(whole / "LATEST", out, Topology.create("BasicTrainer"))
    if checked:
        assert str(error.value).startswith(f"not enough space for the export export in {out.parent}: needs ")
    else:
        assert str(error.value).startswith(f"could not write {out} (No space left on device: ")
    assert list(out.parent.iterdir()) == []


def test_a_read_only_run_directory_is_one_line(tmp_path, pairs_file, read_only, run_main):
    (tmp_path / "run").mkdir()
    run_dir = read_only(tmp_path / "run")
    result = run_main(*tiny_run_overrides(tmp_path, pairs_file), f"local_run_dir={run_dir}")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: could not write {run_dir / '.lock'} (Read-only file system); choose a writable local_run_dir"
    )


def test_a_run_directory_deleted_mid_run_is_one_line(make_config, tmp_path, monkeypatch):
    """Deleted after the first checkpoint: the next metrics line cannot be written, every rank stops at the next
    step, and the line says the checkpoint went with it."""
    run_dir, real_save = tmp_path / "run", checkpoint.save

    def save_then_delete(output_dir, *args, **kwargs):
        real_save(output_dir, *args, **kwargs)
        shutil.rmtree(run_dir)

    monkeypatch.setattr(checkpoint, "save", save_then_delete)
    with pytest.raises(UserError) as error:
        train.run(make_config(f"local_run_dir={run_dir}"))
    assert str(error.value) == (
        f"could not write {run_dir / 'metrics.jsonl'} (No such file or directory); its directory was removed while "
        f"the run went on; stopped after 32 examples, no complete checkpoint is left ({run_dir / 'step-16'} is gone). "
        + CONTINUE.format(run=run_dir)
    )
    assert not run_dir.exists()  # nothing written into a directory that was deleted


def test_a_metrics_append_failing_half_way_leaves_no_torn_line(make_config, whole, tmp_path, monkeypatch):
    """The third metrics line is cut short by a full disk: the run stops with one line at the next step, the log
    holds whole lines only, and the resumed run's log and weights are the uninterrupted run's."""
    run_dir, real_write, appends = tmp_path / "run", os.write, []

    def full_at_the_third_line(descriptor, data):
        if os.readlink(f"/proc/self/fd/{descriptor}").endswith("metrics.jsonl"):
            appends.append(len(data))
            if len(appends) == 3:
                real_write(descriptor, bytes(data[: len(data) // 2]))
                raise OSError(28, os.strerror(28))
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", full_at_the_third_line)
    with pytest.raises(UserError, match=r"^could not write .*metrics.jsonl \(No space left on device: needs "):
        train.run(make_config(f"local_run_dir={run_dir}"))
    monkeypatch.undo()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [0, 8]
    assert_resumes_to_the_whole_run(make_config, run_dir, whole)
    assert [r["step"] for r in records(run_dir, "train")] == [8, 16, 24, 32, 40]


@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_a_full_disk_under_rank_0_stops_every_rank_with_one_line(tmp_path, pairs_file, small_disk, warm_cli):
    """Two processes; the run directory's disk fills at rank 0's first step (FAULT=fill): once metrics.jsonl has no
    room left for a line (a block's slack may hold a line or two), rank 0 cannot append it, and both ranks stop with
    its line at the next step, long before the collective timeout; the log holds whole lines only."""
    run_dir = small_disk("32m") / "run"
    fault = {"PYTHONPATH": str(FAULTS_DIR), "FAULT": "fill:1", "FAULT_FILL": str(run_dir), "OMP_NUM_THREADS": "1"}
    overrides = (f"local_run_dir={run_dir}", "trainer=FSDPTrainer", "nproc=2", "n_epochs=3", "eval_every=120")
    result = warm_cli(*tiny_run_overrides(tmp_path, pairs_file), *overrides, env_extra=fault, timeout=240)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert errors[0].startswith(f"error: could not write {run_dir / 'metrics.jsonl'} (No space left on device: ")
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(0, len(steps) * 8, 8)) and len(steps) < 16
    # the line for steps[-1] + 8 failed; the step after it stopped both ranks
    assert f"; stopped after {steps[-1] + 16} examples, no checkpoint was written yet. " in errors[0]
    assert temporary_files(run_dir) == []
