"""A sweep's own directory that exists but cannot be written (a read-only mount, a full disk) is refused in one line
before any job starts, and Hydra's write of multirun.yaml there, where the disk fills after that check, ends in one
line naming it (issue 70: both ended in Hydra's OSError traceback). Real filesystems: conftest's read_only and
small_disk mounts, skipped where this process may not mount."""

import errno
from pathlib import Path

import pytest
from ballast import fill

import sweeps
from conftest import tiny_run_overrides
from reporting.sweep_report import jobs


def refusal(tmp_path: Path, pairs_file: Path, directory: Path, capsys) -> str:
    """What `train.py -m ... local_run_dir=directory` prints to stderr, in this process; it must start no job."""

    def no_job(*args):
        pytest.fail("a job started")

    common = [arg for arg in tiny_run_overrides(tmp_path, pairs_file) if not arg.startswith("local_run_dir=")]
    with pytest.raises(SystemExit) as exit:
        sweeps.main(["-m", *common, f"local_run_dir={directory}", "loss.beta=0.1,0.3"], no_job, no_job)
    assert exit.value.code == 2 and not jobs(directory)
    return capsys.readouterr().err


def test_an_existing_sweep_directory_on_a_read_only_mount_is_refused_in_one_line(
    tmp_path, pairs_file, read_only, capsys
):
    (tmp_path / "sweep").mkdir()
    directory = read_only(tmp_path / "sweep")
    assert refusal(tmp_path, pairs_file, directory, capsys) == (
        f"error: could not write {directory} (Read-only file system); choose a writable local_run_dir\n"
    )


def test_an_existing_sweep_directory_on_a_full_disk_is_refused_in_one_line(tmp_path, pairs_file, small_disk, capsys):
    disk = small_disk("64k")
    (disk / "sweep").mkdir()
    fill(disk)
    assert refusal(tmp_path, pairs_file, disk / "sweep", capsys) == (
        f"error: could not write {disk / 'sweep'} (No space left on device: 0 B free); choose a writable "
        "local_run_dir\n"
    )


def test_multirun_yaml_on_a_disk_filled_after_the_check_is_one_line_naming_it(
    tmp_path, pairs_file, small_disk, capsys, monkeypatch
):
    disk = small_disk("64k")
    checked = sweeps.create_directory

    def then_filled(directory: Path) -> None:  # another job takes the space between the check and Hydra's write
        checked(directory)
        fill(disk)

    monkeypatch.setattr(sweeps, "create_directory", then_filled)
    assert refusal(tmp_path, pairs_file, disk / "sweep", capsys) == (
        f"error: could not write {disk / 'sweep' / 'multirun.yaml'} (No space left on device: 0 B free); free space "
        "there or write elsewhere\n"
    )


def test_a_jobs_own_os_error_is_not_taken_for_the_multirun_yaml_write(tmp_path, pairs_file):
    # Only the sweeper's writes before its first batch are multirun.yaml's: a job's error stays its own traceback.
    def failing_job(*args):
        raise OSError(errno.ENOSPC, "a job's own write")

    common = [arg for arg in tiny_run_overrides(tmp_path, pairs_file) if not arg.startswith("local_run_dir=")]
    with pytest.raises(OSError, match="a job's own write"):
        sweeps.main(["-m", *common, f"local_run_dir={tmp_path / 'sweep'}", "loss.beta=0.1,0.3"], failing_job, None)
    assert [job.status for job in jobs(tmp_path / "sweep")] == ["failed", "failed"]
