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
