"""The seeded draw: the token each row of logits draws at a temperature from the nucleus (Holtzman et al. 2020) with a
uniform of its own, by the inverse CDF over the probabilities sorted by falling value (equal ones in token-id order).
core.sampling's SeededSampling and core.decoding's loop draw every sampled token with it, so a completion is a
function of its seed, temperature and prompt alone. On a CPU it reads the largest PREFIX probabilities of a row and
sorts the whole row only where the draw may fall past them; on other devices it sorts stably."""

import numpy as np
import torch

# The largest probabilities of a row whose CDF the draw first reads: a draw needs the rest only where the uniform
# falls in the mass beyond them (rare at 1,024 of a 49,152-token vocabulary; then the whole row is sorted).
PREFIX = 1024


def seeded_draw(scores: torch.Tensor, temperature, uniforms: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B] the token each row draws from its scores [B, V] at `temperature` (a number, or [B, 1] one per row) with
    its uniform (uniforms [B]). The nucleus's CDF is summed over the probabilities sorted by falling value, equal
    ones in the order of their token ids (a stable sort); the drawn position is where the row's uniform times the
    nucleus's mass falls in it. That arithmetic reads the sorted values alone, so sorted values give exactly the
    stable sort's CDF; the token at the drawn position is the r-th (by id) of the tokens of its probability, r its
    place among them: the stable order's token, without sorting the token ids. On a CPU (numpy) only the largest
    PREFIX values are sorted (cdf_prefix_draw), and the whole row only where the draw falls beyond them."""
    return probs_draw(tempered_probs(scores, temperature), uniforms, top_p)[0]


def tempered_probs(scores: torch.Tensor, temperature) -> torch.Tensor:
    """[B, V] float32 probabilities of scores [B, V] at `temperature` (a number, or [B, 1]): what the draw reads."""
    return torch.softmax(scores.float() / temperature, dim=-1)


def probs_draw(probs: torch.Tensor, uniforms: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeded_draw's token of each row of tempered float32 probabilities [B, V], [B] each row's float64 sum of them).
    A caller that reads the probabilities too, as the sampled KL's log-probs do, computes them once; and it divides by
    the sum: a float32 softmax's rows sum to 1 only within its rounding, and the log of a token's probability reads
    high by it (at T = 1 on SmolLM2's 49,152 logits by 1.65e-5 a token on average against float64, 1e-3 over a
    completion of 64 tokens; x - logsumexp(x) in float32 reads 2e-8 off, and the probability over the sum 4e-9)."""
    if probs.device.type != "cpu":
        return stable_sorted_draw(probs, uniforms, top_p), probs.sum(dim=-1, dtype=torch.float64)
    p, u, top_p = probs.numpy(), uniforms.cpu().numpy(), np.float32(top_p)
    k = min(PREFIX, p.shape[1])
    prefixes = -np.sort(-np.partition(p, p.shape[1] - k, axis=-1)[:, -k:], axis=-1)  # the k largest, falling
    totals = p.sum(axis=-1, dtype=np.float64)
    drawn = np.empty(len(p), dtype=np.int64)
    for row in range(len(p)):
        index = cdf_prefix_draw(prefixes[row], totals[row], p.shape[1], u[row], top_p)
        if index is None:
            drawn[row] = sorted_cdf_draw(p[row], u[row], top_p)
            continue
        value = prefixes[row, index]
        first = k - int(np.searchsorted(prefixes[row, ::-1], value, side="right"))  # values above it: all here
        drawn[row] = np.flatnonzero(p[row] == value)[index - first]
    return torch.from_numpy(drawn), torch.from_numpy(totals)


def drawn_log_probs(probs: torch.Tensor, tokens: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """[B] float64 log-probability of each row's drawn token (tokens [B]) under float32 probabilities [B, V]: its
    probability over the row's float64 sum (probs_draw's), the softmax's rounding divided out."""
    return (probs.gather(-1, tokens[:, None].to(probs.device))[:, 0].double() / sums.to(probs.device)).log()


def running_sum(values: np.ndarray) -> np.ndarray:
    # torch's cumsum on a CPU: a float64 running sum, each element rounded to float32
    return np.cumsum(values, dtype=np.float64).astype(np.float32)


def cdf_prefix_draw(prefix: np.ndarray, total: np.float64, vocab: int, u: np.float32, top_p: np.float32) -> int | None:
    """The position (in falling order) sorted_cdf_draw would draw, read from the row's `prefix` largest values
    (falling) alone, or None where the rest of the row is needed. The CDF's first entries are the prefix's running
    sums, the same numbers. Its last entry, the nucleus's mass m, is a float64 running sum rounded to float32, and
    `total` is the float64 sum of all values in numpy's order, which differs from any float64 running sum of them by
    at most 2 (V - 1) 2^-53 of it (Higham, "Accuracy and Stability of Numerical Algorithms", 4.2, for both orders).
    m lies in an interval found below; the draw is the position where u m falls, and where every m of it gives the
    same position within the prefix, that position is the draw."""
    cdf = running_sum(prefix)
    outside = cdf - prefix >= top_p  # the mass before it reached top_p
    outside[0] = False
    if outside.any():  # the nucleus ends within the prefix: its CDF is all here
        cdf = running_sum(np.where(outside, 0, prefix))
        target = u * cdf[-1]
        return int(np.searchsorted(cdf, target, side="right")) if target < cdf[-1] else None
    bound = 2.0 * vocab * 2.0**-53 * total * 1.01
    low, high = total - bound, total + bound
    if np.float32(high) >= top_p:
        if top_p < 1:  # the nucleus may end beyond the prefix
            return None
        # At top_p = 1 a mass that rounds to 1 cuts the far tail: the first token cut, j, has fl(fl(S_j) - p_j) >= 1
        # (S_j: the running sum up to it), so S_j - p_j >= 1 - 2^-25 - 2^-24 (fl(S_j) within 2^-24 of S_j, near 1),
        # and everything before j is kept: m lies between that and the total.
        low = min(low, 1 - 3 * 2.0**-25 - bound)
    # every mass in [low, high] rounds to a float32 between these two, and u m and its position in the CDF rise with m
    first, last = (int(np.searchsorted(cdf, u * np.float32(mass), side="right")) for mass in (low, high))
    return first if first == last < len(cdf) else None


def sorted_cdf_draw(p: np.ndarray, u: np.float32, top_p: np.float32) -> int:
    """The token one row [V] draws: the whole row sorted (see seeded_draw)."""
    ascending = np.sort(p)
    descending = ascending[::-1]
    cdf = running_sum(descending)
    if cdf[-1] >= top_p:  # else no mass before any token reaches top_p: the nucleus is everything
        outside = cdf - descending >= top_p
        outside[0] = False
        if outside.any():
            cdf = running_sum(np.where(outside, 0, descending))
    index = min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), len(cdf) - 1)
    value = descending[index]
    first = len(cdf) - int(np.searchsorted(ascending, value, side="right"))
    return int(np.flatnonzero(p == value)[index - first])


def stable_sorted_draw(probs: torch.Tensor, uniforms: torch.Tensor, top_p: float) -> torch.Tensor:
    """SeededSampling's draw by a stable sort of the whole vocabulary (on devices where sorting is cheap)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p  # the mass before it reached top_p
    outside[:, 0] = False
    cdf = sorted_probs.masked_fill(outside, 0).cumsum(dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
    return order.gather(-1, index).squeeze(-1)
