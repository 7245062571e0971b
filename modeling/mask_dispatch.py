"""Attention that follows its mask: FlexAttention for a BlockMask, the model's own implementation (sdpa, eager) for
any other mask. Installed for good on a language model the first time it takes a block mask, not switched for each
forward, for two reasons found on an H200 (2026-11-28):

- activation checkpointing recomputes a block's forward in the backward pass, outside any forward's context: with the
  implementation switched back after the forward, that recomputation handed its BlockMask to sdpa (a TypeError);
- it is set on the language model's own config: setting a composite config (LLaVA, PaliGemma) passes the name to
  every sub-config, so the vision tower ran FlexAttention too (whose GPU kernels take no head under 16 dimensions),
  and setting the previous name back gave Gemma 2's language model sdpa, which refuses its attention soft cap.

A mask that is a tensor, or none, reaches the implementation the model had, so nothing else a model does changes.
"""

import sys

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

PREFIX = "block_masks_or_"


def own_implementation(name: str | None) -> str | None:
    """The implementation a model had before follow_masks: `name` without the dispatcher's prefix."""
    return name.removeprefix(PREFIX) if name else name


def attention_for(module: torch.nn.Module, mask, implementation: str):
    """transformers' attention function for `mask`: FlexAttention's for a BlockMask, else `implementation`'s (eager's
    is each model's own function, defined in its module)."""
    if isinstance(mask, BlockMask):
        return AttentionInterface._global_mapping["flex_attention"]
    if implementation == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return AttentionInterface._global_mapping[implementation]


def dispatcher(implementation: str):
    """An attention function (transformers' signature) that runs attention_for's choice."""

    def attention(module, query, key, value, attention_mask, **kwargs):
        function = attention_for(module, attention_mask, implementation)
        return function(module, query, key, value, attention_mask, **kwargs)

    return attention


def follow_masks(language_model: torch.nn.Module) -> None:
    """The language model's attention layers (those reading its config) dispatch on their mask from now on (the
    module's docstring). Idempotent; a model whose attention already dispatches (the sequence-parallel wrapper's takes
    FlexAttention for a BlockMask itself) is left as it is."""
    config = language_model.config
    current = config._attn_implementation
    if current.startswith((PREFIX, "sequence_parallel")):
        return
    name = PREFIX + current
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, dispatcher(current))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name
