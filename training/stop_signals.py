"""Stopping on a signal: SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, torchrun's shutdown) ask the training
loop to stop after the current step, with a checkpoint; a second Ctrl-C interrupts at once."""

import signal
import threading
from pathlib import Path

from utils import Interrupted


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, torchrun's shutdown) ask the loop to stop after the
    current step, with a checkpoint; a second Ctrl-C interrupts at once. Handlers can only be set in the main thread;
    elsewhere (a test's thread) signals keep their usual effect."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        return self

    @property
    def asked(self) -> bool:
        """Whether a signal asked the run to stop."""
        return self.received is not None

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            print(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint", flush=True)
            self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted(self, examples: int, last_checkpoint: Path | None, run_dir: Path) -> Interrupted:
        """The line a run stopped by the received signal ends with: where it stopped and how to go on."""
        where = f"the checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint (debug=true)"
        return Interrupted(
            f"stopped by {signal.Signals(self.received).name} after {examples} examples; {where}. To continue, run "
            f"the same command with resume_from=auto local_run_dir={run_dir}",
            self.received,
        )

    def __exit__(self, *exception) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
