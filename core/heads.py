"""Per-sequence float32 log-probabilities of a model on a `ModelBatch`, and a reward model's rewards, each in one
forward pass with the model's head swapped for that forward.

The LM head runs inside the model's own forward (so FSDP2 has gathered its weight and tensor parallelism sees it
as usual): transformers' `logits_to_keep` selects the hidden states that predict a scored token, and the head is
swapped, for that forward only, for one that returns their float32 log-probs without materialising logits. A reward
model's scalar head likewise reads only the one position of each sequence its reward is read at.

Nothing here waits for the device: every index is built on the host with the batch, and the per-sequence sums are
a segment reduction over tokens grouped by sequence (deterministic on CUDA, where `index_add_` uses atomics), so
that a policy and its cached reference agree to the last bit on any device.
"""

import contextlib
import dataclasses

import torch

from core.attention import forward_context, language_model_masks, model_class, model_inputs
from core.layouts import AttentionSpan, ModelBatch, SequenceSlice
from core.logprobs import IDENTITY, LogitMap, token_logps_from_hidden, token_logps_from_logits
from modeling.reward_head import reward_head
from modeling.sequence_parallel import SequenceGroup

# The elementwise maps transformers' causal LMs apply to their head's output, by where each reads its constant at
# every forward and the constant's identity value: the fused head applies them itself (logprobs.LogitMap), so for its
# forward the model's own is set to the identity.
HEAD_OUTPUT_MAPS = {
    "final_logit_softcapping": ("config", None),  # Gemma 2 and 3: cap * tanh(logits / cap)
    "logit_scale": ("model", 1.0),  # Cohere, Cohere 2: logits * logit_scale
    "logits_scaling": ("config", 1.0),  # Granite, Granite MoE: logits / logits_scaling
}


def head_output_maps(model: torch.nn.Module) -> dict[str, tuple[object, float | None]]:
    """The HEAD_OUTPUT_MAPS this model applies: attribute -> (the object it is read from, its value)."""
    found = {}
    for attribute, (owner, identity) in HEAD_OUTPUT_MAPS.items():
        holder = model_class(model).config.get_text_config() if owner == "config" else model_class(model)
        value = getattr(holder, attribute, identity)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value != identity:
            found[attribute] = (holder, value)
    return found


def head_logit_map(model: torch.nn.Module) -> LogitMap:
    """The map the model applies to its head's output, as a LogitMap (the identity for most models)."""
    values = {attribute: value for attribute, (_, value) in head_output_maps(model).items()}
    scale = values.get("logit_scale", 1.0) / values.get("logits_scaling", 1.0)
    return LogitMap(scale=scale, cap=values.get("final_logit_softcapping"))


