"""Small helpers shared across modules: the one-line error type, seeding, run directories, JSON lines."""

import ctypes
import dataclasses
import getpass
import math
import os
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING

REPO_ROOT = Path(__file__).resolve().parent


class UserError(Exception):
    """A problem with the user's input or config; train.py prints it as one line, without a traceback."""


class Interrupted(Exception):
    """The run stopped on a signal, after saving a checkpoint; the process exits with 128 + the signal's number, as
    a shell reports a process a signal ended."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass(frozen=True)
class Range:
    """The values a numeric config key accepts: finite, from low to high (None: unbounded), each end open or closed.
    null, infinite: what null or +inf means, for a key that takes it (None: it does not). Declared once per key, in
    its schema's field (`ranged`), and enforced for every key by `check_ranges`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: str | None = None
    infinite: str | None = None

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.null is not None
        if value == math.inf and not isinstance(value, bool):
            return self.infinite is not None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        above = self.low is None or value > self.low or value == self.low and not self.low_open
        below = self.high is None or value < self.high or value == self.high and not self.high_open
        return above and below

    def describe(self) -> str:
        if self.high is None and self.low == 0:
            text = "positive" if self.low_open else "zero or more"
        elif self.high is None and self.low is None:
            text = "a finite number"
        else:
            low, high = "-inf" if self.low is None else self.low, "inf" if self.high is None else self.high
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        return (
            text
            + (f", or inf {self.infinite}" if self.infinite else "")
            + (f", or null {self.null}" if self.null else "")
        )


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)


def ranged(accepted: Range, **metadata) -> Any:
    """A schema field (no default: the YAML gives it) whose values `accepted` bounds."""
    return dataclasses.field(default=MISSING, metadata={"range": accepted, **metadata})


def check_ranges(schema: Any, prefix: str = "") -> None:
    """Every field of the dataclass instance `schema` that declares a Range holds a value in it; else a one-line
    UserError naming the key (prefix: where the schema sits, e.g. "loss.")."""
    for field in dataclasses.fields(schema):
        accepted = field.metadata.get("range")
        value = getattr(schema, field.name)
        if accepted is not None and not accepted.admits(value):
            expected = field.metadata.get("expected") or accepted.describe()
            raise UserError(f"{prefix}{field.name}={value} must be {expected}")


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


def metric_mean(name: str, values: list[float]) -> float:
    """The mean of a per-example metric. On labelled completions the rewards and log-probs of desirable examples go
    under .../chosen and those of the others under .../rejected, NaN for the examples of the other label: these are
    averaged over the values that are not NaN (NaN when none is). Every other metric keeps its NaN (a NaN loss
    shows). A metric named *_std is the standard deviation of its values instead (a reward model's rewards); one
    named counters/* is a count over the whole run, its last value (a float16 run's skipped steps)."""
    if name.startswith("counters/"):
        return values[-1]
    if name.startswith(("rewards_", "logps_")) and name.endswith(("/chosen", "/rejected")):
        values = [value for value in values if not math.isnan(value)]
        if not values:
            return math.nan
    mean = sum(values) / len(values)
    if name.endswith("_std"):  # a column whose spread is logged: its population standard deviation
        return math.sqrt(sum((value - mean) ** 2 for value in values) / len(values))
    return mean


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS. glibc keeps what threads free in their arenas (a tokenizer's
    worker threads, after a build: ~19 bytes a token of a 50k-pair build stayed resident, ~6 after this); other C
    libraries have no malloc_trim, and there this does nothing."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
