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

import contextlib
import copy
import json
import pickle
import re
import shutil
import threading
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import storage
from modeling import weights
from modeling.adapters import is_adapted, is_quantized, merged_weights
from modeling.distributed import Topology
from reporting.model_card import write_cards
from utils import UserError, first_line

DESCRIPTION_BYTES = 16 << 20  # the config, tokenizer and small parts of a checkpoint: a few MiB, rarely more
LEGACY_FILES = ("policy", "optimizer", "scheduler")  # the reference format's files, which it requires
IMPLEMENTATION = ("fused", "foreach")  # an optimizer's parameter-group keys that say how it steps, not what it computes
MARKER = "checkpoint.json"  # written last: a directory without it was not written by save()
STEP_DIR = re.compile(r"step-(\d+)")


class ModelWeights:
    """A checkpoint part: the model's weights and persistent buffers, or a LoRA policy's trainable ones (its
    adapters); sharded as the model is. Collective: every rank writes and reads its own shards. A frozen part of a
    model that is not LoRA's base (a vision-language model's vision tower, model.freeze_vision) is saved with the
    rest: the final export is made from these shards, and must be the whole model."""

    collective = True

    def __init__(self, model):
        self.model = model

    def state(self) -> dict[str, torch.Tensor]:
        """The part's tensors by name (DTensors where sharded; a tied weight under one of its names)."""
        persistent = set(self.model.state_dict(keep_vars=True))
        adapters_only = is_adapted(self.model)
        return {
            name: tensor
            for name, tensor in weights.tensors(self.model).items()
            if name in persistent and (tensor.requires_grad or not adapters_only)
        }

    def save(self, directory: Path, world_size: int) -> None:
        self.write(self.state(), directory, world_size)

    def write(self, state: dict, directory: Path, world_size: int, process_group=None) -> None:
        """Write `state` (state(), or a staged copy of it) as this part's files; `process_group`: the collectives'
        (None: the default group)."""
        weights.write_shards(state, directory, world_size, process_group)

    def nbytes(self) -> int:
        """What save() writes: the tensors whole (over every rank)."""
        return sum(weights.whole_bytes(tensor) for tensor in self.state().values())

    def load(self, directory: Path) -> None:
        weights.read_files(self.model, directory, {name: name for name in self.state()})

    def load_whole(self, state: dict, broadcast: bool) -> None:
        """A reference-format state: whole on rank 0 ({} elsewhere; broadcast from rank 0 when `broadcast`)."""
        # strict=False: a LoRA checkpoint holds the adapters only (check_fit made sure it holds every trainable one)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
        set_model_state_dict(self.model, state, options=options)


class ChosenWeights(ModelWeights):
    """A checkpoint part: the tensors of `model` that chosen() gives by name (a moving reference's weights:
    reference_sync.py), sharded as the model is. Collective."""

    def __init__(self, model, chosen: Callable[[], dict[str, torch.Tensor]]):
        super().__init__(model)
        self.chosen = chosen

    def state(self) -> dict[str, torch.Tensor]:
        return self.chosen()


class OptimizerState(ModelWeights):
    """A checkpoint part: the optimizer's state, keyed by parameter name and sharded like the parameters."""

    def __init__(self, model, optimizer):
        super().__init__(model)
        self.optimizer = optimizer

    def state(self) -> dict:
        """The optimizer's state by parameter name, each rank's shards (DCP's optimizer state dict)."""
        return get_optimizer_state_dict(self.model, self.optimizer)

    def write(self, state: dict, directory: Path, world_size: int, process_group=None) -> None:
        dcp.save(state, checkpoint_id=str(directory), process_group=process_group, no_dist=weights.one_process())

    def nbytes(self) -> int:
        states = self.optimizer.state.values()
        return sum(weights.whole_bytes(value) for state in states for value in state.values() if torch.is_tensor(value))

    def load(self, directory: Path) -> None:
        state = self.state()  # this run's shards, to be filled
        dcp.load(state, checkpoint_id=str(directory), no_dist=weights.one_process())
        with own_implementation(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, state)

    def load_whole(self, state: dict, broadcast: bool) -> None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
        with own_implementation(self.optimizer):
            set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


