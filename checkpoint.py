"""Checkpoints in the DPO reference's format: a directory of policy.pt, optimizer.pt and scheduler.pt, each
{"step_idx": examples seen, "state": state_dict, "metrics": ...}; the final one is also a from_pretrained directory.

States are full (unsharded) and keyed by parameter name, whatever the trainer and mesh, so that any trainer
resumes from any other's checkpoint. A directory is written whole under a temporary name, synced to disk, and
then renamed into place, so that a kill at any moment leaves every checkpoint directory complete or absent, and the
previous ones untouched. Its last file, checkpoint.json, says what it is: the step, the eval metrics, whether it ends
the run, and the loop's own state; `newest` resumes from it and `prune` keeps the disk from filling."""

import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from adapters import is_adapted, is_quantized, merged_state_dict
from distributed import Topology
from utils import UserError, first_line

FILES = ("policy", "optimizer", "scheduler")  # the reference format's files; any other part's file is optional
MARKER = "checkpoint.json"  # written last: a directory without it was not written by save()
STEP_DIR = re.compile(r"step-(\d+)")


class ModelWeights:
    """A checkpoint part: the model's trainable weights (a LoRA policy's: its adapters), full and keyed by name
    whatever the sharding. Collective: every rank takes part; rank 0 gets the whole state, on its CPU."""

    collective = True

    def __init__(self, model):
        self.model = model

    def state_dict(self) -> dict:
        if is_quantized(self.model):  # QLoRA, one process: get_model_state_dict trips on bitsandbytes' 4-bit weights
            return {name: p.detach().cpu() for name, p in self.model.named_parameters() if p.requires_grad}
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return get_model_state_dict(self.model, options=options)

    def load_state_dict(self, state: dict, broadcast: bool) -> None:
        """state: the whole state on rank 0 ({} elsewhere; broadcast from rank 0 when `broadcast`)."""
        # strict=False: a LoRA checkpoint holds the adapters only (check_fit made sure it holds every trainable one)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
        set_model_state_dict(self.model, state, options=options)


class OptimizerState(ModelWeights):
    """A checkpoint part: the optimizer's state, full and keyed by parameter name like the weights."""

    def __init__(self, model, optimizer):
        super().__init__(model)
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state_dict(self, state: dict, broadcast: bool) -> None:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
        set_optimizer_state_dict(self.model, self.optimizer, state, options=options)


def save(
    output_dir: Path,
    step: int,
    metrics: dict[str, float],
    parts: dict,
    topology: Topology,
    loop_state: dict,
    tokenizer=None,
) -> None:
    """Write each part's state to <name>.pt (parts: name -> an object with state_dict(); "policy" a ModelWeights, as
    the reference format has it; a part with an empty state writes no file), and, given the tokenizer, a
    from_pretrained-ready copy of policy and tokenizer (the run's end), then checkpoint.json with `loop_state` (the
    training loop's counters), to a temporary directory; then swap it in whole. Every rank takes part in gathering the
    states; rank 0 writes, and a failure to write (a full disk, no permission) is a UserError on every rank."""
    states = {name: part.state_dict() for name, part in parts.items()}
    policy = parts["policy"].model
    export_state = states["policy"]
    if tokenizer is not None and not is_quantized(policy) and any(not p.requires_grad for p in policy.parameters()):
        # the merged export needs every weight, a LoRA base's frozen ones too
        export_state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    marker = {"step": step, "metrics": metrics, "final": tokenizer is not None, "loop": loop_state}

    def write():
        tmp_dir = output_dir.with_name(output_dir.name + ".tmp")
        try:
            shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed save: none of it may leak into this one
            tmp_dir.mkdir(parents=True)
            for name, state in states.items():
                if state:
                    torch.save({"step_idx": step, "state": state, "metrics": metrics}, tmp_dir / f"{name}.pt")
            if tokenizer is not None:
                export(tmp_dir, policy, export_state, tokenizer)
            (tmp_dir / MARKER).write_text(json.dumps(marker, indent=1))
            sync(tmp_dir)
            replace_dir(tmp_dir, output_dir)
        except OSError as error:  # a full disk, a read-only or vanished directory
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise UserError(
                f"could not write the checkpoint {output_dir} ({error.strerror or first_line(error)}: "
                f"{error.filename or tmp_dir})"
            ) from None
        print(f"saved {output_dir}")

    topology.run_on_main(write)


def sync(directory: Path) -> None:
    """Flush the directory's files and entries to disk: after a power cut, a renamed directory is whole too."""
    for path in [*directory.rglob("*"), directory]:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def export(directory: Path, policy, state: dict, tokenizer) -> None:
    """A from_pretrained directory of the policy (a LoRA policy merged, its adapter in peft's format in adapter/),
    and the tokenizer. A QLoRA policy exports its adapter only: merged into its 4-bit base it would be a model of
    dequantized NF4 weights, not of the original ones; merge the adapter into the original base instead."""
    if is_quantized(policy):
        policy.save_pretrained(directory / "adapter", state_dict=state)
        print(
            "export: the adapter only (adapter/), not a merged model: the base is 4-bit. Merge it into the original "
            "base: PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()"
        )
    elif is_adapted(policy):
        policy.save_pretrained(directory / "adapter", state_dict=state)
        policy.get_base_model().save_pretrained(directory, state_dict=merged_state_dict(state, policy))
    else:
        policy.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)


