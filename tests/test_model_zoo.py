"""The model zoo: for causal-LM architectures of the installed transformers (tiny configs, random weights, float32),
the path the default configuration takes (layout and attention, head, tensor-parallel plan) and its per-sequence
log-probs and gradients against a plain forward of each sequence alone, unpadded.

Windows, chunks, soft caps and logit scales are set small, so that getting one wrong changes the numbers: a window
of 4 tokens and chunks of 4 against segments of up to 32, a cap of 0.5 against logits of about that size."""

import pytest
import torch
import transformers

from conftest import TINY_LM_SIZES, tiny_lm_config
from core.scoring import Scorer, ScoringSettings
from modeling.distributed import Topology
from modeling.placement import TENSOR_PARALLEL_STYLES, tensor_parallel_plan
from utils import UserError

VOCAB = TINY_LM_SIZES["vocab_size"]
WINDOW = 4
MIXED = ["sliding_attention", "full_attention"]
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# model_type: (config overrides, the path expected: the scorer's description, and tensor_parallel).
ZOO = {
    "llama": ({}, "packed layout (dense attention), scored logits", "yes"),
    "mistral": (
        dict(sliding_window=WINDOW),
        "packed layout (dense attention; window 4), scored logits",
        "yes",
    ),
    "mixtral": (
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2),
        "packed layout (dense attention; window 4), scored logits",
        "no: moe_tp_experts, packed_colwise",
    ),
    "qwen2": (
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "yes",
    ),
    "qwen3": (
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "no: replicated_with_grad_allreduce",
    ),
    "qwen2_moe": (
        dict(EXPERTS, shared_expert_intermediate_size=32),
        "packed layout (dense attention), scored logits",
        "no: moe_tp_experts, packed_colwise",
    ),
    "qwen3_moe": (
        EXPERTS,
        "packed layout (dense attention), scored logits",
        "no: moe_tp_experts, packed_colwise, replicated_with_grad_allreduce",
    ),
    "gemma": ({}, "packed layout (dense attention), scored logits", "yes"),
    "gemma2": (
        dict(sliding_window=WINDOW, final_logit_softcapping=0.5),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), "
        "scored logits soft-capped at 0.5",
        "yes",
    ),
    "gemma3_text": (
        dict(sliding_window=WINDOW, layer_types=MIXED, final_logit_softcapping=0.5),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), "
        "scored logits soft-capped at 0.5",
        "no: replicated_with_grad_allreduce",
    ),
    "gpt_oss": (
        dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "no: embedding_rowwise",
    ),
    "cohere": (dict(logit_scale=4.0), "packed layout (dense attention), scored logits times 4", "yes"),
    "cohere2": (
        dict(sliding_window=WINDOW, layer_types=MIXED, logit_scale=4.0),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits times 4",
        "yes",
    ),
    "granite": (dict(logits_scaling=0.25), "packed layout (dense attention), scored logits times 4", "yes"),
    "granitemoe": (
        dict(logits_scaling=0.25, num_local_experts=4, num_experts_per_tok=2),
        "packed layout (dense attention), scored logits times 4",
        "no: moe_tp_experts, packed_colwise",
    ),
    "phi3": (
        dict(sliding_window=WINDOW),
        "packed layout (dense attention; window 4), scored logits",
        "no: colwise_gather_output, rowwise_split_input",
    ),
    "starcoder2": (
        dict(sliding_window=WINDOW),
        "packed layout (dense attention; window 4), scored logits",
        "yes",
    ),
    "ministral": (
        dict(sliding_window=WINDOW, layer_types=MIXED),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "yes",
    ),
    "olmo3": (
        dict(sliding_window=WINDOW, layer_types=MIXED),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "no: colwise_gather_output, rowwise_split_input",
    ),
    "exaone4": (
        dict(sliding_window=WINDOW, layer_types=MIXED),
        "packed layout (dense attention; full_attention full, sliding_attention window 4), scored logits",
        "no: replicated_with_grad_allreduce",
    ),
    "llama4_text": (
        dict(
            attention_chunk_size=WINDOW,
            layer_types=["chunked_attention", "full_attention"],
            no_rope_layers=[1, 0],  # Llama 4's pattern: chunked layers rotate, full ones take no positions
            num_local_experts=2,
            intermediate_size_mlp=96,
        ),
        "packed layout (dense attention; chunked_attention chunks of 4, full_attention full), scored logits",
        "no: moe_tp_experts, packed_rowwise",
    ),
    "olmo": ({}, "packed layout (dense attention), scored logits", "yes"),
    "olmo2": ({}, "packed layout (dense attention), scored logits", "no: colwise_gather_output, rowwise_split_input"),
    "smollm3": ({}, "packed layout (dense attention), scored logits", "yes"),
    "glm": ({}, "packed layout (dense attention), scored logits", "no: colwise_gather_output, rowwise_split_input"),
    "glm4": ({}, "packed layout (dense attention), scored logits", "no: colwise_gather_output, rowwise_split_input"),
    "phi": ({}, "packed layout (dense attention), scored logits", "yes"),
    "stablelm": ({}, "packed layout (dense attention), scored logits", "no plan"),
    "gpt_neox": ({}, "packed layout (dense attention), scored logits", "no: embedding_rowwise"),
    "gpt2": ({}, "packed layout (dense attention), scored logits", "no plan"),
    "falcon": (dict(head_dim=None), "packed layout (dense attention), scored logits", "no plan"),
    "opt": ({}, "packed layout (dense attention), scored logits", "no plan"),
    "gptj": (dict(rotary_dim=8), "packed layout (dense attention), scored logits", "no: embedding_rowwise"),
    "bloom": ({}, "padded layout, scored logits", "no plan"),  # ALiBi, from a 2-D padding mask
    "mpt": ({}, "padded layout, scored logits", "no plan"),  # likewise
}


