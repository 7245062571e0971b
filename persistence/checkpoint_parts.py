"""The stateful parts a checkpoint is made of, each saving and loading itself: the model's weights (ModelWeights; a
LoRA policy's adapters), a chosen set of a model's tensors (ChosenWeights: TR-DPO's moving reference) and the
optimizer's state (OptimizerState), every rank writing and reading its own shards (collective parts); any object
with state_dict() and load_state_dict() (the scheduler, the objective's running state) is a small part, which
checkpoint.py writes whole in the DPO reference's file format."""

import contextlib
from pathlib import Path
from typing import Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from modeling import weights
from modeling.adapters import is_adapted

IMPLEMENTATION = ("fused", "foreach")  # an optimizer's parameter-group keys that say how it steps, not what it computes


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
