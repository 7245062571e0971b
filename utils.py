"""Small helpers shared by the entry point and the trainers: errors, run directories, atomic writes, and the
few torch.distributed calls made outside the trainers."""
import contextlib
import getpass
import json
import os
import pickle
import random
import shutil
import socket
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_secs: float) -> None:
    """Join the process group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun's
    variables): NCCL with one GPU per process, else gloo on the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_secs))


def rank() -> int:
    """This process's rank: in the process group, else as torchrun announced it, else 0."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def broadcast_object(obj):
    """Rank 0's `obj` on every rank (just `obj` outside a process group)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_on_main(fn):
    """fn() on rank 0 only; its result there (None elsewhere). A UserError it raises is raised on every rank,
    so that no rank is left waiting in a collective for one that stopped."""
    result = error = None
    if rank() == 0:
        try:
            result = fn()
        except UserError as e:
            error = str(e)
    error = broadcast_object(error)
    if error is not None:
        raise UserError(error)
    return result


@contextlib.contextmanager
def local_main_first():
    """Local rank 0 runs the block first and the other ranks of its machine after it, so they find its
    downloads, conversions and caches complete instead of racing to write them."""
    first = int(os.environ.get("LOCAL_RANK", 0)) == 0
    if dist.is_initialized() and not first:
        dist.barrier()
    try:
        yield
    finally:  # also on an error: the others then meet the same error themselves instead of a broken barrier
        if dist.is_initialized() and first:
            dist.barrier()


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
