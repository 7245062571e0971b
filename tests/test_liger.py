"""Liger-Kernel (core/liger.py): the key's one-line errors where it cannot run, the probe that keeps or puts back the
plain modules (on the CPU with stand-ins for Liger's per-family function), and Liger's own kernels on a GPU."""

import importlib.util
import sys

import pytest
import torch

import train
from conftest import tiny_lm_config, tiny_run_overrides
from core import liger
from core.heads import sequence_logps
from core.layouts import pad
from core.probes import PROBE_EXAMPLES, exact_float32


@pytest.mark.parametrize("installed, cuda", [(False, False), (True, False)])
def test_liger_kernel_where_it_cannot_run_is_one_line(tmp_path, pairs_file, capsys, monkeypatch, installed, cuda):
    real, found = importlib.util.find_spec, object() if installed else None
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: found if name == "liger_kernel" else real(name))
    with pytest.raises(SystemExit):
        train.main([*tiny_run_overrides(tmp_path, pairs_file), "liger_kernel=true"])
    error = capsys.readouterr().err.strip().splitlines()
    expected = (
        "error: liger_kernel=true: Liger-Kernel's kernels are Triton kernels for CUDA GPUs, and there is none here"
        if installed
        else "error: liger_kernel=true: the liger_kernel package is not importable here (pip install liger-kernel)"
    )
    assert error == [expected]


def tiny_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_lm_config("llama")).eval()


def probe_logps(model) -> torch.Tensor:
    """The probe examples' log-probs, padded, all logits, in float32 (TF32 off, as the probes compute them)."""
    batch = pad(PROBE_EXAMPLES, 0).to(next(model.parameters()).device)
    with torch.no_grad(), exact_float32():
        return sequence_logps(model, batch, None, torch.float32, scored_head=False)


def stand_in(scale: float):
    """A stand-in for Liger's per-family function: each RMSNorm's forward replaced (times `scale`: 1 computes as
    before) and the family module's rotary function rebound, as Liger's patch does."""

    def apply(model, rms_norm=True, swiglu=True, rope=True, cross_entropy=True, fused_linear_cross_entropy=True):
        assert (rms_norm, swiglu, rope, cross_entropy, fused_linear_cross_entropy) == (True, True, True, False, False)
        for module in model.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = lambda x, plain=module.forward: plain(x) * scale
        family = sys.modules[type(model).__module__]
        family.apply_rotary_pos_emb = lambda *args, plain=family.apply_rotary_pos_emb, **kwargs: plain(*args, **kwargs)

    return apply


@pytest.mark.parametrize("scale", [1.0, 1.5])
def test_the_probe_keeps_kernels_that_agree_and_puts_back_the_plain_modules_where_they_do_not(monkeypatch, scale):
    model = tiny_llama()
    family = sys.modules[type(model).__module__]
    rotary = family.apply_rotary_pos_emb
    expected = probe_logps(model)
    monkeypatch.setattr(liger, "family_function", lambda model: stand_in(scale))
    monkeypatch.setattr(family, "apply_rotary_pos_emb", rotary)  # put back after the test, whatever happens
    line = liger.apply_liger(model, torch.float32, torch.device("cpu"))
    norms = [module for module in model.modules() if type(module).__name__ == "LlamaRMSNorm"]
    if scale == 1.0:
        assert line == "liger_kernel: RMSNorm, SwiGLU, RoPE kernels in LlamaForCausalLM"
        assert all("forward" in vars(norm) for norm in norms) and family.apply_rotary_pos_emb is not rotary
    else:
        assert line.startswith("liger_kernel: LlamaForCausalLM's log-probs differ by ")
        assert line.endswith(" with Liger's kernels: plain modules")
        assert not any("forward" in vars(norm) for norm in norms) and family.apply_rotary_pos_emb is rotary
    assert torch.equal(probe_logps(model), expected)


def test_a_family_liger_has_no_function_for_keeps_its_modules(monkeypatch):
    model = tiny_llama()
    monkeypatch.setattr(liger, "family_function", lambda model: None)
    line = liger.apply_liger(model, torch.float32, torch.device("cpu"))
    assert (
        line == "liger_kernel: none for LlamaForCausalLM (Liger-Kernel has no function for its family): plain modules"
    )


@pytest.mark.cuda
def test_ligers_kernels_give_the_plain_log_probs_on_a_gpu():
    pytest.importorskip("liger_kernel")
    model = tiny_llama().cuda()
    expected = probe_logps(model)
    family = sys.modules[type(model).__module__]
    saved = dict(vars(family))
    try:
        line = liger.apply_liger(model, torch.float32, torch.device("cuda"))
        assert line == "liger_kernel: RMSNorm, SwiGLU, RoPE kernels in LlamaForCausalLM", line
        torch.testing.assert_close(probe_logps(model), expected, rtol=1e-4, atol=1e-4)
    finally:  # Liger rebinds the family module's functions and classes for every later model of it
        for key, value in saved.items():
            setattr(family, key, value)
