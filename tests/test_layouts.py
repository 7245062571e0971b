import torch

from layouts import left_padded_prompts, pack, pack_rows, pad
from preference_datasets import PreferencePair, tokenize_pair


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
    assert batch.attention_mask.shape == (1, 1, 8, 8) and batch.attention_mask[0, 0].int().tolist() == allowed
    # The last prompt token (position 2) predicts both chosen[0] and rejected[0].
    assert batch.score_positions.tolist() == [2, 3, 2, 5, 6]
    assert batch.score_targets.tolist() == [4, 5, 6, 7, 8]
    assert batch.score_sequences.tolist() == [0, 0, 1, 1, 1] and batch.n_sequences == 2


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
    two_segments = batch.attention_mask[1, 0].int()
    assert two_segments[:4, 4:].sum() == 0 and two_segments[4:, :4].sum() == 0
    assert batch.attention_mask[2, 0].int().tolist()[2:] == [[0] * i + [1] + [0] * (6 - i) for i in range(2, 7)]
    # Sequences are numbered response-major: chosen of examples 0..3, then rejected of 0..3.
    assert sorted(zip(batch.score_sequences.tolist(), batch.score_targets.tolist())) == [
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
    assert padded.score_sequences.tolist() == [0, 0, 1, 2, 2, 2]
    assert sorted(zip(packed.score_sequences.tolist(), packed.score_targets.tolist())) == sorted(
        zip(padded.score_sequences.tolist(), padded.score_targets.tolist())
    )
    assert padded.position_ids is None and padded.attention_mask.tolist()[2:] == [[1] * 6, [1] + [0] * 5]
    assert torch.equal(padded.input_ids.flatten()[padded.score_positions + 1], padded.score_targets)


def test_masks_and_scored_tokens_come_from_lengths_when_pad_is_eos(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id  # pad == EOS, as for SmolLM2: masks must not come from ids != pad
    pairs = [
        PreferencePair("Hello", " a", " bbbbbb", " a", "keep_start"),
        PreferencePair("Hi", " cc", " d", " cc", "keep_start"),
    ]
    examples = [tokenize_pair(pair, tiny_tokenizer, 100, 50, False) for pair in pairs]
    batch = pad(examples, pad_token_id=eos)
    assert batch.input_ids.shape[0] == 4  # chosen 0, chosen 1, rejected 0, rejected 1
    for row, (ex, r) in enumerate([(examples[0], 0), (examples[1], 0), (examples[0], 1), (examples[1], 1)]):
        response = ex["responses"][r]
        assert batch.attention_mask[row].sum() == len(ex["prompt"]) + len(response)  # includes the final EOS
        assert batch.score_targets[batch.score_sequences == row].tolist() == response
    for layout in (pack, pad):
        assert (layout(examples, eos).score_targets == eos).sum() == 4  # each response's EOS is scored, padding never
    # prompts are left-padded for generation
    prompt_ids, prompt_mask = left_padded_prompts(examples, eos)
    assert prompt_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert prompt_ids[1, -2:].tolist() == examples[1]["prompt"]
