"""Training steps the host does not wait for (`sync_free_steps`): the optimizer steps on the device whatever the
step's verdict, and the verdict and metrics come to the host once per log interval, in one transfer.

A synchronised step waits at its end for its metrics and gradient norm, to decide on the host whether the step was
finite, and so whether the optimizer and the warmup schedule step. Meanwhile the GPU idles: the host's work for the
next step (laying out its batch, launching its kernels) starts only after the device has drained. Here the decision
is taken on the device instead: a non-finite loss or gradient norm sets the fused optimizer's `found_inf`, which
skips the update and takes the step counts back (torch's own path for a float16 gradient scaler), and the learning
rate is a tensor computed on the device from the finite steps taken (core.optim.warmup_factor), so that a skipped
step holds the schedule back exactly as the synchronised step does. The host learns each step's verdict when the
interval closes (`resolve`): the schedule's own count catches up, the non-finite steps are counted in order (the run
stops where max_nonfinite_steps are in a row, up to one interval later), and the steps are logged as before.

Where it applies: a fused optimizer (Adam, AdamW, SGD: found_inf and a tensor learning rate), plain parameters (not
FSDP's or tensor parallelism's DTensors), no loss scale (float16's scale decides on the host: one sync a step
there) and a loss with no running state (bco_pair's reward mean feeds the next step). On a CPU the numbers are the
synchronised step's bit for bit (the learning rate a float64 tensor, as the host computes it); on CUDA the fused
kernel reads a float32 learning rate, which may round the update's last bit differently.
"""

import math
import time
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from core.optim import warmup_factor
from modeling.placement import lever_on
from utils import UserError

DEFERRABLE = (torch.optim.Adam, torch.optim.SGD)  # AdamW is an Adam: their fused steps take found_inf and a tensor lr


@dataclass
class PendingStep:
    """A step whose results are still on the device: its metrics' names and values [names, n], gradient norm [],
    learning rate [], the examples it trained on, its number (optimizer steps so far) and when it started."""

    names: list[str]
    gathered: torch.Tensor
    grad_norm: torch.Tensor
    lr: torch.Tensor
    examples: list[dict]
    number: int
    start: float


@dataclass
class FinishedStep:
    """A step's results on the host: its metrics (as trainers.on_host gives them), whether it was finite, its
    examples, number and seconds (from its start to the next one's, the last one's to the transfer's end)."""

    metrics: dict[str, list[float]]
    finite: bool
    examples: list[dict]
    number: int
    seconds: float


def deferral_problem(optimizer: torch.optim.Optimizer, loss_scale, objective) -> str | None:
    """Why this run's steps must synchronise (None: they need not)."""
    if not (isinstance(optimizer, DEFERRABLE) and optimizer.defaults.get("fused")):
        return f"{type(optimizer).__name__} is not fused Adam, AdamW or SGD (found_inf and a tensor learning rate)"
    if any(isinstance(p, DTensor) for group in optimizer.param_groups for p in group["params"]):
        return "the parameters are DTensors (FSDPTrainer, TensorParallelTrainer)"
    if loss_scale is not None:
        return "float16's loss scale decides each step on the host"
    if objective.state:
        return "the loss keeps a running state that the next step reads"
    return None


def device_steps(parts) -> "DeviceSteps | None":
    """The DeviceSteps of a run's parts (build.RunParts) where sync_free_steps (auto: on CUDA) asks for them and the
    run can take them, with one line; None: each step synchronises. sync_free_steps=true where they cannot is one
    line naming the key."""
    config, device = parts.config, parts.topology.device
    if not lever_on(config.sync_free_steps, device.type):
        return None
    problem = deferral_problem(parts.optimizer, parts.loss_scale, parts.objective)
    if problem and str(config.sync_free_steps).lower() == "true":
        raise UserError(f"sync_free_steps=true: {problem}; set sync_free_steps=auto or false")
    if problem:
        print(f"sync_free_steps: one host sync a step: {problem}")
        return None
    print("sync_free_steps: the optimizer steps on the device; metrics come to the host once per log interval")
    return DeviceSteps(parts.optimizer, parts.scheduler, config.warmup_steps, device)


class DeviceSteps:
    """The steps of a log interval, stepped on the device (`step`) and read on the host at its end (`resolve`)."""

    def __init__(self, optimizer, scheduler, warmup_steps: int, device: torch.device):
        self.optimizer, self.scheduler, self.warmup_steps = optimizer, scheduler, warmup_steps
        self.lr_dtype = torch.float32 if device.type == "cuda" else torch.float64  # what the fused kernel reads
        self.pending: list[PendingStep] = []
        self.finite_steps = torch.zeros((), dtype=torch.float64, device=device)  # since the last resolve

    def step(self, names: list[str], gathered: torch.Tensor, grad_norm: torch.Tensor, examples, number: int):
        """The optimizer's step on the device: skipped (weights, moments and step counts untouched) where the loss
        or the gradient norm is not finite, at the schedule's rate after the finite steps taken; the gradients
        cleared. Its results stay on the device until resolve."""
        finite = torch.isfinite(grad_norm) & torch.isfinite(gathered[names.index("loss/train")]).all()
        taken = self.finite_steps + self.scheduler.last_epoch
        factor = warmup_factor(taken, self.warmup_steps)
        rates = [(factor * base).to(self.lr_dtype) for base in self.scheduler.base_lrs]
        host_rates = [group["lr"] for group in self.optimizer.param_groups]
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        self.optimizer.found_inf = (~finite).float()
        try:
            self.optimizer.step()
        finally:
            for group, rate in zip(self.optimizer.param_groups, host_rates):
                group["lr"] = rate
            del self.optimizer.found_inf  # a synchronised step (resolve's checks) never reads a stale one
        self.optimizer.zero_grad(set_to_none=True)
        self.finite_steps += finite
        self.pending.append(PendingStep(names, gathered, grad_norm, rates[0], examples, number, time.time()))

    def resolve(self) -> list[FinishedStep]:
        """The pending steps' results, brought to the host in one transfer, in order; the schedule's count caught up
        with their finite steps."""
        if not self.pending:
            return []
        # float64 holds every float32 value and the float64 rates exactly: the host reads what the device holds
        parts = [
            torch.cat([p.gathered.flatten().double(), p.grad_norm.double()[None], p.lr.double()[None]])
            for p in self.pending
        ]
        host = torch.cat(parts).cpu().tolist()
        end, finished, offset = time.time(), [], 0
        starts = [p.start for p in self.pending[1:]] + [end]
        for pending, next_start in zip(self.pending, starts):
            n = pending.gathered.shape[1]
            values = host[offset : offset + len(pending.names) * n + 2]
            offset += len(values)
            metrics = {name: values[i * n : (i + 1) * n] for i, name in enumerate(pending.names)}
            metrics["grad_norm"], metrics["lr"] = values[-2:-1], values[-1:]
            finite = all(map(math.isfinite, [*metrics["loss/train"], *metrics["grad_norm"]]))
            metrics["nonfinite_steps"] = [0.0 if finite else 1.0]
            if finite:
                self.scheduler.step()
            finished.append(FinishedStep(metrics, finite, pending.examples, pending.number, next_start - pending.start))
        self.pending, self.finite_steps = [], torch.zeros_like(self.finite_steps)
        return finished
