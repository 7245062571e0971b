"""Win rates of a candidate's completions against a baseline's, from a judge's outcomes (1 a win, 0 a tie, -1 a loss),
with 95% bootstrap confidence intervals, a length-controlled win rate, and the sampled KL of the candidate from its
reference. Every statistic is over [P, S] arrays: P prompts, S samples of each. The bootstrap resamples prompts, not
samples, because a prompt's samples are alike (a hard prompt is lost every time): resampling them one by one would
make the intervals too narrow (Efron and Tibshirani 1993, ch. 6 and 8)."""

from dataclasses import asdict, dataclass

import numpy as np

LEVEL = 0.95


@dataclass(frozen=True)
class Estimate:
    """A statistic and its percentile bootstrap interval at LEVEL."""

    value: float
    low: float
    high: float

    def describe(self, scale: float = 1.0, digits: int = 1) -> str:
        return f"{self.value * scale:.{digits}f} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


def resampled_prompts(n_prompts: int, resamples: int, seed: int) -> np.ndarray:
    """[resamples, n_prompts] prompt indices drawn with replacement."""
    return np.random.default_rng(seed).integers(0, n_prompts, size=(resamples, n_prompts))


def bootstrap(statistic, arrays: tuple[np.ndarray, ...], resamples: int, seed: int) -> Estimate:
    """statistic(*arrays) on the prompts as given, and its percentile interval over `resamples` resamples of the
    prompts (the arrays' first axis) drawn from `seed`; every statistic of one evaluation resamples the same
    prompts (the same seed), so that their intervals agree with each other."""
    value = float(statistic(*arrays))
    draws = resampled_prompts(len(arrays[0]), resamples, seed)
    values = np.array([statistic(*(a[rows] for a in arrays)) for rows in draws], dtype=np.float64)
    low, high = np.nanquantile(values, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Estimate(value, float(low), float(high))


def rate_of(outcome: int):
    return lambda outcomes: float(np.mean(outcomes == outcome))


def score(outcomes: np.ndarray) -> float:
    """The win rate with a tie counted as half a win (AlpacaEval's and MT-Bench's convention): 0.5 for equals."""
    return float(np.mean((outcomes + 1) / 2))


def length_controlled(outcomes: np.ndarray, length_difference: np.ndarray, ridge: float = 1e-3) -> float:
    """The win rate (ties half) that a logistic regression of each outcome on the length difference predicts at
    equal length: P(win) = sigmoid(theta + phi * tanh(d / sd(d))), fitted by Newton's method to the soft targets
    (1, 0.5, 0), and the prediction at d = 0, sigmoid(theta). After AlpacaEval's length-controlled win rate (Dubois
    et al. 2024, arXiv:2404.04475), with the length term alone: one baseline and one candidate here. A small ridge on
    phi keeps the fit finite where the outcomes separate by length; theta is free, so that all wins give 1."""
    targets = ((outcomes + 1) / 2).ravel().astype(np.float64)
    d = length_difference.ravel().astype(np.float64)
    spread = d.std()
    x = np.tanh(d / spread) if spread > 0 else np.zeros_like(d)
    features = np.stack([np.ones_like(x), x], axis=1)
    weights, penalty = np.zeros(2), np.diag([0.0, ridge])
    for _ in range(100):
        p = sigmoid(features @ weights)
        gradient = features.T @ (p - targets) / len(targets) + penalty @ weights
        curvature = (features * (p * (1 - p))[:, None]).T @ features / len(targets) + penalty
        step = np.linalg.lstsq(curvature, gradient, rcond=None)[0]
        weights -= step
        if np.abs(step).max() < 1e-9:
            break
    return float(sigmoid(weights[0]))


def sigmoid(z):
    return 0.5 * (1 + np.tanh(z / 2))  # no overflow where |z| is large


def summarize(
    outcomes: np.ndarray,
    candidate_lengths: np.ndarray,
    baseline_lengths: np.ndarray,
    resamples: int,
    seed: int,
    log_ratios: np.ndarray | None = None,
    rewards: tuple[np.ndarray, np.ndarray] | None = None,
) -> dict:
    """One candidate at one temperature: win, tie and loss rates, the win rate with ties half and its
    length-controlled value, each with its interval; each side's mean length in tokens; the sampled KL of the
    candidate from its reference, the mean of log p(y) - log p_ref(y) over its completions y (an unbiased estimate of
    KL(p || p_ref), the completions being drawn from p: log_ratios [P, S]), where a reference was given; each side's
    mean reward, where the judge gives rewards. Arrays are [P, S]."""
    estimate = lambda statistic, *arrays: asdict(bootstrap(statistic, arrays, resamples, seed))  # noqa: E731
    difference = candidate_lengths - baseline_lengths
    summary = {
        "prompts": int(outcomes.shape[0]),
        "samples": int(outcomes.size),
        "win": estimate(rate_of(1), outcomes),
        "tie": estimate(rate_of(0), outcomes),
        "loss": estimate(rate_of(-1), outcomes),
        "win_rate": estimate(score, outcomes),
        "lc_win_rate": estimate(length_controlled, outcomes, difference),
        "length": {"candidate": float(candidate_lengths.mean()), "baseline": float(baseline_lengths.mean())},
    }
    if log_ratios is not None:
        summary["kl"] = estimate(np.mean, log_ratios)
    if rewards is not None:
        summary["reward"] = {"candidate": estimate(np.mean, rewards[0]), "baseline": estimate(np.mean, rewards[1])}
    return summary
