"""Per-sequence float32 log-probabilities of a model on a `ModelBatch`, and the checks that decide, once per run,
whether a model can take the packed layout and the scored-positions-only LM head.

The LM head runs inside the model's own forward (so FSDP2 has gathered its weight and tensor parallelism sees it
as usual): transformers' `logits_to_keep` selects the hidden states that predict a scored token, and the head is
swapped, for that forward only, for one that returns their float32 log-probs without materialising logits.
"""

import contextlib
import inspect
from dataclasses import dataclass

import torch

from layouts import ModelBatch, make_batch, pack, pad
from logprobs import token_logps_from_hidden, token_logps_from_logits
from utils import first_line

# Probe inputs: two examples with prompts of 3 and 1 tokens and responses of 1 to 3 tokens.
PROBE_EXAMPLES = [
    {"prompt": [5, 6, 7], "responses": [[8, 9], [10]]},
    {"prompt": [11], "responses": [[12, 13, 14], [15, 16]]},
]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4-D mask as the float mask transformers adds to attention scores: eager attention adds the mask
    it is given, so a boolean one would be silently ignored there."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


@contextlib.contextmanager
def head_returns_token_logps(model: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor):
    """For the forwards inside this block, the model's LM head maps the kept hidden states [K, H] to the float32
    log-probs [M] of `targets` at hidden rows `rows` (chunked: no [M, V] logits)."""
    head = model.get_output_embeddings()
    head.forward = lambda hidden: token_logps_from_hidden(hidden, head.weight, head.bias, rows, targets)
    try:
        yield
    finally:
        del head.forward


def sequence_logps(
    model: torch.nn.Module,
    batch: ModelBatch,
    autocast_dtype: torch.dtype | None,
    mask_dtype: torch.dtype,
    scored_head: bool,
) -> torch.Tensor:
    """[S] float32 summed log-probs of each sequence's scored tokens, in one forward pass of `model`.

    autocast_dtype: run the forward under torch.autocast in this dtype (None: no autocast).
    mask_dtype: the dtype attention computes in, for the additive mask of the packed layout.
    scored_head: the head runs only on the hidden states that predict a scored token, fused with the float32
    log-softmax; otherwise the model returns all [R, T, V] logits and the log-softmax is chunked over them."""
    device = batch.input_ids.device
    mask = batch.attention_mask
    if mask.dim() == 4:
        mask = additive_mask(mask, mask_dtype)
    inputs = dict(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
    autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with autocast:
        if scored_head:
            keep = torch.zeros(batch.input_ids.numel(), dtype=torch.bool, device=device)
            keep[batch.score_positions] = True
            rows = keep.cumsum(0)[batch.score_positions] - 1  # row of each scored token among the kept hidden states
            with head_returns_token_logps(model, rows, batch.score_targets):
                token_logps = model(**inputs, logits_to_keep=keep.view_as(batch.input_ids)).logits
        else:
            logits = model(**inputs).logits
            token_logps = token_logps_from_logits(logits.flatten(0, 1), batch.score_positions, batch.score_targets)
    total = torch.zeros(batch.n_sequences, dtype=torch.float32, device=device)
    return total.index_add_(0, batch.score_sequences, token_logps.float().view(-1))


def probe_tolerance(model: torch.nn.Module) -> float:
    """Rounding allowance of the probes: float32 reorderings, or 16-bit weights; a real mismatch is of order 1."""
    return 1e-4 if next(model.parameters()).dtype == torch.float32 else 5e-2


@torch.no_grad()
def scored_head_problem(model: torch.nn.Module) -> str | None:
    """Why the fused scored-positions head cannot replace this model's LM head, or None when it can: the model must
    take `logits_to_keep` and return its head's output unchanged (no soft-capping or scaling after the head)."""
    name = type(model).__name__
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model passes it through
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        return f"{name}.forward takes no logits_to_keep"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return f"{name}'s output embedding is not a Linear layer"
    batch = pad(PROBE_EXAMPLES, 0)
    try:
        dtype = next(model.parameters()).dtype
        fused = sequence_logps(model, batch, None, dtype, scored_head=True)
        full = sequence_logps(model, batch, None, dtype, scored_head=False)
    except Exception as error:  # any failure means: not this model
        return f"{name} failed with it ({type(error).__name__}: {first_line(error)})"
    if not torch.allclose(fused, full, rtol=probe_tolerance(model), atol=probe_tolerance(model)):
        return f"{name} changes its head's output (log-probs differ by {(fused - full).abs().max():.2g})"
    return None


@torch.no_grad()
def packing_problem(model: torch.nn.Module, max_length: int) -> str | None:
    """Why this model cannot take the packed layout, or None when it can: it must honour a custom 4-D attention
    mask and explicit position ids, which the probe checks numerically against the padded layout."""
    config, name = model.config, type(model).__name__
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4-D mask (sdpa and eager do)"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and window < max_length:
        return (
            f"{name}'s sliding window ({window} tokens, below max_length={max_length}) is not applied to a custom mask"
        )
    try:
        dtype = next(model.parameters()).dtype
        packed = sequence_logps(model, pack(PROBE_EXAMPLES, 0), None, dtype, scored_head=False)
        padded = sequence_logps(model, pad(PROBE_EXAMPLES, 0), None, dtype, scored_head=False)
    except Exception as error:
        return f"{name} failed with it ({type(error).__name__}: {first_line(error)})"
    if not torch.allclose(packed, padded, rtol=probe_tolerance(model), atol=probe_tolerance(model)):
        difference = (packed - padded).abs().max()
        return f"{name} does not honour a custom 4-D mask and position ids (log-probs differ by {difference:.2g})"
    return None


@dataclass
class Scorer:
    """How this run turns tokenized examples into per-sequence log-probs: the layout, whether the head runs on
    scored positions only, and who applies the compute dtype (torch.autocast, or FSDP's mixed precision)."""

    layout: str
    scored_head: bool
    pad_token_id: int
    device: torch.device
    autocast: bool

    @classmethod
    def create(
        cls,
        model: torch.nn.Module,
        layout: str,
        scored_head: bool,
        max_length: int,
        pad_token_id: int,
        device: torch.device,
        autocast: bool,
    ) -> "Scorer":
        """As configured where the model allows; each fallback is one line saying why."""
        problem = packing_problem(model, max_length) if layout == "packed" else None
        if problem:
            print(f"layout: padded, not packed: {problem}")
            layout = "padded"
        problem = scored_head_problem(model) if scored_head else None
        if problem:
            print(f"logits: computed at every position, not only where a token is scored: {problem}")
            scored_head = False
        return cls(layout, scored_head, pad_token_id, device, autocast)

    def describe(self) -> str:
        return f"{self.layout} layout, {'scored' if self.scored_head else 'all'} logits"

    def batch(self, examples: list[dict]) -> ModelBatch:
        """The examples in this run's layout, on this rank's device."""
        return make_batch(self.layout, examples, self.pad_token_id).to(self.device)

    def __call__(self, model: torch.nn.Module, batch: ModelBatch, compute: torch.dtype | None) -> torch.Tensor:
        """[R * B] float32 summed log-probs of each example's responses (all first responses, then all second
        ones), in one forward pass; compute: the model's compute dtype, or None for its weights'."""
        autocast = compute if self.autocast else None
        mask_dtype = compute or next(model.parameters()).dtype
        return sequence_logps(model, batch, autocast, mask_dtype, scored_head=self.scored_head)
