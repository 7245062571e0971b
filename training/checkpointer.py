"""The run's checkpoints, as the training loop asks for them: what a checkpoint holds (`checkpoint_parts`: a new
stateful part is one entry), when a save may start (one in the background at a time), the last complete one, and
keep_last's pruning; the run's last checkpoint gets its model cards here, where the run's config is known. How a
checkpoint is written and read is persistence/checkpoint.py's and checkpoint_loading.py's."""

from pathlib import Path

from build import RunParts
from modeling.reference_sync import SyncedReference
from persistence import checkpoint, checkpoint_loading
from persistence.checkpoint_parts import ChosenWeights, ModelWeights, OptimizerState
from training.model_card import write_cards
from utils import UserError


def checkpoint_parts(parts: RunParts) -> dict:
    """What a checkpoint holds, by file name: a new stateful part is one entry here."""
    held = {
        "policy": ModelWeights(parts.policy),
        "optimizer": OptimizerState(parts.policy, parts.optimizer),
        "scheduler": parts.scheduler,
        "objective": parts.objective,
    }
    if parts.loss_scale is not None:  # a float16 run's scale and growth tracker: a resumed run scales alike
        held["loss_scale"] = parts.loss_scale
    if isinstance(parts.reference, SyncedReference):  # the moved reference's weights
        held["reference"] = ChosenWeights(parts.reference.owner, parts.reference.state)
    return held


class Checkpointer:
    """The run's checkpoints, apart from the loop that asks for them: the parts a checkpoint holds (by file name),
    the last complete checkpoint, and keep_last's pruning. Nothing is written under debug=true. With save_async=true
    a step-N checkpoint is written in the background while training goes on (checkpoint.save_in_background), one
    at a time: a save waits for the one before, and so does the run's end (this is a context manager: the run ends
    with it, however it ends)."""

    def __init__(self, parts: dict, config, topology, run_dir: Path, tokenizer):
        self.parts, self.config, self.topology, self.run_dir, self.tokenizer = (
            parts,
            config,
            topology,
            run_dir,
            tokenizer,
        )
        self.last: Path | None = None  # the last complete checkpoint, written or resumed from
        self.saved_at: int | None = None  # the example count it was written (or is being written) at
        self.in_flight: checkpoint.BackgroundSave | None = None
        self.in_background = config.save_async and not config.debug
        if self.in_background:
            self.process_group = checkpoint.save_process_group(config.distributed_timeout_secs)

    def load(self, directory: Path) -> tuple[int, dict]:
        """Every part from the checkpoint in `directory` (checkpoint_loading.load); (its step, its marker)."""
        step, marker = checkpoint_loading.load(directory, self.parts, self.config.batch_size, self.topology)
        self.last, self.saved_at = directory, step
        return step, marker

    def save(self, directory: Path, step: int, metrics: dict[str, float], loop: dict, final: bool, wait=False) -> None:
        """A checkpoint of every part at `step` (checkpoint.save), the run's last one (`final`) with its model cards
        (model_card.py, written here where the run's config is known); keep_last prunes older step-N ones. With
        save_async=true a step-N one is written in the background, once the one before is complete (and complete
        when this returns, with `wait`)."""
        if self.config.debug:
            return
        self.wait()
        keep_last, previous = self.config.keep_last, self.last
        snapshot = checkpoint.Snapshot(step, metrics, self.parts, loop, self.tokenizer)
        if self.in_background and not final:
            self.in_flight = checkpoint.save_in_background(
                directory, snapshot, self.topology, previous, keep_last, self.process_group
            )
            self.saved_at = step
            if wait:
                self.wait()
            return
        cards = lambda export: write_cards(export, directory.parent, step, metrics, directory.parent.name)  # noqa: E731
        checkpoint.save(directory, snapshot, self.topology, final, previous, keep_last, describe_export=cards)
        self.last, self.saved_at = directory, step
        if keep_last is not None and not final:
            self.topology.run_on_main(lambda: checkpoint.prune(self.run_dir, keep_last))

    def failed(self) -> bool:
        """Whether the checkpoint written in the background failed (this rank's view; the next save, or wait(),
        raises the failure, the same on every rank). One that completed is the last complete checkpoint from now
        on."""
        if self.in_flight is not None and self.in_flight.done() and not self.in_flight.failed():
            self.last, self.in_flight = self.in_flight.directory, None
        return self.in_flight is not None and self.in_flight.failed()

    def wait(self) -> None:
        """The checkpoint written in the background, if any, complete (the last complete checkpoint), or its failure
        raised on every rank."""
        if self.in_flight is not None:
            pending, self.in_flight = self.in_flight, None
            pending.wait()
            self.last = pending.directory

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """The run ends: a checkpoint still written in the background is completed first, unless a second Ctrl-C
        asks to stop at once (the half-written directory is never taken for a checkpoint); its failure does not
        hide the error the run ends with."""
        if kind is KeyboardInterrupt:
            return
        try:
            self.wait()
        except UserError:
            if kind is None:
                raise

    def stopped(self, error: UserError, examples: int) -> UserError:
        """A write failure's line, with where the run stopped, what is safe and how to go on."""
        if self.last is None:
            kept = "no checkpoint was written yet"
        elif checkpoint.describe(self.last) is None:
            kept = f"no complete checkpoint is left ({self.last} is gone)"
        else:
            kept = f"the last complete checkpoint, {self.last}, is intact"
        return UserError(
            f"{error}; stopped after {examples} examples, {kept}. To continue once that is fixed, run the same "
            f"command with resume_from=auto local_run_dir={self.run_dir}"
        )
