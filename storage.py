"""Writing files. Everything the project writes goes through these helpers, so that a full disk, a quota, a read-only
or vanished directory ends as one line naming the path, nothing is left half-written, and no complete copy is lost.

A file is written under a temporary name beside its target, flushed, synced to disk and renamed into place (atomic on
a POSIX filesystem): a reader sees the old copy or the new one, never half of one, and a failure removes the temporary
file and leaves the old copy as it was. A directory is written alike (`new_dir`, `replace_dir`). A log grows by whole
lines (`append_lines`). The OS reports a failed write as an OSError, but torch's writer reports it as a RuntimeError
("unexpected pos 576 vs 534"), safetensors as a SafetensorError, and torch.distributed.checkpoint as a
CheckpointException (a BaseException) around either: `reason` reads all of them, and `writing` turns them into a
WriteFailed that says what failed, why, the space it needed where known, and what to do."""

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from torch.distributed.checkpoint.api import CheckpointException

from utils import UserError, first_line

MIB = 1 << 20
# torch's zip writer (PytorchStreamWriter) does not say why a write failed
TORCH_WRITER = ("inline_container.cc", "PytorchStreamWriter", "unexpected pos", "iostream error")
OS_ERROR_CODE = re.compile(r"os error (\d+)")  # safetensors: "I/O error: No space left on device (os error 28)"
ADVICE = {
    errno.ENOSPC: "free space there or write elsewhere",
    errno.EDQUOT: "free space within the quota, raise it, or write elsewhere",
    errno.EFBIG: "the file is larger than this process may write (ulimit -f) or the filesystem holds",
    errno.EROFS: "make it writable or write elsewhere",
    errno.EACCES: "make it writable or write elsewhere",
    errno.EPERM: "make it writable or write elsewhere",
    errno.ENOENT: "its directory was removed while the run went on",
    errno.EIO: "the storage reported an I/O error: check the disk or the network filesystem",
}


class WriteFailed(UserError):
    """A file or directory that could not be written; its message is the one line a run ends with."""


def error_code(error: BaseException) -> int | None:
    """The errno behind a failed write, wherever the writer put it; None where it says none."""
    if isinstance(error, CheckpointException):  # DCP's, around each failed rank's exception
        causes = [cause[0] if isinstance(cause, tuple) else cause for cause in error.failures.values()]
        return next((code for cause in causes if (code := error_code(cause)) is not None), None)
    if isinstance(error, OSError) and error.errno:
        return error.errno
    found = OS_ERROR_CODE.search(str(error))
    return int(found.group(1)) if found else None


def is_write_failure(error: BaseException) -> bool:
    """Whether `error`, raised while writing, is the storage failing (not a bug to show with its traceback)."""
    if isinstance(error, CheckpointException):
        causes = [cause[0] if isinstance(cause, tuple) else cause for cause in error.failures.values()]
        return all(is_write_failure(cause) for cause in causes)
    if isinstance(error, OSError):
        return True
    text = str(error)
    return type(error).__name__ == "SafetensorError" and "I/O error" in text or any(m in text for m in TORCH_WRITER)


def reason(error: BaseException, path: Path) -> tuple[str, int | None]:
    """(why the write failed, in a few words; its errno). A writer that says no errno (torch's) is explained by the
    filesystem's state: no space left, or read-only, or the directory gone."""
    code = error_code(error)
    if code is None:
        code = diagnose(path)
    if code is not None:
        return os.strerror(code), code
    if isinstance(error, CheckpointException):
        causes = [cause[0] if isinstance(cause, tuple) else cause for cause in error.failures.values()]
        return first_line(causes[0]), None
    return first_line(error), None


def diagnose(path: Path) -> int | None:
    """The errno a write of `path` (a file, or into a directory) now meets, judged from its filesystem: ENOENT (its
    directory is gone), EROFS, ENOSPC (under 1 MiB free), else None."""
    parent = Path(path) if Path(path).is_dir() else Path(path).parent
    if not parent.is_dir():
        return errno.ENOENT
    stats = os.statvfs(parent)
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS
    return errno.ENOSPC if stats.f_bavail * stats.f_frsize < MIB else None


