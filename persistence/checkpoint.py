"""Checkpoints: a directory of the run's stateful parts, written by every rank in parallel, each its own shards, and
read back by any number of ranks on any mesh (torch.distributed.checkpoint), so that no rank ever holds the whole model
or optimizer state. A directory holds:

  policy/           the weights (a LoRA policy's: its adapters), every rank's shards as safetensors
  optimizer/        the optimizer's state, every rank's shards in DCP's format (.distcp files and their .metadata)
  reference/        with reference_sync_steps (TR-DPO): the moving reference's weights, every rank's shards
  scheduler.pt ...  each small part's state in the DPO reference's file format ({"step_idx", "state", "metrics"})
  config.json, generation_config.json, tokenizer files (a vision-language model's processor files): the model's,
                    so that export.py needs nothing else
  checkpoint.json   written last: the step, the eval metrics, whether it ends the run, the loop's own state
The run's last one, LATEST, is also a from_pretrained directory (export). A directory is written whole under a
temporary name, checked (every rank's shards there), synced to disk and renamed into place, so that a kill at any
moment leaves every checkpoint directory complete or absent and the previous ones untouched; `newest` resumes from the
newest complete one and `prune` keeps the disk from filling. With save_async, `save_in_background` writes a step-N
checkpoint from a copy in host memory while training goes on, checkpoint.json and the swap still last, once every
rank's writes are complete. Checkpoints in the reference's format (a whole policy.pt and optimizer.pt, written before
the sharded one) are still read."""

import copy
import json
import re
import shutil
import threading
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch

import storage
from modeling import weights
from modeling.adapters import is_adapted, is_quantized, merged_weights
from modeling.distributed import Topology
from persistence.checkpoint_parts import ModelWeights, collective
from utils import UserError

DESCRIPTION_BYTES = 16 << 20  # the config, tokenizer and small parts of a checkpoint: a few MiB, rarely more
MARKER = "checkpoint.json"  # written last: a directory without it was not written by save()
STEP_DIR = re.compile(r"step-(\d+)")


@dataclass(frozen=True)
class Snapshot:
    """What one checkpoint is made of: the examples seen (`step`), the eval metrics there, the stateful parts by file
    name (collective ones from checkpoint_parts.py, or objects with state_dict(); "policy" a ModelWeights), the
    training loop's own state (its counters) and the tokenizer, whose files go beside the weights."""

    step: int
    metrics: dict[str, float]
    parts: dict
    loop_state: dict
    tokenizer: Any


class Draft:
    """A checkpoint on its way to output_dir, under a temporary name: what it holds besides the collective parts'
    shards, taken when the save is asked for (`copied`: copies that training can no longer change, for a save that
    goes on in the background), and the steps rank 0 takes to write it (save, save_in_background)."""

    def __init__(self, output_dir: Path, snapshot: Snapshot, final: bool, copied: bool):
        self.output_dir, self.tmp_dir = output_dir, output_dir.with_name(output_dir.name + ".tmp")
        self.step, self.metrics, self.parts, self.final = snapshot.step, snapshot.metrics, snapshot.parts, final
        marker = {"step": snapshot.step, "metrics": snapshot.metrics, "final": final, "loop": snapshot.loop_state}
        self.marker = json.dumps(marker, indent=1)
        small = {name: part.state_dict() for name, part in self.parts.items() if not collective(part)}
        self.small = copy.deepcopy(small) if copied else small
        self.shapes = {name: tensor.shape for name, tensor in self.parts["policy"].state().items()}  # whole shapes

    def start(self, previous: Path | None, keep_last: int | None) -> None:
        """Room for the checkpoint (space_needed, make_room) and an empty temporary directory (rank 0)."""
        needed = space_needed(self.parts, self.final, previous)
        make_room(self.output_dir.parent, needed, keep_last)
        storage.require_space(self.output_dir.parent, needed, f"the checkpoint {self.output_dir.name}")
        storage.new_dir(self.tmp_dir)

    def finish(self) -> None:
        """The small parts, the check that every rank's shards are there, checkpoint.json, and the swap (rank 0, once
        every rank has written its shards)."""
        for name, state in self.small.items():
            if state:
                record = {"step_idx": self.step, "state": state, "metrics": self.metrics}
                torch.save(record, self.tmp_dir / f"{name}.pt")
        why = weights.missing_shards(self.tmp_dir / "policy", self.shapes)
        if why is not None:
            raise UserError(
                f"the checkpoint's policy/ is incomplete ({why}): with several machines, local_run_dir must be on a "
                "filesystem they all share"
            )
        (self.tmp_dir / MARKER).write_text(self.marker)
        storage.sync(self.tmp_dir)
        storage.replace_dir(self.tmp_dir, self.output_dir)


