"""The seeded draw: the token each row of logits draws at a temperature from the nucleus (Holtzman et al. 2020) with a
uniform of its own, by the inverse CDF over the probabilities sorted by falling value (equal ones in token-id order).
generation.sampling's SeededSampling and generation.decoding's loop draw every sampled token with it, so a completion
is a function of its seed, temperature and prompt alone. On a CPU it reads the HEAD largest probabilities of every row
first, then the PREFIX largest of a row whose draw may fall past them, and sorts the whole row only where the draw may
fall past those; on other devices it sorts stably."""

import numpy as np
import torch

# The largest probabilities of every row whose CDF the draw reads first (torch.topk over the batch's rows, 2.5x
# faster than numpy's partition at 1,024 of SmolLM2's 49,152 on a 2-core Xeon), then, where the draw may fall past
# them, the largest PREFIX of that row alone; the whole row is sorted only where it falls past those too (rare at
# 1,024 of a 49,152-token vocabulary).
HEAD = 64
PREFIX = 1024


def seeded_draw(scores: torch.Tensor, temperature, uniforms: torch.Tensor, top_p: float) -> torch.Tensor:
    """[B] the token each row draws from its scores [B, V] at `temperature` (a number, or [B, 1] one per row) with
    its uniform (uniforms [B]). The nucleus's CDF is summed over the probabilities sorted by falling value, equal
    ones in the order of their token ids (a stable sort); the drawn position is where the row's uniform times the
    nucleus's mass falls in it. That arithmetic reads the sorted values alone, so sorted values give exactly the
    stable sort's CDF; the token at the drawn position is the r-th (by id) of the tokens of its probability, r its
    place among them: the stable order's token, without sorting the token ids. On a CPU only the largest HEAD
    values, then PREFIX, are read (prefix_positions), and the whole row only where the draw falls beyond them."""
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
    totals = p.sum(axis=-1, dtype=np.float64)
    values, ids = (part.numpy() for part in torch.topk(probs, min(HEAD, p.shape[1])))  # falling, ties in any order
    positions = prefix_positions(values, totals, p.shape[1], u, top_p)
    drawn = np.full(len(p), -1, dtype=np.int64)
    drawn[positions >= 0] = head_tokens(values, ids, positions, p.shape[1])[positions >= 0]
    for row in np.flatnonzero(drawn < 0):
        drawn[row] = row_draw(p[row], totals[row], u[row], top_p)
    return torch.from_numpy(drawn), torch.from_numpy(totals)


def head_tokens(values: np.ndarray, ids: np.ndarray, positions: np.ndarray, vocab: int) -> np.ndarray:
    """[B] the token at each row's drawn position of its head (values [B, k] falling, ids their tokens), or -1 where
    the drawn value is the head's last and the vocabulary goes on (tokens of that value may lie past the head). The
    token is the r-th by id of the tokens of the drawn value, r the position's place among them (stable order)."""
    rows = np.arange(len(values))
    value = values[rows, np.maximum(positions, 0)][:, None]
    before = (values > value).sum(axis=1)  # values above the drawn one: all in the head
    tied_ids = np.sort(np.where(values == value, ids, vocab), axis=1)
    tokens = tied_ids[rows, np.maximum(positions, 0) - before]
    boundary = (value[:, 0] == values[:, -1]) & (values.shape[1] < vocab)
    return np.where(boundary, -1, tokens)


def row_draw(p: np.ndarray, total: np.float64, u: np.float32, top_p: np.float32) -> int:
    """The token one row [V] draws where its head did not decide it: from its PREFIX largest values, else (the draw
    may fall past them) the whole row sorted."""
    k = min(PREFIX, len(p))
    prefix = -np.sort(-np.partition(p, len(p) - k)[-k:])  # the k largest, falling
    position = int(prefix_positions(prefix[None], np.array([total]), len(p), np.array([u]), top_p)[0])
    if position < 0:
        return sorted_cdf_draw(p, u, top_p)
    value = prefix[position]
    first = k - int(np.searchsorted(prefix[::-1], value, side="right"))  # values above it: all here
    return int(np.flatnonzero(p == value)[position - first])


