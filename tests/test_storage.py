"""Writing files (storage.py): whole or not at all, and a failure to write as one line naming the path, on real
full and read-only filesystems and on the errors torch, safetensors and torch.distributed.checkpoint raise there."""

import errno
import os
import resource
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ballast import fill
from safetensors.torch import save_file

import storage
from conftest import REPO_ROOT
from storage import WriteFailed, replace_dir


def leftovers(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name != "ballast")


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


def test_write_text_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "config.yaml"
    storage.write_text(path, "old")
    storage.write_text(path, "new")
    assert path.read_text() == "new" and leftovers(tmp_path) == ["config.yaml"]


def test_a_full_disk_leaves_the_old_file_and_no_temporary_file(small_disk):
    disk = small_disk("1m")
    path = disk / "config.yaml"
    storage.write_text(path, "old")
    with pytest.raises(WriteFailed) as error:
        storage.write_bytes(path, b"x" * (2 << 20))
    free = storage.human_size(storage.free_bytes(disk))
    assert str(error.value) == (
        f"could not write {path} (No space left on device: needs 2.0 MiB, {free} free); free space there or write "
        "elsewhere"
    )
    assert path.read_text() == "old" and leftovers(disk) == ["config.yaml"]


@pytest.mark.parametrize("writer", ["torch.save", "safetensors", "dcp"])
def test_each_writers_full_disk_error_is_one_line(small_disk, writer):
    """torch's writer says "unexpected pos", safetensors "os error 28", DCP wraps either in a CheckpointException
    (a BaseException): each is read as what it is, a full disk."""
    disk = small_disk("1m")
    big = torch.zeros(600_000)  # 2.4 MB
    write = {
        "torch.save": lambda: torch.save({"x": big}, disk / "a.pt"),
        "safetensors": lambda: save_file({"x": big}, str(disk / "a.safetensors")),
        "dcp": lambda: dcp.save({"x": big}, checkpoint_id=str(disk / "dcp"), no_dist=True),
    }[writer]
    with pytest.raises(WriteFailed, match=r"^could not write .*disk \(No space left on device: .* free\); free space"):
        with storage.writing(disk):
            write()


def test_other_errors_pass_through_unchanged(tmp_path):
    with pytest.raises(ValueError, match="a bug"):
        with storage.writing(tmp_path):
            raise ValueError("a bug")
    with pytest.raises(RuntimeError, match="shape mismatch"):  # a RuntimeError that is no writer's
        with storage.writing(tmp_path):
            raise RuntimeError("shape mismatch")


def test_a_read_only_directory_is_one_line(tmp_path, read_only):
    (tmp_path / "run").mkdir()
    view = read_only(tmp_path / "run")
    with pytest.raises(WriteFailed) as error:
        storage.write_text(view / "config.yaml", "x")
    assert (
        str(error.value)
        == f"could not write {view / 'config.yaml'} (Read-only file system); make it writable or write elsewhere"
    )


def test_a_vanished_directory_is_one_line(tmp_path):
    with pytest.raises(WriteFailed) as error:
        storage.append_jsonl(tmp_path / "gone" / "metrics.jsonl", {"step": 1})
    assert str(error.value) == (
        f"could not write {tmp_path / 'gone' / 'metrics.jsonl'} (No such file or directory); its directory was "
        "removed while the run went on"
    )


def test_a_file_size_limit_is_one_line(tmp_path):
    """RLIMIT_FSIZE (ulimit -f), with SIGXFSZ ignored as a batch system may: writes past it fail with EFBIG."""
    code = (
        "import storage\n"
        "try:\n"
        f"    storage.write_bytes(__import__('pathlib').Path({str(tmp_path / 'big.bin')!r}), bytes(1 << 20))\n"
        "except storage.WriteFailed as error:\n"
        "    print(error)\n"
    )

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, 1 << 16))

    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, preexec_fn=limit, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == (
        f"could not write {tmp_path / 'big.bin'} (File too large); the file is larger than this process may write "
        "(ulimit -f) or the filesystem holds"
    ), result.stderr
    assert leftovers(tmp_path) == []


def test_a_line_the_disk_cannot_hold_is_not_appended_at_all(small_disk):
    """A real full disk part-way through a line: the part written is cut back off, so no torn line is left."""
    disk = small_disk("64k")
    log = disk / "metrics.jsonl"
    storage.append_jsonl(log, {"step": 8, "loss": 0.69})
    before = log.read_bytes()
    fill(disk)
    with pytest.raises(WriteFailed, match=r"metrics.jsonl \(No space left on device: needs 10.0 KiB"):
        storage.append_lines(log, ["x" * 10239])  # more than the slack of the log's last block
    assert log.read_bytes() == before


def test_an_append_failing_half_way_is_cut_back(tmp_path, monkeypatch):
    log = tmp_path / "samples.jsonl"
    storage.append_jsonl(log, {"step": 8})
    before = log.read_bytes()
    real_write = os.write

    def half_then_full(descriptor, data):  # as a disk filling mid-write: a short write, then ENOSPC
        if len(data) > 1:
            return real_write(descriptor, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(WriteFailed, match="No space left on device"):
        storage.append_jsonl(log, {"step": 16, "text": "a long record"}, {"step": 24})
    monkeypatch.undo()
    assert log.read_bytes() == before
    storage.append_jsonl(log, {"step": 16})
    assert log.read_text().splitlines() == ['{"step": 8}', '{"step": 16}']


def test_require_space_refuses_before_writing(small_disk):
    disk = small_disk("1m")
    with pytest.raises(WriteFailed, match=r"^not enough space for the checkpoint step-8 in .*disk: needs 2.0 MiB, "):
        storage.require_space(disk, 2 << 20, "the checkpoint step-8")
    storage.require_space(disk, 1 << 19, "the checkpoint step-8")