def save(
    output_dir: Path,
    snapshot: Snapshot,
    topology: Topology,
    final: bool = False,
    previous: Path | None = None,
    keep_last: int | None = None,
    describe_export: Callable[[Path], None] | None = None,
) -> None:
    """Write each of the snapshot's parts with the model's config and tokenizer to a temporary directory, every rank
    its shards; at the run's end (`final`) the from_pretrained export too (export), and what `describe_export` writes
    into it (rank 0: the model cards, written by what knows the run's config); then checkpoint.json with the loop's
    state, and swap the directory in whole. First the space it needs (space_needed; `previous`: this run's last
    checkpoint) is checked against the free space, after pruning what keep_last would prune after it (make_room). A
    failure to write (a full disk, a quota, no permission, a directory the machines do not share) is a WriteFailed
    on every rank, and leaves no temporary directory behind."""
    draft = Draft(output_dir, snapshot, final, copied=False)
    tmp_dir, parts, policy = draft.tmp_dir, snapshot.parts, snapshot.parts["policy"].model

    def on_main(write) -> None:
        topology.run_on_main(lambda: written(output_dir, write))

    try:
        on_main(lambda: draft.start(previous, keep_last))
        with storage.writing(output_dir):  # DCP's writes, on every rank: a failure on any is raised on every one
            for name, part in parts.items():
                if collective(part):
                    part.save(tmp_dir / name, topology.world_size)
        on_main(lambda: describe_model(tmp_dir, policy, snapshot.tokenizer))
        if final:
            export(tmp_dir, policy, topology, tmp_dir / "policy")
            if describe_export is not None:
                on_main(lambda: describe_export(tmp_dir))
        on_main(draft.finish)
    except UserError as error:
        remove(tmp_dir, topology)
        raise storage.as_final(error, tmp_dir, output_dir) from None
    print(f"saved {output_dir}")


def save_in_background(
    output_dir: Path,
    snapshot: Snapshot,
    topology: Topology,
    previous: Path | None,
    keep_last: int | None,
    process_group,
) -> "BackgroundSave":
    """save() of a step-N checkpoint while training goes on (DCP's async_save, for a checkpoint of several DCP
    saves): here the room is made and checked (as save() does: a refusal is raised here), then every rank copies its
    shards of each collective part to host memory (weights.staged, as async_save stages) and the small parts' states;
    a thread then writes them, every rank its shards with DCP's collectives over `process_group` (a group of the
    saves' own, None without one: training's collectives go on meanwhile on the others), rank 0 the config and
    tokenizer. Only once every rank's writes are complete, which DCP's save and Topology.run_on_main agree on over that
    group, does rank 0 write checkpoint.json and swap the directory in, then prune to keep_last. A failure is a
    WriteFailed on every rank, raised by the BackgroundSave's wait(), and leaves no temporary directory behind."""
    draft = Draft(output_dir, snapshot, final=False, copied=True)
    tmp_dir, parts, policy = draft.tmp_dir, snapshot.parts, snapshot.parts["policy"].model
    try:
        topology.run_on_main(lambda: written(output_dir, lambda: draft.start(previous, keep_last)))
    except UserError as error:
        remove(tmp_dir, topology)
        raise storage.as_final(error, tmp_dir, output_dir) from None
    staged = {name: weights.staged(part.state()) for name, part in parts.items() if collective(part)}
    on_main = lambda write: topology.run_on_main(lambda: written(output_dir, write), process_group)  # noqa: E731

    def finish() -> None:
        draft.finish()
        if keep_last is not None:
            prune(output_dir.parent, keep_last)

    def write() -> None:
        try:
            with storage.writing(output_dir):
                for name, state in staged.items():
                    parts[name].write(state, tmp_dir / name, topology.world_size, process_group)
            on_main(lambda: describe_model(tmp_dir, policy, snapshot.tokenizer))
            on_main(finish)
        except UserError as error:
            topology.run_on_main(lambda: shutil.rmtree(tmp_dir, ignore_errors=True), process_group)
            raise storage.as_final(error, tmp_dir, output_dir) from None
        print(f"saved {output_dir}")

    return BackgroundSave(output_dir, write)


