"""Per-sequence float32 log-probabilities of a model on a `ModelBatch`, and the checks that decide, once per run,
whether a model can take the packed layout, its block-mask attention and the scored-positions-only LM head.

The LM head runs inside the model's own forward (so FSDP2 has gathered its weight and tensor parallelism sees it
as usual): transformers' `logits_to_keep` selects the hidden states that predict a scored token, and the head is
swapped, for that forward only, for one that returns their float32 log-probs without materialising logits.

Nothing here waits for the device: every index is built on the host with the batch, and the per-sequence sums are
a segment reduction over tokens grouped by sequence (deterministic on CUDA, where `index_add_` uses atomics), so
that a policy and its cached reference agree to the last bit on any device.
"""

import contextlib
import inspect
from dataclasses import dataclass

import torch

from layouts import ModelBatch, dense_mask, make_batch, pack, packed_mask_mod, pad, segment_lengths
from logprobs import token_logps_from_hidden, token_logps_from_logits
from utils import first_line

# Probe inputs: two examples with prompts of 3 and 1 tokens and responses of 1 to 3 tokens.
PROBE_EXAMPLES = [
    {"prompt": [5, 6, 7], "responses": [[8, 9], [10]]},
    {"prompt": [11], "responses": [[12, 13, 14], [15, 16]]},
]
ATTENTIONS = ("auto", "dense", "block")
# FlexAttention's tile: block-mask rows are padded to a multiple of it, so that the compiled kernel sees few shapes.
FLEX_BLOCK = 128


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4-D mask as the float mask transformers adds to attention scores: eager attention adds the mask
    it is given, so a boolean one would be silently ignored there."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def block_mask(batch: ModelBatch):
    """FlexAttention's BlockMask of a packed batch, from its per-token ids: fully masked 128 x 128 blocks are listed
    as skipped, and no [T, T] tensor is made (the compiled builder works block by block: at T = 32k on a CPU, 0.5 s
    and no extra memory, against 18 s and 10 GB uncompiled; `python bench.py --attention`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = batch.input_ids.shape
    device = batch.input_ids.device
    mask_mod = packed_mask_mod(batch.segment_ids, batch.branch_ids)
    return create_block_mask(mask_mod, rows, None, length, length, device=device, _compile=True)


def packed_mask(batch: ModelBatch, attention: str):
    """A packed batch's attention on its device: the [R, 1, T, T] boolean mask ("dense") or a BlockMask ("block")."""
    return block_mask(batch) if attention == "block" else dense_mask(batch)


@contextlib.contextmanager
def attention_implementation(model: torch.nn.Module, name: str | None):
    """transformers' attention implementation set to `name` for the forwards inside this block (None: unchanged).
    The config's setter passes it on to sub-configs; every attention layer reads it at each forward."""
    if name is None:
        yield
        return
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = previous


