"""A packed batch's FlexAttention BlockMask built from its per-token ids with plain tensor operations
(`BlockMask.from_kv_blocks`, as modded-nanogpt builds its document masks), instead of `create_block_mask`, which
compiles a builder for each new row length and evaluates the mask at every (query, key) pair.

The packed layout's visibility (core.layouts.packed_mask_mod) gives each query at most two intervals of keys in its
row: a response token sees its segment's prompt and its own response up to itself; a prompt token its prompt up to
itself; a padding token itself. A sliding window or attention chunks (AttentionSpan) cut each interval's start, since
positions grow along the prompt and along each response. So the number of keys a query sees in each key tile is two
interval overlaps, [R, T, T / 128] small integers, and a tile is full where every query of its query tile sees all
128 keys, partial where some see some: exactly the tiles create_block_mask lists (tested equal, windows and chunks
included). Bidirectional blocks (Gemma 3's images, PaliGemma's prefix) add intervals this does not derive: such a
batch keeps create_block_mask.
"""

import torch
from torch.nn.attention.flex_attention import BlockMask

from core.layouts import FULL_ATTENTION, AttentionSpan, ModelBatch, packed_mask_mod


def run_starts(change: torch.Tensor) -> torch.Tensor:
    """[R, T] the index where each token's run starts, from [R, T] bool `change` (True where a run begins)."""
    index = torch.arange(change.shape[1], device=change.device).expand_as(change)
    return torch.where(change, index, 0).cummax(dim=1).values


def visible_intervals(batch: ModelBatch, span: AttentionSpan) -> tuple[torch.Tensor, ...]:
    """(prompt start, prompt end, own start, own end), each [R, T]: the two key intervals [start, end) each query
    sees. A response token: its segment's prompt and its response up to itself; a prompt token: its prompt up to
    itself (the first interval empty); a padding token: itself. A window keeps keys fewer than `window` positions
    back, chunks the keys of the query's chunk: both raise the intervals' starts, by position."""
    segments, branches, positions = batch.segment_ids, batch.branch_ids, batch.position_ids
    index = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    first = torch.ones_like(segments[:, :1], dtype=torch.bool)
    new_segment = torch.cat([first, segments[:, 1:] != segments[:, :-1]], dim=1)
    new_run = new_segment | torch.cat([first, branches[:, 1:] != branches[:, :-1]], dim=1)
    segment_start, own_start = run_starts(new_segment), run_starts(new_run)
    own_first = positions.gather(1, own_start)  # a response's first position is its prompt's length
    lowest = torch.zeros_like(positions)  # the lowest position a query sees
    if span.window is not None:
        lowest = torch.maximum(lowest, positions - span.window + 1)
    if span.chunk is not None:
        lowest = torch.maximum(lowest, positions // span.chunk * span.chunk)
    response, real = branches > 0, segments >= 0
    prompt_end = torch.where(response, segment_start + own_first, 0)
    prompt_start = torch.where(response, torch.minimum(segment_start + lowest, prompt_end), 0)
    own_start = torch.where(real, own_start + (lowest - own_first).clamp(min=0), index)
    return prompt_start, prompt_end, own_start, index + 1


def tile_counts(intervals: tuple[torch.Tensor, ...], block: int) -> torch.Tensor:
    """[R, T, T / block] how many keys of each key tile each query sees, from its two intervals."""
    prompt_start, prompt_end, own_start, own_end = (bound[..., None] for bound in intervals)
    length = prompt_start.shape[1]
    tile_start = torch.arange(0, length, block, device=prompt_start.device)
    tile_end = tile_start + block
    prompt = (torch.minimum(prompt_end, tile_end) - torch.maximum(prompt_start, tile_start)).clamp(min=0)
    own = (torch.minimum(own_end, tile_end) - torch.maximum(own_start, tile_start)).clamp(min=0)
    return (prompt + own).to(torch.int16)


def kv_lists(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number [R, 1, Q], indices [R, 1, Q, K]) of the key tiles each query tile lists, from [R, Q, K] bool, as
    create_block_mask orders them: the listed ones first, in order."""
    tiles = tiles[:, None].to(torch.int32)
    return tiles.sum(dim=-1, dtype=torch.int32), torch.argsort(tiles, dim=-1, descending=True, stable=True).int()


def tensor_block_mask(batch: ModelBatch, span: AttentionSpan = FULL_ATTENTION, block: int = 128) -> BlockMask:
    """The packed batch's BlockMask ([R, 1, T, T] in tiles of `block`; T a multiple of it), with the same mask_mod
    and the same partial and full tiles as create_block_mask gives, built without compiling and without evaluating
    the mask pair by pair."""
    rows, length = batch.input_ids.shape
    counts = tile_counts(visible_intervals(batch, span), block).view(rows, length // block, block, -1)
    seen = counts > 0
    full = (counts == block).all(dim=2)
    partial = seen.any(dim=2) & ~full
    mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids, batch.position_ids, span)
    return BlockMask.from_kv_blocks(
        *kv_lists(partial), *kv_lists(full), BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(length, length)
    )