def load(checkpoint_dir: Path, parts: dict, batch_size: int, topology: Topology) -> tuple[int, dict]:
    """Load each part's state (as save() wrote them) into the placed parts; return the examples seen and
    checkpoint.json ({} in checkpoints older than it). Rank 0 reads and checks the files; collective parts (weights,
    optimizer) are broadcast by torch's state-dict loaders, the others' states as objects. A part without a file
    keeps its state: an optional one (not one of FILES) that had none to save."""
    setting = f"resume_from={checkpoint_dir}"
    main = topology.is_main
    policy, optimizer = parts["policy"].model, parts["optimizer"].optimizer
    states = topology.run_on_main(lambda: read(checkpoint_dir, list(parts), policy, optimizer, batch_size, setting))
    step, marker, small = topology.broadcast(
        (
            states["policy"]["step_idx"],
            states["marker"],
            {name: states.get(name) for name, part in parts.items() if not collective(part)},
        )
        if main
        else None
    )
    for name, part in parts.items():
        if collective(part):
            part.load_state_dict(states[name]["state"] if main else {}, broadcast=topology.world_size > 1)
        elif small[name] is not None:
            load_state(part, small[name]["state"], setting, checkpoint_dir / f"{name}.pt")
    print(f"resumed from {checkpoint_dir} at {step} examples")
    return step, marker


def collective(part) -> bool:
    """Whether every rank takes part in the part's state_dict() and load_state_dict() (ModelWeights)."""
    return getattr(part, "collective", False)


def preflight(checkpoint_dir: Path, policy, batch_size: int) -> None:
    """`read`'s checks of the files and the weights' names and shapes, made before the run spends time on anything
    else (the files' tensors are mapped, not read). policy: the model before placement; names and shapes are the
    same after it."""
    setting = f"resume_from={checkpoint_dir}"
    check_fit(checkpoint_dir, read_states(checkpoint_dir, setting, mmap=True), policy, batch_size, setting)


def read(checkpoint_dir: Path, names: list[str], policy, optimizer, batch_size: int, setting: str) -> dict[str, dict]:
    """The parts' files (FILES required, the others where present), checked to fit this run, so that loading them
    cannot fail half-way through a broadcast; and checkpoint.json as "marker"."""
    states = read_states(checkpoint_dir, setting)
    for name in set(names) - set(FILES):
        if (checkpoint_dir / f"{name}.pt").exists():
            states[name] = read_file(checkpoint_dir / f"{name}.pt", setting)
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
    states = {"policy": read_file(checkpoint_dir / "policy.pt", setting, mmap)}
    if not isinstance(states["policy"].get("step_idx"), int):
        raise UserError(f"{setting}: {checkpoint_dir / 'policy.pt'} has no step_idx: not a training checkpoint")
    return states | {name: read_file(checkpoint_dir / f"{name}.pt", setting, mmap) for name in FILES[1:]}


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
    mismatches = [f"{name} is missing" for name in expected.keys() - found.keys()]
    mismatches += [f"{name} is unexpected" for name in found.keys() - expected.keys()]
    mismatches += [
        f"{name} has shape {list(found[name])}, expected {list(expected[name])}"
        for name in expected.keys() & found.keys()
        if found[name] != expected[name]
    ]
    if mismatches:
        raise UserError(
            f"{setting}: {checkpoint_dir / 'policy.pt'} does not fit this {type(policy).__name__} "
            f"({sorted(mismatches)[0]})"
        )
    optimizer_state = states["optimizer"]["state"]
    groups = optimizer_state.get("param_groups", [])
    parameters = [p for group in groups for p in group.get("params", [])] + list(optimizer_state.get("state", {}))
    unknown = [p for p in parameters if p not in expected]
    if unknown:
        raise UserError(
            f"{setting}: {checkpoint_dir / 'optimizer.pt'} has state for an unknown parameter {unknown[0]!r}"
        )


def read_file(path: Path, setting: str, mmap: bool = False) -> dict:
    """A checkpoint file in the reference format, read with weights_only (mmap: its tensors mapped, not read).
    Anything else raises a UserError that names the `setting` it came from."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
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
            doomed = directory.with_name(directory.name + ".deleted")
            directory.rename(doomed)
            shutil.rmtree(doomed)
    for leftover in run_dir.glob("step-*.deleted"):  # from a kill mid-deletion
        shutil.rmtree(leftover)


def replace_dir(tmp_dir: Path, final_dir: Path) -> None:
    """Move a fully written `tmp_dir` to `final_dir`; an older `final_dir` is removed only afterwards,
    so a crash at any point leaves either the old or the new directory complete."""
    old_dir = final_dir.with_name(final_dir.name + ".old")
    if old_dir.exists():
        shutil.rmtree(old_dir)
    if final_dir.exists():
        final_dir.rename(old_dir)
    tmp_dir.rename(final_dir)
    sync(final_dir.parent)
    if old_dir.exists():
        shutil.rmtree(old_dir)
