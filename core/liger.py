"""Liger-Kernel's Triton kernels in a model (liger_kernel=true, CUDA): its RMSNorm, SwiGLU or GeGLU MLP and rotary
embedding put in place of the model family's own modules by Liger's per-family function, then checked by the log-prob
probe every fast path takes (the padded probe examples' log-probs before and after); where they disagree or fail,
the plain modules are put back and one line says why. The fused head here stays: Liger's fused linear cross-entropy
and cross-entropy are not applied. liger_kernel is an optional dependency (like bitsandbytes): importable only where
installed."""

import importlib.util
import inspect
import sys

import torch

from core.attention import model_class
from core.heads import sequence_logps
from core.layouts import pad
from core.probes import PROBE_EXAMPLES, exact_float32, probe_tolerance, probes_dtype
from utils import first_line

# Liger's kernels taken, by the keyword its per-family functions name them; the losses stay off
KERNELS = {"rms_norm": "RMSNorm", "swiglu": "SwiGLU", "geglu": "GeGLU", "rope": "RoPE"}
LOSSES_OFF = ("cross_entropy", "fused_linear_cross_entropy")


def liger_problem(cuda: bool) -> str | None:
    """Why liger_kernel=true cannot run here (one line naming the key), or None."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger_kernel=true: the liger_kernel package is not importable here (pip install liger-kernel)"
    if not cuda:
        return "liger_kernel=true: Liger-Kernel's kernels are Triton kernels for CUDA GPUs, and there is none here"
    return None


def family_function(model: torch.nn.Module):
    """Liger's function that patches a model of this family in place (its model= argument), or None."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN  # optional: CUDA only

    return MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_class(model).config.model_type)


def apply_liger(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, agree=lambda line: line, label="liger_kernel"
) -> str:
    """Liger's kernels in `model` where its family has them and the probe agrees (dtype: the model's compute dtype
    in the probe; every rank probes, a sharded model needing all of them, and agree(line) gives rank 0's verdict to
    all); the line that says what was taken, or why not (the model then keeps its plain modules), after `label`
    (the policy's key, or the reference's)."""
    name = type(model_class(model)).__name__
    apply = family_function(model)
    if apply is None:
        return f"{label}: none for {name} (Liger-Kernel has no function for its family): plain modules"
    accepted = inspect.signature(apply).parameters
    kernels = [key for key in KERNELS if key in accepted]
    batch = pad(PROBE_EXAMPLES, 0).to(device)
    saved = plain_state(model)
    taken = f"{label}: {', '.join(KERNELS[key] for key in kernels)} kernels in {name}"
    try:
        with torch.no_grad(), exact_float32():
            want = sequence_logps(model, batch, None, dtype, scored_head=False)
            apply(model=model_class(model), **{key: True for key in kernels}, **dict.fromkeys(LOSSES_OFF, False))
            got = sequence_logps(model, batch, None, dtype, scored_head=False)
        line = taken
        if not torch.allclose(got, want, rtol=probe_tolerance(dtype), atol=probe_tolerance(dtype)):
            line = f"{label}: {name}'s log-probs differ by {(got - want).abs().max():.2g} with Liger's kernels"
    except Exception as error:  # any failure means: not this model
        line = f"{label}: {name} failed with Liger's kernels ({type(error).__name__}: {first_line(error)})"
    line = agree(line)
    if line != taken:
        restore(saved)
        line += ": plain modules"
    return line


def plain_state(model: torch.nn.Module) -> tuple:
    """What Liger's patch may change, to put back: each module's class and instance-level forward, and the
    globals of the model's transformers module (its rotary function and module classes)."""
    modules = [(m, type(m), m.__dict__.get("forward")) for m in model.modules()]
    family = sys.modules[type(model_class(model)).__module__]
    return modules, family, dict(vars(family))


def restore(saved: tuple) -> None:
    modules, family, names = saved
    for module, kind, forward in modules:
        module.__class__ = kind
        if forward is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = forward
    for key, value in names.items():
        setattr(family, key, value)


def liger_line(model: torch.nn.Module, compute, topology, autocast: bool, label: str) -> str:
    """Liger-Kernel's kernels in a placed model (apply_liger, probed as the scorer's probes run it, rank 0
    deciding for every rank); the line that says what was taken, after `label`."""
    dtype = probes_dtype(model, compute, autocast)
    return apply_liger(model, dtype, topology.device, topology.broadcast, label)