class BackgroundSave:
    """A checkpoint written by a thread of its own (save_in_background): failed() says, without waiting, whether it
    failed; wait() waits for it and raises its failure. A daemon thread: a process that stops at once (a second
    Ctrl-C) leaves a half-written temporary directory, which is never taken for a checkpoint."""

    def __init__(self, directory: Path, write: Callable[[], None]):
        self.directory, self.error = directory, None
        self.thread = threading.Thread(target=self.run, args=(write,), name=f"save {directory.name}", daemon=True)
        self.thread.start()

    def run(self, write: Callable[[], None]) -> None:
        try:
            write()
        except BaseException as error:  # raised by wait(), in the thread that trains
            self.error = error

    def done(self) -> bool:
        return not self.thread.is_alive()

    def failed(self) -> bool:
        return self.done() and self.error is not None

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def save_process_group(timeout_secs: float):
    """A gloo process group of every rank for save_in_background's collectives, which run in a thread of their own
    beside training's (on NCCL or gloo); None without a process group. Collective: every rank creates it at once."""
    if weights.one_process():
        return None
    return torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_secs))


def written(output_dir: Path, write) -> None:
    """write(), with a failure to write as one line naming the checkpoint (storage.writing)."""
    try:
        with storage.writing(output_dir):
            write()
    except storage.WriteFailed:
        raise
    except UserError as error:
        raise UserError(f"could not write the checkpoint {output_dir}: {error}") from None


def space_needed(parts: dict, final: bool, previous: Path | None) -> int:
    """The bytes save() will write: the size of this run's previous step-N checkpoint, else every collective part's
    tensors whole plus what the config, tokenizer and small parts take; at the run's end also the export (the whole
    model's weights). 2% to spare."""
    if previous is not None and STEP_DIR.fullmatch(previous.name) and previous.is_dir():
        total = storage.tree_bytes(previous)
    else:
        total = sum(part.nbytes() for part in parts.values() if collective(part)) + DESCRIPTION_BYTES
    if final:
        total += sum(weights.whole_bytes(tensor) for tensor in weights.tensors(parts["policy"].model).values())
    return int(total * 1.02)


def make_room(run_dir: Path, needed: int, keep_last: int | None) -> None:
    """Where the filesystem has less than `needed` free, prune now what keep_last would prune once the checkpoint is
    written: the older step-N checkpoints beyond keep_last - 1, never the newest complete one (nor the best)."""
    free = storage.free_bytes(run_dir)
    if keep_last is not None and free is not None and free < needed:
        prune(run_dir, max(keep_last - 1, 1))


def remove(directory: Path, topology: Topology) -> None:
    """Remove a half-written checkpoint, once every rank has stopped writing into it."""
    topology.run_on_main(lambda: shutil.rmtree(directory, ignore_errors=True))


def describe_model(directory: Path, policy, tokenizer) -> None:
    """The model's config (and generation config) and the tokenizer, as from_pretrained reads them (rank 0); a
    vision-language model's processor (its tokenizer and image processor), as AutoProcessor reads it."""
    base = policy.get_base_model() if is_adapted(policy) else policy
    config = base.config
    config.architectures = [weights.class_name(base)]
    config.save_pretrained(directory)
    if base.can_generate():
        base.generation_config.save_pretrained(directory)
    vision = getattr(tokenizer, "vision", None)  # modeling.tokenizers.load_tokenizer's
    (vision.processor if vision is not None else tokenizer).save_pretrained(directory)


