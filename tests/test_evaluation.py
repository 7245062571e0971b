"""Evaluation and sampling (evaluation.py)."""

from types import SimpleNamespace

import pytest
import torch
from transformers.cache_utils import DynamicLayer

import train
from conftest import build_trainer, read_jsonl
from core.scoring import Scorer
from generation import decoding, sampling, seeded_draw
from generation.decoding import ReservedLayer, hole_filling_order, length_groups
from generation.sampling import SeededSampling
from generation.seeded_draw import drawn_log_probs, probs_draw


def test_sampling_during_eval_strips_prompt(make_config):
    config = make_config(
        "sample_during_eval=true", "n_eval_model_samples=3", "generation.max_new_tokens=5", "n_examples=8"
    )
    train.run(config)
    samples = read_jsonl(train.Path(config.local_run_dir) / "samples.jsonl")
    assert len(samples) == 6 and {s["step"] for s in samples} == {0, 8}
    for sample in samples:
        assert sample["prompt"].startswith("Q: ")
        assert not sample["policy"].startswith("Q: ") and len(sample["policy"]) <= 5 * 4  # <= 5 byte tokens


def test_eval_micro_batches_give_the_same_metrics(make_config, tmp_path):
    # 6 held-out pairs: with eval_batch_size=8 and 4 accumulation steps they go through in micro-batches of 2.
    whole = build_trainer(make_config(f"local_run_dir={tmp_path / 'a'}", "n_eval_examples=6"))
    micro = build_trainer(
        make_config(
            f"local_run_dir={tmp_path / 'b'}", "n_eval_examples=6", "gradient_accumulation_steps=4", "layout=padded"
        )
    )
    calls = []
    micro.policy.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    metrics, micro_metrics = whole.evaluator.evaluate(whole.policy), micro.evaluator.evaluate(micro.policy)
    assert calls == [4, 4, 4]  # 3 micro-batches of 2 pairs (chosen + rejected)
    assert micro_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        assert micro_metrics[name] == pytest.approx(value, abs=1e-5), name


def test_a_seeded_completion_is_the_same_whatever_is_batched_with_it(make_config):
    # Row i's tokens come from seeds[i] alone: alone, in a batch, in another order, they are the same (transformers'
    # own sampler draws every row from one generator, so a row's tokens would depend on the rows beside it).
    trainer = build_trainer(make_config("generation.max_new_tokens=10", "generation.temperature=1.0"))
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(5)]
    seeds = [11, 12, 13, 14, 15]
    complete = trainer.evaluator.sampler.decode_generate_seeded
    batched = complete(trainer.policy, prompts, seeds)
    alone = [complete(trainer.policy, [p], [s])[0] for p, s in zip(prompts, seeds)]
    reversed_order = complete(trainer.policy, prompts[::-1], seeds[::-1])[::-1]
    assert batched == alone == reversed_order
    assert len({tuple(c) for c in batched}) == 5  # five seeds, five different completions
    again = complete(trainer.policy, prompts, [seed + 100 for seed in seeds])
    assert again != batched


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8), (2.0, 0.5)])
def test_seeded_sampling_draws_from_the_tempered_nucleus(temperature, top_p):
    # Uniforms on an even grid of N points: each token is drawn for N times its probability, to within one draw.
    # The nucleus written out: tokens by falling probability while the mass before them is below top_p.
    logits = torch.tensor([1.0, 2.0, 0.5, 3.0, -1.0])
    n = 10_000
    uniforms = ((torch.arange(n) + 0.5) / n)[:, None]
    scores = SeededSampling(uniforms, 0, temperature, top_p)(torch.zeros(n, 0, dtype=torch.long), logits.repeat(n, 1))
    assert ((scores == 0).sum(dim=1) == 1).all() and torch.isinf(scores).sum() == n * 4  # one finite score a row
    counts = torch.bincount(scores.argmax(dim=1), minlength=5).double() / n
    p = torch.softmax(logits.double() / temperature, dim=0)
    kept, mass = torch.zeros(5, dtype=torch.bool), 0.0
    for token in torch.argsort(p, descending=True).tolist():
        if mass < top_p:
            kept[token] = True
        mass += p[token].item()
    expected = torch.where(kept, p, 0) / p[kept].sum()
    torch.testing.assert_close(counts, expected, rtol=0, atol=1.5 / n)


