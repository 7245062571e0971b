"""Checkpoints written in the background (--async-save [--rounds N]): the 286M Llama of --scale (hidden 1024, 20
layers, float32, AdamW, 4 HH pairs a step at max_length 256, one process) trains 8 steps with a step-N checkpoint
every 2 (save_every=8; keep_last=1), written synchronously and with save_async=true, alternating fresh processes
(2 rounds unless told). Each run's training loop is timed step by step: how long training stands still at a
save (the save's call: the whole write, or waiting for the one before, the space check and the copy to host
memory), the steps' time with no checkpoint being written and while one is written in the background (the
writer shares the cores), and the loop's whole time up to the last step-N checkpoint complete (--async-save
--smoke: a hidden-64 model of 2 layers, one round, as the test suite runs it)."""

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import HH_FILE, worker_subprocess
from bench.scale import scale_model_dir, scale_overrides
from utils import REPO_ROOT

STEPS, SAVE_EVERY_STEPS, BATCH = 8, 2, 4
MODES = {"sync": "save_async=false", "async": "save_async=true"}


def async_save_overrides(model_dir: Path, run_dir: Path, mode: str) -> list[str]:
    """--scale's run on one process, STEPS steps with a checkpoint every SAVE_EVERY_STEPS, one eval at the end."""
    examples = STEPS * BATCH
    return [
        *scale_overrides(model_dir, run_dir, 1),
        f"n_examples={examples}",
        f"eval_every={examples}",
        f"save_every={SAVE_EVERY_STEPS * BATCH}",
        "keep_last=1",
        MODES[mode],
    ]


def async_save_worker(result_file: str, overrides: list[str]) -> None:
    """A run of `overrides` (train.run), its training steps, its checkpoints' calls and their background writes
    timed (perf_counter): {"steps": [[start, end]], "saves": [{"name", "start", "returned", "written"}]}."""
    import train
    import trainers
    from persistence import checkpoint
    from training.checkpointer import Checkpointer

    steps, saves = [], []
    train_step, save, run = trainers.Trainer.train_step, Checkpointer.save, checkpoint.BackgroundSave.run

    def timed_step(self, examples):
        start = time.perf_counter()
        metrics = train_step(self, examples)
        steps.append([start, time.perf_counter()])
        return metrics

    def timed_save(self, directory, *args, **kwargs):
        record = {"name": directory.name, "start": time.perf_counter()}
        saves.append(record)  # before the save: its write may end before it returns
        save(self, directory, *args, **kwargs)
        record["returned"] = time.perf_counter()
        record.setdefault("written", record["returned"])  # a synchronous save: written when it returns

    def timed_run(self, write):
        run(self, write)
        [r for r in saves if r["name"] == self.directory.name][-1]["written"] = time.perf_counter()

    trainers.Trainer.train_step, Checkpointer.save, checkpoint.BackgroundSave.run = (
        timed_step,
        timed_save,
        timed_run,
    )
    train.run(train.configuration.load(overrides))
    Path(result_file).write_text(json.dumps({"steps": steps, "saves": saves}))


def summarize(result: dict) -> dict:
    """A run's numbers (seconds): the loop (first step's start to the last step-N checkpoint written), the mean
    stall at a step-N save, the median step with nothing written, the mean step while a checkpoint is written."""
    steps, saves = result["steps"], [s for s in result["saves"] if s["name"] != "LATEST"]
    writing = [(s["returned"], s["written"]) for s in saves]
    overlaps = lambda step: any(step[0] < end and start < step[1] for start, end in writing)  # noqa: E731
    quiet = [end - start for start, end in steps if not overlaps((start, end))]
    busy = [end - start for start, end in steps if overlaps((start, end))]
    return {
        "loop": max(steps[-1][1], *(s["written"] for s in saves)) - steps[0][0],
        "stall": statistics.mean(s["returned"] - s["start"] for s in saves),
        "write": statistics.mean(s["written"] - s["start"] for s in saves),
        "step": statistics.median(quiet) if quiet else float("nan"),
        "step_writing": statistics.mean(busy) if busy else float("nan"),
        "saves": len(saves),
    }


def bench_async_save(smoke: bool, rounds: int) -> None:
    if not HH_FILE.exists():
        sys.exit(f"--async-save trains on HH harmless-base pairs: {HH_FILE} is missing")
    model_dir = scale_model_dir(2 if smoke else 20, smoke)
    rounds = 1 if smoke else rounds
    print(
        f"--async-save: {model_dir.name}, {STEPS} steps of {BATCH} pairs, a checkpoint every {SAVE_EVERY_STEPS} "
        "steps, synchronous and in the background, alternating fresh processes. Seconds: the loop up to the last "
        "step-N checkpoint written; training's stall at a save (mean); a save from its call to its files complete "
        "(mean); a step with no checkpoint written (median), and while one is written (mean)"
    )
    print("mode   round   loop s  stall s  write s   step s  step s writing  saves")
    results = {mode: [] for mode in MODES}
    for index in range(rounds):
        for mode in MODES:
            with tempfile.TemporaryDirectory(dir=REPO_ROOT / ".cache") as tmp:
                overrides = async_save_overrides(model_dir, Path(tmp) / "run", mode)
                result = worker_subprocess(async_save_worker, str(Path(tmp) / "result.json"), overrides=overrides)
            summary = summarize(result)
            results[mode].append(summary)
            print(
                f"{mode:6} {index + 1:5d} {summary['loop']:8.1f} {summary['stall']:8.2f} {summary['write']:8.2f} "
                f"{summary['step']:8.2f} {summary['step_writing']:15.2f} {summary['saves']:6d}"
            )
    mean = {mode: {k: statistics.mean(r[k] for r in runs) for k in ("loop", "stall")} for mode, runs in results.items()}
    print(
        f"async against sync: the loop {mean['async']['loop']:.1f} s against {mean['sync']['loop']:.1f} s "
        f"({mean['sync']['loop'] / mean['async']['loop']:.2f}x); training stood still {mean['async']['stall']:.2f} s "
        f"a save against {mean['sync']['stall']:.2f} s"
    )
