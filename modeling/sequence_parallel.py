"""Sequence parallelism: the ranks of an sp group share every row of a batch, each holding a contiguous slice of its
tokens (layouts.sequence_slice), so that a pair longer than one device can hold trains on several.

Attention is the only layer that mixes tokens. It runs as DeepSpeed-Ulysses does (Jacobs et al. 2023,
arXiv:2309.14509): an all-to-all turns each rank's queries, keys and values from [its tokens, all heads] into [all
tokens, its share of the heads], the model's own attention function runs on them with the whole row's mask (the
packed layout's dense mask or FlexAttention's block mask, per layer type, windows included), and a second all-to-all
turns the output back. Any attention kernel runs unchanged, on gloo and on NCCL. The collectives are autograd-aware:
the backward pass all-to-alls the gradients back to the ranks whose tokens they belong to.

Everything else (embeddings, MLPs, norms, rotary positions, the scored head) works on the rank's own tokens: each
rank scores the tokens its slice predicts, and their log-probs, each in its place among the batch's (zeros elsewhere),
are summed over the sp group (`SequenceGroup.sum`, heads.sequence_logps), so that every rank of the group has every
token's log-prob and the whole loss. That sum's backward sums the group's gradients too, so each rank's gradients are
sp times its slice's share; FSDP averages them over the dp x sp ranks, which leaves the sum over the sp group's
slices, averaged over the dp groups: the one-process gradient (tested against it)."""

import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from modeling.mask_dispatch import attention_for, own_implementation
from utils import UserError

# The attention implementations the wrapper runs inside (a block mask always runs FlexAttention's).
INNER_IMPLEMENTATIONS = ("sdpa", "eager")


def check_sequence_parallel(model: torch.nn.Module, sp: int, tp: int) -> None:
    """One line where the model's query heads cannot be shared out over sp x tp ranks. Key and value heads that do
    not divide are replicated (grouped-query attention: SequenceGroup.attention)."""
    config = model.config.get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or heads % (sp * tp):
        raise UserError(
            f"sequence_parallel_size={sp} shares each layer's attention heads out over the sp ranks (x "
            f"tensor_parallel_size={tp}), but {type(model).__name__} has num_attention_heads={heads}, not a multiple "
            f"of {sp * tp}"
        )


class GroupSum(torch.autograd.Function):
    """An all-reduce (sum) over a process group whose backward all-reduces the gradients, on torch.distributed's
    stable all_reduce: torch.distributed.nn's all_reduce warns that it is deprecated (torch 2.11 and later), and the
    functional collectives' all_reduce gained a backward only in recent versions."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: torch.distributed.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        total = tensor.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        total = grad.contiguous().clone()
        torch.distributed.all_reduce(total, group=ctx.group)
        return total, None


@dataclass
class SequenceGroup:
    """This rank's sp group: its process group, size and place in it; `install` puts the Ulysses attention into a
    model."""

    group: torch.distributed.ProcessGroup
    size: int
    rank: int
    inner: str = "sdpa"  # the attention implementation the model had

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the group, autograd-aware: the gradient of each rank's copy of the sum reaches every
        rank's part (the backward is the same all-reduce: GroupSum)."""
        return GroupSum.apply(tensor.contiguous(), self.group)

    def install(self, model: torch.nn.Module) -> None:
        """The model's attention layers run `attention` from now on. Set for good, not for each forward: activation
        checkpointing recomputes a block's forward during the backward pass, outside the scorer's forward. Where the
        mask is no longer than the queries (generation, the probes) the wrapper is the model's own attention."""
        config = model.config
        current = own_implementation(config._attn_implementation)  # it takes a BlockMask itself
        if current.startswith("sequence_parallel"):
            return
        if current not in INNER_IMPLEMENTATIONS:
            raise UserError(f"sequence parallelism wraps sdpa or eager attention, not {current!r}")
        self.inner = current
        name = f"sequence_parallel_{current}"
        AttentionInterface.register(name, self.attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
        config._attn_implementation = name

    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """transformers' attention function signature: query [B, Hq, t, D], key and value [B, Hkv, t, D] of this
        rank's t tokens; the output [B, t, Hq, D]. The mask covers the whole row, T = size x t tokens."""
        inner = attention_for(module, attention_mask, self.inner)
        if attention_mask is None or attention_mask.shape[-2] == query.shape[2]:
            return inner(module, query, key, value, attention_mask, **kwargs)
        if attention_mask.shape[-2] != query.shape[2] * self.size:
            raise ValueError(f"a mask of {attention_mask.shape[-2]} queries for {self.size} slices of {query.shape[2]}")
        # Key and value heads that do not divide over the ranks are replicated r times, the fewest that divide
        # (every query head keeps its key and value head); each rank's queries then share them r times less.
        replicas = self.size // math.gcd(key.shape[1], self.size)
        if replicas > 1:
            key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
        query, key, value = (self.tokens_to_heads(x) for x in (query, key, value))
        groups = getattr(module, "num_key_value_groups", None)
        if replicas > 1 and groups is not None:
            module.num_key_value_groups = groups // replicas  # read by the attention function
        try:
            output, _ = inner(module, query, key, value, attention_mask, **kwargs)
        finally:
            if replicas > 1 and groups is not None:
                module.num_key_value_groups = groups
        return self.heads_to_tokens(output), None

    def tokens_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, t, D] of this rank's tokens -> [B, H / size, T, D] of its heads: head share j goes to rank j, and
        the slices come back in rank order, which is token order."""
        batch, heads, tokens, dim = x.shape
        send = x.reshape(batch, self.size, heads // self.size, tokens, dim).transpose(0, 1).contiguous()
        received = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, self.group))
        return received.permute(1, 2, 0, 3, 4).reshape(batch, heads // self.size, self.size * tokens, dim)

    def heads_to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H / size, D] of this rank's heads -> [B, t, H, D] of its tokens (tokens_to_heads undone)."""
        batch, tokens, heads, dim = x.shape
        send = x.reshape(batch, self.size, tokens // self.size, heads, dim).transpose(0, 1).contiguous()
        received = funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, self.group))
        return received.permute(1, 2, 0, 3, 4).reshape(batch, tokens // self.size, self.size * heads, dim)
