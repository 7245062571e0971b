"""Small helpers shared across modules: the one-line error type, seeding, run directories, JSON lines."""

import getpass
import json
import os
import random
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent


class UserError(Exception):
    """A problem with the user's input or config; train.py prints it as one line, without a traceback."""


class Interrupted(Exception):
    """The run stopped on a signal, after saving a checkpoint; the process exits with 128 + the signal's number, as
    a shell reports a process a signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def get_local_dir(local_dirs: list[str]) -> Path:
    """The first of `local_dirs` that exists; the last one is created when none does (the reference's rule)."""
    if not local_dirs:
        raise UserError("local_dirs is empty: give at least one directory for run outputs and caches")
    for candidate in local_dirs:
        if os.path.isdir(candidate):
            return Path(candidate)
    Path(local_dirs[-1]).mkdir(parents=True, exist_ok=True)
    return Path(local_dirs[-1])


def get_local_run_dir(exp_name: str, local_dirs: list[str]) -> Path:
    timestamp = datetime.now().strftime("%Y-%m-%d_%H-%M-%S_%f")
    return get_local_dir(local_dirs) / getpass.getuser() / f"{exp_name}_{timestamp}"


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(record) + "\n" for record in records if keep(record)))
    tmp.replace(path)


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
