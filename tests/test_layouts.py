import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from core.layouts import (
    FULL_ATTENTION,
    AttentionSpan,
    dense_mask,
    left_padded_prompts,
    pack,
    pack_rows,
    packed_mask_mod,
    pad,
    segment_lengths,
)
from pairs.formats import PreferencePair
from persistence.tokenized import Tokenization, tokenize_pairs


def token_sequences(batch) -> torch.Tensor:
    """[N] the sequence each scored token belongs to (tokens are grouped by sequence)."""
    return torch.repeat_interleave(torch.arange(batch.n_sequences), batch.sequence_lengths)


def test_pack_lays_out_prompt_chosen_rejected_with_restarted_positions():
    # One pair: prompt [1 2 3], chosen [4 5], rejected [6 7 8], written out by hand.
    batch = pack([{"prompt": [1, 2, 3], "responses": [[4, 5], [6, 7, 8]]}], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]  # rejected restarts after the prompt
    allowed = [
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],  # chosen: prompt and earlier chosen tokens
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 1, 0, 0],  # rejected: prompt and earlier rejected tokens, never chosen
        [1, 1, 1, 0, 0, 1, 1, 0],
        [1, 1, 1, 0, 0, 1, 1, 1],
    ]
    assert dense_mask(batch).shape == (1, 1, 8, 8) and dense_mask(batch)[0, 0].int().tolist() == allowed
    # The last prompt token (position 2) predicts both chosen[0] and rejected[0]: kept once for the head.
    assert batch.score_positions.tolist() == [2, 3, 2, 5, 6]
    assert batch.keep_positions.tolist() == [[2, 3, 5, 6]] and batch.score_rows.tolist() == [0, 1, 0, 2, 3]
    assert batch.score_targets.tolist() == [4, 5, 6, 7, 8]
    assert batch.sequence_lengths.tolist() == [2, 3] and batch.n_sequences == 2


def test_pack_keeps_segments_apart_and_lets_padding_attend_to_itself():
    examples = [
        {"prompt": [1, 2], "responses": [[3], [4]]},
        {"prompt": [5], "responses": [[6], [7]]},
        {"prompt": [9, 9, 9], "responses": [[9, 9], [9, 9]]},
        {"prompt": [], "responses": [[8], [9]]},
    ]
    batch = pack(examples, pad_token_id=0)  # segments of 4, 3, 7 and 2 tokens in rows of 7
    assert batch.input_ids.tolist() == [[9] * 7, [1, 2, 3, 4, 5, 6, 7], [8, 9, 0, 0, 0, 0, 0]]
    assert batch.position_ids[1].tolist() == [0, 1, 2, 2, 0, 1, 1]
    mask = dense_mask(batch)
    two_segments = mask[1, 0].int()
    assert two_segments[:4, 4:].sum() == 0 and two_segments[4:, :4].sum() == 0
    assert mask[2, 0].int().tolist()[2:] == [[0] * i + [1] + [0] * (6 - i) for i in range(2, 7)]
    # Sequences are numbered response-major: chosen of examples 0..3, then rejected of 0..3; tokens grouped by them.
    assert batch.sequence_lengths.tolist() == [1, 1, 2, 0, 1, 1, 2, 0]  # example 3 has no prompt: nothing scored
    assert list(zip(token_sequences(batch).tolist(), batch.score_targets.tolist())) == [
        (0, 3),
        (1, 6),
        (2, 9),
        (2, 9),
        (4, 4),
        (5, 7),
        (6, 9),
        (6, 9),
    ]
    assert batch.n_sequences == 8


def test_pack_rows_is_first_fit_decreasing_under_the_budget():
    assert pack_rows([5, 3, 4, 2, 6], budget=8) == [[4, 3], [0, 1], [2]]
    assert pack_rows([10, 2], budget=4) == [[0], [1]]  # too long for the budget: a row of its own
    assert all(len(row) == 1 for row in pack_rows([3, 3, 3], budget=3))


