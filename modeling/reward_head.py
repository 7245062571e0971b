"""A reward model's scalar head (`score`): found in the model (under peft's wrapper too), and initialised the same on
every rank and trainer where the model's files hold none."""

import torch

from modeling import weights
from utils import UserError


def reward_head(model: torch.nn.Module) -> torch.nn.Module:
    """A reward model's scalar head: `score`, as every one of transformers' sequence classifiers built on a causal LM
    names it (inside peft's wrapper for a LoRA policy)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(inner, "score", None)
    if head is None:
        raise UserError(f"{weights.class_name(inner)} has no `score` head: not a sequence classifier of a causal LM")
    return head


def init_reward_head(model: torch.nn.Module, seed: int) -> None:
    """The scalar head of a reward model built from a causal LM, which its files do not hold: normal with the
    config's initializer_range (transformers' own initialisation of it), from `seed`, so that every rank and every
    trainer starts from the same head. Real tensors on the CPU: placement keeps them (weights.real_tensors), and
    files that hold a head (an existing reward model's) replace them."""
    head = reward_head(model)
    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    weight = torch.randn(head.weight.shape, generator=generator).mul_(std)
    head.weight = torch.nn.Parameter(weight.to(head.weight.dtype))
    if getattr(head, "bias", None) is not None:
        head.bias = torch.nn.Parameter(torch.zeros(head.bias.shape, dtype=head.bias.dtype))
