"""Attention for one query token a row, as the static decode loop (generation.static_decoding) calls it: each group of
query heads attends over its key/value head in one call, so each key and value row is read once for the group, where
transformers' SDPA path (before 5.24) copied the cache once per query head (`repeat_kv`: 3x for SmolLM2's 9 heads over
3); on a CPU by a kernel of our own where it builds (generation.native_attention). Installed on a model for the decode
steps alone (attention_for_decode): the prefill keeps the model's own."""

import contextlib

import torch
from transformers import AttentionInterface

from generation import native_attention

# the name the decode steps' attention is registered under in transformers' AttentionInterface
NAME = "dpo_grouped_decode"


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                      scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:  # fmt: skip
    """([R, 1, H, D] the attention's output, None) of query [R, H, 1, D] over key and value [R, G, L, D] (G key/value
    heads, each shared by H / G query heads, in order), attention_mask [R, 1, 1, L] bool (True: read). The H / G query
    heads of a group are one [H / G, D] block of queries over their key/value head: on a CPU our kernel
    (native_attention) where it built and takes the inputs, else SDPA on [R, G, H / G, D]."""
    rows, heads, length, dim = query.shape
    if query.device.type == "cpu":
        scale = dim**-0.5 if scaling is None else scaling  # SDPA's default
        output = native_attention.decode_attention(query, key, value, attention_mask, scale)
        if output is not None:
            return output[:, None], None
    groups = key.shape[1]
    packed = query.reshape(rows, groups, heads // groups, dim)  # length 1: the heads of a group are consecutive
    output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=attention_mask,
                                                              scale=scaling)  # fmt: skip
    return output.reshape(rows, heads, length, dim).transpose(1, 2), None


AttentionInterface.register(NAME, grouped_attention)


@contextlib.contextmanager
def attention_for_decode(model: torch.nn.Module):
    """Within the context, the model's attention layers call grouped_attention (its config's attention
    implementation, which every layer reads at each call, set to NAME and put back after)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before