def zoo_examples() -> list[dict]:
    """Pairs whose segments (prompt + both responses) span 9 to 32 tokens: longer than the window and the chunks,
    one-token responses and a one-token prompt included."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(9, 7, 3), (1, 12, 1), (14, 2, 9), (6, 5, 5), (3, 1, 6)]

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=generator).tolist()

    return [{"prompt": ids(p), "responses": [ids(a), ids(b)]} for p, a, b in shapes]


def plain_logps(model, examples: list[dict]) -> torch.Tensor:
    """[2B] summed log-probs of each response, all chosen then all rejected: one forward per sequence, alone,
    unpadded, with the model's own logits."""
    logps = []
    for r in range(2):
        for example in examples:
            prompt, response = example["prompt"], example["responses"][r]
            logits = model(torch.tensor([prompt + response])).logits[0].float()
            token_logps = logits[len(prompt) - 1 : -1].log_softmax(-1)
            logps.append(token_logps.gather(-1, torch.tensor(response)[:, None]).sum())
    return torch.stack(logps)


def with_gradients(logps: torch.Tensor, model) -> dict[str, torch.Tensor]:
    """Gradients of a weighting of the sequences (each counts separately) for every parameter."""
    model.zero_grad(set_to_none=True)
    (logps * torch.linspace(-1, 1, logps.numel())).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def tensor_parallel(model) -> str:
    """Whether TensorParallelTrainer takes the model: "yes", "no plan", or "no: " and the styles of its plan that
    it does not implement."""
    try:
        tensor_parallel_plan(model, 1, 1, "TensorParallelTrainer")
    except UserError:
        plan = getattr(model.config, "base_model_tp_plan", None)
        return "no: " + ", ".join(sorted(set(plan.values()) - set(TENSOR_PARALLEL_STYLES))) if plan else "no plan"
    return "yes"


@pytest.mark.parametrize("model_type", list(ZOO))
def test_default_path_equals_a_plain_forward_of_each_sequence(model_type, capsys):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_lm_config(model_type, **ZOO[model_type][0])
    ).eval()  # eval: no dropout
    scorer = Scorer.create(model, ScoringSettings(), 0, Topology.create("BasicTrainer"), autocast=False, compute=None)
    _, path, tp = ZOO[model_type]
    assert (scorer.describe(), tensor_parallel(model)) == (path, tp), capsys.readouterr().out

    examples = zoo_examples()
    expected = plain_logps(model, examples)
    expected_grads = with_gradients(expected, model)
    logps = scorer(model, scorer.batch(examples), None)
    grads = with_gradients(logps, model)
    # Sums of up to 30 token log-probs reach ~100, where one float32 ulp is 8e-6: rtol 1e-6 allows the ulps another
    # summation order changes, and nothing more.
    torch.testing.assert_close(logps, expected.detach(), rtol=1e-6, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    # A gradient that vanishes by symmetry (a key projection's bias: softmax ignores a constant added to every
    # score) is rounding noise, so each is relative to its norm or 1e-5 of the largest, whichever is larger.
    floor = 1e-5 * max(grad.norm() for grad in expected_grads.values())
    for name, grad in expected_grads.items():
        error = (grads[name] - grad).norm() / grad.norm().clamp_min(floor)
        assert error < 1e-4, f"{name}: relative gradient error {error:.2g}"
