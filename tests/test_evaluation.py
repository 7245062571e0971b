"""Evaluation and sampling (evaluation.py)."""

import pytest

import train
from conftest import build_trainer, read_jsonl


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
