"""Reward modelling (loss=reward): the Bradley-Terry loss written out, rewards read at each response's last token in
every layout with the padded layout's values and gradients, whole runs (GA == full batch, resumed == uninterrupted,
the margin column), and the export that rounds.reward takes scoring as the trained model did."""

import json
import math

import pytest
import torch
import transformers

from conftest import (
    TINY_DIR,
    arithmetic_pairs,
    assert_resume_matches_uninterrupted,
    build_trainer,
    records,
    write_jsonl,
)
from core.heads import reward_positions, sequence_rewards
from core.layouts import pack, pad
from core.losses import bradley_terry
from core.objective import RewardObjective
from judging.rewards import ModelReward
from modeling.reward_head import init_reward_head, reward_head
from pairs.formats import PreferencePair
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import get_dataset
from utils import UserError, metric_mean

EOS = transformers.AutoTokenizer.from_pretrained(TINY_DIR).eos_token_id


def test_the_loss_is_bradley_terry_with_the_margin_and_the_centring_term():
    chosen = torch.tensor([1.5, -0.25], requires_grad=True)
    rejected = torch.tensor([-0.5, 0.75], requires_grad=True)
    margin, center = torch.tensor([1.0, 0.0]), 0.1
    losses = bradley_terry(chosen, rejected, margin, center)
    # -log sigma(x) = log(1 + e^-x), with x = r_c - r_r - m: 1 and -1; centring 0.1 (r_c + r_r)^2: 0.1 and 0.025
    expected = [math.log1p(math.exp(-1.0)) + 0.1, math.log1p(math.exp(1.0)) + 0.025]
    assert losses.tolist() == pytest.approx(expected, abs=1e-6)
    losses.sum().backward()
    # d/dr_c = -sigma(-x) + 2 center (r_c + r_r), d/dr_r = sigma(-x) + 2 center (r_c + r_r)
    sigma = [1 / (1 + math.exp(1.0)), 1 / (1 + math.exp(-1.0))]
    assert chosen.grad.tolist() == pytest.approx([-sigma[0] + 0.2, -sigma[1] + 0.1], abs=1e-6)
    assert rejected.grad.tolist() == pytest.approx([sigma[0] + 0.2, sigma[1] + 0.1], abs=1e-6)


def test_the_objective_logs_accuracy_margins_and_the_spread_of_rewards():
    objective = RewardObjective(type("Loss", (), {"center_rewards_coefficient": 0.0})())
    rewards = torch.tensor([2.0, 0.0, 1.0, 1.0, 3.0, -1.0])  # chosen 2, 0, 1; rejected 1, 3, -1
    loss, metrics = objective(rewards, None, None, "eval")
    assert loss.item() == pytest.approx(sum(math.log1p(math.exp(-d)) for d in (1.0, -3.0, 2.0)) / 3)
    assert metrics["rewards_eval/accuracies"].tolist() == [1.0, 0.0, 1.0]
    assert metrics["rewards_eval/margins"].tolist() == [1.0, -3.0, 2.0]
    assert metrics["rewards_eval/mean"].tolist() == [1.5, 1.5, 0.0]
    spread = metric_mean("rewards_eval/chosen_std", metrics["rewards_eval/chosen_std"].tolist())
    assert spread == pytest.approx(math.sqrt(2 / 3))  # chosen 2, 0, 1 about their mean 1
    assert metric_mean("rewards_eval/chosen", metrics["rewards_eval/chosen"].tolist()) == 1.0


