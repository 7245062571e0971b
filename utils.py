"""Small helpers shared by the entry point and the trainers: errors, run directories, atomic writes."""
import getpass
import json
import os
import pickle
import random
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent


class UserError(Exception):
    """A problem with the user's input or config; train.py prints it as one line, without a traceback."""


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


def get_device() -> torch.device:
    """CUDA when present (this process's LOCAL_RANK under torchrun), otherwise the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written `tmp_dir` to `final_dir`; an older `final_dir` is removed only afterwards,
    so a crash at any point leaves either the old or the new directory complete."""
    old_dir = final_dir.with_name(final_dir.name + ".old")
    if old_dir.exists():
        shutil.rmtree(old_dir)
    if final_dir.exists():
        final_dir.rename(old_dir)
    tmp_dir.rename(final_dir)
    if old_dir.exists():
        shutil.rmtree(old_dir)


def append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def load_checkpoint_file(path: Path, setting: str) -> dict:
    """A checkpoint file in the reference format ({"step_idx", "state", "metrics"}), read with weights_only.
    Anything else raises a UserError that names the `setting` it came from."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{setting}: {path} does not exist") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise UserError(f"{setting}: {path} is not a readable checkpoint ({first_line(error)})") from None
    if not isinstance(checkpoint, dict) or "state" not in checkpoint:
        raise UserError(f"{setting}: {path} is not a checkpoint in the reference format (no 'state')")
    return checkpoint


def load_state(target, state: dict, setting: str, path: Path) -> None:
    """target.load_state_dict(state) for a module, optimizer or scheduler, with a one-line error on mismatch."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"{setting}: {path} does not fit this {type(target).__name__} ({first_line(error)})") from None


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
