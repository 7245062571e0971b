"""Every layout, attention path and head computes the padded layout's per-sequence log-probs and gradients (float32,
1e-5); the probes that decide them."""

import pytest
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from conftest import TINY_DIR, tiny_lm_config
from core.attention import FLEX_BLOCK, additive_mask, block_mask, language_model
from core.heads import sequence_logps
from core.layouts import FULL_ATTENTION, dense_mask, pack, pad, segment_lengths
from core.probes import block_attention_problem, packing_problem, scored_head_problem
from modeling.mask_dispatch import follow_masks
from pairs.formats import PreferencePair
from persistence.tokenized import Tokenization, tokenize_pairs

CPU = torch.device("cpu")


def tiny_model(architecture: str, attention: str, head_dim: int = 8) -> torch.nn.Module:
    """A 2-layer random model over the tiny byte tokenizer's 259 ids: Llama (rotary positions; heads of head_dim) or
    GPT-2 (learned absolute positions)."""
    if architecture == "llama":
        config = transformers.LlamaConfig(
            head_dim=head_dim,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=259,
            max_position_embeddings=256,
        )
    else:
        config = transformers.GPT2Config(
            n_embd=32,
            n_layer=2,
            n_head=4,
            vocab_size=259,
            n_positions=256,
            bos_token_id=0,
            eos_token_id=258,
            resid_pdrop=0,
            embd_pdrop=0,
            attn_pdrop=0,
        )
    config._attn_implementation = attention
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.fixture(scope="module")
def examples() -> list[dict]:
    """Tokenized pairs covering the edge cases: a prompt truncated at its start (keep_end) and at its end
    (keep_start), one-token responses (just EOS), responses of very different lengths, and an empty prompt."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    pairs = [
        PreferencePair("Q: 2 + 3?\nA:", " 5, glad to help.", " 8, go away.", " 5, glad to help.", "keep_start"),
        PreferencePair(
            "\n\nHuman: a long question " * 4 + "\n\nAssistant:", " yes", " no, not that, never", " yes", "keep_end"
        ),
        PreferencePair("A long explicit prompt that will not fit. " * 3, " fine", " bad", " fine", "keep_start"),
        PreferencePair("Say nothing.", "", "", "", "keep_start"),  # responses of one token: EOS
        PreferencePair("", " no prompt here", " none", " no prompt here", "keep_start"),
        PreferencePair("Why?", " because the sky is blue and the grass is green", " no", " x", "keep_start"),
    ]
    settings = Tokenization(max_length=64, max_prompt_length=24, sft=False)
    examples = tokenize_pairs(pairs, tokenizer, settings).take(range(len(pairs)))
    assert len(examples[1]["prompt"]) == len(examples[2]["prompt"]) == 24  # truncated
    assert [len(r) for r in examples[3]["responses"]] == [1, 1]
    return examples


def logps_and_gradients(
    model, batch, scored_head: bool, autocast=None, dtype=torch.float32, attention="dense", tail_weight=1.0
):
    model.zero_grad(set_to_none=True)
    logps = sequence_logps(model, batch, autocast, dtype, scored_head, attention, tail_weight)
    weights = torch.linspace(
        -1, 1, logps.numel(), device=logps.device
    )  # any weighting: every sequence's gradient counts separately
    (logps * weights).sum().backward()
    return logps.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


LAYOUTS = {
    "packed": lambda examples: pack(examples, 0),
    "packed, one row": lambda examples: pack(examples, 0, row_tokens=10_000),
    "packed, one segment per row": lambda examples: pack(examples, 0, row_tokens=1),
    "padded": lambda examples: pad(examples, 0),
}


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scored_head", [True, False])
@pytest.mark.parametrize("sft", [False, True])
def test_layouts_and_heads_equal_padded_full_logits(examples, architecture, attention, layout, scored_head, sft):
    if sft:
        examples = [{**ex, "responses": ex["responses"][:1]} for ex in examples]
    model = tiny_model(architecture, attention)
    expected, expected_grads = logps_and_gradients(model, pad(examples, 0), scored_head=False)
    batch = LAYOUTS[layout](examples)
    logps, grads = logps_and_gradients(model, batch, scored_head)
    assert logps.shape == (len(examples) * (1 if sft else 2),)
    # Sums of up to 64 token log-probs reach ~270, where one float32 ulp is 3e-5: rtol 1e-6 allows the few ulps that
    # another summation order (a packed row's, a CPU's other kernels) can change, and nothing more.
    torch.testing.assert_close(logps, expected, rtol=1e-6, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    if layout == "packed":
        assert batch.n_tokens < pad(examples, 0).n_tokens  # each prompt once, less padding


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scored_head", [True, False])
def test_length_desensitized_sums_weigh_the_tail_beyond_the_shorter_response(examples, layout, scored_head):
    # LD-DPO: in each pair the tokens within the shorter response count fully and the longer one's rest alpha
    # times; written out token by token from the padded layout's full float32 log-softmax.
    alpha, n_examples = 0.3, len(examples)
    model = tiny_model("llama", "sdpa")
    padded = pad(examples, 0)
    with torch.no_grad():
        logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits.flatten(0, 1)
    token_logps = torch.log_softmax(logits.float(), -1)[padded.score_positions, padded.score_targets].tolist()
    lengths, expected, start = padded.sequence_lengths.tolist(), [], 0
    for sequence, length in enumerate(lengths):
        shared = min(lengths[sequence % n_examples], lengths[sequence % n_examples + n_examples])
        values, start = token_logps[start : start + length], start + length
        expected.append(sum(values[:shared]) + alpha * sum(values[shared:]))
    assert sum(length != min(lengths[i % n_examples :: n_examples]) for i, length in enumerate(lengths)) >= 3
    logps, grads = logps_and_gradients(model, LAYOUTS[layout](examples), scored_head, tail_weight=alpha)
    torch.testing.assert_close(logps, torch.tensor(expected), rtol=0, atol=1e-5)
    _, padded_grads = logps_and_gradients(model, padded, scored_head=False, tail_weight=alpha)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scored_head", [True, False])
def test_sums_of_log_sum_squared_probs_equal_the_padded_full_logits(examples, layout, scored_head):
    # WPO reads, per sequence, the sum over its scored tokens of log sum_v p_v^2; every layout and head gives the
    # padded layout's, from its full float32 softmax, with the log-probs and their gradients unchanged.
    model = tiny_model("gpt2", "sdpa")
    padded = pad(examples, 0)
    with torch.no_grad():
        logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits.flatten(0, 1)
    per_token = torch.logsumexp(2 * torch.log_softmax(logits.float(), -1), dim=-1)[padded.score_positions]
    expected = torch.segment_reduce(per_token, "sum", lengths=padded.sequence_lengths, unsafe=True, initial=0)
    batch = LAYOUTS[layout](examples)
    plain, plain_grads = logps_and_gradients(model, batch, scored_head)
    model.zero_grad(set_to_none=True)
    logps, log_sum_sq = sequence_logps(model, batch, None, torch.float32, scored_head, with_sum_sq=True)
    (logps * torch.linspace(-1, 1, logps.numel())).sum().backward()
    torch.testing.assert_close(log_sum_sq, expected, rtol=1e-6, atol=1e-5)
    assert not log_sum_sq.requires_grad and (expected < -1).all()  # far from one-hot: a real sum of many tokens
    torch.testing.assert_close(logps.detach(), plain, rtol=0, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, plain_grads[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("scored_head", [True, False])
def test_log_probs_at_a_temperature_per_sequence_equal_each_sequence_alone(examples, layout, scored_head):
    # The sampled KL's log-probs (generation/prompt_groups.py): each sequence's response tokens under
    # softmax(logits / T), T its own temperature, from one forward of the whole batch, equal a plain forward of that
    # sequence alone, its logits divided by its T (sequences are numbered response-major: all first responses, then
    # all second).
    model = tiny_model("llama", "sdpa")
    n = len(examples)
    temperatures = torch.tensor([0.25, 0.5, 1.0, 2.0, 0.7, 1.5, 1.5, 0.7, 2.0, 1.0, 0.5, 0.25])[: 2 * n]
    with torch.no_grad():
        logps = sequence_logps(
            model, LAYOUTS[layout](examples), None, torch.float32, scored_head, temperature=temperatures
        )
        expected = []
        for sequence, temperature in enumerate(temperatures.tolist()):
            response, example = divmod(sequence, n)
            prompt, tokens = examples[example]["prompt"], examples[example]["responses"][response]
            ids = torch.tensor([prompt + tokens])
            first = max(len(prompt), 1)  # with no prompt, nothing predicts the first token: not scored
            logits = model(input_ids=ids).logits[0, first - 1 : -1].double() / temperature
            expected.append(torch.log_softmax(logits, -1).gather(1, ids[0, first:, None]).sum().item())
    torch.testing.assert_close(logps.double(), torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-4)
    at_one = sequence_logps(model, LAYOUTS[layout](examples), None, torch.float32, scored_head)
    assert (logps - at_one).abs().max() > 1  # the temperatures change the log-probs: the test can tell


def test_probes_accept_models_that_take_both():
    for architecture in ("llama", "gpt2"):
        for attention in ("sdpa", "eager"):
            model = tiny_model(architecture, attention)
            assert packing_problem(model, torch.float32, CPU) is None
            assert scored_head_problem(model, torch.float32, CPU) is None


@pytest.mark.xdist_group("flex")  # on one worker: each worker would compile FlexAttention's kernels anew (~20 s)
@pytest.mark.parametrize("scored_head", [True, False])
@pytest.mark.parametrize("sft", [False, True])
def test_flex_attention_forward_equals_dense_and_padded_on_cpu(examples, scored_head, sft):
    # FlexAttention runs forward only on a CPU (no backward in torch 2.13): the no-grad log-probs of the whole
    # micro-batch in one block-mask row equal the dense-mask and padded ones. GPT-2 declares no FlexAttention
    # support (its probe says so), so the tiny Llama is the test architecture here.
    if sft:
        examples = [{**ex, "responses": ex["responses"][:1]} for ex in examples]
    model = tiny_model("llama", "sdpa")
    one_row = pack(examples, 0, row_tokens=sum(segment_lengths(examples)), multiple=FLEX_BLOCK)
    assert one_row.input_ids.shape[0] == 1 and one_row.input_ids.shape[1] % FLEX_BLOCK == 0
    with torch.no_grad():
        padded = sequence_logps(model, pad(examples, 0), None, torch.float32, scored_head=False)
        dense = sequence_logps(model, pack(examples, 0), None, torch.float32, scored_head)
        block = sequence_logps(model, one_row, None, torch.float32, scored_head, attention="block")
    # 1e-5, and a few float32 ulps of sums of order 100 (the spacing at 256 is 3e-5: AVX2 kernels round the flex
    # kernel's sums a step or two apart where AVX512 ones happened to agree); a masking error is of order 1.
    torch.testing.assert_close(block, padded, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(block, dense, rtol=1e-6, atol=1e-5)
    # The model's attention now follows its mask for good: activation checkpointing recomputes a block's forward in
    # the backward pass, outside the scorer's forward, with the same BlockMask (on the GPU, with FlexAttention
    # switched on for the scorer's forward only, that recomputation reached sdpa and failed). Given the BlockMask with
    # no context at all, the model takes FlexAttention; given a tensor mask, its own sdpa, as before.
    assert model.config._attn_implementation == "block_masks_or_sdpa"
    inputs = dict(input_ids=one_row.input_ids, position_ids=one_row.position_ids)
    with torch.no_grad():
        recomputed = model(**inputs, attention_mask=block_mask(one_row)).logits
        with sdpa_kernel(SDPBackend.MATH):
            plain = model(**inputs, attention_mask=additive_mask(dense_mask(one_row), torch.float32)).logits
    real = one_row.segment_ids[0] >= 0  # the tail's padding sees nothing but itself, however the kernels treat it
    torch.testing.assert_close(recomputed[:, real], plain[:, real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llava", "gemma3", "paligemma"])
def test_following_block_masks_changes_the_language_model_alone(family):
    # A vision tower keeps its attention (FlexAttention's GPU kernels take no head under 16 dimensions: the tiny
    # towers' 8 failed on the H200), and PaliGemma's Gemma 2 keeps eager, which its attention soft cap needs (setting
    # the composite config passes one name to every sub-config: sdpa there refused the soft cap).
    from conftest import tiny_vlm

    model, _ = tiny_vlm(family)
    before = {
        name: module.config._attn_implementation for name, module in model.named_modules() if name.endswith("attn")
    }
    follow_masks(language_model(model))
    for name, module in model.named_modules():
        if name.endswith("attn"):
            expected = f"block_masks_or_{before[name]}" if ".language_model." in f".{name}" else before[name]
            assert module.config._attn_implementation == expected, name
    assert {before[name] for name in before if "language_model" in name} == {
        "eager" if family == "paligemma" else "sdpa"
    }


def test_block_attention_probe_needs_cuda_and_declared_support():
    assert block_attention_problem(tiny_model("llama", "sdpa"), torch.float32, CPU) == (
        "FlexAttention has no backward pass on CPU"
    )
    assert block_attention_problem(tiny_model("gpt2", "sdpa"), torch.float32, CPU) == (
        "GPT2LMHeadModel does not declare FlexAttention support"
    )


def test_packing_probe_rejects_what_cannot_take_a_custom_mask(monkeypatch):

    model = tiny_model("llama", "sdpa")
    model.config._attn_implementation = "flash_attention_2"
    assert "attention implementation 'flash_attention_2' takes no 4-D mask" in packing_problem(
        model, torch.float32, CPU
    )
    model = tiny_model("llama", "sdpa")
    original = model.forward
    model.forward = lambda input_ids, attention_mask=None, position_ids=None, **kwargs: original(input_ids, **kwargs)
    assert "does not honour a custom 4-D mask and position ids" in packing_problem(model, torch.float32, CPU)
    model = tiny_model("llama", "sdpa")
    model.config.layer_types = ["linear_attention", "full_attention"]  # a recurrent layer type (Qwen3-Next)
    assert packing_problem(model, torch.float32, CPU) == (
        "LlamaForCausalLM has linear_attention layers, which take no packed mask"
    )


def test_the_probes_compute_in_exact_float32_while_training_uses_tf32():
    # train.py turns TF32 on; on a GPU it rounds float32 matmul inputs to 10 mantissa bits, and a 1B model's packed
    # and padded log-probs then differ by more than float32's allowance (seen on an H200: every packed run fell back
    # to padded rows). Every probe forward runs with TF32 off, and the setting is restored after it.
    model = tiny_model("llama", "sdpa")
    seen = []
    flags = lambda *_: seen.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32))  # noqa: E731
    model.register_forward_pre_hook(flags)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        assert packing_problem(model, torch.float32, CPU) is None
        assert scored_head_problem(model, torch.float32, CPU) is None
        assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (True, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
    assert len(seen) == 4 and set(seen) == {(False, False)}


def windowed_mistral(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_lm_config("mistral", sliding_window=window))


def test_packing_probe_checks_windows_shorter_than_its_examples(monkeypatch):
    # A 4096-token window is cut to 2 for the probe, against 6-token examples: packed rows without the window
    # compute other log-probs than transformers' own windowed mask of the padded rows, and the probe says so.
    from core import probes

    model = windowed_mistral(4096)
    assert packing_problem(model, torch.float32, CPU) is None
    assert model.config.sliding_window == 4096  # restored
    monkeypatch.setattr(probes, "attention_spans", lambda model: {"full_attention": FULL_ATTENTION})
    assert "MistralForCausalLM does not honour a custom 4-D mask" in packing_problem(model, torch.float32, CPU)


@pytest.mark.parametrize("scored_head", [True, False])
def test_windowed_packed_rows_equal_padded(examples, scored_head):
    # Mistral with a window of 4: the packed rows' windowed mask gives the padded layout's log-probs and gradients.
    from core import attention as scoring

    model = windowed_mistral(4)
    expected, expected_grads = logps_and_gradients(model, pad(examples, 0), scored_head=False)
    model.zero_grad(set_to_none=True)
    logps = sequence_logps(
        model, pack(examples, 0), None, torch.float32, scored_head, spans=scoring.attention_spans(model)
    )
    (logps * torch.linspace(-1, 1, logps.numel())).sum().backward()
    torch.testing.assert_close(logps.detach(), expected, rtol=1e-6, atol=1e-5)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    unwindowed = sequence_logps(model, pack(examples, 0), None, torch.float32, scored_head)
    assert (unwindowed - expected).abs().max() > 1e-2  # the window matters for these examples


def test_scored_head_probe_accepts_the_maps_it_applies_and_rejects_other_changes():
    # Gemma 2 soft-caps its logits after the head, Cohere scales them: the fused head applies both itself. A scale
    # it does not know (a tensor, where Cohere keeps a number) changes the head's output: all logits, as before.
    model = transformers.AutoModelForCausalLM.from_config(tiny_lm_config("gemma2", final_logit_softcapping=0.5))
    assert scored_head_problem(model, torch.float32, CPU) is None
    assert model.config.final_logit_softcapping == 0.5  # restored after the forward
    model = transformers.AutoModelForCausalLM.from_config(tiny_lm_config("cohere", logit_scale=4.0))
    assert scored_head_problem(model, torch.float32, CPU) is None
    model.logit_scale = torch.tensor(4.0)
    assert "CohereForCausalLM changes its head's output" in scored_head_problem(model, torch.float32, CPU)
    model = tiny_model("llama", "sdpa")
    original = model.forward
    model.forward = lambda input_ids, attention_mask=None, position_ids=None, use_cache=None: original(
        input_ids, attention_mask=attention_mask
    )
    assert scored_head_problem(model, torch.float32, CPU) == "LlamaForCausalLM.forward takes no logits_to_keep"


@pytest.mark.cuda
@pytest.mark.parametrize("architecture", ["llama", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", ["dense", "block"])
def test_layouts_and_heads_equal_padded_on_cuda(examples, architecture, dtype, attention):
    # Forward and backward on the GPU, the batch built on the host and sent asynchronously: float32 without TF32 to
    # 1e-5; bfloat16 autocast within bf16 rounding of the padded run on the GPU.
    if attention == "block" and architecture == "gpt2":
        pytest.skip("GPT-2 declares no FlexAttention support")
    cuda = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        model = tiny_model(architecture, "sdpa", head_dim=16).to(cuda)  # FlexAttention's GPU kernels: 16 at least
        autocast = dtype if dtype == torch.bfloat16 else None
        expected, expected_grads = logps_and_gradients(model, pad(examples, 0).to(cuda), False, autocast, dtype)
        budget = sum(segment_lengths(examples)) if attention == "block" else None
        packed = pack(examples, 0, row_tokens=budget, multiple=FLEX_BLOCK if attention == "block" else 1)
        for batch in (packed, pad(examples, 0)):
            for scored_head in (True, False):
                options = dict(attention=attention, autocast=autocast, dtype=dtype)
                logps, grads = logps_and_gradients(model, batch.to(cuda), scored_head, **options)
                close = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=0.1)
                torch.testing.assert_close(logps, expected, **close)
                grad_close = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.1, atol=0.05)
                for name, grad in expected_grads.items():
                    torch.testing.assert_close(grads[name], grad, **grad_close, msg=name)
        if attention == "block":
            assert block_attention_problem(model, dtype, cuda) is None
    finally:
        torch.backends.cuda.matmul.allow_tf32 = True


def test_a_packed_batch_builds_its_mask_once_for_policy_and_live_reference(make_config, monkeypatch):
    from conftest import build_trainer
    from core import attention as scoring

    trainer = build_trainer(make_config("reference_cache=false", "gradient_accumulation_steps=2"))
    built = []
    monkeypatch.setattr(scoring, "dense_mask", lambda batch, span: built.append(batch) or dense_mask(batch, span))
    trainer.train_step([trainer.data.train_examples[i] for i in trainer.data.schedule[0]])
    assert len(built) == 2  # one per micro-batch, though the policy and the live reference both score each