@contextlib.contextmanager
def own_implementation(optimizer: torch.optim.Optimizer):
    """Loading a checkpoint's parameter groups keeps how this run's optimizer steps (fused or foreach, chosen for its
    parameters: optim.fused_default), which torch would replace with the writer's: tensor parallelism's plain and
    DTensor parameters, which the fused kernel cannot take together, made fused by a BasicTrainer or FSDP checkpoint,
    stopped at the first step."""
    own = [{key: group[key] for key in IMPLEMENTATION if key in group} for group in optimizer.param_groups]
    yield
    for group, keys in zip(optimizer.param_groups, own):
        group.update(keys)


def collective(part) -> bool:
    """Whether every rank takes part in saving and loading the part (ModelWeights, OptimizerState)."""
    return getattr(part, "collective", False)


class Draft:
    """A checkpoint on its way to output_dir, under a temporary name: what it holds besides the collective parts'
    shards, taken when the save is asked for (`copied`: copies that training can no longer change, for a save that
    goes on in the background), and the steps rank 0 takes to write it (save, save_in_background)."""

    def __init__(
        self, output_dir: Path, step: int, metrics: dict, parts: dict, loop_state: dict, final: bool, copied: bool
    ):
        self.output_dir, self.tmp_dir = output_dir, output_dir.with_name(output_dir.name + ".tmp")
        self.step, self.metrics, self.parts, self.final = step, metrics, parts, final
        self.marker = json.dumps({"step": step, "metrics": metrics, "final": final, "loop": loop_state}, indent=1)
        small = {name: part.state_dict() for name, part in parts.items() if not collective(part)}
        self.small = copy.deepcopy(small) if copied else small
        self.shapes = {name: tensor.shape for name, tensor in parts["policy"].state().items()}  # whole shapes

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
    step: int,
    metrics: dict[str, float],
    parts: dict,
    topology: Topology,
    loop_state: dict,
    tokenizer,
    final: bool = False,
    previous: Path | None = None,
    keep_last: int | None = None,
) -> None:
    """Write each part (parts: name -> a collective part, or an object with state_dict(); "policy" a ModelWeights)
    with the model's config and tokenizer to a temporary directory, every rank its shards; at the run's end (`final`)
    the from_pretrained export too (export); then checkpoint.json with `loop_state` (the training loop's counters), and
    swap the directory in whole. First the space it needs (space_needed; `previous`: this run's last checkpoint) is
    checked against the free space, after pruning what keep_last would prune after it (make_room). A failure to write
    (a full disk, a quota, no permission, a directory the machines do not share) is a WriteFailed on every rank,
    and leaves no temporary directory behind."""
    draft = Draft(output_dir, step, metrics, parts, loop_state, final, copied=False)
    tmp_dir, policy = draft.tmp_dir, parts["policy"].model

    def on_main(write) -> None:
        topology.run_on_main(lambda: written(output_dir, write))

    try:
        on_main(lambda: draft.start(previous, keep_last))
        with storage.writing(output_dir):  # DCP's writes, on every rank: a failure on any is raised on every one
            for name, part in parts.items():
                if collective(part):
                    part.save(tmp_dir / name, topology.world_size)
        on_main(lambda: describe_model(tmp_dir, policy, tokenizer))
        if final:
            export(tmp_dir, policy, topology, tmp_dir / "policy")
            on_main(lambda: write_cards(tmp_dir, output_dir.parent, step, metrics, output_dir.parent.name))
        on_main(draft.finish)
    except UserError as error:
        remove(tmp_dir, topology)
        raise storage.as_final(error, tmp_dir, output_dir) from None
    print(f"saved {output_dir}")


