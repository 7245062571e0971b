"""What one step computes from its examples: the objective on a micro-batch (`BatchLoss`: the policy's log-probs, the
reference's, the loss and per-example metrics), and what a loss reads from the whole batch before its first
micro-batch (`CoupledBatch`: every pair's statistics for aot, KTO's KL estimate over mismatched examples, the router
loss's counts); the keys of every example whose reference log-probs a run reads. The Trainer (trainers.py) calls these
once per micro-batch and once per batch; build.py makes them."""

import contextlib
import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from core.examples import Examples, from_ids
from core.layouts import ModelBatch, to_device
from core.loss_contract import PairStats
from core.router_loss import RouterCounts, Routers, token_weights
from core.scoring import Scorer
from modeling.distributed import Topology
from utils import UserError


@dataclass
class Data:
    """The run's tokenized examples and the order it trains on them."""

    train_examples: Examples
    eval_batches: list[list[dict]]
    schedule: list[list[int]]  # per optimizer step, the indices of its training examples


@dataclass
class RouterPart:
    """Where a micro-batch sits in its batch, for the router loss (router_loss): the batch's counts (None: this
    micro-batch is its rank's whole share, and its own counts summed over the ranks are the batch's), its real
    examples (the rest are a rank's padding copies), the batch's, and the micro-batches of the batch over all ranks
    (the trainer divides each one's loss by the accumulation and averages over ranks: its part is multiplied back)."""

    counts: RouterCounts | None
    n_real: int
    batch_examples: int
    parts: int


@dataclass
class CoupledBatch:
    """What a loss reads from the whole batch (an optimizer step's, or an eval batch), computed before its first
    micro-batch: for aot every pair's statistics, detached, in batch order on every rank, with where each of this
    rank's micro-batches sits in it and its reference log-probs (computed once, here); for kto the KL estimate; for
    the router loss where each micro-batch sits and, where a rank has several, the batch's router counts."""

    stats: PairStats | None  # [G]
    positions: list[torch.Tensor | None]  # [b] per micro-batch
    reference_logps: list[torch.Tensor | None]  # [2b] per micro-batch
    kl_estimate: torch.Tensor | None  # [] float32
    router: list[RouterPart] | None = None  # per micro-batch

    def part(self, index: int) -> tuple[dict, torch.Tensor | None, RouterPart | None]:
        """(the PairStats fields of micro-batch `index`, its reference log-probs if computed here, its RouterPart)."""
        fields = {"batch": self.stats, "batch_positions": self.positions[index], "kl_estimate": self.kl_estimate}
        return fields, self.reference_logps[index], self.router and self.router[index]