def free_bytes(path: Path) -> int | None:
    """The bytes this process may still write on the filesystem of `path` (or of its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def failed(path: Path, error: BaseException, needed: int | None = None, advice: str | None = None) -> WriteFailed:
    """The one line for a write of `path` that failed with `error`: why, the space needed and free where it matters,
    and what to do."""
    why, code = reason(error, path)
    if code in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(path)
        needs = f"needs {human_size(needed)}, " if needed else ""
        why += f": {needs}{human_size(free)} free" if free is not None else ""
    return WriteFailed(f"could not write {path} ({why}); {advice or ADVICE.get(code, 'check that it can be written')}")


@contextlib.contextmanager
def writing(path: Path, needed: int | None = None, advice: str | None = None) -> Iterator[None]:
    """Run the block that writes `path`; a failure of the storage becomes WriteFailed(path) (failed)."""
    try:
        yield
    except WriteFailed:
        raise
    except (Exception, CheckpointException) as error:
        if not is_write_failure(error):
            raise
        raise failed(path, error, needed, advice) from None


def as_final(error: UserError, tmp: Path, final: Path) -> UserError:
    """The error with the temporary path `tmp` named as the `final` one it was being written for: the temporary one
    is gone once the error is reported."""
    return type(error)(str(error).replace(str(tmp), str(final)))


def temporary_name(path: Path) -> Path:
    """A name beside `path` that no other process or thread picks."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def replaced(path: Path, needed: int | None = None) -> Iterator[Path]:
    """A temporary path to write `path`'s new content to; when the block ends, the file is synced and renamed into
    place (its directory synced too). A failure removes the temporary file and leaves `path` as it was."""
    path = Path(path)
    tmp = temporary_name(path)
    with writing(path, needed):
        try:
            yield tmp
            sync(tmp)
            tmp.replace(path)
            sync_entries(path.parent)
        finally:
            if os.path.lexists(tmp):  # (unlink raises EROFS even for a missing file on a read-only filesystem)
                tmp.unlink()


def write_bytes(path: Path, data: bytes) -> None:
    with replaced(path, len(data)) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def append_lines(path: Path, lines: list[str]) -> None:
    """Add lines to a log, all whole or none at all: a write cut short (a full disk) is cut back off, so the log
    never holds a torn line, and the lines are synced to disk before this returns."""
    data = "".join(line + "\n" for line in lines).encode()
    with writing(path, len(data)):
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.fstat(descriptor).st_size
            try:
                written = 0
                while written < len(data):
                    written += os.write(descriptor, data[written:])
                os.fsync(descriptor)
            except OSError:
                os.ftruncate(descriptor, start)  # frees what the torn line took
                raise
        finally:
            os.close(descriptor)


def append_jsonl(path: Path, *records: dict) -> None:
    """Add records to a JSON-lines log, all of them or none (append_lines)."""
    append_lines(path, [json.dumps(record) for record in records])


def truncate_jsonl(path: Path, keep) -> None:
    """Rewrite a JSON-lines log with the records for which keep(record) holds; a line cut short by a kill is
    dropped. The rewrite replaces the file whole."""
    if not path.exists():
        return
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    write_text(path, "".join(json.dumps(record) + "\n" for record in records if keep(record)))


def sync(path: Path) -> None:
    """Flush a file, or a directory's files and entries, to disk: after a power cut, a renamed copy is whole too."""
    path = Path(path)
    for item in [*path.rglob("*"), path] if path.is_dir() else [path]:
        sync_entries(item)


def new_dir(directory: Path) -> None:
    """An empty `directory`, whatever a crashed write left there."""
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)


def remove_tree(directory: Path) -> None:
    """Remove a directory, renamed aside first (atomic): a kill mid-deletion leaves no half of it under its name."""
    aside = directory.with_name(f"{directory.name}.deleted-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        directory.rename(aside)
    except FileNotFoundError:
        return
    shutil.rmtree(aside, ignore_errors=True)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written and synced `tmp_dir` to `final_dir`; an older `final_dir` is removed only afterwards, so
    a crash at any point leaves the old directory or the new one complete."""
    old_dir = final_dir.with_name(final_dir.name + ".old")
    if old_dir.exists():
        shutil.rmtree(old_dir)
    if final_dir.exists():
        final_dir.rename(old_dir)
    tmp_dir.rename(final_dir)
    sync_entries(final_dir.parent)
    if old_dir.exists():
        shutil.rmtree(old_dir)


def publish(tmp_dir: Path, final_dir: Path, complete: str) -> bool:
    """Rename a synced `tmp_dir` to `final_dir` unless another process published it first (a cache's copy made by
    another process holds the same content: `final_dir/complete` exists), in which case ours is dropped. Whether
    ours was published."""
    try:
        tmp_dir.rename(final_dir)
    except OSError:
        if not (final_dir / complete).exists():
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)
        return False
    sync_entries(final_dir.parent)
    return True


def sync_entries(path: Path) -> None:
    """Flush one file's content, or one directory's entries (a rename into it), to disk."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def tree_bytes(path: Path) -> int:
    """The bytes of a file, or of the files under a directory."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def check_writable(directory: Path, advice: str | None = None) -> None:
    """Stop with WriteFailed(directory) unless a file can be written, synced and removed in the existing `directory`:
    tried, since neither its mode (root writes anywhere) nor statvfs tells of every mount, quota or full disk."""
    probe = temporary_name(Path(directory) / "write-probe")
    with writing(directory, advice=advice):
        try:
            descriptor = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(descriptor, b"\n")  # a full disk refuses the first block, not the name
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        finally:
            if os.path.lexists(probe):
                probe.unlink()


def require_space(directory: Path, needed: int, what: str) -> None:
    """Stop before writing `needed` bytes of `what` under `directory` when its filesystem has less free."""
    free = free_bytes(directory)
    if free is not None and free < needed:
        raise WriteFailed(
            f"not enough space for {what} in {directory}: needs {human_size(needed)}, {human_size(free)} free; "
            "nothing was written. Free space there (or raise the quota)"
        )
