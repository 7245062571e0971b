"""One run per run directory: rank 0 holds an exclusive lock on <run_dir>/.lock for the whole run, taken before
anything in the directory is read, deleted or written, so that two processes started on the same local_run_dir (two
resume_from=auto jobs, a scheduler's retry racing the first attempt) never interleave checkpoints or logs.

The lock is a `flock` on the file: the kernel (or the NFS lock service) releases it when its process ends, however
it ends, so a lock left by a process killed with SIGKILL is free. The file says who holds it (pid, host, start time),
written after locking: a second run reads it to refuse in one line, and a run that gets the lock while the file
still names a holder knows that holder died without releasing it and takes over, saying so. A clean release deletes
the file (before unlocking; a run that locked a deleted file locks the new one instead).

Where the file system refuses flock (some NFS mounts without a lock service, Lustre mounted without flock), the file
itself is the lock: created whole with an atomic link(), deleted on release; a file naming a process on this host
that no longer runs is taken over; one naming another host cannot be checked, and the refusal says to delete it if
that run has ended. A pid reused by another process reads as alive there: the refusal names the file to delete."""

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import storage
from utils import UserError

LOCK_FILE = ".lock"  # neither a log nor a checkpoint: checkpoint.newest/prune and the "already holds a run" check
UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL}  # flock, per file system


@dataclass(frozen=True)
class Holder:
    pid: int
    host: str
    started: float  # time.time() at locking

    @classmethod
    def me(cls) -> "Holder":
        return cls(os.getpid(), socket.gethostname(), time.time())

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        try:
            record = json.loads(text)
            return cls(int(record["pid"]), str(record["host"]), float(record["started"]))
        except (ValueError, TypeError, KeyError):
            return None

    def dump(self) -> bytes:
        return (json.dumps({"pid": self.pid, "host": self.host, "started": self.started}) + "\n").encode()

    def describe(self) -> str:
        started = datetime.fromtimestamp(self.started).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
        return f"pid {self.pid} on {self.host}, started {started} ({age(time.time() - self.started)} ago)"

    def on_this_host(self) -> bool:
        return self.host == socket.gethostname()


def age(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host (a zombie, not yet reaped by its parent, counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class RunLock:
    """The lock on a run directory, as a context manager (acquire on enter, release on exit); the directory is
    created if missing. acquire raises a one-line UserError when another live process holds it."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self.fd: int | None = None  # the flocked file's descriptor
        self.linked = False  # the fallback's lock file, ours to delete on release

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if self.fd is not None or self.linked:
            raise RuntimeError(f"{self.path} is already held by this RunLock")
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for _ in range(100):  # a retry per holder that deleted the file between our open and our flock
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    holder = read_holder(fd)
                    current = same_file(fd, self.path)
                    os.close(fd)
                    if not current:  # its holder is releasing it (deleted, not yet unlocked): lock the next one
                        time.sleep(0.01)
                        continue
                    raise self.refusal(holder) from None
                except OSError as error:
                    os.close(fd)
                    if error.errno not in UNSUPPORTED:
                        raise
                    print(
                        f"run directory lock: {self.run_dir} does not support flock ({error.strerror}); using "
                        f"{self.path} as a lock file checked by pid on this host instead"
                    )
                    return self.acquire_without_flock()
                if not same_file(fd, self.path):
                    os.close(fd)
                    continue
                try:
                    previous = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
                    mine = Holder.me().dump()
                    os.pwrite(fd, mine, 0)
                    os.ftruncate(fd, len(mine))
                except OSError:
                    os.close(fd)
                    raise
                if previous is not None:  # its holder ended without releasing it: killed, or its machine went down
                    print(takeover(previous))
                self.fd = fd
                return
            raise UserError(f"could not lock {self.path}: it keeps being replaced")
        except OSError as error:
            where = Path(error.filename or self.path)  # the run directory itself, where it cannot be made
            raise storage.failed(where, error, advice="choose a writable local_run_dir") from None

    def acquire_without_flock(self) -> None:
        """The lock file is the lock: linked into place whole (atomic, also on NFS), or refused while its holder
        may still run."""
        mine = Holder.me()
        tmp = self.path.with_name(f"{LOCK_FILE}.{mine.host}.{mine.pid}.tmp")
        try:
            tmp.write_bytes(mine.dump())  # removed below, also when the disk is too full for it
            for _ in range(100):
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    text = read_text(self.path)
                    holder = None if text is None else Holder.parse(text)
                    if text is None:  # deleted meanwhile: try again
                        continue
                    if holder is None and not text.strip():  # a flock probe's leftover: no lock file here is empty
                        self.path.unlink(missing_ok=True)
                        continue
                    if holder is not None and holder.on_this_host() and not alive(holder.pid):
                        print(takeover(holder))
                        self.path.unlink(missing_ok=True)
                        continue
                    raise self.refusal(holder, checked=False) from None
                current = read_text(self.path)
                if current is None or Holder.parse(current) != mine:  # a racing takeover replaced ours
                    raise self.refusal(Holder.parse(current) if current else None, checked=False)
                self.linked = True
                return
            raise UserError(f"could not lock {self.path}: it keeps being replaced")
        finally:
            tmp.unlink(missing_ok=True)

    def refusal(self, holder: Holder | None, checked: bool = True) -> UserError:
        """The one line for a directory another run holds. checked: the holder holds the flock (it runs); else it
        is only named by the lock file, and may have ended where this process cannot tell."""
        who = holder.describe() if holder else "another process (the lock file does not say which)"
        hint = "" if checked else f"; if that run has ended, delete {self.path}"
        return UserError(
            f"local_run_dir={self.run_dir} is in use by another run: {who}; wait for it to end, or stop it, or "
            f"choose another local_run_dir{hint}"
        )

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)  # while locked: a run waiting on this file retries on the new one
            os.close(self.fd)  # unlocks
            self.fd = None
        if self.linked:
            self.path.unlink(missing_ok=True)
            self.linked = False


def takeover(holder: Holder) -> str:
    return f"run directory lock: taking over from pid {holder.pid} on {holder.host} (no longer running)"


def same_file(fd: int, path: Path) -> bool:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (stat.st_dev, stat.st_ino)


def read_holder(fd: int) -> Holder | None:
    """The holder a locked file names; it writes itself just after locking, so an empty or half-written file is
    read again for up to a second."""
    for _ in range(20):
        holder = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        if holder is not None:
            return holder
        time.sleep(0.05)
    return None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return None