def sorted_draw(scores, uniforms, temperature, top_p):
    """The seeded sampler as it was: a stable descending sort of the vocabulary, the nucleus's CDF, searchsorted."""
    probs = torch.softmax(scores.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    outside[:, 0] = False
    cdf = sorted_probs.masked_fill(outside, 0).cumsum(dim=-1)
    index = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, index).squeeze(-1)


@pytest.mark.parametrize("vocab", [7, 300, 49152])
def test_seeded_sampling_draws_the_token_the_stable_full_sort_drew(vocab):
    # The sampler finds the stable sort's token without sorting the token ids: over many seeds, temperatures and
    # top_p values, on logits with many exact ties (integers, -inf for suppressed tokens, underflow at low
    # temperatures) and on continuous ones, and at uniforms at the ends of [0, 1), every draw is the old one. A
    # vocabulary of 7 lies within the head; of 300, past it and within the prefix; of 49,152, past both.
    generator = torch.Generator().manual_seed(vocab)
    rows = 8 if vocab > 100 else 64
    for seed in range(3 if vocab > 100 else 40):
        continuous = torch.randn(rows, vocab, generator=generator) * (1 + seed % 4)
        tied = torch.randint(-3, 3, (rows, vocab), generator=generator).float()
        tied[torch.rand(rows, vocab, generator=generator) < 0.2] = -torch.inf
        tied[:, 0] = 5.0  # never a row of -inf alone
        uniforms = torch.rand(rows, 1, generator=generator)
        uniforms[:3, 0] = torch.tensor([0.0, 1 - 2**-24, 0.5])
        for logits in (continuous, tied, continuous.bfloat16()):
            for temperature, top_p in ((1.0, 1.0), (0.25, 1.0), (0.7, 0.9), (2.0, 0.5), (1.0, 0.999)):
                sampler = SeededSampling(uniforms, 0, temperature, top_p)
                new = sampler.draw(logits, 0)
                old = sorted_draw(logits, uniforms, temperature, top_p)
                assert torch.equal(new, old), (seed, temperature, top_p, (new != old).nonzero()[:4])


def test_seeded_draw_at_top_p_1_where_the_mass_rounds_to_1_and_the_rule_cuts_the_tail():
    # At T = 1 the float32 probabilities of a 49,152-token softmax sum past 1, and the rule's float32 running sum
    # reaches 1.0 before the sorted tail ends: the rule cuts the tail, so its mass m is below the total. A uniform
    # just below a CDF step over m (and above it over the total), or on it, must draw the rule's token.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 49152, generator=generator) * 3
    logits[:, :50] += torch.randn(8, 50, generator=generator) * 6  # a head of likely tokens, as a model's
    sorted_probs = torch.softmax(logits, -1).sort(-1, descending=True).values
    outside = sorted_probs.cumsum(-1) - sorted_probs >= 1
    outside[:, 0] = False
    cdf = sorted_probs.masked_fill(outside, 0).cumsum(-1)
    total = torch.softmax(logits, -1).sum(-1, dtype=torch.float64)
    assert outside.any(-1).all() and (total.float() > cdf[:, -1]).all()  # the case at hand, in every row
    for step in (1, 10, 100):
        on = cdf[:, step - 1 : step] / cdf[:, -1:]
        for uniforms in (on * (1 - 2**-22), on, torch.nextafter(on, torch.ones_like(on))):
            new = SeededSampling(uniforms, 0, 1.0, 1.0).draw(logits, 0)
            assert torch.equal(new, sorted_draw(logits, uniforms, 1.0, 1.0)), step


