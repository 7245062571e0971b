"""How a run turns tokenized examples into per-sequence scores, float32 log-probs or a reward model's rewards: the
Scorer, decided once per run from the configuration and, where the model allows it, the probes (core/probes.py),
then applied to every micro-batch: the batch built in the run's layout on this rank's device with its attention
mask (core/attention.py), and scored in one forward (core/heads.py).
"""

import math
from dataclasses import dataclass

import torch

from core.attention import FLEX_BLOCK, attention_spans, describe_spans, packed_mask
from core.heads import head_logit_map, sequence_logps, sequence_rewards
from core.image_inputs import with_image_inputs
from core.layouts import AttentionSpan, ModelBatch, make_batch, segment_lengths, sequence_slice
from core.logprobs import IDENTITY, LogitMap
from core.probes import block_attention_problem, packing_problem, probes_dtype, scored_head_problem, vision_problem
from modeling.placement import lever_on
from modeling.sequence_parallel import SequenceGroup
from modeling.vision import Vision
from utils import UserError


@dataclass(frozen=True)
class ScoringSettings:
    """What a Scorer is asked for (train.py's keys of the same names); the defaults are config/config.yaml's: packed
    rows, the attention path the probes choose, the head only where a token is scored."""

    layout: str = "packed"
    packed_attention: str = "auto"
    scored_logits_only: bool = True
    pack_row_tokens: int | None = None  # a packed row's tokens (None: the layout's default)
    compile_blocks: str = "false"  # compiled blocks (modeling.placement.lever_on): rows in multiples of 128
    shape_buckets: str = "auto"  # packed batches' dimensions in buckets (core/shapes.py): auto, true or false

    @classmethod
    def of_run(cls, config) -> "ScoringSettings":
        return cls(
            config.layout, config.packed_attention, config.scored_logits_only, config.pack_row_tokens,
            config.compile_blocks, config.shape_buckets,
        )  # fmt: skip


