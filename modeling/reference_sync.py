"""TR-DPO (Gorbatovski et al. 2024, "Learn Your Reference Model for Real Good Alignment", arXiv:2404.09656): the
reference moves towards the policy while it trains. After every `reference_sync_steps`-th optimizer step each weight
the reference owns becomes alpha * policy + (1 - alpha) * reference (`reference_mixup_alpha`; 1.0 copies the policy,
the paper's hard update). TRL 1.16 names them sync_ref_model, ref_model_sync_steps and ref_model_mixup_alpha.

The weights mixed are the reference's own: a reference model's parameters, or, under LoRA, the factors A and B of
the `reference` adapter (adapters.add_reference_adapter) with those of the policy's adapter, the base being shared.
The rule is elementwise and reference and policy are placed alike, so each rank mixes its own shards (the local
tensors of FSDP's and tensor parallelism's DTensors): nothing is gathered or sent.

A moved reference is scored live, a forward pass per micro-batch (reference_sync_steps makes the run keep a reference
model, or the adapter); with reference_cache=true the cached log-probs of the initial weights serve the steps before
the first update, and are never read after it (`SyncedReference`)."""

from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modeling.adapters import reference_adapter_pairs


@torch.no_grad()
def mix(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float) -> None:
    """reference <- (1 - alpha) * reference + alpha * policy for each (reference, policy) pair, in place, on this
    rank's shards: with alpha = 1 the reference becomes the policy exactly (0 * reference + policy). A reference held
    in another dtype than the policy (model.reference_dtype) is mixed in float32 and rounded to its own."""
    for name, (reference, policy) in pairs.items():
        if isinstance(reference, DTensor) != isinstance(policy, DTensor) or reference.shape != policy.shape:
            raise RuntimeError(f"the reference's {name} is not placed like the policy's")
        if isinstance(reference, DTensor):
            if reference.placements != policy.placements:
                raise RuntimeError(f"the reference's {name} is sharded as {reference.placements}, not as the policy")
            reference, policy = reference.to_local(), policy.to_local()
        if reference.dtype == policy.dtype:
            reference.mul_(1 - alpha).add_(policy, alpha=alpha)
        else:
            reference.copy_(reference.float().mul_(1 - alpha).add_(policy.float(), alpha=alpha))


def weight_pairs(policy: nn.Module, owner: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name in owner: (the reference's tensor, the policy's counterpart)}. owner: the reference model, whose
    parameters are named as the policy's; or the LoRA policy itself, which holds the reference adapter."""
    if owner is policy:
        return reference_adapter_pairs(policy)
    own = dict(policy.named_parameters())
    return {name: (parameter, own[name]) for name, parameter in owner.named_parameters()}


class SyncedReference:
    """The reference's log-probs when it moves: from `live` (reference_cache.LiveReference over the moving model), or
    from `cached` (the initial weights' CachedReference, or None) until the first update. The Trainer calls update()
    after each optimizer step that due() names, and resumed() after loading a checkpoint, which holds the moved
    weights (state(): the tensors mixed, by name in `owner`)."""

    def __init__(self, live, cached, policy: nn.Module, owner: nn.Module, every: int, alpha: float):
        self.live_source, self.cached, self.every, self.alpha = live, cached, every, alpha
        self.pairs: Callable[[], dict] = lambda: weight_pairs(policy, owner)
        self.owner = owner
        self.updates = 0  # updates made so far

    @property
    def live(self) -> bool:
        """Whether log-probs come from a forward pass now (the cache holds the initial weights' only)."""
        return self.cached is None or self.updates > 0

    def __call__(self, examples: list[dict], batch) -> torch.Tensor:
        """[R * B] log-probs, ordered like the policy's."""
        return (self.live_source if self.live else self.cached)(examples, batch)

    def due(self, steps: int) -> bool:
        """Whether the reference moves after optimizer step `steps` (counted from 1)."""
        return steps % self.every == 0

    def update(self, steps: int) -> int:
        """TR-DPO's update after optimizer step `steps`, said in one line; the updates made so far."""
        mix(self.pairs(), self.alpha)
        self.updates += 1
        print(f"reference: update {self.updates} after step {steps}, alpha {self.alpha:g}")
        return self.updates

    def resumed(self, steps: int) -> None:
        """Training continues after `steps` optimizer steps, the reference's weights read from their checkpoint."""
        self.updates = steps // self.every

    def state(self) -> dict[str, torch.Tensor]:
        """The reference's tensors that updates change, by name in `owner` (a checkpoint part's tensors)."""
        return {name: reference for name, (reference, _) in self.pairs().items()}


def schedule_line(every: int, alpha: float, steps: int, cached: bool, lora: bool) -> str:
    """The run's reference schedule in one line (the dry run, the build)."""
    what = "the reference adapter" if lora else "the reference's weights"
    line = (
        f"reference: TR-DPO, {what} <- {alpha:g} x policy + {1 - alpha:g} x reference after every {every} "
        f"optimizer steps: {steps // every} updates in {steps} steps, the reference scored live"
    )
    if cached:
        line += " after the first (cached log-probs of the initial weights before it)"
    return line