def test_the_own_decode_loop_draws_what_generate_drew_sharing_prefills_and_dropping_finished_rows(make_config):
    # Rows of prompts x temperatures x samples through generation.decoding's loop: each completion equal (float32) to
    # the one model.generate with SeededSampling draws from the same seed and temperature, one row at a time; each
    # distinct prompt prefilled once; rows that drew their EOS leave the batch (the forward passes shrink).
    trainer = build_trainer(make_config("generation.max_new_tokens=12"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    eos = trainer.tokenizer.eos_token_id
    likelier_eos = lambda module, args, logits: logits + 3.0 * (torch.arange(logits.shape[-1]) == eos)  # noqa: E731
    policy.get_output_embeddings().register_forward_hook(likelier_eos)  # rows finish early
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(3)]
    rows = [(p, t, j) for p in range(3) for t in (0.5, 1.0, 2.0) for j in range(2)]
    seeds = [100 * p + 10 * j + int(4 * t) for p, t, j in rows]
    widths = []
    record = lambda module, args, kwargs: widths.append(tuple(kwargs["input_ids"].shape))  # noqa: E731
    hook = policy.register_forward_pre_hook(record, with_kwargs=True)
    sampler.batch_size = len(rows)
    drawn = sampler.sample(policy, [prompts[p] for p, _, _ in rows], None, seeds, [t for _, t, _ in rows])
    hook.remove()
    old = [
        sampler.decode_generate_seeded(policy, [prompts[p]], [seed], None, t)[0] for (p, t, _), seed in zip(rows, seeds)
    ]
    assert drawn == old
    assert widths[0][0] == 3 and {w[1] for w in widths[1:]} == {1}  # three prefills, then one token a row
    # a row is computed for each token it draws after its first, and for no step after its EOS
    assert sum(w[0] for w in widths[1:]) == sum(len(c) - 1 for c in drawn)
    assert sum(len(c) < 12 for c in drawn) >= 2 and widths[-1][0] < len(rows)


def test_the_decode_loop_passes_its_cache_by_the_name_the_models_forward_reads(make_config):
    # transformers 5.24 renamed the models' past_key_values to cache. A model whose forward reads past_key_values alone
    # (transformers' models before 5.24, remote code written for them) gets the loop's cache by that name: its greedy
    # completions are those of the model it wraps. By the other name the cache would be refused, or fall unread into
    # a forward's **kwargs (as cache= did under transformers 5.20 to 5.23: every step attended to its own token).
    trainer = build_trainer(make_config())
    policy, tokenizer = trainer.policy, trainer.tokenizer
    name = decoding.cache_argument(policy)

    class ReadsPastKeyValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = policy, policy.config

        def get_output_embeddings(self):
            return policy.get_output_embeddings()

        def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache, logits_to_keep=0):
            return policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, logits_to_keep=logits_to_keep, **{name: past_key_values})  # fmt: skip

    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(3)]
    greedy = lambda logits, step, live: logits.argmax(-1)  # noqa: E731
    args = (prompts, greedy, 8, tokenizer.pad_token_id, tokenizer.eos_token_id, torch.device("cpu"))
    assert decoding.cache_argument(ReadsPastKeyValues()) == "past_key_values"
    assert decoding.decode(ReadsPastKeyValues(), *args) == decoding.decode(policy, *args)


