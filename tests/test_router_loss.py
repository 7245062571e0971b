"""The MoE router load-balancing loss (core/router_loss.py): transformers' own loss on the padded batch, the same in
the packed layout, split over micro-batches and ranks without changing, and in whole runs."""

import pytest
import torch
import transformers

from conftest import assert_same_metrics, read_jsonl, records, save_tiny_lm, tiny_lm_config
from core.heads import sequence_logps
from core.layouts import pack, pad
from core.router_loss import find_routers, token_weights
from utils import UserError

# model_type: the config overrides of a tiny MoE (4 experts, 2 chosen per token).
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def tiny_moe(model_type: str) -> torch.nn.Module:
    """Random weights, routers sharpened (x 100) so that they route unevenly, as trained ones do, rather than close
    to uniformly."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_lm_config(model_type, **MOE[model_type])).float()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".gate." in name or name.endswith(".gate.weight"):
                parameter.mul_(100)
    return model


def examples(n: int, seed: int = 0) -> list[dict]:
    """n pairs of random token ids: prompts of 2-9 tokens, responses of 1-8."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda low, high: torch.randint(3, 300, (int(torch.randint(low, high, (1,), generator=g)),), generator=g)  # noqa: E731
    return [{"prompt": ids(2, 10).tolist(), "responses": [ids(1, 9).tolist(), ids(1, 9).tolist()]} for _ in range(n)]


def router_loss(model, routers, batch, items, batch_counts=None):
    """(this batch's part of the loss against batch_counts (None: its own), its counts): through the scoring path."""
    with routers.recorded(routers.modules(model)) as logits:
        sequence_logps(model, batch, None, torch.float32, scored_head=True)
    sums = routers.sums(logits, token_weights(batch, items, len(items)))
    return routers.loss(sums, batch_counts or sums.counts), sums.counts


def assert_same_gradients(actual: dict, expected: dict) -> None:
    """Equal to float32 rounding: within 1e-5 of each tensor's largest entry."""
    assert actual.keys() == expected.keys() and any("gate" in name for name in expected)
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=0, atol=1e-5 * grad.abs().max().item(), msg=name)


def router_gradients(model) -> dict[str, torch.Tensor]:
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("model_type", MOE)
def test_the_router_loss_is_transformers_on_the_padded_batch_and_the_same_packed(model_type):
    # transformers' MoE causal LMs compute load_balancing_loss_func over the padded rows' real tokens (the prompt
    # once per response): ours is that number, and the packed layout, which computes each prompt once, counts its
    # tokens once per response and gives the same loss and the same gradient.
    model, items = tiny_moe(model_type), examples(5)
    routers = find_routers(model, None)
    assert (routers.n_experts, routers.top_k, routers.coefficient) == (4, 2, model.config.router_aux_loss_coef)
    padded = pad(items, 0)
    with torch.no_grad():
        out = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask, output_router_logits=True)
    loss, _ = router_loss(model, routers, padded, items)
    torch.testing.assert_close(loss.detach(), out.aux_loss.float(), rtol=1e-6, atol=0)
    assert 2.01 < loss.item() < 8.0  # k = 2 when perfectly balanced, E k = 8 at worst: an unbalanced batch
    loss.backward()
    padded_grads = router_gradients(model)
    packed_loss, _ = router_loss(model, routers, pack(items, 0, row_tokens=60), items)
    torch.testing.assert_close(packed_loss, loss.detach(), rtol=1e-6, atol=0)
    packed_loss.backward()
    assert_same_gradients(router_gradients(model), padded_grads)


