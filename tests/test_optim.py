"""Optimizer construction (optim.py)."""

import pytest
import torch

from core.optim import build_optimizer
from utils import UserError


def test_optimizer_errors_list_valid_choices():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(UserError, match=r"unknown optimizer 'Adamm'; torch.optim has: .*AdamW.*RMSprop"):
        build_optimizer("Adamm", params, 1e-3, {})
    with pytest.raises(
        UserError, match=r"optimizer RMSprop has no setting betas; its settings: alpha, eps, weight_decay, momentum"
    ):
        build_optimizer("RMSprop", params, 1e-3, {"betas": [0.9, 0.99]})
    assert build_optimizer("AdamW", params, 1e-3, {"betas": [0.8, 0.9], "weight_decay": 0.0}).defaults["betas"] == (
        0.8,
        0.9,
    )


def test_clip_grad_norm_matches_torch_and_returns_the_norm_on_the_device():
    from core.optim import clip_grad_norm

    for scale in (0.1, 10.0):  # below and above max_norm
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
        for p in params:
            p.grad = torch.randn_like(p) * scale
        expected = [p.grad.clone() for p in params]
        expected_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in expected]))
        norm = clip_grad_norm(params, max_norm=1.0)
        assert torch.is_tensor(norm) and norm.dtype == torch.float32
        torch.testing.assert_close(norm, expected_norm)
        factor = min(1.0, 1.0 / (expected_norm.item() + 1e-6))
        for p, g in zip(params, expected):
            torch.testing.assert_close(p.grad, g * factor)


def test_the_fused_implementation_is_the_default_where_there_is_one_and_the_knobs_still_choose():
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert build_optimizer("AdamW", params, 1e-3, {}).defaults["fused"] is True
    assert build_optimizer("SGD", params, 1e-3, {}).defaults["fused"] is True
    chosen = build_optimizer("AdamW", params, 1e-3, {"foreach": True}).defaults
    assert chosen["foreach"] is True and not chosen["fused"]
    assert not build_optimizer("AdamW", params, 1e-3, {"fused": False}).defaults["fused"]
    assert "fused" not in build_optimizer("RMSprop", params, 1e-3, {}).defaults  # it has none


def test_fused_adamw_steps_like_the_per_operation_one():
    torch.manual_seed(0)
    start = [torch.randn(40, 30), torch.randn(30)]
    runs = {}
    for knobs in ({}, {"foreach": False}):
        params = [torch.nn.Parameter(value.clone()) for value in start]
        optimizer = build_optimizer("AdamW", params, 1e-2, {"weight_decay": 0.1, **knobs})
        for step in range(5):
            for p in params:
                p.grad = torch.sin(p.detach() * (step + 1))
            optimizer.step()
        runs[bool(optimizer.defaults["fused"])] = params
    for fused, plain in zip(runs[True], runs[False]):
        torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-7)