@contextlib.contextmanager
def head_returns_token_logps(model: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor, with_sum_sq: bool):
    """For the forwards inside this block, the model's LM head maps the kept hidden states [R, K, H] to the
    float32 log-probs [M] of `targets` at flat kept rows `rows` (chunked: no [M, V] logits). with_sum_sq: the
    block yields a dict that the forward fills with "log_sum_sq", [M] log sum_v p_v^2 (the model returns one
    tensor, its head's)."""
    head, extras = model.get_output_embeddings(), {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        out = token_logps_from_hidden(hidden.flatten(0, -2), head.weight, head.bias, rows, targets, with_sum_sq)
        if not with_sum_sq:
            return out
        extras["log_sum_sq"] = out[1]
        return out[0]

    head.forward = forward
    try:
        yield extras
    finally:
        del head.forward


def sequence_logps(
    model: torch.nn.Module,
    batch: ModelBatch,
    autocast_dtype: torch.dtype | None,
    mask_dtype: torch.dtype,
    scored_head: bool,
    attention: str = "dense",
    tail_weight: float = 1.0,
    with_sum_sq: bool = False,
):
    """[S] float32 summed log-probs of each sequence's scored tokens, in one forward pass of `model`.

    autocast_dtype: run the forward under torch.autocast in this dtype (None: no autocast).
    mask_dtype: the dtype attention computes in, for the additive dense mask of the packed layout.
    scored_head: the head runs only on the hidden states that predict a scored token, fused with the float32
    log-softmax; otherwise the model returns all [R, T, V] logits and the log-softmax is chunked over them.
    attention: for a packed batch whose mask is not built yet (see Scorer.batch), "dense" ([R, 1, T, T] additive
    mask, SDPA) or "block" (FlexAttention).
    tail_weight: the weight of the tokens beyond the example's shortest response (response_sums).
    with_sum_sq: also [S] sums of log sum_v p_v^2 over each sequence's scored tokens (WPO), no gradient, from the
    same logits: (logps, log_sum_sq)."""
    mask = batch.attention_mask if batch.attention_mask is not None else packed_mask(batch, attention)
    flex = not torch.is_tensor(mask)  # a BlockMask
    if not flex and mask.dim() == 4:
        mask = additive_mask(mask, mask_dtype)
    inputs = dict(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
    device = batch.input_ids.device
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with autocast, attention_implementation(model, "flex_attention" if flex else None):
        if scored_head:
            with head_returns_token_logps(model, batch.score_rows, batch.score_targets, with_sum_sq) as extras:
                token_logps = model(**inputs, logits_to_keep=batch.keep_positions).logits
            log_sum_sq = extras.get("log_sum_sq")
        else:
            logits = model(**inputs).logits.flatten(0, 1)
            out = token_logps_from_logits(logits, batch.score_positions, batch.score_targets, with_sum_sq)
            token_logps, log_sum_sq = out if with_sum_sq else (out, None)
    logps = response_sums(token_logps.float().view(-1), batch, tail_weight)
    return (logps, response_sums(log_sum_sq.view(-1), batch)) if with_sum_sq else logps


def response_sums(token_values: torch.Tensor, batch: ModelBatch, tail_weight: float = 1.0) -> torch.Tensor:
    """[S] sums of [N] per-token values over each sequence's scored tokens. With tail_weight alpha != 1, LD-DPO's
    length-desensitized sum (Liu et al. 2024, arXiv:2409.06411): the tokens within the example's shortest
    response count fully and the rest (the longer response's tail) alpha times, so that the likelihood no longer
    grows with the length difference alone. A policy and its reference sum alike."""
    if tail_weight == 1.0:
        return torch.segment_reduce(token_values, "sum", lengths=batch.sequence_lengths, unsafe=True, initial=0)
    shared, lengths = batch.shared_lengths, batch.sequence_lengths
    parts = torch.stack([shared, lengths - shared], dim=1).view(-1)  # [2S]: shared part, then tail, per sequence
    sums = torch.segment_reduce(token_values, "sum", lengths=parts, unsafe=True, initial=0).view(-1, 2)
    return sums[:, 0] + tail_weight * sums[:, 1]


def probe_tolerance(dtype: torch.dtype) -> float:
    """Rounding allowance of the probes: float32 reorderings, or 16-bit compute; a real mismatch is of order 1."""
    return 1e-4 if dtype == torch.float32 else 1e-1


def model_class(model: torch.nn.Module):
    """The transformers model inside peft's wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compare(model, batch: ModelBatch, expected: ModelBatch, dtype, device, mismatch: str, **options) -> str | None:
    """None when `batch` gives `expected`'s log-probs (padded, all logits) within rounding, else why not, starting
    with the model's name; mismatch: what a numeric difference means. No autocast: the model computes in `dtype`
    (its weights', or FSDP's mixed precision)."""
    name = type(model_class(model)).__name__
    try:
        with torch.no_grad():
            got = sequence_logps(model, batch.to(device), None, dtype, **options)
            want = sequence_logps(model, expected.to(device), None, dtype, scored_head=False)
    except Exception as error:  # any failure means: not this model
        return f"{name} failed with it ({type(error).__name__}: {first_line(error)})"
    if not torch.allclose(got, want, rtol=probe_tolerance(dtype), atol=probe_tolerance(dtype)):
        return f"{name} {mismatch} (log-probs differ by {(got - want).abs().max():.2g})"
    return None


def scored_head_problem(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the fused scored-positions head cannot replace this model's LM head, or None when it can: the model must
    take `logits_to_keep` as positions per row and return its head's output unchanged (no soft-capping or scaling
    after the head)."""
    name = type(model_class(model)).__name__
    if "logits_to_keep" not in inspect.signature(model_class(model).forward).parameters:
        return f"{name}.forward takes no logits_to_keep"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return f"{name}'s output embedding is not a Linear layer"
    batch = pad(PROBE_EXAMPLES, 0)
    return compare(model, batch, batch, dtype, device, "changes its head's output", scored_head=True)


def packing_problem(model: torch.nn.Module, max_length: int, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why this model cannot take the packed layout, or None when it can: it must honour a custom 4-D attention
    mask and explicit position ids, which the probe checks numerically against the padded layout."""
    config, name = model.config, type(model_class(model)).__name__
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4-D mask (sdpa and eager do)"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and window < max_length:
        return (
            f"{name}'s sliding window ({window} tokens, below max_length={max_length}) is not applied to a custom mask"
        )
    mismatch = "does not honour a custom 4-D mask and position ids"
    return compare(model, pack(PROBE_EXAMPLES, 0), pad(PROBE_EXAMPLES, 0), dtype, device, mismatch, scored_head=False)


def block_attention_problem(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why packed rows cannot run through FlexAttention with a block mask, or None when they can: a CUDA device
    (FlexAttention has no backward pass on CPU), a model that declares FlexAttention support, and log-probs equal
    to the padded layout's."""
    name = type(model_class(model)).__name__
    if not getattr(model_class(model), "_supports_flex_attn", False):
        return f"{name} does not declare FlexAttention support"
    if device.type != "cuda":
        return "FlexAttention has no backward pass on CPU"
    packed = pack(PROBE_EXAMPLES, 0, row_tokens=sum(segment_lengths(PROBE_EXAMPLES)), multiple=FLEX_BLOCK)
    mismatch = "computes other log-probs with a block mask"
    return compare(model, packed, pad(PROBE_EXAMPLES, 0), dtype, device, mismatch, scored_head=False, attention="block")


@dataclass
class Scorer:
    """How this run turns tokenized examples into per-sequence log-probs: the layout and, for packed rows, the
    attention path; whether the head runs on scored positions only; who applies the compute dtype (torch.autocast,
    or FSDP's mixed precision); and the token budget of a packed row."""

    layout: str
    attention: str
    scored_head: bool
    pad_token_id: int
    device: torch.device
    autocast: bool
    row_tokens: int | None = None
    tail_weight: float = 1.0  # LD-DPO's alpha (response_sums); 1: plain sums

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        settings,
        pad_token_id: int,
        topology,
        autocast: bool,
        compute: torch.dtype | None,
        tail_weight: float = 1.0,
    ) -> "Scorer":
        """As configured (settings: the run's config) where the model allows, checked on the placed model by every
        rank (sharded models need them all in each forward) and decided by rank 0; each fallback is one line
        saying why. compute: the policy's compute dtype (None: its weights'); tail_weight: the objective's
        (response_sums)."""
        weights = next(model.parameters()).dtype
        probe_dtype = weights if autocast else (compute or weights)  # probes run without autocast: exact in float32
        device = topology.device
        layout, attention, scored_head = settings.layout, settings.packed_attention, settings.scored_logits_only
        notes = []
        problem = packing_problem(model, settings.max_length, probe_dtype, device) if layout == "packed" else None
        if problem:
            notes.append(f"layout: padded, not packed: {problem}")
            layout = "padded"
        if layout == "packed" and attention != "dense":
            problem = block_attention_problem(model, probe_dtype, device)
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
        row_tokens = settings.pack_row_tokens
        scorer = cls(layout, attention, scored_head, pad_token_id, device, autocast, row_tokens, tail_weight)
        for note in notes:
            print(note)
        print(f"scoring: {scorer.describe()}")
        return scorer

    def describe(self) -> str:
        attention = f" ({self.attention} attention)" if self.layout == "packed" else ""
        tails = f", response tails weighted {self.tail_weight:g}" if self.tail_weight != 1.0 else ""
        return f"{self.layout} layout{attention}, {'scored' if self.scored_head else 'all'} logits{tails}"

    def row_budget(self, examples: list[dict]) -> int | None:
        """Tokens per packed row: `pack_row_tokens` when set; with a block mask the whole micro-batch in one row
        (masked blocks cost nothing, and one row has no padding but its tail); with a dense mask the longest
        segment (each row's attention costs T x T)."""
        if self.row_tokens is not None or self.attention != "block":
            return self.row_tokens
        return sum(segment_lengths(examples))

    def batch(self, examples: list[dict]) -> ModelBatch:
        """The examples in this run's layout, on this rank's device, a packed batch with its attention mask built
        (once: the policy and a live reference share it)."""
        multiple = FLEX_BLOCK if self.attention == "block" else 1
        batch = make_batch(self.layout, examples, self.pad_token_id, self.row_budget(examples), multiple)
        batch = batch.to(self.device)
        if self.layout == "packed":
            batch.attention_mask = packed_mask(batch, self.attention)
        return batch

    def __call__(self, model: torch.nn.Module, batch: ModelBatch, compute: torch.dtype | None, with_sum_sq=False):
        """[R * B] float32 summed log-probs of each example's responses (all first responses, then all second
        ones), in one forward pass; compute: the model's compute dtype, or None for its weights'. with_sum_sq: and
        their sums of log sum_v p_v^2 (sequence_logps)."""
        autocast = compute if self.autocast else None
        mask_dtype = compute or next(model.parameters()).dtype
        return sequence_logps(
            model, batch, autocast, mask_dtype, self.scored_head, self.attention, self.tail_weight, with_sum_sq
        )