def test_micro_batches_against_the_whole_batch_counts_add_up_to_the_batch_loss():
    # f is the whole batch's (counts of both halves); each half adds E sum_e f_e S_e / T: the parts sum to the loss
    # of the batch in one forward, and so do their gradients. Each half's own f would not (the check at the end).
    model, items = tiny_moe("mixtral"), examples(6, seed=1)
    routers = find_routers(model, 0.01)
    whole, counts = router_loss(model, routers, pack(items, 0), items)
    whole.backward()
    whole_grads = router_gradients(model)
    halves = [items[:3], items[3:]]
    parts_counts = [router_loss(model, routers, pack(half, 0), half)[1] for half in halves]
    assert torch.equal(sum(parts_counts[1:], parts_counts[0]).choices, counts.choices)
    total = 0.0
    for half in halves:
        part, _ = router_loss(model, routers, pack(half, 0), half, counts)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-6, atol=0)
    assert_same_gradients(router_gradients(model), whole_grads)
    own = sum(router_loss(model, routers, pack(half, 0), half)[0].detach() for half in halves) / 2
    assert abs(own - whole.detach()) > 1e-3


def test_token_weights_count_prompts_once_per_response_and_padding_copies_not_at_all():
    items = [{"prompt": [5, 6], "responses": [[7], [8, 9]]}, {"prompt": [10], "responses": [[11, 12], [13]]}]
    packed = pack(items, 0, row_tokens=16)
    # row: [5 6 | 7 | 8 9][10 | 11 12 | 13] then padding to the row's length (9 tokens: no padding here)
    assert token_weights(packed, items, 2).tolist() == [2, 2, 1, 1, 1, 2, 1, 1, 1]
    assert token_weights(packed, items, 1).tolist() == [2, 2, 1, 1, 1, 0, 0, 0, 0]  # example 1 a padding copy
    padded = pad(items, 0)  # rows: ex0 chosen, ex1 chosen, ex0 rejected, ex1 rejected; 4 tokens each
    assert token_weights(padded, items, 2).view(4, 4).tolist() == [[1, 1, 1, 0], [1, 1, 1, 0], [1] * 4, [1, 1, 0, 0]]
    assert token_weights(padded, items, 1).view(4, 4).sum(1).tolist() == [3, 0, 4, 0]


def test_a_router_loss_for_a_dense_model_is_one_line():
    dense = transformers.AutoModelForCausalLM.from_config(tiny_lm_config("llama"))
    assert find_routers(dense, None) is None and find_routers(tiny_moe("mixtral"), 0.0) is None
    with pytest.raises(UserError, match=r"loss.router_aux_loss_coef=0.01: LlamaForCausalLM has no router logits"):
        find_routers(dense, 0.01)


@pytest.fixture
def moe_dir(tmp_path):
    """A tiny Mixtral whose config asks for a router loss of 0.05, for whole runs."""
    return save_tiny_lm(tmp_path / "mixtral", "mixtral", router_aux_loss_coef=0.05, **MOE["mixtral"])


def moe_run(make_config, model_dir, name: str, *overrides: str):
    import train

    model = ("model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null", "n_examples=16")
    config = make_config(*model, f"local_run_dir={model_dir.parent / name}", *overrides)
    train.run(config)
    return read_jsonl(model_dir.parent / name / "metrics.jsonl")


def test_runs_with_the_router_loss_equal_for_any_accumulation_and_layout(make_config, moe_dir, capfd):
    # The model config's coefficient (0.05) by default; accumulation 2 (f from the no-grad pass before the step)
    # and the padded layout give the packed full batch's every logged number, aux_loss included; 0 turns it off.
    full = moe_run(make_config, moe_dir, "full")
    assert "router loss: 0.05 x the load-balancing loss of 4 experts, top 2 (aux_loss)" in capfd.readouterr().out
    steps = [r for r in full if "aux_loss/train" in r]
    assert len(steps) == 2 and all(2.0 < r["aux_loss/train"] < 8.0 for r in steps)
    assert all("aux_loss/eval" in r for r in records(moe_dir.parent / "full", "eval"))
    assert_same_metrics(full, moe_run(make_config, moe_dir, "accumulated", "gradient_accumulation_steps=2"))
    assert_same_metrics(full, moe_run(make_config, moe_dir, "padded", "layout=padded"))
    off = moe_run(make_config, moe_dir, "off", "loss.router_aux_loss_coef=0")
    assert not any("aux_loss/train" in r for r in off)
    last = lambda run: records(moe_dir.parent / run, "train")[-1]["loss/train"]  # noqa: E731
    assert last("off") != pytest.approx(last("full"), rel=1e-4)  # the router loss moved the weights