@pytest.mark.cuda
def test_the_own_decode_loop_on_cuda_draws_what_generate_draws_and_sums_the_scored_log_probs(make_config):
    # evaluate.py's sampling on the GPU, float32 without TF32: each distinct prompt prefilled once, every token drawn
    # by the stable sort (the GPU's draw), rows that drew their EOS leaving the batch; each completion the one
    # model.generate with SeededSampling draws from its seed alone, and the log-probs summed while drawing the ones
    # scored afterwards.
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        trainer = build_trainer(make_config("generation.max_new_tokens=12"))
        policy, sampler = trainer.policy, trainer.evaluator.sampler
        assert next(policy.parameters()).device.type == "cuda"
        eos = trainer.tokenizer.eos_token_id

        def likelier_eos(module, args, logits):  # rows finish early
            return logits + 3.0 * (torch.arange(logits.shape[-1], device=logits.device) == eos)

        policy.get_output_embeddings().register_forward_hook(likelier_eos)
        prompts = [trainer.data.train_examples[i]["prompt"] for i in range(3)]
        rows = [(p, t) for p in range(3) for t in (0.5, 1.0, 2.0)]
        seeds = [10 * p + int(4 * t) for p, t in rows]
        args = ([prompts[p] for p, _ in rows], None, seeds, [t for _, t in rows])
        drawn, logps = sampler.sample_scored(policy, *args)
        alone = [
            sampler.decode_generate_seeded(policy, [prompts[p]], [seed], None, t)[0]
            for (p, t), seed in zip(rows, seeds)
        ]
        assert drawn == alone and len(set(map(len, drawn))) > 1
        assert logps == pytest.approx(sampler.score(policy, args[0], drawn, None, args[3]), abs=1e-4)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def test_completions_of_one_prompt_are_scored_together_each_as_it_would_be_alone(make_config, monkeypatch):
    # The sampled KL's log-probs: the completions of each prompt, at several temperatures, scored in one packed
    # segment (the prompt computed once) equal each completion's own forward, its logits divided by its temperature;
    # prompts with unequal numbers of completions are scored one completion an example, to the same values.
    trainer = build_trainer(make_config("generation.max_new_tokens=8"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(3)]
    rows = [(p, t) for p in range(3) for t in (0.5, 1.0, 2.0)]
    row_prompts, temperatures = [prompts[p] for p, _ in rows], [t for _, t in rows]
    completions = sampler.sample(policy, row_prompts, None, list(range(len(rows))), temperatures)
    positions, batch = [], Scorer.batch
    monkeypatch.setattr(Scorer, "batch", lambda *a: positions.append(batch(*a).input_ids.numel()) or batch(*a))
    together = sampler.score(policy, row_prompts, completions, None, temperatures)
    monkeypatch.undo()
    with torch.no_grad():
        alone = []
        for prompt, completion, temperature in zip(row_prompts, completions, temperatures):
            logits = policy(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            logps = torch.log_softmax(logits.double() / temperature, -1)
            alone.append(logps.gather(1, torch.tensor(completion)[:, None]).sum().item())
    assert together == pytest.approx(alone, abs=1e-4)
    # each prompt once: fewer positions than the completions' rows hold without any padding
    assert sum(positions) < sum(len(p) + len(c) for p, c in zip(row_prompts, completions))
    uneven = sampler.score(policy, row_prompts[:-1], completions[:-1], None, temperatures[:-1])
    assert uneven == pytest.approx(together[:-1], abs=1e-5)


def test_log_probs_summed_while_drawing_equal_the_scored_log_probs(make_config, monkeypatch):
    # evaluate.py's KL: a candidate's own log-probs are summed from the logits each token was drawn from, at the row's
    # temperature; they equal those logps scores afterwards, with the own loop and with model.generate (which
    # records none: logps scores them). Rows finish early, so that the live rows change as they are summed.
    trainer = build_trainer(make_config("generation.max_new_tokens=8"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    eos = trainer.tokenizer.eos_token_id
    likelier_eos = lambda module, args, logits: logits + 4.0 * (torch.arange(logits.shape[-1]) == eos)  # noqa: E731
    policy.get_output_embeddings().register_forward_hook(likelier_eos)
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(3)]
    rows = [(p, t) for p in range(3) for t in (0.5, 1.0, 2.0)]
    args = ([prompts[p] for p, _ in rows], None, list(range(len(rows))), [t for _, t in rows])
    drawn, logps = sampler.sample_scored(policy, *args)
    assert drawn == sampler.sample(policy, *args)
    scored = sampler.score(policy, args[0], drawn, None, args[3])
    assert logps == pytest.approx(scored, abs=1e-4) and len(set(map(len, drawn))) > 1
    monkeypatch.setattr(sampling, "own_loop_problem", lambda *a: "forced")
    assert sampler.sample_scored(policy, *args) == (drawn, pytest.approx(scored, abs=1e-6))


def test_sampling_batches_hold_the_rows_of_batch_size_prompts_shortest_prompts_first(make_config):
    # batch_size counts prompts: a batch holds every row (temperature, sample) of batch_size distinct prompts, which
    # share one prefill, prompts of similar lengths together; the completions are those of any other batching.
    trainer = build_trainer(make_config("generation.max_new_tokens=6"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    first = trainer.data.train_examples[0]["prompt"]
    prompts = [first + first[: 2 * k] for k in (4, 3, 2, 1, 0)]  # 20, 18, 16, 14 and 12 tokens
    rows = [(p, t) for p in range(5) for t in (0.5, 1.0)]
    args = ([list(prompts[p]) for p, _ in rows], None, [7 * p + int(4 * t) for p, t in rows], [t for _, t in rows])
    prefills = []
    record = lambda module, args, kwargs: prefills.append(tuple(kwargs["input_ids"].shape))  # noqa: E731
    hook = policy.register_forward_pre_hook(record, with_kwargs=True)
    sampler.batch_size = 2
    by_two = sampler.sample(policy, *args)
    hook.remove()
    sampler.batch_size = 1
    assert sampler.sample(policy, *args) == by_two
    widths = [shape for shape in prefills if shape[1] > 1]
    assert [rows for rows, _ in widths] == [2, 2, 1]  # prefills of distinct prompts: 2, 2 and the last one
    assert [width for _, width in widths] == sorted(len(p) for p in prompts)[1::2] + [len(prompts[0])]


def test_reserved_cache_layer_holds_what_a_growing_cache_holds():
    # The own decode loop's KV cache writes each step into buffers reserved up front (and grows them past their
    # capacity): after prefill, steps, rows leaving and a reorder, its keys and values are DynamicLayer's.
    generator = torch.Generator().manual_seed(0)
    reserved, growing = ReservedLayer(capacity=4), DynamicLayer()
    for width, kept in [(3, None), (1, None), (1, [0, 2, 3]), (2, [2, 0]), (1, None)]:
        if kept is not None:
            for layer in (reserved, growing):
                layer.batch_select_indices(torch.tensor(kept))
        rows = reserved.keys.shape[0] if reserved.is_initialized else 4
        keys, values = torch.randn(2, rows, 3, width, 8, generator=generator)
        got, expected = reserved.update(keys, values[..., :5]), growing.update(keys, values[..., :5])
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert reserved.get_seq_length() == growing.get_seq_length() == 8 and reserved.capacity >= 8


def test_length_groups_are_the_split_with_fewest_padded_tokens_and_forwards():
    # Prompts of unequal lengths are prefilled in groups of neighbouring lengths: of every split of the sorted lengths
    # into runs, the one whose padded tokens (a group's size times its longest) plus `cost` a group are fewest.
    lengths = [100, 10, 12, 101, 11, 40, 38]

    def total(groups, cost):
        return sum(len(group) * max(lengths[i] for i in group) + cost for group in groups)

    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    for cost in (0, 5, 20, 60, 1000):
        splits = []
        for cuts in range(2 ** (len(order) - 1)):  # each bit: a new group starts after that place
            groups, start = [], 0
            for place in range(1, len(order)):
                if cuts >> (place - 1) & 1:
                    groups.append(order[start:place])
                    start = place
            splits.append(groups + [order[start:]])
        best = min(total(groups, cost) for groups in splits)
        got = length_groups(lengths, cost)
        assert sorted(i for group in got for i in group) == list(range(len(lengths))) and total(got, cost) == best
    assert length_groups(lengths, 20) == [[1, 4, 2], [6, 5], [0, 3]]
    assert length_groups(lengths, 1000) == [order] and len(length_groups(lengths, 0)) == len(lengths)


def test_prompts_prefilled_in_length_groups_hold_what_one_padded_batch_holds(make_config, monkeypatch):
    # Each group of lengths is prefilled apart and its keys and values written into the one left-padded layout the
    # decode steps extend: the same last logits, the same cache wherever a mask reads it (zeros elsewhere), as one
    # padded batch's; and the completions drawn from them, the LM head in blocks of a few tokens, are the same.
    trainer = build_trainer(make_config("generation.max_new_tokens=6"))
    policy, sampler, pad = trainer.policy, trainer.evaluator.sampler, trainer.tokenizer.pad_token_id
    first = trainer.data.train_examples[0]["prompt"]
    prompts = [tuple(first[:k]) for k in (len(first), 3, 9, 4)]
    shapes, results = [], {}
    hook = policy.register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape), with_kwargs=True)
    for cost in (10**6, 0):
        monkeypatch.setitem(decoding.GROUP_COST, "cpu", cost)
        with torch.no_grad():
            results[cost] = decoding.prefill(policy, prompts, pad, 6, torch.device("cpu"))
    hook.remove()
    assert shapes == [(4, len(first)), (1, 3), (1, 4), (1, 9), (1, len(first))]  # one batch; each length apart
    (whole, whole_logits, whole_mask, whole_positions), (grouped, logits, mask, positions) = results[10**6], results[0]
    assert torch.equal(mask, whole_mask) and torch.equal(positions, whole_positions)
    torch.testing.assert_close(logits, whole_logits, atol=1e-5, rtol=1e-5)
    read = mask.bool()[:, None, :, None]
    for layer, whole_layer in zip(grouped.layers, whole.layers):
        for got, expected in ((layer.keys, whole_layer.keys), (layer.values, whole_layer.values)):
            torch.testing.assert_close(got * read, expected * read, atol=1e-5, rtol=1e-5)
            assert not got.masked_select(~read).any()
    rows = [(p, t) for p in range(4) for t in (0.5, 1.0)]
    args = ([list(prompts[p]) for p, _ in rows], None, [11 * p + int(4 * t) for p, t in rows], [t for _, t in rows])
    sampler.batch_size = 4
    drawn = sampler.sample(policy, *args)
    monkeypatch.setitem(decoding.GROUP_COST, "cpu", 10**6)
    monkeypatch.setattr(decoding, "VOCAB_BLOCK", 10**9)
    assert sampler.sample(policy, *args) == drawn


def test_the_blocked_head_gives_the_heads_logits_and_is_the_heads_own_again_after(monkeypatch):
    # On a CPU the decode steps' LM head multiplies by the vocabulary in column blocks (faster with few rows): the
    # same logits as the head's, with and without a bias, the last block shorter; a head in another dtype is left
    # as it is.
    monkeypatch.setattr(decoding, "VOCAB_BLOCK", 7)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 2, 16, generator=generator)
    for bias in (True, False):
        head = torch.nn.Linear(16, 50, bias=bias)
        model = SimpleNamespace(get_output_embeddings=lambda head=head: head)
        with decoding.blocked_head(model), torch.no_grad():  # as decode runs it
            assert "forward" in vars(head)
            logits = head(hidden)
        assert "forward" not in vars(head)
        torch.testing.assert_close(logits, torch.nn.functional.linear(hidden, head.weight, head.bias).detach())
    head.to(torch.bfloat16)
    with decoding.blocked_head(model):
        assert "forward" not in vars(head)


def test_rows_that_leave_give_their_places_to_the_last_live_rows():
    # When rows finish, the last live rows move into their places: the KV cache copies as many rows as left.
    keep = torch.tensor([False, True, True, False, True, True, False, True])
    assert hole_filling_order(keep).tolist() == [5, 1, 2, 7, 4]
    assert hole_filling_order(torch.tensor([True, True, False, False])).tolist() == [0, 1]
    layer, growing = ReservedLayer(capacity=6), DynamicLayer()
    keys, values = torch.randn(2, 8, 2, 3, 4)
    for each in (layer, growing):
        each.update(keys, values)
        each.batch_select_indices(hole_filling_order(keep))
    assert torch.equal(layer.keys, growing.keys) and torch.equal(layer.values, growing.values)
    assert torch.equal(layer.key_buffer[1:3, :, :3], keys[1:3]) and layer.key_buffer.shape[0] == 8  # in place


def test_scored_examples_are_batched_by_length_and_each_score_returns_to_its_row(make_config, monkeypatch):
    # The KL's log-probs and a reward model's rewards: examples (a prompt and its completions) are batched by their
    # tokens, shortest first, so that a batch pads little; each score is the one the completion gets in any batching.
    trainer = build_trainer(make_config("generation.max_new_tokens=8"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    first = trainer.data.train_examples[0]["prompt"]
    prompts = [first[:k] for k in (len(first), 4, 11)]  # longest first
    rows = [(p, t) for p in range(3) for t in (0.5, 1.0, 2.0)]
    row_prompts, temperatures = [prompts[p] for p, _ in rows], [t for _, t in rows]
    sampler.batch_size = 9
    completions = sampler.sample(policy, row_prompts, None, list(range(len(rows))), temperatures)
    together = sampler.score(policy, row_prompts, completions, None, temperatures)
    sizes, batch = [], Scorer.batch

    def recorded(self, examples):
        sizes.append([len(e["prompt"]) + sum(map(len, e["responses"])) for e in examples])
        return batch(self, examples)

    monkeypatch.setattr(Scorer, "batch", recorded)
    sampler.batch_size = 3  # one example (3 completions) a batch
    apart = sampler.score(policy, row_prompts, completions, None, temperatures)
    tokens = [len(p) + sum(len(c) for c, (q, _) in zip(completions, rows) if q == i) for i, p in enumerate(prompts)]
    assert sizes == [[n] for n in sorted(tokens)] and sorted(tokens) != tokens
    assert apart == pytest.approx(together, abs=1e-5)


def test_the_log_probs_read_while_drawing_divide_out_the_float32_softmaxs_rounding():
    # The sampled KL's log-probs summed while drawing read each token's probability from the float32 softmax the draw
    # computed; its rows sum to 1 only within its rounding, which over a 49,152-token vocabulary puts the log of a
    # probability high by ~1e-5 on average (1e-3 over a completion). Divided by the row's float64 sum that
    # probs_draw returns (drawn_log_probs), it is the float64 log-softmax's within 1e-6.
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 49152, generator=generator) * 3
    logits[:, :50] += 8  # a head of likely tokens, as a model's
    probs = torch.softmax(logits, -1)
    tokens, sums = probs_draw(probs, torch.rand(64, generator=generator), 1.0)
    exact = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None])[:, 0]
    assert (probs.gather(1, tokens[:, None])[:, 0].double().log() - exact).mean() > 5e-6  # the softmax's rounding
    assert (drawn_log_probs(probs, tokens, sums) - exact).abs().max() < 1e-6


def nucleus_probabilities(logits: torch.Tensor, temperature: float, top_p: float, shift: int = 0) -> torch.Tensor:
    """float64 probabilities of the tempered nucleus, written out: tokens by falling probability while the mass
    before them is below top_p (shift: the cut moved by that many tokens, a wrong cut), renormalised."""
    p = torch.softmax(logits.double() / temperature, dim=0)
    order = torch.argsort(p, descending=True, stable=True)
    before = torch.cumsum(p[order], dim=0) - p[order]
    kept = torch.zeros_like(p, dtype=torch.bool)
    kept[order[: int((before < top_p).sum()) + shift]] = True
    return torch.where(kept, p, 0) / p[kept].sum()


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against probabilities `expected` (tokens expected under 5 times pooled in
    one bin); a token drawn where its probability is 0 is a p-value of 0."""
    from scipy.stats import chisquare

    n = counts.sum().item()
    if counts[expected == 0].sum() > 0:
        return 0.0
    large = expected * n >= 5
    observed = torch.cat([counts[large], counts[~large & (expected > 0)].sum()[None]]).double()
    wanted = torch.cat([expected[large], expected[~large].sum()[None]]) * n
    keep = wanted > 0
    return float(chisquare(observed[keep].numpy(), wanted[keep].numpy()).pvalue)


@pytest.mark.parametrize("head, prefix", [(4, 16), (64, 1024)])
def test_the_own_loops_draws_are_an_exact_sample_of_the_tempered_nucleus(make_config, monkeypatch, head, prefix):
    # 8,000 rows of one prompt, each drawing its first token from its own seed through the Sampler's own decode loop,
    # on a tiny Llama whose logits are spread (x 24): at each temperature and top_p, the counts pass a chi-square test
    # against the float64 tempered nucleus of the model's logits, and no token outside the nucleus is drawn. With a
    # head of 4 and a prefix of 16 of the 259 probabilities, a CPU draw often falls past both and sorts the whole
    # row; with 64 and 1,024 it falls past the head alone. The test has the power to tell: the same counts reject a
    # nucleus cut one token earlier and a temperature 10% off.
    monkeypatch.setattr(seeded_draw, "HEAD", head)
    monkeypatch.setattr(seeded_draw, "PREFIX", prefix)
    trainer = build_trainer(make_config("generation.max_new_tokens=1"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    policy.get_output_embeddings().register_forward_hook(lambda module, args, logits: logits * 24)
    prompt = trainer.data.train_examples[0]["prompt"]
    with torch.no_grad():
        logits = policy(torch.tensor([prompt])).logits[0, -1]
    n, vocab = 8000, logits.shape[0]
    sampler.batch_size = 1
    for temperature, top_p in ((0.7, 1.0), (1.0, 1.0), (2.0, 1.0), (2.0, 0.9), (4.0, 0.7)):
        drawn = sampler.sample(policy, [prompt] * n, None, list(range(n)), temperature, top_p)
        assert {len(completion) for completion in drawn} == {1}
        counts = torch.bincount(torch.tensor([c[0] for c in drawn]), minlength=vocab)
        expected = nucleus_probabilities(logits, temperature, top_p)
        assert int((expected * n >= 5).sum()) >= 9  # spread: many tokens are drawn often
        assert chi_square_p_value(counts, expected) > 1e-4, (temperature, top_p)
        assert chi_square_p_value(counts, nucleus_probabilities(logits, 1.1 * temperature, top_p)) < 1e-6
        if top_p < 1:
            assert chi_square_p_value(counts, nucleus_probabilities(logits, temperature, top_p, shift=-1)) == 0.0


def test_a_run_in_bfloat16_autocast_samples_its_win_rate_and_rounds_in_bfloat16(make_config, capsys):
    # The float32-weight policy a BasicTrainer run trains under bfloat16 autocast samples as it computes: its
    # completions are those of the policy's forward passes under that autocast, which differ from float32's on
    # these rows, and the line on the sampling path says so.
    trainer = build_trainer(make_config("model.fsdp_policy_mp=bfloat16", "generation.max_new_tokens=16"))
    assert trainer.sampler.autocast == torch.bfloat16
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(4)] * 2
    seeds, temperatures = list(range(8)), [0.7, 1.0] * 4
    drawn = trainer.sampler.sample(trainer.policy, prompts, None, seeds, temperatures)
    assert "sampling: our decode loop (bfloat16 autocast, as the run computes)" in capsys.readouterr().out
    plain = sampling.Sampler(trainer.tokenizer, trainer.topology, 16, trainer.sampler.batch_size)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain.sample(trainer.policy, prompts, None, seeds, temperatures) == drawn
    assert sum(a != b for a, b in zip(plain.sample(trainer.policy, prompts, None, seeds, temperatures), drawn)) >= 2
