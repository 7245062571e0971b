"""The static decode loop (generation/static_decoding.py) and its grouped decode attention
(generation/decode_attention.py): the same completions as the own loop (generation/decoding.py), an exact sample."""

import pytest
import torch
import transformers

from conftest import build_trainer, tiny_lm_config
from generation import seeded_draw, static_decoding
from generation.decode_attention import grouped_attention
from generation.decoding import decode
from generation.seeded_draw import RowDraws
from generation.static_decoding import BUCKETS, static_decode, static_loop_problem
from test_evaluation import chi_square_p_value, nucleus_probabilities

CPU = torch.device("cpu")


def greedy(logits, step, rows):
    return logits.argmax(-1)


@pytest.fixture
def likely_eos(make_config):
    """(policy, eos, prompts of 2 to 150 tokens): the tiny Llama in float32, its EOS made likely so that rows finish
    at many different steps."""
    trainer = build_trainer(make_config())
    policy, eos = trainer.policy, trainer.tokenizer.eos_token_id
    policy.get_output_embeddings().register_forward_hook(
        lambda module, args, logits: logits + 3.0 * (torch.arange(logits.shape[-1], device=logits.device) == eos)
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (2, 150, 9, 64, 2, 31)]
    return policy, eos, prompts + prompts[:2]  # two prompts twice: prefilled once for both rows


def seeded(rows: int, new_tokens: int, top_p: float, scored: bool = True) -> RowDraws:
    uniforms = torch.rand(rows, new_tokens, generator=torch.Generator().manual_seed(1))
    return RowDraws(uniforms, [(0.5, 1.0, 2.0)[row % 3] for row in range(rows)], top_p, scored, CPU)


def test_the_static_loop_draws_what_the_own_loop_draws_greedy_and_seeded(likely_eos):
    # float32, rows of 2 to 150 prompt tokens finishing at different steps: token for token the completions of
    # decoding.decode, greedy and seeded (three temperatures, top_p 1 and 0.8), and the log-probs summed while drawing.
    policy, eos, prompts = likely_eos
    args = (30, 256, eos, CPU)
    assert static_decode(policy, prompts, greedy, *args) == decode(policy, prompts, greedy, *args)
    for top_p in (1.0, 0.8):
        own, static = seeded(len(prompts), 30, top_p), seeded(len(prompts), 30, top_p)
        drawn = decode(policy, prompts, own, *args)
        assert static_decode(policy, prompts, static, *args) == drawn
        assert len(set(map(len, drawn))) >= 4 and max(map(len, drawn)) == 30
        torch.testing.assert_close(static.logps[:-1], own.logps[:-1], rtol=0, atol=1e-6)


def test_padded_buckets_and_late_checks_change_no_row(likely_eos, monkeypatch):
    # As on CUDA: the rows run in bucket-sized slots (padding slots drawing for the padding row), finished rows keep
    # their slots until the host checks (every 3 steps here), then the live rows move into a smaller bucket. Every
    # row's tokens and log-probs are those of the unpadded loop, and the batches are buckets that shrink.
    policy, eos, prompts = likely_eos
    prompts = prompts * 3  # 24 rows
    args = (30, 256, eos, CPU)
    plain = seeded(len(prompts), 30, 1.0)
    drawn = static_decode(policy, prompts, plain, *args)
    monkeypatch.setattr(static_decoding, "PADDED_DEVICES", {"cpu"})
    monkeypatch.setattr(static_decoding, "CHECK_EVERY", 3)
    monkeypatch.setattr(static_decoding, "BUCKETS", (1, 2, 4, 8, 16, 20))
    sizes = []
    hook = policy.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].shape), with_kwargs=True)
    padded = seeded(len(prompts), 30, 1.0)
    assert static_decode(policy, prompts, padded, *args) == drawn
    hook.remove()
    torch.testing.assert_close(padded.logps[:-1], plain.logps[:-1], rtol=0, atol=1e-6)
    steps = [rows for rows, width in sizes if width == 1]
    assert steps[0] == 40 and set(steps) <= {1, 2, 4, 8, 16, 20, 40} and steps == sorted(steps, reverse=True)
    assert len(set(steps)) >= 3  # the bucket shrank at least twice


