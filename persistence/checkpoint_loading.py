"""Reading a checkpoint back, on any mesh: the checks made before a run spends time on anything else (`preflight`:
the files, and the weights' names and shapes from their headers), then each part's state into the placed parts
(`load`: every rank its own shards of the collective parts, rank 0 the small parts' files, broadcast). Checkpoints
in the DPO reference's format (a whole policy.pt and optimizer.pt, written before the sharded one) are read too:
rank 0 reads and checks them whole, then broadcasts."""

import pickle
from pathlib import Path

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from modeling import weights
from modeling.distributed import Topology
from persistence.checkpoint import MARKER, describe
from persistence.checkpoint_parts import ModelWeights, collective
from utils import UserError, first_line

LEGACY_FILES = ("policy", "optimizer", "scheduler")  # the reference format's files, which it requires


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
