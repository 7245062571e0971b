"""Scores of many completions of few prompts, each prompt computed once for all of its completions: the sampled KL's
log-probs at each completion's temperature (generation.sampling.Sampler.score), and a reward model's rewards
(judging.rewards.ModelReward, a judge's or a round's).

An evaluation samples each prompt at 4 temperatures x S samples, and a judge reads each prompt with two completions;
scored one row per completion, each prompt was computed 4 S (or 2) times, padded to the longest row of its batch,
and the LM head ran at every position. Here the completions of one prompt are the responses of one example, which
the prompt-shared packed layout (core.layouts.pack) lays out as one segment [prompt | completion_1 | ...]: every
completion sees exactly the context and positions it has alone, the prompt is computed once, rows carry no padding
but their tails, and the head runs only where a completion's token is scored. Where a model does not allow the
packed layout or the scored head, core.scoring.Scorer falls back to padded rows or all logits, and says so.
"""

from collections.abc import Callable

import torch
import tqdm

from core.scoring import Scorer, ScoringSettings
from modeling.distributed import Topology
from modeling.vision import Vision


def prompt_scorer(
    model: torch.nn.Module, topology: Topology, pad_token_id: int, vision: Vision | None, reward_eos: int | None = None
) -> Scorer:
    """The Scorer of `model` (a causal LM's log-probs, or with reward_eos a reward model's rewards), checked on it, as
    training scores by default (ScoringSettings())."""
    settings = ScoringSettings()
    return Scorer.create(model, settings, pad_token_id, topology, False, None, reward_eos=reward_eos, vision=vision)


def prompt_groups(prompts: list[list[int]], completions: list[list[int]], images: list[bytes], most: int):
    """(examples, rows): the completions of each distinct prompt (ids and images) as the responses of examples of
    that prompt, at most `most` responses an example, and the rows (indices into completions) of each example's
    responses. A batch takes one number of responses per example: where prompts have different numbers of
    completions, each completion is an example of its own; a prompt's k completions make k / d examples of d each, d
    the largest divisor of k within `most` (a segment of 4,000 completions would be one [T, T] mask of its own)."""
    groups: dict[tuple, list[int]] = {}
    for row, key in enumerate(zip(map(tuple, prompts), images)):
        groups.setdefault(key, []).append(row)
    sizes = {len(group) for group in groups.values()}
    size = 1
    if len(sizes) == 1:
        (count,) = sizes
        size = max(d for d in range(1, min(count, most) + 1) if count % d == 0)
    rows = [group[start : start + size] for group in groups.values() for start in range(0, len(group), size)]
    examples = [
        {"prompt": prompts[group[0]], "responses": [completions[row] for row in group], "images": images[group[0]]}
        for group in rows
    ]
    return examples, rows


def no_bar(total: int) -> tqdm.tqdm:
    return tqdm.tqdm(total=total, disable=True)


@torch.no_grad()
def scores_by_prompt(
    scorer: Scorer,
    model: torch.nn.Module,
    topology: Topology,
    prompts: list[list[int]],
    completions: list[list[int]],
    images: list[bytes],
    completions_per_batch: int,
    progress: Callable | None = None,
    temperatures: list[float] | None = None,
) -> list[float]:
    """[len(completions)] each completion's score: its float32 log-prob under `model` at its temperature
    (temperatures: one per completion), or the reward model's reward (scorer.reward_eos set; temperatures None);
    this rank's share of the prompts in batches of about completions_per_batch completions, gathered on every rank.
    progress(total): a progress bar of completions (None: none)."""
    examples, rows = prompt_groups(prompts, completions, images, completions_per_batch)
    per_example = len(rows[0])
    size = max(1, completions_per_batch // per_example)
    local, n_real = topology.shard(list(range(len(examples))))
    values: list[list[float]] = [[] for _ in local]  # each local example's, in its responses' order
    # batched by length: a batch's rows are padded to its longest, so examples of similar lengths go together
    tokens = [len(examples[i]["prompt"]) + sum(map(len, examples[i]["responses"])) for i in local]
    by_length = sorted(range(len(local)), key=tokens.__getitem__)
    with (progress or no_bar)(len(local) * per_example) as bar:
        for start in range(0, len(local), size):
            places = by_length[start : start + size]
            chunk = [local[place] for place in places]
            batch = scorer.batch([examples[i] for i in chunk])
            # sequences are numbered response-major: all first responses, then all second ones, ...
            temperature = 1.0
            if temperatures is not None:
                temperature = torch.tensor([temperatures[rows[i][r]] for r in range(per_example) for i in chunk])
            scores = scorer(model, batch, None, temperature=temperature).view(per_example, len(chunk))
            for place, example_values in zip(places, scores.t().cpu().tolist()):
                values[place] = example_values
            bar.update(len(chunk) * per_example)
    gathered = topology.gather({"values": values[:n_real]})["values"]
    result = [0.0] * len(completions)
    for group, group_values in zip(rows, gathered):
        for row, value in zip(group, group_values):
            result[row] = value
    return result
