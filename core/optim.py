"""The optimizer, its learning-rate schedule and gradient clipping."""

import inspect
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from utils import UserError


def optimizer_class(name: str, knobs: dict) -> type[torch.optim.Optimizer]:
    """`torch.optim.<name>`, checked to accept `knobs`; one-line errors list the valid names or knobs."""
    optimizers = sorted(
        n
        for n, c in vars(torch.optim).items()
        if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
    )
    if name not in optimizers:
        raise UserError(f"unknown optimizer '{name}'; torch.optim has: {', '.join(optimizers)}")
    optimizer = getattr(torch.optim, name)
    accepted = [p for p in inspect.signature(optimizer).parameters if p not in ("params", "lr")]
    unknown = sorted(set(knobs) - set(accepted))
    if unknown:
        raise UserError(f"optimizer {name} has no setting {', '.join(unknown)}; its settings: {', '.join(accepted)}")
    return optimizer


def build_optimizer(name: str, params, lr: float, knobs: dict) -> torch.optim.Optimizer:
    """torch.optim.<name> over `params` with `knobs` (+optimizer_kwargs), its fused implementation where it has one
    for these parameters and the knobs choose no other (fused_default)."""
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}  # e.g. betas
    optimizer, params = optimizer_class(name, knobs), list(params)
    return optimizer(params, lr=lr, **fused_default(optimizer, params, knobs), **knobs)


def fused_default(optimizer: type[torch.optim.Optimizer], params: list, knobs: dict) -> dict:
    """{"fused": True} where the optimizer has a fused implementation (Adam, AdamW, SGD, Adagrad) for the
    parameters' devices and dtypes, unless the knobs choose an implementation (fused, foreach) or ask for what
    fused refuses (differentiable): one kernel per step over every parameter instead of a pass per operation. For
    SmolLM2-135M's AdamW step on a 2-core AVX2 CPU, 0.10 s against 0.53-0.59 s with torch's default (foreach).
    Tensor parallelism leaves some parameters plain beside the DTensors, which the fused kernel cannot take in one
    call: there the default stays."""
    accepted = inspect.signature(optimizer).parameters
    if "fused" not in accepted or {"fused", "foreach", "differentiable"} & knobs.keys():
        return {}
    devices = _get_fused_kernels_supported_devices()
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    usable = all(p.device.type in devices and torch.is_floating_point(p) for p in tensors)
    one_kind = len({isinstance(p, DTensor) for p in tensors}) == 1
    return {"fused": True} if tensors and usable and one_kind else {}


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over warmup_steps optimizer steps (step s runs at (s + 1) / (warmup_steps + 1) of lr), then
    constant, as in the DPO reference."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps))


def warmup_factor(step, warmup_steps: int):
    """The schedule's share of lr at optimizer step `step` (a number, or a float64 tensor of steps taken, computed on
    its device without a host sync: the same IEEE operations, so the same value)."""
    factor = (step + 1) / (warmup_steps + 1)
    return factor.clamp(max=1.0) if torch.is_tensor(factor) else min(1.0, factor)


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients down to a total L2 norm of at most max_norm; return the norm before clipping, a float32
    scalar on the run's device (computed without waiting for the device, as torch's clipping does, unless the
    gradients are offloaded: the host then waits for the norm to scale them).

    Gradients may be plain tensors, FSDP's sharded DTensors, or tensor parallelism's mix of both (on a 2-D mesh
    as well), which torch.nn.utils.clip_grad_norm_ refuses: each group of gradients with one layout gets one norm,
    the squares of each rank's part summed over the mesh dimensions that shard it (a dimension that replicates it,
    a row-parallel bias's, adds nothing). That sum runs on the mesh's device: FSDP's offloaded gradients
    (fsdp_cpu_offload) are on the host, where NCCL reaches nothing, which is why the norm is not DTensor's own (its
    reduction runs on the tensors' device). The scale is applied where each gradient is: on the host, offloaded."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups = defaultdict(list)
    for grad in grads:
        groups[(grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None].append(grad)
    squares = []
    for layout, group in groups.items():
        local = [grad.to_local() if layout else grad for grad in group]
        square = torch.nn.utils.get_total_norm(local).float() ** 2
        if layout:
            mesh, placements = layout
            square = square.to(mesh.device_type)
            for dim, placement in enumerate(placements):
                if not placement.is_replicate():  # Shard, or 2-D FSDP's _StridedShard (no Shard in torch 2.13)
                    dist.all_reduce(square, group=mesh.get_group(dim))
        squares.append(square)
    total = torch.stack([square.to(squares[0].device) for square in squares]).sum().sqrt()
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)  # torch's rule, so clipping matches clip_grad_norm_
    local = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]  # views of each rank's part
    torch._foreach_mul_(local, scale.to(local[0].device))
    return total
