"""Optimizer construction (optim.py)."""

import pytest
import torch

from optim import build_optimizer
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
    from optim import clip_grad_norm

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
