"""Dynamic loss scaling for float16 compute (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2).

float16 keeps 10 mantissa bits like bfloat16's 7 plus 3, but only 5 exponent bits: its smallest normal value is
6.1e-5 (subnormals to 6e-8), so a DPO step's gradients, often 1e-6..1e-9 per element, flush to zero in a float16
backward. Multiplying the loss by S before backward multiplies every gradient by S, lifting them into float16's
range; dividing the float32 master gradients by S afterwards (before clipping, which must see the true norm)
restores them. S is chosen dynamically: halved (backoff) whenever a step's gradients hold an inf or NaN, which
skips that step, and doubled after `growth_interval` finite steps in a row, so that it stays near the largest
value that does not overflow. The scaler is torch's own: torch.amp.GradScaler in one process, and FSDP's
ShardedGradScaler across ranks, which all-reduces the "found inf" flag so that every rank skips the same steps
(gradients are sharded under FSDP and tensor parallelism: one rank may hold the only inf). torch's scaler has no
floor; `min_scale` is ours, as DeepSpeed's dynamic scaler has one: a scale below 1 would shrink gradients instead.
"""

import math
from dataclasses import dataclass

import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class ScaleSettings:
    """The loss_scale section of the config (configuration.sections.LossScaleConfig), as the scaler reads it."""

    init: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float


class LossScale:
    """A float16 run's loss scale over one optimizer: `scale` the loss of each micro-batch before its backward,
    `unscale` the gradients once per step before they are clipped, then `finish` the step (the optimizer steps only
    where the step was finite). Its state (scale, growth tracker, skipped steps) is a checkpoint part."""

    def __init__(self, settings: ScaleSettings, device: torch.device, distributed: bool):
        scaler = ShardedGradScaler if distributed else torch.amp.GradScaler
        self.scaler = scaler(
            device.type,
            init_scale=settings.init,
            growth_factor=settings.growth_factor,
            backoff_factor=settings.backoff_factor,
            growth_interval=settings.growth_interval,
        )
        self.min_scale = settings.min_scale
        self.skipped = 0  # steps skipped for an overflow, over the whole run

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's gradients divided by the scale, in place, and whether any is inf or NaN recorded
        (all-reduced over the ranks by the sharded scaler)."""
        self.scaler.unscale_(LocalGradients(optimizer))

    def finish(self, optimizer: torch.optim.Optimizer, finite: bool, metrics: dict[str, list[float]]) -> bool:
        """The optimizer's step where the step was finite (its weights, moments and step count untouched where not),
        then the scale's update: halved after an overflow, floored at min_scale; doubled after growth_interval
        finite steps. `finite` is the trainer's verdict on the loss and the clipped norm, the same on every rank;
        `metrics` (the step's) gain the scale and the run's skipped steps. Whether the step failed in a way the scale
        cannot fix: its loss not finite (the forward overflowed), or its gradients at the scale's floor."""
        failed = not finite and (self.at_floor or not all(map(math.isfinite, metrics["loss/train"])))
        if finite:  # not scaler.step: the gradients are unscaled already, and the verdict is taken
            optimizer.step()
        else:
            self.skipped += 1
        self.scaler.update()
        scale = self.scaler.get_scale()  # the one read of the scale a step (a host sync)
        if scale < self.min_scale:
            self.scaler.update(new_scale=self.min_scale)
            scale = self.min_scale
        metrics["loss_scale"], metrics["counters/skipped_steps"] = [scale], [float(self.skipped)]
        return failed

    @property
    def value(self) -> float:
        return self.scaler.get_scale()

    @property
    def at_floor(self) -> bool:
        """Whether the scale can fall no further: an overflow now is the forward's, not the scale's."""
        return self.value * self.scaler.get_backoff_factor() < self.min_scale

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scaler.load_state_dict(state["scaler"])
        self.skipped = state["skipped"]


class LocalGradients:
    """What torch's scaler reads of an optimizer (`param_groups` of objects with a `.grad`), each gradient as this
    rank's own tensor: tensor parallelism leaves some gradients plain beside the DTensors, and the scaler's one
    foreach call per device refuses the mix. Its unscaling in place reaches the DTensors' local tensors, which are
    their storage; the "found inf" flag is then this rank's alone, which the sharded scaler all-reduces."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
        self.param_groups = [{"params": [holding(grad) for grad in local]}]


def holding(grad: torch.Tensor) -> torch.Tensor:
    """A tensor whose .grad is `grad`, as the scaler takes a parameter: a view of the gradient itself (no copy)."""
    stand_in = grad.detach()
    stand_in.grad = grad
    return stand_in