@contextlib.contextmanager
def head_returns_token_logps(
    model: torch.nn.Module,
    rows: torch.Tensor,
    targets: torch.Tensor,
    with_sum_sq: bool,
    logit_map: LogitMap,
    temperatures: torch.Tensor | None = None,
    compiled: bool = False,
):
    """For the forwards inside this block, the model's LM head maps the kept hidden states [R, K, H] to the
    float32 log-probs [M] of `targets` at flat kept rows `rows` (chunked: no [M, V] logits), its output mapped by
    `logit_map` first, and the model's own map of the head's output is the identity. with_sum_sq: the block yields
    a dict that the forward fills with "log_sum_sq", [M] log sum_v p_v^2 (the model returns one tensor, its
    head's). temperatures: [M] (on the host) each token's, its logits divided by it after the map (no with_sum_sq):
    the tokens of each temperature go through the head together. compiled: the head's chunks through compiled kernels
    (logprobs.CompiledChunks)."""
    head, extras = model.get_output_embeddings(), {}
    own_maps = head_output_maps(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.flatten(0, -2)
        if temperatures is not None:
            out = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
            for temperature in temperatures.unique().tolist():
                group = (temperatures == temperature).nonzero().flatten().to(rows.device)
                tempered = dataclasses.replace(logit_map, temperature=temperature)
                weight, bias = head.weight, head.bias
                out[group] = token_logps_from_hidden(
                    hidden, weight, bias, rows[group], targets[group], False, tempered, compiled
                )
            return out
        out = token_logps_from_hidden(hidden, head.weight, head.bias, rows, targets, with_sum_sq, logit_map, compiled)
        if not with_sum_sq:
            return out
        extras["log_sum_sq"] = out[1]
        return out[0]

    head.forward = forward
    for attribute, (holder, _) in own_maps.items():
        setattr(holder, attribute, HEAD_OUTPUT_MAPS[attribute][1])
    try:
        yield extras
    finally:
        del head.forward
        for attribute, (holder, value) in own_maps.items():
            setattr(holder, attribute, value)


def sequence_logps(
    model: torch.nn.Module,
    batch: ModelBatch,
    autocast_dtype: torch.dtype | None,
    mask_dtype: torch.dtype,
    scored_head: bool,
    attention: str = "dense",
    tail_weight: float = 1.0,
    with_sum_sq: bool = False,
    spans: dict[str, AttentionSpan] | None = None,
    logit_map: LogitMap = IDENTITY,
    sequence: SequenceGroup | None = None,
    temperature: float | torch.Tensor = 1.0,
    compiled_head: bool = False,
):
    """[S] float32 summed log-probs of each sequence's scored tokens, in one forward pass of `model`.

    autocast_dtype: run the forward under torch.autocast in this dtype (None: no autocast).
    mask_dtype: the dtype attention computes in, for the additive dense mask of the packed layout.
    scored_head: the head runs only on the hidden states that predict a scored token, fused with the float32
    log-softmax and `logit_map` (the model's own map of its head's output, head_logit_map); otherwise the model
    returns all [R, T, V] logits and the log-softmax is chunked over them.
    attention, spans: for a packed batch whose mask is not built yet (see Scorer.batch), "dense" ([R, 1, T, T]
    additive mask, SDPA) or "block" (FlexAttention), and each layer type's span (packed_mask).
    tail_weight: the weight of the tokens beyond the example's shortest response (response_sums).
    with_sum_sq: also [S] sums of log sum_v p_v^2 over each sequence's scored tokens (WPO), no gradient, from the
    same logits: (logps, log_sum_sq).
    sequence: this rank's sp group (sequence parallelism): the model reads this rank's slice of the rows
    (batch.sequence_part) with the whole rows' mask, and scores the tokens its slice predicts; summed over the
    group, in their places among the batch's scored tokens (the others zeros), every rank has every token's
    log-prob, and sums them in the order one process does: an sp run's sums do not depend on where a slice ends.
    temperature: the log-probs of the model's logits divided by it, a number or [S] one per sequence (on the host;
    no with_sum_sq, no sequence parallelism): sampled completions' log-probs (generation/sampling.py).
    compiled_head: the scored head's chunks through compiled kernels (logprobs.CompiledChunks; compile_blocks)."""
    per_token = None  # [N] each scored token's temperature, on the host
    if isinstance(temperature, torch.Tensor):
        per_token = temperature.float().repeat_interleave(batch.sequence_lengths.cpu())
    elif temperature != 1.0:
        per_token = torch.full((batch.score_targets.numel(),), float(temperature))
    if per_token is not None and (with_sum_sq or sequence is not None):
        raise ValueError("a temperature: without with_sum_sq and sequence parallelism")
    inputs, flex = model_inputs(batch, mask_dtype, attention, spans)
    scored = batch
    if sequence is not None:  # the sequence-parallel attention runs FlexAttention itself for a block mask
        scored, flex = sequence_inputs(inputs, batch), False
    with (
        forward_context(model, batch.input_ids.device, autocast_dtype, flex),
        language_model_masks(model, inputs) as inputs,
    ):
        if scored_head:
            rows, targets = scored.score_rows, scored.score_targets
            fused = (rows, targets, with_sum_sq, logit_map, per_token, compiled_head)
            with head_returns_token_logps(model, *fused) as extras:
                token_logps = model(**inputs, logits_to_keep=scored.keep_positions).logits
            log_sum_sq = extras.get("log_sum_sq")
        else:
            logits = model(**inputs).logits.flatten(0, 1)
            if per_token is None:
                out = token_logps_from_logits(logits, scored.score_positions, scored.score_targets, with_sum_sq)
            else:  # each temperature's tokens from their own logits divided by it (in the packed layout the last
                # prompt token predicts the first token of every response, at each response's temperature)
                out = torch.empty(scored.score_targets.numel(), dtype=torch.float32, device=logits.device)
                for value in per_token.unique().tolist():
                    group = (per_token == value).nonzero().flatten().to(logits.device)
                    tempered = logits[scored.score_positions[group]] / value
                    every = torch.arange(group.numel(), device=logits.device)
                    out[group] = token_logps_from_logits(tempered, every, scored.score_targets[group])
            token_logps, log_sum_sq = out if with_sum_sq else (out, None)
    token_logps = token_logps.float().view(-1)
    if sequence is not None:  # every rank's tokens in their places, the rest zeros: summed, the whole batch's
        token_logps = sequence.sum(scattered(token_logps, scored.score_index, batch.score_targets.numel()))
        if with_sum_sq:
            log_sum_sq = sequence.sum(scattered(log_sum_sq.view(-1), scored.score_index, batch.score_targets.numel()))
    logps = response_sums(token_logps, batch, tail_weight)
    return (logps, response_sums(log_sum_sq.view(-1), batch)) if with_sum_sq else logps


def scattered(values: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """[size] zeros with `values` at `index`."""
    return values.new_zeros(size).index_copy(0, index, values)


def sequence_inputs(inputs: dict, batch: ModelBatch) -> SequenceSlice:
    """The model's inputs made this rank's slice of the rows (its tokens and positions; the mask stays the whole
    rows'); the slice."""
    part = batch.sequence_part
    inputs.update(input_ids=part.input_ids, position_ids=part.position_ids)
    return part


def reward_positions(batch: ModelBatch, eos_token_id: int) -> torch.Tensor:
    """[S] flat index into R * T of the token each sequence's reward is read at: its response's last token before
    the EOS the tokenizer appends (the last token where truncation cut the EOS off). That is the token transformers'
    sequence classifiers pool at for a text given without an EOS, where padding is the EOS (SmolLM2, Llama) or
    none follows, so that the exported model scores a prompt and a response as it was trained to."""
    last = batch.last_positions
    ends_with_eos = batch.input_ids.flatten()[last] == eos_token_id
    return torch.where(ends_with_eos & (last > batch.first_positions), last - 1, last)


@contextlib.contextmanager
def head_returns_rewards(model: torch.nn.Module, positions: torch.Tensor):
    """For the forwards inside this block, the reward model's scalar head reads only the hidden states at flat
    `positions` [S] of its [R, T] rows, and the model returns those S float32 rewards as its output's `loss` (call it
    with labels): transformers' sequence classifiers compute their loss from the head's output through
    `_loss_function`, which is set here to hand the rewards over. Returned by the model, they are what FSDP hooks
    for the backward (it gathers the root's weights again where the gradient reaches its output); its own pooling,
    at each row's last token that is not padding (which packed rows do not mark), gets zeros, one element
    broadcast."""
    head, inner = reward_head(model), model_class(model)
    rewards = {}

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        picked = hidden.flatten(0, -2)[positions]
        rewards["rewards"] = torch.nn.functional.linear(picked, head.weight, head.bias)[:, 0].float()
        return hidden.new_zeros(()).expand(*hidden.shape[:-1], 1)

    head.forward = forward
    inner._loss_function = lambda **_: rewards.pop("rewards")
    try:
        yield
    finally:
        del head.forward, inner._loss_function


def sequence_rewards(
    model: torch.nn.Module,
    batch: ModelBatch,
    autocast_dtype: torch.dtype | None,
    mask_dtype: torch.dtype,
    eos_token_id: int,
    attention: str = "dense",
    spans: dict[str, AttentionSpan] | None = None,
    sequence: SequenceGroup | None = None,
) -> torch.Tensor:
    """[S] float32 rewards of a reward model (a sequence classifier with one output) on each sequence, read at its
    response's last token (reward_positions), in one forward pass; the head runs on those S hidden states only.
    The other arguments as sequence_logps'; with sequence parallelism each rank reads the rewards in its slice."""
    inputs, flex = model_inputs(batch, mask_dtype, attention, spans)
    positions = reward_positions(batch, eos_token_id)
    if sequence is not None:
        sequence_inputs(inputs, batch)
        flex = False
        length, width = batch.input_ids.shape[1], batch.sequence_part.input_ids.shape[1]
        column = positions % length - sequence.rank * width
        here = (column >= 0) & (column < width)  # no host round trip: a reward elsewhere is read, then zeroed
        positions = positions // length * width + column.clamp(0, width - 1)
    with forward_context(model, batch.input_ids.device, autocast_dtype, flex), head_returns_rewards(model, positions):
        rewards = model(**inputs, labels=positions).loss
    return rewards if sequence is None else sequence.sum(rewards * here)


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
