"""What a run writes besides checkpoints (`LOGS`): metrics.jsonl, samples.jsonl and wandb (rank 0 only), by example
count, a failure to write kept until every rank can stop together, and the logs cut back to a checkpoint on resume;
the run's summary at its end."""

import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

from reporting.telemetry import Throughput
from storage import append_jsonl, truncate_jsonl
from utils import UserError, metric_mean

LOGS = ("metrics.jsonl", "samples.jsonl", "plots.png")  # what a run writes besides checkpoints


class RunLog:
    """What a run writes besides checkpoints: metrics.jsonl, samples.jsonl and wandb (rank 0 only), by example
    count. Training metrics of every step count: they are averaged over a log interval, not sampled at its end."""

    def __init__(self, run_dir: Path, wandb_run, is_main: bool, throughput: Callable[[], Throughput]):
        self.run_dir, self.wandb_run, self.is_main, self.throughput = run_dir, wandb_run, is_main, throughput
        self.interval, self.interval_speed = defaultdict(list), throughput()
        self.failure: str | None = None  # a write that failed (rank 0): the loop stops every rank at its next check

    def write(self, write: Callable[[], None]) -> None:
        """write() (rank 0), or nothing after a failure to write: that is kept for check(), which stops every rank
        (this one alone cannot: the others would wait for it in their next collective)."""
        if self.failure is None:
            try:
                write()
            except UserError as error:
                self.failure = str(error)

    def check(self, topology, stop_line: Callable[[UserError], UserError]) -> None:
        """Stop every rank with stop_line(rank 0's failure to write a log), if there was one. Collective."""
        failure = topology.broadcast(self.failure)
        if failure is not None:
            raise stop_line(UserError(failure))

    def add_step(self, step_metrics: dict[str, list[float]], amounts: dict[str, float]) -> float:
        """Add a training step to the interval; the interval's mean training loss so far."""
        self.interval_speed.add(**amounts)
        for name, values in step_metrics.items():
            self.interval[name].extend(values)
        return sum(self.interval["loss/train"]) / len(self.interval["loss/train"])

    def close_interval(self, examples: int, updates: int) -> None:
        record = {name: metric_mean(name, values) for name, values in self.interval.items()}
        self.metrics({**record, **self.interval_speed.rates()}, examples, updates)
        self.interval, self.interval_speed = defaultdict(list), self.throughput()

    def metrics(self, metrics: dict[str, float], examples: int, updates: int) -> None:
        if not self.is_main:
            return
        metrics = {**metrics, "counters/examples": examples, "counters/updates": updates}
        self.write(lambda: append_jsonl(self.run_dir / "metrics.jsonl", {"step": examples, **metrics}))
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=examples)

    def samples(self, samples: list[dict], examples: int, updates: int) -> None:
        if not self.is_main:
            return
        self.write(lambda: append_jsonl(self.run_dir / "samples.jsonl", *samples))
        if self.wandb_run is not None:
            import wandb  # on use: ~1.3 s to import, and only runs that log to wandb need it

            columns = ["step", "prompt", "policy", "reference"]
            table = wandb.Table(columns=columns, data=[[s[k] for k in columns] for s in samples])
            self.wandb_run.log({"samples": table}, step=examples)

    def summary(self, final_metrics, examples: int, steps: int, resumed_at: int, start_time: float, speed, where):
        """The run in a few lines: what was trained, how fast, how it ended, and where it is (None: debug=true)."""
        trained, where = examples - resumed_at, where or "nowhere (debug=true)"
        seconds = time.time() - start_time
        evals = ", ".join(f"{name}={value:.4f}" for name, value in final_metrics.items())
        print(
            f"done: {trained} examples in {steps} steps"
            + (f" (resumed at {resumed_at})" if resumed_at else "")
            + f", {seconds / 60:.1f} min, {trained / max(seconds, 1e-9):.2f} pairs/s with evals and checkpoints\n"
            f"training steps: {speed.describe()}\n"
            f"final eval: {evals}\ncheckpoint and from_pretrained export: {where}; metrics: "
            f"{self.run_dir / 'metrics.jsonl'}"
        )

    def truncate(self, step: int, evaluated: bool) -> None:
        """Cut the logs back to a checkpoint at `step`: its own step's eval stays only if it came before the
        checkpoint (evaluated); a round's record there came after it (rounds.py: a round starts after the checkpoint
        that ends the one before)."""
        if not self.is_main:
            return

        def kept(record: dict) -> bool:
            at_step = (evaluated or "loss/eval" not in record) and "rounds/round" not in record
            return record["step"] < step or record["step"] == step and at_step

        self.write(lambda: truncate_jsonl(self.run_dir / "metrics.jsonl", kept))
        samples_kept = lambda r: r["step"] < step or evaluated and r["step"] == step  # noqa: E731
        self.write(lambda: truncate_jsonl(self.run_dir / "samples.jsonl", samples_kept))
