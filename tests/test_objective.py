"""The objectives (objective.py) through whole runs: closed forms at step 0, SFT, reference-free."""

import pytest

import train
from conftest import records


def test_ipo_first_eval_matches_closed_form(make_config):
    config = make_config("loss=ipo", "loss.beta=0.25", "n_examples=8")
    train.run(config)
    first = records(train.Path(config.local_run_dir), "eval")[0]
    assert first["loss/eval"] == pytest.approx(1 / (2 * 0.25) ** 2)  # (0 - 1/(2 beta))^2 when policy == reference


def test_sft_trains_on_chosen_and_needs_no_reference(make_config):
    config = make_config("loss=sft", "n_examples=16")
    train.run(config)
    evals = records(train.Path(config.local_run_dir), "eval")
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"]
    assert evals[0]["loss/eval"] == pytest.approx(-evals[0]["logps_eval/chosen"])
    assert "rewards_eval/chosen" not in evals[0]


def test_reference_free_rewards_are_policy_logps(make_config):
    config = make_config("loss.reference_free=true", "n_examples=8")
    train.run(config)
    first = records(train.Path(config.local_run_dir), "eval")[0]
    assert first["rewards_eval/chosen"] == pytest.approx(0.1 * first["logps_eval/chosen"], rel=1e-5)