def drawn_log_probs(probs: torch.Tensor, tokens: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """[B] float64 log-probability of each row's drawn token (tokens [B]) under float32 probabilities [B, V]: its
    probability over the row's float64 sum (probs_draw's), the softmax's rounding divided out."""
    return (probs.gather(-1, tokens[:, None].to(probs.device))[:, 0].double() / sums.to(probs.device)).log()


def running_sum(values: np.ndarray) -> np.ndarray:
    # torch's cumsum on a CPU: a float64 running sum (along the last axis), each element rounded to float32
    return np.cumsum(values, axis=-1, dtype=np.float64).astype(np.float32)


def prefix_positions(prefixes: np.ndarray, totals: np.ndarray, vocab: int, u: np.ndarray, top_p: np.float32):
    """[B] the position (in falling order) sorted_cdf_draw would draw in each row, read from its largest values alone
    (prefixes [B, k], falling; totals [B] float64 sums of the rows), or -1 where the rest of the row is needed. The
    CDF's first entries are the prefix's running sums, the same numbers. Its last entry, the nucleus's mass m, is a
    float64 running sum rounded to float32, and a row's total is the float64 sum of all values in numpy's order, which
    differs from any float64 running sum of them by at most 2 (V - 1) 2^-53 of it (Higham, "Accuracy and Stability of
    Numerical Algorithms", 4.2, for both orders). m lies in an interval found below; the draw is the position where
    u m falls (searchsorted's right side: the count of CDF entries at or below it), and where every m of the interval
    gives the same position within the prefix, that position is the draw."""
    k = prefixes.shape[1]
    cdf = running_sum(prefixes)
    outside = cdf - prefixes >= top_p  # the mass before it reached top_p
    outside[:, 0] = False
    cut = outside.any(axis=1)  # the nucleus ends within the prefix: its CDF is all here
    cut_cdf = running_sum(np.where(outside, 0, prefixes))
    target = u * cut_cdf[:, -1]
    in_cut = np.where(target < cut_cdf[:, -1], (cut_cdf <= target[:, None]).sum(axis=1), -1)
    bound = 2.0 * vocab * 2.0**-53 * totals * 1.01
    low, high = totals - bound, totals + bound
    reaches = high.astype(np.float32) >= top_p
    # At top_p = 1 a mass that rounds to 1 cuts the far tail: the first token cut, j, has fl(fl(S_j) - p_j) >= 1
    # (S_j: the running sum up to it), so S_j - p_j >= 1 - 2^-25 - 2^-24 (fl(S_j) within 2^-24 of S_j, near 1), and
    # everything before j is kept: m lies between that and the total. Below 1, the nucleus may end past the prefix.
    low = np.where(reaches, np.minimum(low, 1 - 3 * 2.0**-25 - bound), low)
    # every mass in [low, high] rounds to a float32 between these two, and u m and its position in the CDF rise with m
    first, last = ((cdf <= (u * mass.astype(np.float32))[:, None]).sum(axis=1) for mass in (low, high))
    whole = np.where((first == last) & (first < k) & ~(reaches & (top_p < 1)), first, -1)
    return np.where(cut, in_cut, whole)


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


class RowDraws:
    """The seeded draws of a batch's rows, as a decode loop calls them: draw(logits [S, V], step, rows [S]) -> [S]
    tokens on the logits' device, slot s drawing with row rows[s]'s temperature and its uniform at `step` (an int, or a
    0-d tensor on the device), and (scored) adding the drawn token's log-prob to the row's sum. Row R (one past the
    last) stands for slots that hold no row: a uniform of 0.5, temperature 1, a sum nothing reads. On CUDA every
    operation stays on the device, so a captured decode step draws without the host.

    uniforms: [R, max_new_tokens], each row's from its seed (drawn up front); temperatures: R numbers."""

    def __init__(self, uniforms: torch.Tensor, temperatures: list[float], top_p: float, scored: bool,
                 device: torch.device):  # fmt: skip
        self.uniforms = torch.cat([uniforms, uniforms.new_full((1, uniforms.shape[1]), 0.5)]).to(device)
        # one temperature: a number, as SeededSampling divides by it (a division by a tensor may round otherwise)
        self.one = temperatures[0] if len(set(temperatures)) == 1 else None
        self.temperature = torch.tensor([*temperatures, 1.0], dtype=torch.float32, device=device)[:, None]
        self.top_p, self.scored = top_p, scored
        self.logps = torch.zeros(len(temperatures) + 1, dtype=torch.float64, device=device)  # [R + 1] summed

    @torch.profiler.record_function("seeded draw")  # named for python -m bench --generate --profile
    def __call__(self, logits: torch.Tensor, step, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.uniforms.device)
        probs = tempered_probs(logits, self.one if self.one is not None else self.temperature[rows])
        column = step.expand(len(rows)) if torch.is_tensor(step) else step  # a 0-d index would be read on the host
        tokens, sums = probs_draw(probs, self.uniforms[rows, column], self.top_p)
        if self.scored:
            self.logps.index_put_((rows,), drawn_log_probs(probs, tokens, sums).to(self.logps.device), accumulate=True)
        return tokens.to(logits.device)