def test_rows_of_very_different_lengths_equal_each_row_alone(likely_eos):
    # A row batched with prompts 75 times its length (and 1/75 of it) draws what it draws alone, as the own loop's do.
    policy, eos, prompts = likely_eos
    args = (20, 256, eos, CPU)
    batched = static_decode(policy, prompts, seeded(len(prompts), 20, 1.0), *args)
    for row, prompt in enumerate(prompts):
        uniforms = torch.rand(len(prompts), 20, generator=torch.Generator().manual_seed(1))[row : row + 1]
        alone = RowDraws(uniforms, [(0.5, 1.0, 2.0)[row % 3]], 1.0, False, CPU)
        assert static_decode(policy, [prompt], alone, *args) == [batched[row]]
        assert decode(policy, [prompt], alone, *args) == [batched[row]]


def test_the_static_loops_draws_are_an_exact_sample_of_the_tempered_nucleus(make_config, monkeypatch, capsys):
    # The Sampler's default path, its rows in padded buckets as on CUDA: 6,000 rows of one prompt, each drawing its
    # first two tokens from its own seed on a tiny Llama whose logits are spread (x 24). The first tokens pass a
    # chi-square test against the float64 tempered nucleus and reject a temperature 10% off; the second tokens of the
    # rows whose first was the likeliest token pass against the nucleus after it.
    monkeypatch.setattr(static_decoding, "PADDED_DEVICES", {"cpu"})
    trainer = build_trainer(make_config("generation.max_new_tokens=2"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    policy.get_output_embeddings().register_forward_hook(lambda module, args, logits: logits * 24)
    eos = trainer.tokenizer.eos_token_id
    prompt = trainer.data.train_examples[0]["prompt"]
    n = 6000
    sampler.batch_size = 1
    for temperature, top_p in ((1.0, 1.0), (2.0, 0.9)):
        drawn = sampler.sample(policy, [prompt] * n, None, list(range(n)), temperature, top_p)
        with torch.no_grad():
            logits = policy(torch.tensor([prompt])).logits[0, -1]
        first = torch.tensor([c[0] for c in drawn])
        counts = torch.bincount(first, minlength=logits.shape[0])
        assert chi_square_p_value(counts, nucleus_probabilities(logits, temperature, top_p)) > 1e-4
        assert chi_square_p_value(counts, nucleus_probabilities(logits, 1.1 * temperature, top_p)) < 1e-6
        top = int(counts.argmax())
        assert top != eos
        with torch.no_grad():
            after = policy(torch.tensor([prompt + [top]])).logits[0, -1]
        second = torch.bincount(torch.tensor([c[1] for c in drawn if c[0] == top]), minlength=logits.shape[0])
        assert second.sum() > 500
        assert chi_square_p_value(second, nucleus_probabilities(after, temperature, top_p)) > 1e-4
    assert "sampling: static decode steps, eager (not on CUDA)" in capsys.readouterr().out


def test_a_decode_step_reads_nothing_on_the_host(likely_eos, monkeypatch):
    # What makes the step capturable as a CUDA graph: with the device's draw (the stable sort, as on CUDA), a decode
    # step (forward pass, mask, cache write, draw, log-probs, record) never reads a tensor's value on the host. Run on
    # the meta device, which holds no values, any such read raises, in Python or in torch's C++ (an index by a 0-d
    # tensor, a tensor's truth value).
    policy, eos, prompts = likely_eos
    device_draw = lambda probs, u, top_p: (seeded_draw.stable_sorted_draw(probs, u, top_p), probs.sum(-1))  # noqa: E731
    monkeypatch.setattr(seeded_draw, "probs_draw", device_draw)
    step, calls = static_decoding.decode_step, []
    monkeypatch.setattr(static_decoding, "decode_step", lambda *args: calls.append(args) or step(*args))
    static_decode(policy, prompts, seeded(len(prompts), 4, 1.0), 4, 256, eos, CPU)
    model, cache, argument, slots, draw, _ = calls[-1]
    model.to("meta")
    for layer in cache.layers:
        layer.key_buffer, layer.value_buffer = layer.key_buffer.to("meta"), layer.value_buffer.to("meta")
    for holder in (slots, draw):
        for name, value in vars(holder).items():
            if torch.is_tensor(value):
                setattr(holder, name, value.to("meta"))
    step(model, cache, argument, slots, draw, eos)
    assert slots.drawn.device.type == "meta" and len(calls) == 3


def test_grouped_decode_attention_is_the_float64_attention_of_each_rows_columns():
    # One query a row, 6 heads over 2 key/value heads: each group of 3 heads over its key/value head, read where the
    # mask says (a start and an end a row), is the float64 attention with the key/value heads repeated.
    generator = torch.Generator().manual_seed(0)
    rows, heads, groups, length, dim = 5, 6, 2, 40, 16
    query = torch.randn(rows, heads, 1, dim, generator=generator)
    key, value = torch.randn(2, rows, groups, length, dim, generator=generator)
    starts, ends = torch.tensor([0, 3, 20, 39, 10]), torch.tensor([40, 17, 40, 40, 11])
    columns = torch.arange(length)
    mask = ((columns >= starts[:, None]) & (columns < ends[:, None]))[:, None, None, :]
    got, _ = grouped_attention(None, query, key, value, mask, scaling=dim**-0.5)
    repeat = lambda x: x.double().repeat_interleave(heads // groups, dim=1)  # noqa: E731
    scores = (query.double() @ repeat(key).transpose(-1, -2)) * dim**-0.5
    expected = (scores.masked_fill(~mask, -torch.inf).softmax(-1) @ repeat(value)).transpose(1, 2)
    assert got.shape == (rows, 1, heads, dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-6)


def test_a_model_the_static_loop_cannot_serve_samples_by_the_own_loop_and_says_why(make_config, capsys):
    # A sliding window (its cache layers are not one full cache) keeps the own loop, one line saying why; so does
    # the Sampler with static_loop off (the bench's comparison), whose completions are the static loop's.
    sliding = transformers.AutoModelForCausalLM.from_config(tiny_lm_config("mistral", sliding_window=4))
    assert "other than full attention" in static_loop_problem(sliding)
    trainer = build_trainer(make_config("generation.max_new_tokens=8"))
    policy, sampler = trainer.policy, trainer.evaluator.sampler
    assert static_loop_problem(policy) is None
    prompts = [trainer.data.train_examples[i]["prompt"] for i in range(4)]
    drawn = sampler.sample(policy, prompts, None, [1, 2, 3, 4], [0.5, 1.0, 1.0, 2.0])
    sampler.static_loop = False
    assert sampler.sample(policy, prompts, None, [1, 2, 3, 4], [0.5, 1.0, 1.0, 2.0]) == drawn
    out = capsys.readouterr().out
    assert "sampling: static decode steps" in out
    assert "sampling: decode steps without a static cache: Sampler.static_loop is off" in out


@pytest.mark.cuda
def test_the_static_loop_on_cuda_replays_a_graph_per_bucket_and_draws_what_the_own_loop_draws(likely_eos):
    # On the GPU in float32 (no TF32): the step captured once per bucket and replayed, the draw on the device; every
    # completion the own loop's, and the log-probs summed while drawing.
    policy, eos, prompts = likely_eos
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        policy.cuda()
        cuda = torch.device("cuda")
        uniforms = torch.rand(len(prompts) * 3, 30, generator=torch.Generator().manual_seed(1))
        temperatures = [(0.5, 1.0, 2.0)[row % 3] for row in range(len(prompts) * 3)]
        own, static = (RowDraws(uniforms, temperatures, 1.0, True, cuda) for _ in range(2))
        captured = []
        capture = torch.cuda.CUDAGraph.capture_end
        torch.cuda.CUDAGraph.capture_end = lambda graph: captured.append(graph) or capture(graph)
        try:
            drawn = static_decode(policy, prompts * 3, static, 30, 256, eos, cuda)
        finally:
            torch.cuda.CUDAGraph.capture_end = capture
        assert drawn == decode(policy, prompts * 3, own, 30, 256, eos, cuda)
        assert len(captured) >= 2 and len(set(map(len, drawn))) >= 4 and len(prompts) * 3 not in BUCKETS
        torch.testing.assert_close(static.logps[:-1], own.logps[:-1], rtol=0, atol=1e-6)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True
        policy.cpu()
