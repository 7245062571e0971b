"""Fixed shapes for training (shape_buckets, core/shapes.py) and block masks built from tensors
(core/block_masks.py): a handful of shapes an epoch, log-probs unchanged by the padding, the same masks."""

import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from conftest import TINY_DIR, build_trainer
from core.block_masks import tensor_block_mask
from core.layouts import AttentionSpan, pack, packed_mask_mod
from core.shapes import bucket


def test_buckets_are_multiples_of_their_unit_padding_at_most_an_eighth():
    assert [bucket(n, 128) for n in (1, 128, 129, 1100, 1153, 1409, 2200)] == [128, 128, 256, 1152, 1280, 1536, 2304]
    for n in range(1, 40_000, 37):
        value = bucket(n, 128)
        assert value % 128 == 0 and n <= value and (value - n <= 127 or value <= n * 1.125), n
    assert [bucket(n, 1) for n in (1, 16, 17, 19, 21, 25)] == [1, 16, 18, 20, 22, 27]  # rows: each count up to 16


@pytest.mark.parametrize("attention", ["dense", "block"])
def test_an_epoch_of_the_demo_data_takes_a_handful_of_shapes(make_config, attention, capsys):
    # the default data (demo) at the default max_length: without buckets every step's micro-batch is a new shape;
    # with them a few, and the report says what the padding costs
    overrides = ("datasets=[demo]", "max_length=512", "n_eval_examples=16", "reference_cache=false")
    shapes = {}
    for buckets in ("false", "true"):
        trainer = build_trainer(make_config(*overrides, f"shape_buckets={buckets}"))
        trainer.scorer.attention = attention  # the block mask's one row a micro-batch (its layout only: no forward)
        batches = [trainer.scorer.batch(trainer.data.train_examples.take(step)) for step in trainer.data.schedule]
        shapes[buckets] = {tuple(batch.input_ids.shape) for batch in batches}
    assert len(trainer.data.schedule) == 25
    assert len(shapes["true"]) <= 5 and len(shapes["true"]) < len(shapes["false"]), shapes
    if attention == "dense":  # rows of the longest segment: each step its own (the block mask's one row of about
        assert len(shapes["false"]) >= 20  # 2,000 tokens takes 6 multiples of 128 without buckets, 5 with them)
    report = [line for line in capsys.readouterr().out.splitlines() if line.startswith("shape buckets:")]
    assert len(report) == 1 and "an epoch's 25 micro-batches take" in report[0], report  # dense: built with it


def random_examples(rng: random.Random, n: int, vocab: int = 200) -> list[dict]:
    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    return [{"prompt": ids(rng.randint(0, 40)), "responses": [ids(rng.randint(1, 30)), ids(rng.randint(1, 30))]}
            for _ in range(n)]  # fmt: skip


def test_padding_to_buckets_leaves_log_probs_and_gradients_unchanged():
    # float32, eager, the dense mask: the bucketed batch (more rows, longer rows, more kept positions) gives each
    # sequence's log-prob and the gradients to float rounding (stated: 1e-6)
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.heads import sequence_logps

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR)).eval()
    examples = random_examples(random.Random(0), 6, model.config.vocab_size)
    results = []
    for bucketed in (False, True):
        batch = pack(examples, 0, bucketed=bucketed)
        model.zero_grad()
        logps = sequence_logps(model, batch, None, torch.float32, True)
        logps.sum().backward()
        results.append((batch.input_ids.shape, logps.detach(), [p.grad.clone() for p in model.parameters()]))
    (plain_shape, plain, plain_grads), (padded_shape, padded, padded_grads) = results
    assert padded_shape[1] > plain_shape[1]  # padded up to a bucket: the test pads something
    torch.testing.assert_close(padded, plain, rtol=0, atol=1e-6)
    for a, b in zip(padded_grads, plain_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def tiles(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """([R, Q, K] partial tiles, [R, Q, K] full tiles) of a BlockMask, whatever the order of its index lists."""
    out = []
    for numbers, indices in ((mask.kv_num_blocks, mask.kv_indices), (mask.full_kv_num_blocks, mask.full_kv_indices)):
        rows, _, queries, keys = indices.shape
        dense = torch.zeros(rows, queries, keys, dtype=torch.bool)
        listed = torch.arange(keys)[None, None, :] < numbers[:, 0, :, None]
        dense.scatter_(2, indices[:, 0].long(), listed)
        out.append(dense)
    return tuple(out)


SPANS = [AttentionSpan(), AttentionSpan(window=7), AttentionSpan(chunk=9), AttentionSpan(window=5, chunk=12)]


@pytest.mark.parametrize("span", SPANS, ids=lambda span: span.describe())
def test_block_masks_from_tensors_equal_create_block_masks(span):
    # random packed layouts (empty prompts, one-token responses, many segments a row, padded tails, several rows),
    # tiles of 16: the same partial and full tiles, and the same mask_mod inside them
    rng = random.Random(0)
    for trial in range(12):
        examples = random_examples(rng, rng.randint(1, 8))
        for row_tokens in (None, 10_000):
            batch = pack(examples, 0, row_tokens=row_tokens, multiple=16, bucketed=trial % 2 == 1)
            rows, length = batch.input_ids.shape
            mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids, batch.position_ids, span)
            expected = create_block_mask(mask_mod, rows, None, length, length, device="cpu", BLOCK_SIZE=16)
            built = tensor_block_mask(batch, span, block=16)
            for have, want in zip(tiles(built), tiles(expected)):
                assert torch.equal(have, want), (trial, row_tokens)
            assert built.mask_mod(0, 0, torch.tensor(length - 1), torch.tensor(0)) == mask_mod(
                0, 0, torch.tensor(length - 1), torch.tensor(0)
            )
