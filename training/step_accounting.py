"""What the training loop counts of its finished steps: their time, pairs, tokens and useful FLOPs (the run's
throughput, reporting/telemetry.py, and the log interval's, run_log.py), and the optimizer steps skipped in a row for a
non-finite loss or gradient norm, with the run stopped in one line once max_nonfinite_steps were."""

import time
from dataclasses import dataclass
from pathlib import Path

from reporting.telemetry import Throughput, step_amounts
from training.device_steps import FinishedStep
from training.run_log import RunLog
from utils import UserError


@dataclass
class NonfiniteSteps:
    """Optimizer steps skipped for a non-finite loss or gradient norm, counted in a row: the run stops with one line
    once `allowed` were."""

    allowed: int
    in_a_row: int = 0

    def count(self, finite: bool, step: int, last_checkpoint: Path | None, loss_scale=None) -> None:
        """finite: the step updated the weights, or a float16 run's scale (loss_scale) overflowed above its floor."""
        self.in_a_row = 0 if finite else self.in_a_row + 1
        if self.in_a_row < self.allowed:
            return
        cause = "lower lr or check the data"
        if loss_scale is not None:  # at the floor, scaling cannot help: float16's range is what overflows
            cause = (
                f"the loss scale is at its floor ({loss_scale.value:g}, loss_scale.min_scale), so float16's range "
                "(65,504) overflows in the forward or backward itself: compute in bfloat16 or float32 "
                "(model.fsdp_policy_mp), or lower lr"
            )
        raise UserError(
            f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm and were skipped "
            f"(max_nonfinite_steps={self.allowed}), the last at step {step}; stopping. The last checkpoint is "
            f"{last_checkpoint or 'none (none was written yet)'}; {cause}"
        )


class StepAccounting:
    """The loop's account of its finished steps: the run's throughput (speed, for its summary), the log's interval
    (closed at least every `interval` seconds) and the non-finite steps in a row. deferred (sync_free_steps'
    DeviceSteps, or None): steps whose results, their finiteness included, reach the host at an interval's end and are
    counted then; else a step counts its finiteness itself when it ends (nonfinite.count)."""

    def __init__(self, log: RunLog, flops, speed: Throughput, deferred, max_nonfinite_steps: int, interval: float):
        self.log, self.flops, self.speed, self.deferred, self.interval = log, flops, speed, deferred, interval
        self.nonfinite = NonfiniteSteps(max_nonfinite_steps)
        self.start_interval()

    def start_interval(self) -> None:
        """A log interval starts now (a round's training begins)."""
        self.interval_start = time.time()

    def add(self, steps: list[FinishedStep], live_reference: bool, last_checkpoint: Path | None, progress=None):
        """Finished steps, in order, into the throughput and the log's interval; the progress bar's loss.
        live_reference: whether a step runs the reference's forward pass (its FLOPs count in MFU)."""
        for step in steps:
            if self.deferred is not None:
                self.nonfinite.count(step.finite, step.number, last_checkpoint)
            computed = sum(step.metrics.pop("perf/computed_tokens"))
            amounts = step_amounts(step.examples, step.seconds, computed, self.flops, live_reference)
            self.speed.add(**amounts)
            loss = self.log.add_step(step.metrics, amounts)
            if progress is not None:
                progress.set_postfix(loss=f"{loss:.4f}")

    def close_interval(self, due: bool, counters: tuple[int, int], *accounted) -> None:
        """The log's interval closed and logged at (examples, updates) = counters where `due` or its time is up, the
        deferred steps' results resolved into it first (add's `accounted`). Every step's metrics count: they are
        averaged over the interval, not sampled at its end."""
        if not due and time.time() - self.interval_start < self.interval:
            return
        self.add(self.deferred.resolve() if self.deferred is not None else [], *accounted)
        self.log.close_interval(*counters)
        self.start_interval()