@pytest.fixture(scope="module")
def examples() -> list[dict]:
    """Pairs of varied lengths, ending with the EOS each response gets; one whose responses are the EOS alone, one
    with no prompt, one truncated at the end of its longer response (its EOS cut off)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    pairs = [
        PreferencePair("Q: 2 + 3?\nA:", " 5, glad to help.", " 8, go away.", "", "keep_start"),
        PreferencePair("Say nothing.", "", "", "", "keep_start"),
        PreferencePair("", " no prompt here", " none", "", "keep_start"),
        PreferencePair("Why?", " because the sky is blue and the grass is green" * 3, " no", "", "keep_start"),
    ]
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(64, 24, sft=False)).take(range(len(pairs)))
    assert examples[3]["responses"][0][-1] != EOS and examples[1]["responses"] == [[EOS], [EOS]]
    return examples


LAYOUTS = {
    "padded": lambda examples: pad(examples, 0),
    "packed": lambda examples: pack(examples, 0),
    "packed, one row": lambda examples: pack(examples, 0, row_tokens=10_000),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_sequence_reads_its_responses_last_token_before_the_eos(examples, layout):
    batch = LAYOUTS[layout](examples)
    ids = batch.input_ids.flatten()
    sequences = [ex["responses"][r] for r in range(2) for ex in examples]  # response-major
    assert ids[batch.last_positions].tolist() == [response[-1] for response in sequences]
    assert ids[batch.first_positions].tolist() == [response[0] for response in sequences]
    read = ids[reward_positions(batch, EOS)].tolist()
    # before the EOS where the response has more than it; the EOS where it is all there is, or the cut-off end
    expected = [r[-2] if r[-1] == EOS and len(r) > 1 else r[-1] for r in sequences]
    assert read == expected


def tiny_reward_model(seed: int = 0) -> torch.nn.Module:
    config = transformers.AutoConfig.from_pretrained(TINY_DIR, num_labels=1)
    torch.manual_seed(seed)
    model = transformers.AutoModelForSequenceClassification.from_config(config)
    model.config.pad_token_id = 0
    init_reward_head(model, seed)
    return model


def rewards_and_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    rewards = sequence_rewards(model, batch, None, torch.float32, EOS)
    (rewards * torch.linspace(-1, 1, rewards.numel())).sum().backward()  # every sequence's gradient counts
    return rewards.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["packed", "packed, one row"])
def test_packed_rows_give_the_padded_rewards_and_gradients(examples, layout):
    model = tiny_reward_model()
    expected, expected_grads = rewards_and_gradients(model, LAYOUTS["padded"](examples))
    rewards, grads = rewards_and_gradients(model, LAYOUTS[layout](examples))
    torch.testing.assert_close(rewards, expected, rtol=0, atol=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5, msg=name)
    # distinct sequences, distinct rewards (the pair of two EOS-only responses aside)
    assert grads["score.weight"].abs().sum() > 0 and len(set(expected.tolist())) == len(expected) - 1


def test_the_head_is_read_as_transformers_pools_a_text_without_eos(examples):
    # One sequence, no padding: the sequence classifier's own pooling reads its last token; with the response's
    # EOS dropped that is where the reward is read.
    model = tiny_reward_model().eval()
    with torch.no_grad():
        ours = sequence_rewards(model, pad(examples[:1], 0), None, torch.float32, EOS)
        for sequence, response in enumerate(examples[0]["responses"]):
            ids = torch.tensor([examples[0]["prompt"] + response[:-1]])
            assert model(input_ids=ids).logits[0, 0].item() == pytest.approx(ours[sequence].item(), abs=1e-6)


def trained(config):
    """The trainer of a whole run of `config`, after its end (LATEST written)."""
    trainer = build_trainer(config)
    trainer.train()
    trainer.finish()
    return trainer


def test_gradient_accumulation_matches_full_batch(make_config):
    # SGD at lr 1 without clipping: equal parameters after the steps mean equal gradients
    base = ("loss=reward", "optimizer=SGD", "lr=1.0", "max_grad_norm=1e9")
    full = build_trainer(make_config(*base))
    accumulated = build_trainer(make_config(*base, "gradient_accumulation_steps=4", f"local_run_dir={full.run_dir}_ga"))
    for step in range(2):
        examples = [full.data.train_examples[i] for i in full.data.schedule[step]]
        full_metrics, accumulated_metrics = full.train_step(examples), accumulated.train_step(examples)
        assert accumulated_metrics["loss/train"] == pytest.approx(full_metrics["loss/train"], abs=1e-6)
        assert accumulated_metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=1e-5)
    for (name, a), b in zip(full.policy.named_parameters(), accumulated.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_resumed_run_equals_the_uninterrupted_one(make_config, tmp_path):
    assert_resume_matches_uninterrupted(make_config, tmp_path, "loss=reward")


def test_a_run_learns_the_pairs_and_its_export_scores_as_the_trained_model(make_config, tiny_tokenizer):
    trainer = trained(make_config("loss=reward", "n_epochs=3", "lr=3e-3"))
    evals = records(trainer.run_dir, "eval")
    assert evals[0]["loss/eval"] > 0.6 and evals[-1]["loss/eval"] < 0.2 and evals[-1]["rewards_eval/accuracies"] == 1
    assert evals[-1]["rewards_eval/chosen_std"] > 0 and "logps_eval/chosen" not in evals[-1]
    export = trainer.run_dir / "LATEST"
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    # rounds.reward=<export> scores prompt + completion text as the trained model scored the tokenized pairs
    examples = [ex for batch in trainer.data.eval_batches for ex in batch]
    with torch.no_grad():
        expected = trainer.scorer(trainer.policy, trainer.scorer.batch(examples), None)
    decode = tiny_tokenizer.decode
    prompts = [decode(ex["prompt"]) for ex in examples] * 2
    completions = [decode(ex["responses"][r][:-1]) for r in range(2) for ex in examples]  # generated: no EOS
    scored = ModelReward(export, torch.device("cpu"), batch_size=3, max_length=512)(prompts, completions)
    assert scored == pytest.approx(expected.tolist(), abs=1e-5)
    assert len(set(round(value, 3) for value in scored)) > 2


def test_the_margin_column_is_subtracted_from_the_reward_difference(make_config, tmp_path):
    pairs = arithmetic_pairs(48)
    write_jsonl(tmp_path / "margins.jsonl", [{**pair, "margin": 2.0 if i % 2 else 0.5} for i, pair in enumerate(pairs)])
    plain = build_trainer(make_config("loss=reward"))
    data = (f"datasets=[{tmp_path / 'margins.jsonl'}]", f"local_run_dir={tmp_path / 'margins'}")
    margins = build_trainer(make_config("loss=reward", *data))
    batch = margins.data.eval_batches[0]
    assert {ex["margin"] for ex in batch} == {0.5, 2.0}
    with torch.no_grad():
        rewards = margins.scorer(margins.policy, margins.scorer.batch(batch), None)
        loss, _ = margins.batch_loss(batch, "eval")
        plain_loss, _ = plain.batch_loss(plain.data.eval_batches[0], "eval")
    chosen, rejected = rewards.chunk(2)
    margin = torch.tensor([ex["margin"] for ex in batch])
    assert loss.item() == pytest.approx(bradley_terry(chosen, rejected, margin, 0.0).mean().item(), abs=1e-6)
    assert plain_loss.item() == pytest.approx(bradley_terry(chosen, rejected, 0 * margin, 0.0).mean().item(), abs=1e-6)


def test_a_margin_that_is_not_a_number_is_one_line(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "bad.jsonl", [{**arithmetic_pairs(1)[0], "margin": "high"}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: margin is 'high', expected a finite number"):
        get_dataset(str(tmp_path / "bad.jsonl"), tiny_tokenizer, 0, 1, cache_dir=None)


def test_lora_trains_the_adapters_and_the_whole_head_and_exports_them_merged(make_config):
    config = make_config("loss=reward", "lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lr=1e-2")
    trainer = trained(config)
    trainable = {name for name, p in trainer.policy.named_parameters() if p.requires_grad}
    assert "base_model.model.score.modules_to_save.default.weight" in trainable
    assert all(".lora_" in name or ".modules_to_save." in name for name in trainable)
    export = transformers.AutoModelForSequenceClassification.from_pretrained(trainer.run_dir / "LATEST")
    torch.testing.assert_close(export.score.weight, reward_head(trainer.policy).weight.detach(), rtol=0, atol=0)
    initial = transformers.AutoModelForSequenceClassification.from_config(export.config)
    init_reward_head(initial, config.seed)
    assert not torch.equal(export.score.weight, initial.score.weight)  # the head trained


def test_a_reward_model_cannot_sample_or_run_rounds(make_config):
    with pytest.raises(UserError, match="^sample_during_eval=true samples from the policy, but loss=reward trains"):
        make_config("loss=reward", "sample_during_eval=true")