@dataclass
class BatchLoss:
    """The objective on a micro-batch: the policy's log-probs (scored as the Scorer decided), the reference's, and the
    loss. Returns (mean loss, {name: [B] per-example metric on the device}), metrics named as in the DPO reference."""

    objective: object
    scorer: Scorer
    policy: torch.nn.Module
    policy_compute: torch.dtype | None
    reference: object | None  # reference_cache.LiveReference or CachedReference; None for a loss without one
    topology: Topology
    max_lengths: tuple[int, int]  # max_length, max_prompt_length: of KTO's mismatched examples
    routers: Routers | None = None  # the policy's, where its router loss is on (router_loss)

    @property
    def live_reference(self) -> bool:
        """Whether a step runs the reference's forward pass (its FLOPs count in MFU)."""
        return self.reference is not None and self.reference.live

    def __call__(self, examples: list[dict], split: str, batch: ModelBatch | None = None, coupled=None):
        """batch: the examples already laid out, else they are laid out here (once: policy and a live reference
        share it). coupled: CoupledBatch.part of this micro-batch, for a loss that reads the whole batch (always
        given where the router loss is on)."""
        batch = batch or self.scorer.batch(examples)
        with_sum_sq = self.objective.reads_sum_sq
        with self.recorded_routers() as router_logits:
            scores = self.scorer(self.policy, batch, self.policy_compute, with_sum_sq)  # a reward model's rewards
        policy_logps, log_sum_sq = scores if with_sum_sq else (scores, None)
        fields, reference_logps, router = coupled or ({}, None, None)
        if reference_logps is None and self.reference is not None:
            reference_logps = self.reference(examples, batch)
        labels = None
        if "label" in examples[0]:  # labelled completions
            labels = to_device(torch.tensor([ex["label"] for ex in examples]), policy_logps.device)
        lengths, margins = batch.sequence_lengths, {}
        if self.objective.reads_margins and "margin" in examples[0]:  # a data column (reward models)
            margins["margins"] = to_device(torch.tensor([ex["margin"] for ex in examples]), policy_logps.device)
        loss, metrics = self.objective(
            policy_logps, reference_logps, lengths, split, log_sum_sq, fields, labels, **margins
        )
        if self.routers is None:
            return loss, metrics
        part = self.routers.loss(*self.router_sums(router_logits, batch, examples, router))
        metrics[f"aux_loss/{split}"] = (
            (part * router.batch_examples / max(router.n_real, 1)).detach().expand(len(examples))
        )
        return loss + self.routers.coefficient * router.parts * part, metrics

    @functools.cached_property
    def router_modules(self) -> list[torch.nn.Module]:
        """The placed policy's routers, found once (not on each forward)."""
        return self.routers.modules(self.policy)

    def recorded_routers(self):
        """The policy's router logits of the forwards inside (router_loss.Routers.recorded), where its loss is on."""
        return self.routers.recorded(self.router_modules) if self.routers is not None else contextlib.nullcontext([])

    def router_sums(self, logits: list, batch: ModelBatch, examples: list[dict], router: RouterPart):
        """(this forward's router sums, the batch's router counts)."""
        sums = self.routers.sums(logits, token_weights(batch, examples, router.n_real))
        counts = router.counts if router.counts is not None else self.over_ranks(sums.counts)  # a rank's whole share
        return sums, counts

    def over_ranks(self, counts: RouterCounts) -> RouterCounts:
        """Router counts summed over the data-parallel ranks."""
        summed = self.topology.sum_over_dp(torch.cat([counts.choices, counts.tokens.reshape(1)]))
        return RouterCounts(summed[:-1], summed[-1])

    def use_reference(self, reference) -> None:
        """Read the reference's log-probs from `reference` from now on (a round's cached ones: rounds.py)."""
        self.reference = reference

    def over_micro_batches(
        self,
        examples: list[dict],
        split: str,
        batch_size: int,
        accumulation: int,
        backward: bool = False,
        scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> tuple[list[str], torch.Tensor]:
        """The loop of a training step and of a held-out batch alike: this rank's share of the batch `examples` in
        `accumulation` equal micro-batches (Topology.micro_batches), what the loss reads of the whole batch coupled
        first, each micro-batch laid out once and its loss computed (backward: its share of the batch's mean loss
        backpropagated, multiplied by `scale` where a float16 run scales it (core.loss_scale.LossScale.scale), and
        the positions it computed counted as perf/computed_tokens). Returns the metrics' names and their values
        [metrics, len(examples)] gathered over the ranks, still on the device."""
        columns = defaultdict(list)
        micro_batches, _ = self.topology.micro_batches(examples, batch_size, accumulation)
        coupled = self.couple(examples, batch_size, accumulation)
        for index, micro_batch in enumerate(micro_batches):
            batch = self.scorer.batch(micro_batch)
            loss, metrics = self(micro_batch, split, batch, coupled and coupled.part(index))
            if backward:
                # Each rank's loss is the mean over its share; averaging gradients over ranks gives the batch mean.
                share = loss / accumulation
                (scale(share) if scale else share).backward()
                # the positions this micro-batch computed, shared out over its examples: they add up over ranks
                n = len(micro_batch)
                metrics["perf/computed_tokens"] = torch.full((n,), batch.n_tokens / n, device=loss.device)
            for name, values in metrics.items():
                columns[name].append(values.detach().float())
        names = sorted(columns)
        return names, self.topology.gather_columns(torch.stack([torch.cat(columns[n]) for n in names]), len(examples))

    def couple(self, examples: list[dict], batch_size: int, accumulation: int) -> CoupledBatch | None:
        """What the loss reads from the whole batch `examples` (cut into micro-batches as Topology.micro_batches
        cuts it), or None if nothing: no-grad passes before the step, gathered over ranks.
        - aot, where the batch is more than one micro-batch (accumulation or ranks): the policy over this rank's
          micro-batches (its sort needs every pair before any backward): one forward more per step.
        - kto: the policy and the reference over the batch's mismatched examples (mismatched): KTO's
          reference point z0 = max(0, mean over their responses of log pi / pi_ref), the same for any
          accumulation and rank count.
        - the router loss: where each micro-batch sits, and where a rank has several, the batch's router counts
          from one no-grad forward of each (router_parts)."""
        micro_batches, n_real = self.topology.micro_batches(examples, batch_size, accumulation)
        several = len(micro_batches) > 1 or self.topology.dp_size > 1
        pairs = self.objective.couples_pairs and several
        if not pairs and not self.objective.needs_kl_estimate and self.routers is None:
            return None
        stats, kl, router = None, None, None
        positions, references = [None] * len(micro_batches), [None] * len(micro_batches)
        with torch.no_grad():
            if pairs:
                stats, positions, references = self.batch_statistics(micro_batches, n_real, len(examples))
            if self.objective.needs_kl_estimate:
                kl = self.kl_estimate(mismatched(examples, *self.max_lengths), batch_size, accumulation)
            if self.routers is not None:
                router = self.router_parts(micro_batches, n_real, len(examples))
        return CoupledBatch(stats, positions, references, kl, router)

    def router_parts(self, micro_batches: list[list[dict]], n_real: int, n_examples: int) -> list[RouterPart]:
        """Each micro-batch's RouterPart; where this rank has several, the batch's router counts from a no-grad
        forward of each (router_loss: the choices of the whole batch are needed before the first backward)."""
        size = len(micro_batches[0])
        reals = [max(0, min(size, n_real - index * size)) for index in range(len(micro_batches))]
        parts = len(micro_batches) * self.topology.dp_size
        counts = None
        if len(micro_batches) > 1:
            counts = RouterCounts(
                torch.zeros(self.routers.n_experts, device=self.topology.device),
                torch.zeros((), device=self.topology.device),
            )
            for examples, real in zip(micro_batches, reals):
                batch = self.scorer.batch(examples)
                with self.recorded_routers() as logits:
                    self.scorer(self.policy, batch, self.policy_compute)
                counts = counts + self.routers.sums(logits, token_weights(batch, examples, real)).counts
            counts = self.over_ranks(counts)
        return [RouterPart(counts, real, n_examples, parts) for real in reals]

    def batch_statistics(self, micro_batches: list[list[dict]], n_real: int, n_examples: int):
        """(PairStats [G] of the whole batch, where each micro-batch's pairs are in it, their reference log-probs)."""
        columns, references, positions = [], [], []
        share_start, index = self.topology.dp_rank * -(-n_examples // self.topology.dp_size), 0
        for examples in micro_batches:
            policy, reference, batch = self.scores(examples)
            references.append(reference)
            reference = torch.zeros_like(policy) if reference is None else reference
            lengths = batch.sequence_lengths.to(policy)
            columns.append(torch.stack([*policy.chunk(2), *reference.chunk(2), *lengths.chunk(2)]))
            local = torch.arange(index, index + len(examples))  # a padding copy (past n_real) is items[0]
            positions.append(to_device(torch.where(local < n_real, share_start + local, 0), policy.device))
            index += len(examples)
        stats = PairStats(*self.topology.gather_columns(torch.cat(columns, dim=1), n_examples))
        return stats, positions, references

    def kl_estimate(self, examples: list[dict], batch_size: int, accumulation: int) -> torch.Tensor:
        """[] max(0, mean over every response of `examples` of policy - reference log-prob), over all ranks."""
        micro_batches, _ = self.topology.micro_batches(examples, batch_size, accumulation)
        columns = []
        for micro_batch in micro_batches:
            policy, reference, _ = self.scores(micro_batch)
            columns.append((policy - reference).view(-1, len(micro_batch)).sum(0, keepdim=True))  # [1, b]
        log_ratios = self.topology.gather_columns(torch.cat(columns, dim=1), len(examples))  # [1, G]
        n_responses = len(examples[0]["responses"])
        return (log_ratios.sum() / (n_responses * len(examples))).clamp(min=0)

    def reference_keys(self, data: Data) -> list:
        """The keys of every example whose reference log-probs training on `data` reads: its scheduled training
        examples (an epoch's incomplete last batch is dropped), its eval batches' and, for kto, the mismatched
        examples of each step and eval batch."""
        scheduled = sorted({i for indices in data.schedule for i in indices})
        keys = [*data.train_examples.keys[scheduled], *(ex["key"] for batch in data.eval_batches for ex in batch)]
        if self.objective.needs_kl_estimate:
            batches = [data.train_examples.take(indices) for indices in data.schedule] + data.eval_batches
            keys += [ex["key"] for batch in batches for ex in mismatched(batch, *self.max_lengths)]
        return keys

    def scores(self, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor | None, ModelBatch]:
        """(policy log-probs, reference log-probs or None, the batch laid out), without gradients."""
        batch = self.scorer.batch(examples)
        policy = self.scorer(self.policy, batch, self.policy_compute)
        return policy, self.reference(examples, batch) if self.reference is not None else None, batch


def mismatched(examples: list[dict], max_length: int, max_prompt_length: int) -> list[dict]:
    """KTO's KL examples (Ethayarajh et al. 2024): each example's prompt, with its images, and the next one's
    responses (the last with the first's), truncated and keyed as `from_ids` does, so that the reference cache holds
    them as it holds pairs."""
    responses = [examples[(index + 1) % len(examples)]["responses"] for index in range(len(examples))]
    groups = np.zeros(len(examples), np.int64)
    prompts, images = [example["prompt"] for example in examples], [example.get("images", b"") for example in examples]
    made = from_ids(prompts, responses, groups, max_length, max_prompt_length, images)
    return made.take(range(len(made)))


def check_kto_prompts(examples: Examples, max_prompt_length: int) -> None:
    """One line where a prompt with images could be cut in a mismatched example (mismatched): with another example's
    longer completion it may exceed max_length, and a cut prompt is cut to max_prompt_length, which would drop
    image tokens."""
    long = np.flatnonzero((examples.image_lengths > 0) & (examples.lengths[:, 0] > max_prompt_length))
    if len(long):
        tokens = int(examples.lengths[long, 0].max())
        raise UserError(
            f"loss=kto pairs each prompt with another example's completion for its KL estimate, which cuts a prompt "
            f"to max_prompt_length={max_prompt_length} where the two exceed max_length; a prompt with images is "
            f"{tokens} tokens, its images' included, and must stay whole: raise max_prompt_length to {tokens}"
        )