def export(directory: Path, policy, topology: Topology, shards: Path) -> None:
    """Make `directory` (holding describe_model's files) a from_pretrained directory of the policy, no rank holding
    the whole model: the weights consolidated from the checkpoint's shards (`shards`), or, for a LoRA policy, the base
    with the adapters merged in (adapters.merged_weights) and the adapter in peft's format in adapter/. A QLoRA policy
    exports its adapter only: merged into its 4-bit base it would be a model of dequantized NF4 weights, not of the
    original ones; merge the adapter into the original base instead. Collective."""
    if is_adapted(policy):
        adapters = {name: adapter_whole(t) for name, t in ModelWeights(policy).state().items()}
        own = ["default"]  # not TR-DPO's reference adapter (reference_sync.py)
        save = lambda: policy.save_pretrained(directory / "adapter", state_dict=adapters, selected_adapters=own)  # noqa: E731
        topology.run_on_main(lambda: written(directory, save))
        if is_quantized(policy):
            print(
                "export: the adapter only (adapter/), not a merged model: the base is 4-bit. Merge it into the "
                "original base: PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()"
            )
            return
        weights.export_weights(merged_weights(policy), directory, topology)
    else:
        weights.consolidate(shards, directory, topology)


def export_live(directory: Path, policy, tokenizer, topology: Topology) -> None:
    """`directory` a from_pretrained directory of the policy's weights as they are now, not from a checkpoint (a
    round's policy served by an engine: training/policy_server.py), no rank holding the whole model: every rank writes
    its shards and they are consolidated (weights.export_weights); a LoRA policy's base with its adapters merged in.
    Collective."""
    with storage.writing(directory):
        topology.run_on_main(lambda: directory.mkdir(parents=True, exist_ok=True))
        topology.run_on_main(lambda: describe_model(directory, policy, tokenizer))
    weights.export_weights(merged_weights(policy) if is_adapted(policy) else ModelWeights(policy).state(), directory,
                           topology)  # fmt: skip


def adapter_whole(tensor: torch.Tensor) -> torch.Tensor:
    """An adapter's tensor whole, on the CPU (collective where sharded)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()


# -------------------------------------------------------------------------------------------------------------
# A run's checkpoint directories


def describe(checkpoint_dir: Path) -> dict | None:
    """checkpoint.json of a directory save() completed, else None."""
    try:
        marker = json.loads((checkpoint_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and isinstance(marker.get("step"), int) else None


def newest(run_dir: Path) -> Path | None:
    """The complete checkpoint (step-N or LATEST) of the run in run_dir that has seen the most examples."""
    candidates = [d for d in run_dir.glob("*") if d.name == "LATEST" or STEP_DIR.fullmatch(d.name)]
    complete = [(marker["step"], d.name == "LATEST", d) for d in candidates if (marker := describe(d)) is not None]
    return max(complete)[2] if complete else None


def prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` step-N checkpoints, sparing the one with the lowest eval loss. A
    directory is renamed before it is deleted, so that a kill mid-deletion leaves no half checkpoint behind."""
    markers = {d: describe(d) for d in run_dir.glob("step-*") if STEP_DIR.fullmatch(d.name)}
    markers = {d: marker for d, marker in markers.items() if marker is not None}
    steps = sorted((marker["step"], d) for d, marker in markers.items())
    evaluated = [(m["metrics"]["loss/eval"], d) for d, m in markers.items() if "loss/eval" in (m["metrics"] or {})]
    best = min(evaluated)[1] if evaluated else None
    for _, directory in steps[:-keep_last]:
        if directory != best:
            storage.remove_tree(directory)
    for leftover in run_dir.glob("step-*.deleted*"):  # from a kill mid-deletion
        shutil.rmtree(leftover, ignore_errors=True)
