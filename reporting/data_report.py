"""What the data holds, told before training: the data report every run prints (build.load_data; a round's, rounds.py):
token lengths of prompts and responses, how many examples were truncated, the pairs' length bias, and the first
training example decoded token by token; with shape buckets (core/shapes.py), the shapes an epoch takes and the
padding they cost (shape_report, printed once the Scorer has chosen the layout)."""

import numpy as np

from core.examples import Examples
from core.layouts import batch_shape

SHOWN_TOKENS = 24  # of a long segment, the decoded example shows this many tokens at each end


def data_report(
    train: Examples, evals: Examples, tokenizer, max_length: int, max_prompt_length: int, header: str | None = None
) -> str:
    """Token lengths (before truncation) of prompts and responses, how many examples were truncated, and the first
    training example decoded token by token, so that a tokenization problem shows at a glance. Computed on the
    examples' length arrays: a million examples take milliseconds. header: a first line instead of the counts (a
    round's, rounds.py)."""
    full = np.concatenate([train.full_lengths, evals.full_lengths])
    kept = np.concatenate([train.lengths, evals.lengths])
    names = ["prompt", "chosen", "rejected"] if full.shape[1] == 3 else ["prompt", "target"]
    kind = ""
    if train.labelled:
        names = ["prompt", "response"]  # the completion (8 letters: the columns stay aligned)
        desirable = int((train.labels == 1).sum())
        kind = f" (labelled completions: {desirable} desirable, {len(train) - desirable} undesirable in training)"
    lines = [
        header or f"data report: {len(train)} training and {len(evals)} eval examples{kind}",
        "  tokens     p50    p90    p99    max",
    ]
    for i, name in enumerate(names):
        cuts = np.percentile(full[:, i], [50, 90, 99])  # linear interpolation between ranks ("inclusive")
        lines.append(f"  {name:8} {cuts[0]:5.0f}  {cuts[1]:5.0f}  {cuts[2]:5.0f}  {full[:, i].max():5d}")
    truncated = int((kept.sum(axis=1) < full.sum(axis=1)).sum())
    lines.append(
        f"  truncated: {truncated} of {len(full)} examples (prompt + longest response over max_length="
        f"{max_length}; prompts cut to max_prompt_length={max_prompt_length})"
    )
    if full.shape[1] == 3 and not train.labelled and len(train):
        lines.append(length_bias(train.full_lengths[:, 1], train.full_lengths[:, 2]))
    example = train[0]
    lines.append("  first training example, token by token (| between tokens; the responses are scored):")
    for name, ids in zip(names, [example["prompt"], *example["responses"]]):
        lines.append(f"    {name:8} {len(ids):4d} tokens: {decoded_tokens(ids, tokenizer)}")
    return "\n".join(lines)


LENGTH_BIAS = 2 / 3  # above it, the pairs teach length (Park et al. 2024, arXiv:2403.19159)


def length_bias(chosen: np.ndarray, rejected: np.ndarray) -> str:
    """The pairs' length bias: the share whose chosen response is longer (in tokens, before truncation) and the mean
    ratio of chosen to rejected length; above LENGTH_BIAS, what DPO learns of it and the losses that control it."""
    longer = float((chosen > rejected).mean())
    ratio = float(np.mean(chosen / np.maximum(rejected, 1)))
    line = f"  length bias: the chosen response is longer in {longer:.0%} of training pairs, {ratio:.2f}x on average"
    if longer > LENGTH_BIAS:
        line += (
            "; DPO learns length from such data (its implicit reward rises with it): consider loss=ld_dpo or a "
            "length-normalised loss (dpo_norm, simpo), and judge by length-controlled win rates (evaluate.py)"
        )
    return line


def decoded_tokens(ids: list[int], tokenizer) -> str:
    pieces = [tokenizer.decode([i]).replace("\n", "\\n") for i in ids]
    if len(pieces) > 2 * SHOWN_TOKENS:
        hidden = len(pieces) - 2 * SHOWN_TOKENS
        pieces = [*pieces[:SHOWN_TOKENS], f" ... {hidden} more ... ", *pieces[-SHOWN_TOKENS:]]
    return "|".join(pieces)


def shape_report(lengths: np.ndarray, schedule: list[list[int]], parts: int, scorer) -> str:
    """One line: the distinct model-input shapes (rows x length) an epoch's packed micro-batches take with shape
    buckets and without, and the share of the positions computed that are padding. lengths: [n, 1 + R] the examples'
    kept lengths; schedule: each step's examples (by index), cut into `parts` micro-batches (accumulation x
    data-parallel ranks); scorer: the run's (core.scoring.Scorer: its rows' budget and length multiple)."""
    shapes, positions = {True: set(), False: set()}, {True: 0, False: 0}
    micro_batches = [part for indices in schedule for part in np.array_split(np.asarray(indices), parts)]
    real = 0
    for indices in micro_batches:
        rows = lengths[indices]
        real += int(rows.sum())
        budget = scorer.row_budget(rows.sum(axis=1).tolist())
        for bucketed in (True, False):
            shape = batch_shape("packed", rows, budget, scorer.multiple, bucketed)
            shapes[bucketed].add(shape)
            positions[bucketed] += shape[0] * shape[1]
    waste = {bucketed: 1 - real / max(1, positions[bucketed]) for bucketed in (True, False)}
    return (
        f"shape buckets: an epoch's {len(micro_batches)} micro-batches take {len(shapes[True])} shapes "
        f"({len(shapes[False])} without buckets); padding is {waste[True]:.1%} of the positions computed "
        f"({waste[False]:.1%} without)"
    )
