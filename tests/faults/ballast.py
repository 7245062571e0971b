"""fill(directory): a real full disk on demand, for the storage-fault tests (conftest.py) and the `fill` fault
(sitecustomize.py)."""

import os
from pathlib import Path


def fill(directory: Path, leave: int = 0) -> Path:
    """Fill the filesystem of `directory` until about `leave` bytes are free, with a ballast file (delete it to free
    the space)."""
    ballast = Path(directory) / "ballast"
    stats = os.statvfs(directory)
    size = max(stats.f_bavail * stats.f_frsize - leave, 0)
    with open(ballast, "wb", buffering=0) as f:
        try:
            while size > 0:
                size -= f.write(b"\0" * min(size, 1 << 20))
        except OSError:  # full: the filesystem's own blocks took the rest
            pass
    return ballast