@dataclass
class Scorer:
    """How this run turns tokenized examples into per-sequence scores, log-probs or a reward model's rewards: the
    layout and, for packed rows, the attention path and each layer type's span; whether the head runs on scored
    positions only, and the map of its output it applies; who applies the compute dtype (torch.autocast, or FSDP's
    mixed precision); and the token budget of a packed row."""

    layout: str
    attention: str
    scored_head: bool
    pad_token_id: int
    device: torch.device
    autocast: bool
    row_tokens: int | None = None
    tail_weight: float = 1.0  # LD-DPO's alpha (response_sums); 1: plain sums
    spans: dict[str, AttentionSpan] | None = None  # packed rows' span per layer type (None: full attention)
    logit_map: LogitMap = IDENTITY  # the scored head's map of its output
    reward_eos: int | None = None  # a reward model's: rewards read before this EOS id (sequence_rewards)
    fallbacks: tuple[str, ...] = ()  # each lever the run asked for and did not get, and why (printed by create)
    vision: Vision | None = None  # a vision-language model's processor: the batches' image inputs
    sequence: SequenceGroup | None = None  # this rank's sp group: each rank computes a slice of every row
    row_multiple: int = 1  # packed rows' length rounded up to a multiple of this (compiled blocks: FLEX_BLOCK)
    buckets: bool = False  # packed batches' dimensions rounded up to core.shapes' buckets (shape_buckets)
    compiled_head: bool = False  # the scored head's chunks through compiled kernels (compile_blocks)

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        settings: ScoringSettings,
        pad_token_id: int,
        topology,
        autocast: bool,
        compute: torch.dtype | None,
        tail_weight: float = 1.0,
        reward_eos: int | None = None,
        vision: Vision | None = None,
    ) -> "Scorer":
        """As `settings` ask where the model allows, checked on the placed model by every
        rank (sharded models need them all in each forward) and decided by rank 0; each fallback is one line
        saying why. compute: the policy's compute dtype (None: its weights'); tail_weight: the objective's
        (response_sums); reward_eos: a reward model's EOS id (its head reads one position a sequence: no scored
        logits to choose)."""
        probe_dtype = probes_dtype(model, compute, autocast)
        device = topology.device
        layout, attention, scored_head = settings.layout, settings.packed_attention, settings.scored_logits_only
        scored_head = scored_head and reward_eos is None
        notes = []
        vision = vision.for_model(model) if vision is not None else None
        problem = vision_problem(model, vision, probe_dtype, device, reward_eos) if vision is not None else None
        problem = topology.broadcast(problem)
        if problem:
            raise UserError(f"{problem}: this model cannot train on pairs with images here (docs/vision.md)")
        problem = packing_problem(model, probe_dtype, device, reward_eos, vision) if layout == "packed" else None
        if problem:
            notes.append(f"layout: padded, not packed: {problem}")
            layout = "padded"
        if layout == "packed" and attention != "dense":
            problem = block_attention_problem(model, probe_dtype, device, reward_eos)
            if problem and attention == "block":
                notes.append(f"packed_attention=block: dense mask instead: {problem}")
            elif problem and device.type == "cuda":
                notes.append(f"packed attention: dense [T, T] mask, not a block mask: {problem}")
            attention = "dense" if problem else "block"
        attention = attention if layout == "packed" else "dense"  # padded rows take a 2-D mask: no choice to make
        problem = scored_head_problem(model, probe_dtype, device) if scored_head else None
        if problem:
            notes.append(f"logits: computed at every position, not only where a token is scored: {problem}")
            scored_head = False
        layout, attention, scored_head, notes = topology.broadcast((layout, attention, scored_head, notes))
        sequence = None
        if topology.sp_size > 1:
            sequence = sequence_group(topology, layout, notes, vision)
        spans = attention_spans(model) if layout == "packed" else None
        logit_map = head_logit_map(model) if scored_head else IDENTITY
        compiled = lever_on(settings.compile_blocks, device.type)
        row_tokens, row_multiple = settings.pack_row_tokens, FLEX_BLOCK if compiled else 1
        buckets = layout == "packed" and lever_on(settings.shape_buckets, device.type)
        scorer = cls(
            layout, attention, scored_head, pad_token_id, device, autocast, row_tokens, tail_weight, spans, logit_map,
            reward_eos, tuple(notes), vision, sequence, row_multiple, buckets, compiled and scored_head,
        )  # fmt: skip
        for note in notes:
            print(note)
        print(f"scoring: {scorer.describe()}")
        return scorer

    def describe(self) -> str:
        spans = describe_spans(self.spans) if self.spans else ""
        rounded = f"; rows in multiples of {self.row_multiple} tokens" if self.row_multiple > 1 else ""
        rounded = "; shapes in buckets" if self.buckets else rounded
        attention = (
            f" ({self.attention} attention{'; ' + spans if spans else ''}{rounded})" if self.layout == "packed" else ""
        )
        head = f"scored logits{' ' + self.logit_map.describe() if self.logit_map != IDENTITY else ''}"
        head += " (compiled chunks)" if self.compiled_head else ""
        tails = f", response tails weighted {self.tail_weight:g}" if self.tail_weight != 1.0 else ""
        if self.reward_eos is not None:
            head = "reward head on each response's last token"
        elif not self.scored_head:
            head = "all logits"
        sequence = f", each row's tokens over {self.sequence.size} sequence-parallel ranks" if self.sequence else ""
        return f"{self.layout} layout{attention}, {head}{tails}{sequence}"

    def row_budget(self, segments: list[int]) -> int | None:
        """Tokens per packed row of segments of these lengths: `pack_row_tokens` when set; with a block mask the whole
        micro-batch in one row (masked blocks cost nothing, and one row has no padding but its tail); with a dense
        mask the longest segment (None: each row's attention costs T x T)."""
        if self.row_tokens is not None or self.attention != "block":
            return self.row_tokens
        return sum(segments)

    @property
    def multiple(self) -> int:
        """What a packed row's length is a multiple of: FlexAttention's tile (a block mask, compiled blocks), and a
        sequence-parallel group's size (rows cut into equal slices)."""
        multiple = FLEX_BLOCK if self.attention == "block" else self.row_multiple
        return math.lcm(multiple, self.sequence.size) if self.sequence is not None else multiple

    def batch(self, examples: list[dict]) -> ModelBatch:
        """The examples in this run's layout, on this rank's device, a packed batch with its attention mask built
        (once: the policy and a live reference share it)."""
        budget = self.row_budget(segment_lengths(examples))
        batch = make_batch(self.layout, examples, self.pad_token_id, budget, self.multiple, self.buckets)
        batch = with_image_inputs(batch, examples, self.vision)
        if self.sequence is not None:
            batch.sequence_part = sequence_slice(batch, self.sequence.rank, self.sequence.size)
        batch = batch.to(self.device)
        if self.layout == "packed":
            batch.attention_mask = packed_mask(batch, self.attention, self.spans)
        return batch

    def __call__(
        self, model: torch.nn.Module, batch: ModelBatch, compute: torch.dtype | None, with_sum_sq=False, temperature=1.0
    ):
        """[R * B] float32 summed log-probs of each example's responses (all first responses, then all second
        ones), or a reward model's rewards, in one forward pass; compute: the model's compute dtype, or None for its
        weights'. with_sum_sq: and their sums of log sum_v p_v^2 (sequence_logps). temperature: the log-probs'
        (sequence_logps: a number, or [R * B] one per sequence)."""
        autocast = compute if self.autocast else None
        mask_dtype = compute or next(model.parameters()).dtype
        if self.sequence is not None:
            self.sequence.install(model)  # the policy's and a live reference's, at their first forward
        if self.reward_eos is not None:
            return sequence_rewards(
                model, batch, autocast, mask_dtype, self.reward_eos, self.attention, self.spans, self.sequence
            )
        return sequence_logps(
            model,
            batch,
            autocast,
            mask_dtype,
            self.scored_head,
            self.attention,
            self.tail_weight,
            with_sum_sq,
            logit_map=self.logit_map,
            sequence=self.sequence,
            temperature=temperature,
            compiled_head=self.compiled_head,
        )


def sequence_group(topology, layout: str, notes: list[str], vision: Vision | None) -> SequenceGroup:
    """This rank's sp group, where the run can cut its rows: packed rows, whose mask is given whole to every layer
    (padded rows' masks are transformers' own, built from the tokens a rank holds), and no images."""
    size = topology.sp_size
    if layout != "packed":
        why = next((note for note in notes if note.startswith("layout:")), "layout=padded")
        raise UserError(f"sequence_parallel_size={size} cuts packed rows into slices; {why}")
    if vision is not None:
        raise UserError(f"sequence_parallel_size={size}: a vision-language model's images are not cut into slices")
    return SequenceGroup(topology.mesh["sp"].get_group(), size, topology.sp_rank)
