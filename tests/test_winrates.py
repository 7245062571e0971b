"""Win-rate statistics (judging/winrates.py): rates, their bootstrap intervals, the length-controlled win rate."""

import numpy as np
import pytest

from judging.winrates import bootstrap, length_controlled, rate_of, score, summarize


def test_rates_and_the_tie_counted_half_are_the_outcomes_counted():
    outcomes = np.array([[1, 1], [0, -1], [1, 0]])  # 3 wins, 2 ties, 1 loss
    assert rate_of(1)(outcomes) == pytest.approx(3 / 6)
    assert rate_of(0)(outcomes) == pytest.approx(2 / 6)
    assert rate_of(-1)(outcomes) == pytest.approx(1 / 6)
    assert score(outcomes) == pytest.approx((3 + 2 / 2) / 6)


def test_bootstrap_intervals_cover_the_true_rate_at_their_nominal_level():
    # 400 evaluations of 100 prompts whose outcomes are wins with probability 0.3: the 95% interval of each holds
    # 0.3 in 95% of them, within the binomial spread of 400 trials (sd 1.1%) and the percentile method's small bias.
    rng = np.random.default_rng(0)
    covered = 0
    for trial in range(400):
        outcomes = np.where(rng.random((100, 1)) < 0.3, 1, -1)
        estimate = bootstrap(rate_of(1), (outcomes,), resamples=500, seed=trial)
        covered += estimate.low <= 0.3 <= estimate.high
    assert 0.91 <= covered / 400 <= 0.98, covered / 400


def test_the_bootstrap_resamples_prompts_not_samples():
    # Each prompt's 8 samples are all wins or all losses: the interval is that of 20 outcomes, not 160.
    outcomes = np.repeat(np.where(np.arange(20) < 10, 1, -1)[:, None], 8, axis=1)
    estimate = bootstrap(rate_of(1), (outcomes,), resamples=2000, seed=0)
    half_width = (estimate.high - estimate.low) / 2
    assert half_width == pytest.approx(1.96 * np.sqrt(0.25 / 20), rel=0.15)  # 0.22, not 0.077


def test_the_length_controlled_win_rate_removes_a_preference_for_length():
    # Outcomes drawn from P(win) = sigmoid(0 + 3 tanh(d / sd(d))), the candidate mostly longer: the raw win rate is
    # far above one half, the rate at equal length is one half.
    rng = np.random.default_rng(0)
    d = rng.normal(40, 30, size=(20_000, 1))
    p = 1 / (1 + np.exp(-3 * np.tanh(d / d.std())))
    outcomes = np.where(rng.random(d.shape) < p, 1, -1)
    assert score(outcomes) > 0.8
    assert length_controlled(outcomes, d) == pytest.approx(0.5, abs=0.02)


def test_without_a_length_effect_the_length_controlled_rate_is_the_win_rate():
    rng = np.random.default_rng(1)
    d = rng.normal(0, 10, size=(20_000, 1))
    outcomes = np.where(rng.random(d.shape) < 0.7, 1, -1)
    assert length_controlled(outcomes, d) == pytest.approx(score(outcomes), abs=0.01)


def test_a_summary_holds_every_statistic_with_its_interval():
    outcomes = np.array([[1], [1], [0], [-1]])
    lengths = np.array([[5], [6], [7], [8]]), np.array([[4], [4], [4], [4]])
    log_ratios, rewards = np.array([[0.5], [0.1], [0.2], [0.0]]), (np.ones((4, 1)), np.zeros((4, 1)))
    summary = summarize(outcomes, *lengths, resamples=200, seed=0, log_ratios=log_ratios, rewards=rewards)
    assert summary["win"]["value"] == 0.5 and summary["tie"]["value"] == 0.25 and summary["loss"]["value"] == 0.25
    assert summary["win_rate"]["value"] == pytest.approx(0.625)
    assert summary["length"] == {"candidate": 6.5, "baseline": 4.0}
    assert summary["kl"]["value"] == pytest.approx(0.2)
    assert summary["reward"]["candidate"]["value"] == 1.0 and summary["reward"]["baseline"]["value"] == 0.0
    for key in ("win", "win_rate", "lc_win_rate", "kl"):
        assert summary[key]["low"] <= summary[key]["value"] <= summary[key]["high"], key