def test_pad_scores_the_same_tokens_as_pack():
    examples = [{"prompt": [1, 2, 3], "responses": [[4, 5], [6, 7, 8]]}, {"prompt": [], "responses": [[9, 10], [11]]}]
    padded, packed = pad(examples, pad_token_id=0), pack(examples, pad_token_id=0)
    # With an empty prompt nothing predicts a response's first token: it is not scored, in either layout.
    assert padded.score_targets.tolist() == [4, 5, 10, 6, 7, 8]
    assert token_sequences(padded).tolist() == [0, 0, 1, 2, 2, 2]
    assert token_sequences(packed).tolist() == token_sequences(padded).tolist()
    assert packed.score_targets.tolist() == padded.score_targets.tolist()
    assert padded.position_ids is None and padded.attention_mask.tolist()[2:] == [[1] * 6, [1] + [0] * 5]
    assert torch.equal(padded.input_ids.flatten()[padded.score_positions + 1], padded.score_targets)
    # LD-DPO's shared part: scored tokens within each example's shorter response (2 of 2 and 3; 0 of 1 and 0)
    for batch in (padded, packed):
        assert batch.sequence_lengths.tolist() == [2, 1, 3, 0] and batch.shared_lengths.tolist() == [2, 0, 2, 0]
    sft = [{**ex, "responses": ex["responses"][:1]} for ex in examples]
    assert pad(sft, 0).shared_lengths.tolist() == pack(sft, 0).shared_lengths.tolist() == [2, 1]  # no tail


def test_masks_and_scored_tokens_come_from_lengths_when_pad_is_eos(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id  # pad == EOS, as for SmolLM2: masks must not come from ids != pad
    pairs = [
        PreferencePair("Hello", " a", " bbbbbb", " a", "keep_start"),
        PreferencePair("Hi", " cc", " d", " cc", "keep_start"),
    ]
    examples = tokenize_pairs(pairs, tiny_tokenizer, Tokenization(100, 50, sft=False)).take(range(2))
    batch = pad(examples, pad_token_id=eos)
    assert batch.input_ids.shape[0] == 4  # chosen 0, chosen 1, rejected 0, rejected 1
    for row, (ex, r) in enumerate([(examples[0], 0), (examples[1], 0), (examples[0], 1), (examples[1], 1)]):
        response = ex["responses"][r]
        assert batch.attention_mask[row].sum() == len(ex["prompt"]) + len(response)  # includes the final EOS
        assert batch.score_targets[token_sequences(batch) == row].tolist() == response
    for layout in (pack, pad):
        assert (layout(examples, eos).score_targets == eos).sum() == 4  # each response's EOS is scored, padding never
    # prompts are left-padded for generation
    prompt_ids, prompt_mask = left_padded_prompts(examples, eos)
    assert prompt_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert prompt_ids[1, -2:].tolist() == examples[1]["prompt"]


# Layouts of every kind the scoring tests use: prompts of several lengths, an empty prompt, one-token responses,
# one response (SFT), many segments per row, rows padded at the tail.
MASK_EXAMPLES = [
    {"prompt": [1, 2, 3], "responses": [[4, 5], [6, 7, 8]]},
    {"prompt": [], "responses": [[9], [10, 11]]},
    {"prompt": [12], "responses": [[13], [14]]},
    {"prompt": [15, 16, 17, 18, 19], "responses": [[20, 21, 22, 23], [24]]},
]
MASK_LAYOUTS = {
    "longest segment per row": lambda examples: pack(examples, 0),
    "one row": lambda examples: pack(examples, 0, row_tokens=10_000),
    "one segment per row": lambda examples: pack(examples, 0, row_tokens=1),
    "rows rounded up to 16": lambda examples: pack(examples, 0, multiple=16),
}


def expected_mask(batch, span: AttentionSpan = FULL_ATTENTION) -> torch.Tensor:
    """[R, T, T] written from the padded layout's meaning: a token sees the tokens before it (by position) in its own
    padded sequence [prompt | its response], i.e. its example's prompt and its own response; padding sees itself.
    With a window, only the tokens fewer than `window` positions back; with chunks, only those of its own chunk of
    positions (transformers' sliding-window and chunked masks of a padded row)."""
    rows, length = batch.input_ids.shape
    mask = torch.zeros(rows, length, length, dtype=torch.bool)
    for r in range(rows):
        for q in range(length):
            for k in range(length):
                example_q, example_k = batch.segment_ids[r, q].item(), batch.segment_ids[r, k].item()
                part_q, part_k = batch.branch_ids[r, q].item(), batch.branch_ids[r, k].item()
                if example_q < 0:
                    mask[r, q, k] = q == k
                elif example_q == example_k and part_k in (0, part_q):
                    position_q, position_k = batch.position_ids[r, q].item(), batch.position_ids[r, k].item()
                    in_window = span.window is None or position_q - position_k < span.window
                    in_chunk = span.chunk is None or position_q // span.chunk == position_k // span.chunk
                    mask[r, q, k] = position_k <= position_q and in_window and in_chunk
    return mask


@pytest.mark.parametrize("sft", [False, True])
@pytest.mark.parametrize("layout", list(MASK_LAYOUTS))
@pytest.mark.parametrize("span", [FULL_ATTENTION, AttentionSpan(window=2), AttentionSpan(chunk=3)], ids=str)
def test_the_mask_mod_is_the_padded_layouts_visibility(layout, sft, span):
    examples = [{**ex, "responses": ex["responses"][:1]} if sft else ex for ex in MASK_EXAMPLES]
    batch = MASK_LAYOUTS[layout](examples)
    expected = expected_mask(batch, span)
    assert torch.equal(dense_mask(batch, span)[:, 0], expected)
    if span != FULL_ATTENTION:
        assert not torch.equal(expected, expected_mask(batch))  # the examples are longer than the span
    # FlexAttention evaluates the same mask_mod: its dense rendering is the same mask, and its block mask covers it
    rows, length = batch.input_ids.shape
    mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids, batch.position_ids, span)
    assert torch.equal(create_mask(mask_mod, rows, 1, length, length, device="cpu")[:, 0], expected)
    blocks = create_block_mask(mask_mod, rows, None, length, length, device="cpu", BLOCK_SIZE=4)
    listed = blocks.to_dense().bool()[:, 0].repeat_interleave(4, 1).repeat_interleave(4, 2)[:, :length, :length]
    assert not (expected & ~listed).any()  # no visible pair falls in a skipped block