def save_in_background(
    output_dir: Path,
    step: int,
    metrics: dict[str, float],
    parts: dict,
    topology: Topology,
    loop_state: dict,
    tokenizer,
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
    draft = Draft(output_dir, step, metrics, parts, loop_state, final=False, copied=True)
    tmp_dir, policy = draft.tmp_dir, parts["policy"].model
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
            on_main(lambda: describe_model(tmp_dir, policy, tokenizer))
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
    vision = getattr(tokenizer, "vision", None)  # modeling.models.load_tokenizer's
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


def adapter_whole(tensor: torch.Tensor) -> torch.Tensor:
    """An adapter's tensor whole, on the CPU (collective where sharded)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()


def is_legacy(checkpoint_dir: Path) -> bool:
    """A checkpoint in the DPO reference's format: whole states in policy.pt and optimizer.pt."""
    return not (checkpoint_dir / "policy").is_dir() and (checkpoint_dir / "policy.pt").exists()


def load(checkpoint_dir: Path, parts: dict, batch_size: int, topology: Topology) -> tuple[int, dict]:
    """Load each part's state (as save() wrote them) into the placed parts; return the examples seen and
    checkpoint.json. Every rank reads its own shards of the collective parts; rank 0 reads the small parts' files
    and broadcasts them. A part without a file keeps its state: an optional one that had none to save."""
    if is_legacy(checkpoint_dir):
        return load_legacy(checkpoint_dir, parts, batch_size, topology)
    setting = f"resume_from={checkpoint_dir}"
    optimizer = parts["optimizer"].optimizer
    marker = topology.broadcast(
        topology.run_on_main(lambda: check_sharded(checkpoint_dir, parts["policy"].model, optimizer, batch_size))
    )
    for name, part in parts.items():
        if collective(part) and not optional_part_missing(checkpoint_dir, name):
            try:
                part.load(checkpoint_dir / name)
            except CheckpointException as error:
                raise UserError(f"{setting}: {checkpoint_dir / name} ({weights.failure(error)})") from None
    load_small(checkpoint_dir, parts, topology, setting)
    print(f"resumed from {checkpoint_dir} at {marker['step']} examples")
    return marker["step"], marker


def optional_part_missing(checkpoint_dir: Path, name: str) -> bool:
    """Whether a collective part other than the weights and the optimizer (checked before: check_sharded) has no
    directory in the checkpoint, written by a run without it: the part keeps its state as built, and a line says so."""
    if name in ("policy", "optimizer") or (checkpoint_dir / name).is_dir():
        return False
    print(f"resume: {checkpoint_dir} holds no {name}/ (written by a run without it): the {name} is as built")
    return True


def load_small(checkpoint_dir: Path, parts: dict, topology: Topology, setting: str) -> None:
    """The parts that are not collective: rank 0 reads their files and broadcasts the states."""
    names = [name for name, part in parts.items() if not collective(part)]

    def read() -> dict:
        return {
            n: weights.read_reference_format(checkpoint_dir / f"{n}.pt", setting)
            for n in names
            if (checkpoint_dir / f"{n}.pt").exists()
        }

    states = topology.broadcast(topology.run_on_main(read))
    for name, state in states.items():
        load_state(parts[name], state["state"], setting, checkpoint_dir / f"{name}.pt")


def preflight(checkpoint_dir: Path, policy, batch_size: int, offload: bool = False) -> None:
    """The checks of the files and the weights' names and shapes, made before the run spends time on anything else,
    from the files' headers (tensors are not read). policy: the model before placement (names and whole shapes are the
    same after it). offload: the run keeps FSDP's shards on the host (fsdp_cpu_offload), where the reference format's
    broadcast from rank 0 (over NCCL, which reaches GPU tensors only) cannot put them."""
    if is_legacy(checkpoint_dir):
        setting = f"resume_from={checkpoint_dir}"
        if offload:
            raise UserError(
                f"{setting} is in the DPO reference's format (whole policy.pt and optimizer.pt), broadcast from rank 0 "
                "over the GPUs, which fsdp_cpu_offload=true's host shards cannot take: resume it once without "
                "fsdp_cpu_offload, and go on with it from the sharded checkpoints that run writes"
            )
        check_fit(checkpoint_dir, read_states(checkpoint_dir, setting, mmap=True), policy, batch_size, setting)
    else:
        check_sharded(checkpoint_dir, policy, None, batch_size)


def check_sharded(checkpoint_dir: Path, policy, optimizer, batch_size: int) -> dict:
    """checkpoint.json of a complete checkpoint that fits this run: its step fits the batch size, policy/ holds every
    trainable weight in its shape, optimizer/ names only those and has the optimizer's parameter groups (not checked
    with optimizer=None)."""
    setting = f"resume_from={checkpoint_dir}"
    marker = describe(checkpoint_dir)
    if marker is None:
        what = "does not exist" if not checkpoint_dir.exists() else f"has no {MARKER}: not a complete checkpoint"
        raise UserError(f"{setting}: {checkpoint_dir} {what}")
    if marker["step"] % batch_size:
        raise UserError(f"{setting}: {marker['step']} examples seen is not a multiple of batch_size={batch_size}")
    try:
        found = weights.stored_shapes(checkpoint_dir / "policy")
        metadata = FileSystemReader(str(checkpoint_dir / "optimizer")).read_metadata()
    except UserError as error:
        raise UserError(f"{setting}: {error}") from None
    except (OSError, ValueError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise UserError(f"{setting}: {checkpoint_dir / 'optimizer'} is not readable ({first_line(error)})") from None
    expected = {name: tuple(t.shape) for name, t in ModelWeights(policy).state().items()}
    mismatch = fit_problem(expected, {name: tuple(shape) for name, shape in found.items()})
    if mismatch:
        raise UserError(
            f"{setting}: {checkpoint_dir / 'policy'} does not fit this {weights.class_name(policy)} ({mismatch})"
        )
    paths = (metadata.planner_data or {}).values()
    unknown = sorted({path[1] for path in paths if path[0] == "state"} - expected.keys())
    if unknown:
        raise UserError(f"{setting}: {checkpoint_dir / 'optimizer'} has state for an unknown parameter {unknown[0]!r}")
    groups = len({path[1] for path in paths if path[0] == "param_groups"})
    if optimizer is not None and groups != len(optimizer.param_groups):
        raise UserError(
            f"{setting}: {checkpoint_dir / 'optimizer'} does not fit this {type(optimizer).__name__} ({groups} "
            f"parameter groups, expected {len(optimizer.param_groups)})"
        )
    return marker


def fit_problem(expected: dict[str, tuple], found: dict[str, tuple]) -> str | None:
    """The first way the checkpoint's weights (name -> shape) differ from the expected ones, or None."""
    mismatches = [f"{name} is missing" for name in expected.keys() - found.keys()]
    mismatches += [f"{name} is unexpected" for name in found.keys() - expected.keys()]
    mismatches += [
        f"{name} has shape {list(found[name])}, expected {list(expected[name])}"
        for name in expected.keys() & found.keys()
        if found[name] != expected[name]
    ]
    return sorted(mismatches)[0] if mismatches else None


# -------------------------------------------------------------------------------------------------------------
# The DPO reference's format, written before the sharded one: whole states, read by rank 0 and broadcast


def load_legacy(checkpoint_dir: Path, parts: dict, batch_size: int, topology: Topology) -> tuple[int, dict]:
    setting = f"resume_from={checkpoint_dir}"
    policy, optimizer = parts["policy"].model, parts["optimizer"].optimizer
    states = topology.run_on_main(lambda: read(checkpoint_dir, list(parts), policy, optimizer, batch_size, setting))
    step, marker = topology.broadcast((states["policy"]["step_idx"], states["marker"]) if topology.is_main else None)
    for name, part in parts.items():
        if collective(part) and not optional_part_missing(checkpoint_dir, name):
            part.load_whole(states[name]["state"] if topology.is_main else {}, broadcast=topology.world_size > 1)
    load_small(checkpoint_dir, parts, topology, setting)
    print(f"resumed from {checkpoint_dir} at {step} examples")
    return step, marker


def read(checkpoint_dir: Path, names: list[str], policy, optimizer, batch_size: int, setting: str) -> dict[str, dict]:
    """The collective parts' files, checked to fit this run, so that loading them cannot fail half-way through a
    broadcast; and checkpoint.json as "marker" ({} in checkpoints older than it)."""
    states = read_states(checkpoint_dir, setting)
    states["marker"] = describe(checkpoint_dir) or {}
    check_fit(checkpoint_dir, states, policy, batch_size, setting)
    if len(states["optimizer"]["state"].get("param_groups", [])) != len(optimizer.param_groups):
        raise UserError(
            f"{setting}: {checkpoint_dir / 'optimizer.pt'} does not fit this {type(optimizer).__name__} "
            f"({len(states['optimizer']['state'].get('param_groups', []))} parameter groups, expected "
            f"{len(optimizer.param_groups)})"
        )
    return states


def read_states(checkpoint_dir: Path, setting: str, mmap: bool = False) -> dict[str, dict]:
    states = {"policy": weights.read_reference_format(checkpoint_dir / "policy.pt", setting, mmap)}
    if not isinstance(states["policy"].get("step_idx"), int):
        raise UserError(f"{setting}: {checkpoint_dir / 'policy.pt'} has no step_idx: not a training checkpoint")
    for name in LEGACY_FILES[1:]:
        states[name] = weights.read_reference_format(checkpoint_dir / f"{name}.pt", setting, mmap)
    return states


def check_fit(checkpoint_dir: Path, states: dict[str, dict], policy, batch_size: int, setting: str) -> None:
    """The step fits the batch size; policy.pt holds every trainable weight of the policy in its shape; the
    optimizer state names only those."""
    step = states["policy"]["step_idx"]
    if step % batch_size:
        raise UserError(f"{setting}: {step} examples seen is not a multiple of batch_size={batch_size}")
    # DTensor shapes are global, so these are the full shapes whatever the sharding. Frozen weights (a LoRA base)
    # are not saved.
    frozen = {name for name, parameter in policy.named_parameters() if not parameter.requires_grad}
    expected = {name: tuple(value.shape) for name, value in policy.state_dict().items() if name not in frozen}
    found = {name: tuple(value.shape) for name, value in states["policy"]["state"].items()}
    mismatch = fit_problem(expected, found)
    if mismatch:
        raise UserError(
            f"{setting}: {checkpoint_dir / 'policy.pt'} does not fit this {weights.class_name(policy)} ({mismatch})"
        )
    optimizer_state = states["optimizer"]["state"]
    groups = optimizer_state.get("param_groups", [])
    parameters = [p for group in groups for p in group.get("params", [])] + list(optimizer_state.get("state", {}))
    unknown = [p for p in parameters if p not in expected]
    if unknown:
        raise UserError(
            f"{setting}: {checkpoint_dir / 'optimizer.pt'} has state for an unknown parameter {unknown[0]!r}"
        )


def load_state(target, state: dict, setting: str, path: Path) -> None:
    """target.load_state_dict(state) for a module, optimizer or scheduler, with a one-line error on mismatch."""
    try:
        target.load_state_dict(state)
    except (RuntimeError, ValueError, KeyError) as error:
        raise UserError(f"{setting}: {path} does not fit this {type(target).__name__} ({first_line(error)})") from None


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