def test_a_block_mask_skips_the_blocks_between_segments():
    # 8 segments of 64 tokens in one row of 512: with 64-token blocks, each query block sees its own segment's
    # block only (its diagonal), so 8 of 64 blocks are computed; a dense mask computes all 512 x 512 scores.
    examples = [{"prompt": list(range(1, 33)), "responses": [list(range(16)), list(range(16))]} for _ in range(8)]
    batch = pack(examples, 0, row_tokens=sum(segment_lengths(examples)))
    assert batch.input_ids.shape == (1, 512)
    mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids, batch.position_ids)
    blocks = create_block_mask(mask_mod, 1, None, 512, 512, device="cpu", BLOCK_SIZE=64)
    assert blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum() == 8


def test_a_block_mask_skips_the_blocks_beyond_a_window():
    # One 512-token sequence, a 64-token window, 64-token blocks: query block i sees key blocks i - 1 and i only,
    # so 1 + 2 x 7 = 15 of 64 blocks are computed (without the window, the causal half: 36).
    examples = [{"prompt": list(range(1, 448)), "responses": [list(range(65))]}]
    batch = pack(examples, 0)
    assert batch.input_ids.shape == (1, 512)

    def computed_blocks(span: AttentionSpan) -> int:
        mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids, batch.position_ids, span)
        blocks = create_block_mask(mask_mod, 1, None, 512, 512, device="cpu", BLOCK_SIZE=64)
        return int(blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum())

    assert computed_blocks(AttentionSpan(window=64)) == 15
    assert computed_blocks(FULL_ATTENTION) == 36
