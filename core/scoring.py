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
import io
import math
from dataclasses import dataclass

import torch

from core.layouts import (
    FULL_ATTENTION,
    AttentionSpan,
    ModelBatch,
    SequenceSlice,
    dense_mask,
    image_runs,
    make_batch,
    pack,
    packed_mask_mod,
    pad,
    prompt_blocks,
    prompt_tokens,
    segment_lengths,
    sequence_slice,
)
from core.logprobs import IDENTITY, LogitMap, token_logps_from_hidden, token_logps_from_logits
from modeling.models import reward_head
from modeling.sequence_parallel import SequenceGroup
from modeling.vision import MARK_INPUTS, Vision, decode, pack_images, unpack_images, vision_tower
from utils import UserError, first_line

# Probe inputs: two examples with prompts of 3 and 1 tokens and responses of 1 to 3 tokens.
PROBE_EXAMPLES = [
    {"prompt": [5, 6, 7], "responses": [[8, 9], [10]]},
    {"prompt": [11], "responses": [[12, 13, 14], [15, 16]]},
]
ATTENTIONS = ("auto", "dense", "block")
# FlexAttention's tile: block-mask rows are padded to a multiple of it, so that the compiled kernel sees few shapes.
FLEX_BLOCK = 128
# The span each of transformers' layer types (`config.layer_types`) attends over, from the config's constants.
LAYER_SPANS = {
    "full_attention": lambda config: FULL_ATTENTION,
    "sliding_attention": lambda config: AttentionSpan(window=config.sliding_window),
    "chunked_attention": lambda config: AttentionSpan(chunk=config.attention_chunk_size),
}
# The probes' window and chunks: shorter than PROBE_EXAMPLES' sequences, so that a model that ignores them shows it.
PROBE_SPAN = 2
# The elementwise maps transformers' causal LMs apply to their head's output, by where each reads its constant at
# every forward and the constant's identity value: the fused head applies them itself (logprobs.LogitMap), so for its
# forward the model's own is set to the identity.
HEAD_OUTPUT_MAPS = {
    "final_logit_softcapping": ("config", None),  # Gemma 2 and 3: cap * tanh(logits / cap)
    "logit_scale": ("model", 1.0),  # Cohere, Cohere 2: logits * logit_scale
    "logits_scaling": ("config", 1.0),  # Granite, Granite MoE: logits / logits_scaling
}


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4-D mask as the float mask transformers adds to attention scores: eager attention adds the mask
    it is given, so a boolean one would be silently ignored there."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def block_mask(batch: ModelBatch, span: AttentionSpan = FULL_ATTENTION):
    """FlexAttention's BlockMask of a packed batch, from its per-token ids: fully masked 128 x 128 blocks (beyond a
    window, too) are listed as skipped, and no [T, T] tensor is made (the compiled builder works block by block: at
    T = 32k on a CPU, 0.5 s and no extra memory, against 18 s and 10 GB uncompiled; `python -m bench --attention`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, length = batch.input_ids.shape
    device = batch.input_ids.device
    mask_mod = packed_mask_mod(
        batch.segment_ids, batch.branch_ids, batch.position_ids, span, batch.bidirectional_blocks,
        batch.blocks_within_span,
    )  # fmt: skip
    return create_block_mask(mask_mod, rows, None, length, length, device=device, _compile=True)


def packed_mask(batch: ModelBatch, attention: str, spans: dict[str, AttentionSpan] | None = None):
    """A packed batch's attention on its device: the [R, 1, T, T] boolean mask ("dense") or a BlockMask ("block"),
    built once per distinct span. spans: each layer type's (None: full attention everywhere); where layer types
    differ, transformers takes a dict of masks by layer type, and otherwise one mask for every layer."""
    build = block_mask if attention == "block" else dense_mask
    masks = {span: build(batch, span) for span in set((spans or {"full_attention": FULL_ATTENTION}).values())}
    if len(masks) == 1:
        return next(iter(masks.values()))
    return {layer_type: masks[span] for layer_type, span in spans.items()}


def attention_spans(model: torch.nn.Module) -> dict[str, AttentionSpan] | str:
    """Each layer type's span from the model's config, or why the packed layout has no mask for one of them. A
    config without `layer_types` has one type for every layer: windowed where it sets a sliding window (Mistral,
    Mixtral, Starcoder2, Phi-3), as transformers then masks every layer."""
    config, name = model.config.get_text_config(), type(model_class(model)).__name__  # a VLM's: its language model's
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
        return {"full_attention": FULL_ATTENTION} if window is None else {"sliding_attention": AttentionSpan(window)}
    unknown = sorted(set(layer_types) - set(LAYER_SPANS))
    if unknown:
        return f"{name} has {', '.join(unknown)} layers, which take no packed mask"
    return {layer_type: LAYER_SPANS[layer_type](config) for layer_type in sorted(set(layer_types))}


def describe_spans(spans: dict[str, AttentionSpan]) -> str:
    if len(set(spans.values())) == 1:
        span = next(iter(spans.values()))
        return "" if span == FULL_ATTENTION else span.describe()
    return ", ".join(f"{layer_type} {span.describe()}" for layer_type, span in spans.items())


@contextlib.contextmanager
def probe_spans(model: torch.nn.Module):
    """The model's sliding window and attention chunks set to PROBE_SPAN for the forwards inside this block: every
    layer type's mask (ours, and transformers' own in the padded layout) reads them from the config at each
    forward (a vision-language model's language model reads its own, text_config's)."""
    config = model.config.get_text_config()
    saved = {
        key: getattr(config, key) for key in ("sliding_window", "attention_chunk_size") if getattr(config, key, None)
    }
    for key in saved:
        setattr(config, key, PROBE_SPAN)
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(config, key, value)


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
    model: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor, with_sum_sq: bool, logit_map: LogitMap
):
    """For the forwards inside this block, the model's LM head maps the kept hidden states [R, K, H] to the
    float32 log-probs [M] of `targets` at flat kept rows `rows` (chunked: no [M, V] logits), its output mapped by
    `logit_map` first, and the model's own map of the head's output is the identity. with_sum_sq: the block yields
    a dict that the forward fills with "log_sum_sq", [M] log sum_v p_v^2 (the model returns one tensor, its
    head's)."""
    head, extras = model.get_output_embeddings(), {}
    own_maps = head_output_maps(model)

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.flatten(0, -2)
        out = token_logps_from_hidden(hidden, head.weight, head.bias, rows, targets, with_sum_sq, logit_map)
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
    temperature: float = 1.0,
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
    temperature: the log-probs of the model's logits divided by it (all logits only: sampled completions' log-probs,
    core/generations.py)."""
    if scored_head and temperature != 1.0:
        raise ValueError("a temperature is applied to all logits (scored_head=False)")
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
            with head_returns_token_logps(model, rows, targets, with_sum_sq, logit_map) as extras:
                token_logps = model(**inputs, logits_to_keep=scored.keep_positions).logits
            log_sum_sq = extras.get("log_sum_sq")
        else:
            logits = model(**inputs).logits.flatten(0, 1)
            logits = logits / temperature if temperature != 1.0 else logits
            out = token_logps_from_logits(logits, scored.score_positions, scored.score_targets, with_sum_sq)
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


def model_inputs(batch: ModelBatch, mask_dtype: torch.dtype, attention: str, spans) -> tuple[dict, bool]:
    """(the model's keyword inputs for `batch`, whether its mask is FlexAttention's): a packed batch's mask built
    here unless Scorer.batch built it, a dense one as the model takes it (model_mask)."""
    mask = batch.attention_mask if batch.attention_mask is not None else packed_mask(batch, attention, spans)
    flex = not torch.is_tensor(next(iter(mask.values())) if isinstance(mask, dict) else mask)  # BlockMasks
    if not flex:
        mask = model_mask(mask, mask_dtype)
    inputs = dict(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
    return inputs | (batch.image_inputs or {}), flex


def forward_context(model: torch.nn.Module, device: torch.device, autocast_dtype: torch.dtype | None, flex: bool):
    """Autocast in `autocast_dtype` (None: none), and FlexAttention for a block mask."""
    stack = contextlib.ExitStack()
    if autocast_dtype:
        stack.enter_context(torch.autocast(device.type, dtype=autocast_dtype))
    stack.enter_context(attention_implementation(model, "flex_attention" if flex else None))
    return stack


@contextlib.contextmanager
def language_model_masks(model: torch.nn.Module, inputs: dict):
    """The inputs to call the model with: for a vision-language model given masks by layer type (a dict), its
    language model takes them itself, and the model one of them, which it passes on. PaliGemma builds its language
    model's full and sliding masks from the one mask it is given (a dict there fails: Gemma 2's layers need both),
    while every language model takes masks by layer type as they are (transformers' generate hands them over so)."""
    mask = inputs["attention_mask"]
    if not isinstance(mask, dict) or vision_tower(model) is None:
        yield inputs
        return

    def hand_over(module, args, kwargs):
        return args, kwargs | {"attention_mask": mask}

    handle = model_class(model).get_decoder().register_forward_pre_hook(hand_over, with_kwargs=True)
    try:
        yield inputs | {"attention_mask": next(iter(mask.values()))}
    finally:
        handle.remove()


def model_mask(mask, dtype: torch.dtype):
    """A dense mask as the model takes it: a padded batch's [R, T] as it is, a packed batch's boolean [R, 1, T, T]
    as the additive float mask (once per distinct tensor of a dict by layer type)."""
    if not isinstance(mask, dict):
        return additive_mask(mask, dtype) if mask.dim() == 4 else mask
    distinct = {id(tensor): tensor for tensor in mask.values()}
    additive = {key: additive_mask(tensor, dtype) for key, tensor in distinct.items()}
    return {layer_type: additive[id(tensor)] for layer_type, tensor in mask.items()}


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
    """Rounding allowance of the probes: float32 reorderings (TF32 is off while they run: exact_float32), or 16-bit
    compute; a real mismatch is of order 1."""
    return 1e-4 if dtype == torch.float32 else 1e-1


@contextlib.contextmanager
def exact_float32():
    """TF32 off for the forwards inside this block. Training enables it (train.py), and on a GPU it rounds float32
    matmul inputs to 10 mantissa bits: a 16-layer 1B model's packed and padded log-probs then differ by more than
    float32's allowance, and a model that honours the packed mask would be refused."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def probes_dtype(model: torch.nn.Module, compute: torch.dtype | None, autocast: bool) -> torch.dtype:
    """The dtype a placed model computes in without autocast, as the probes run it (exact in float32): its weights'
    under autocast, FSDP's compute dtype (`compute`) otherwise."""
    weights = next(model.parameters()).dtype
    return weights if autocast else (compute or weights)


def model_class(model: torch.nn.Module):
    """The transformers model inside peft's wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def compare(
    model, batch: ModelBatch, expected: ModelBatch, dtype, device, tried: str, mismatch: str, reward_eos=None, **options
) -> str | None:
    """None when `batch` gives `expected`'s log-probs (padded, all logits) within rounding, else why not, starting
    with the model's name; tried: what the model is given; mismatch: what a numeric difference means. No autocast:
    the model computes in `dtype` (its weights', or FSDP's mixed precision). reward_eos: a reward model's rewards
    are compared instead (sequence_rewards, with this EOS id)."""
    name = type(model_class(model)).__name__
    try:
        with torch.no_grad(), exact_float32():
            if reward_eos is not None:
                options = {key: options[key] for key in ("attention", "spans") if key in options}
                got = sequence_rewards(model, batch.to(device), None, dtype, reward_eos, **options)
                want = sequence_rewards(model, expected.to(device), None, dtype, reward_eos)
            else:
                got = sequence_logps(model, batch.to(device), None, dtype, **options)
                want = sequence_logps(model, expected.to(device), None, dtype, scored_head=False)
    except Exception as error:  # any failure means: not this model
        return f"{name} failed with {tried} ({type(error).__name__}: {first_line(error)})"
    if not torch.allclose(got, want, rtol=probe_tolerance(dtype), atol=probe_tolerance(dtype)):
        what = "log-probs" if reward_eos is None else "rewards"
        return f"{name} {mismatch} ({what} differ by {(got - want).abs().max():.2g})"
    return None


def scored_head_problem(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
    """Why the fused scored-positions head cannot replace this model's LM head, or None when it can: the model must
    take `logits_to_keep` as positions per row and change its head's output by no more than the map the fused head
    applies too (head_logit_map: soft-capping, logit scaling)."""
    name = type(model_class(model)).__name__
    if "logits_to_keep" not in inspect.signature(model_class(model).forward).parameters:
        return f"{name}.forward takes no logits_to_keep"
    if not isinstance(model.get_output_embeddings(), torch.nn.Linear):
        return f"{name}'s output embedding is not a Linear layer"
    batch, logit_map = pad(PROBE_EXAMPLES, 0), head_logit_map(model)
    mismatch = "changes its head's output" + (f" other than {logit_map.describe()}" if logit_map != IDENTITY else "")
    tried = "the fused head"
    return compare(model, batch, batch, dtype, device, tried, mismatch, scored_head=True, logit_map=logit_map)


def probe_examples(vision: Vision | None) -> list[dict]:
    """The probes' examples; for a vision-language model the first one's prompt opens with an image (a 64 x 32
    picture of two colours), whose tokens the packed layout must give the positions and the attention that the
    model's own forward gives them. Twice as wide as high, it is cut into tiles by a family that tiles an image by
    its aspect (Idefics3, LLaVA-OneVision, Aya Vision), where a square one may be a single tile."""
    if vision is None:
        return PROBE_EXAMPLES
    from PIL import Image

    picture = Image.new("RGB", (64, 32), (200, 40, 40))
    picture.paste((40, 40, 200), (32, 0, 64, 32))
    encoded = io.BytesIO()
    picture.save(encoded, format="PNG")
    images = (encoded.getvalue(),)
    prompt = vision.prompt_ids(f"{vision.placeholder} a", images)
    first = PROBE_EXAMPLES[0] | {"prompt": prompt + PROBE_EXAMPLES[0]["prompt"], "images": pack_images(images)}
    return [first, *PROBE_EXAMPLES[1:]]


def vision_problem(
    model: torch.nn.Module, vision: Vision, dtype: torch.dtype, device: torch.device, reward_eos: int | None = None
) -> str | None:
    """Why this vision-language model cannot train on this trainer's inputs, or None when it can: its processor may
    give no input for the probe's image prompt that this trainer does not build (Mllama's cross_attention_mask), and
    the prompt and both responses in padded rows, with the image inputs this trainer builds (pixel values from the
    processor, the tokens marked where the model reads marks: Vision.marks), must give the log-probs of the model's
    own forward of each sequence from its processor's inputs, the response marked as the processor marks a suffix
    where it takes one (PaliGemma's, whose prefix sees itself both ways), as text otherwise; a reward model's rewards
    (reward_eos: its EOS id), its own pooling at the response's last token."""
    name = type(model_class(model)).__name__
    example = probe_examples(vision)[0]
    image = decode(unpack_images(example["images"])[0])
    padded = with_image_inputs(pad([example], 0), [example], vision).to(device)
    what = "log-probs" if reward_eos is None else "rewards"
    try:
        with torch.no_grad(), exact_float32():
            text = [vision.placeholder + " a"]  # the probe prompt's text, as probe_examples expands it
            own = vision.processor(text=text, images=[[image]], add_special_tokens=False, return_tensors="pt")
            unbuilt = sorted(set(own) - {"input_ids", "attention_mask", "labels", *padded.image_inputs})
            if unbuilt:
                inputs = ", ".join(unbuilt)
                return f"{name}'s processor gives {inputs} with an image, which this trainer does not build"
            if reward_eos is None:
                ours = sequence_logps(model, padded, None, dtype, scored_head=False)
            else:
                ours = sequence_rewards(model, padded, None, dtype, reward_eos)
            response_marks = suffix_marks(vision, text, image)
            theirs = []
            for response in example["responses"]:
                rest, answer = torch.tensor([PROBE_EXAMPLES[0]["prompt"]]), torch.tensor([response])
                # the rest is attended (Qwen2.5-Omni's 3-D positions ask for the mask); labels are no input
                inputs = {key: value for key, value in own.items() if key != "labels"}
                inputs["input_ids"] = torch.cat([inputs["input_ids"], rest, answer], dim=1)
                inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
                for key in MARK_INPUTS:  # per token: the rest of the prompt is its text
                    if key in inputs:
                        marks = [torch.zeros_like(rest), torch.full_like(answer, response_marks.get(key, 0))]
                        inputs[key] = torch.cat([inputs[key], *marks], dim=1)
                inputs = {key: value.to(device) for key, value in inputs.items()}
                output = model(**inputs, use_cache=False)
                if reward_eos is not None:  # the probe's responses end without an EOS: pooled at their last token
                    theirs.append(output.logits[0, 0].float())
                    continue
                logits = output.logits[0, :-1].float()
                ids = inputs["input_ids"][0, 1:]
                scored = logits.log_softmax(-1).gather(-1, ids[:, None])[-len(response) :, 0]
                theirs.append(scored.sum())
    except Exception as error:  # any failure means: not this model
        return f"{name} failed with this trainer's image inputs ({type(error).__name__}: {first_line(error)})"
    theirs = torch.stack(theirs)
    # the same inputs through the same model: in float32 the two differ by summation order alone (a relative 1e-6
    # of a sum), where a token marked otherwise moves a sum by 1e-3 even in a tiny random model
    relative = 1e-6 if dtype == torch.float32 else 1e-2
    if not torch.allclose(ours, theirs, rtol=relative, atol=probe_tolerance(dtype)):
        return (
            f"{name} computes other {what} from this trainer's image inputs than from its processor's (they differ "
            f"by {(ours - theirs).abs().max():.2g})"
        )
    return None


def suffix_marks(vision: Vision, text: list[str], image) -> dict[str, int]:
    """The mark the processor's per-token inputs give a response: a suffix's, where the processor takes one
    (PaliGemma's token_type_ids: 1, its prefix 0); none for the others (a response is text, 0)."""
    if "suffix" not in inspect.signature(vision.processor.__call__).parameters:
        return {}
    marked = vision.processor(text=text, images=[image], suffix=["a"], add_special_tokens=False, return_tensors="pt")
    return {key: int(marked[key][0, -1]) for key in MARK_INPUTS if key in marked}


def packing_problem(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, reward_eos=None, vision: Vision | None = None
) -> str | None:
    """Why this model cannot take the packed layout, or None when it can: it must honour a custom 4-D attention
    mask (one per layer type where they differ) and explicit position ids, which the probe checks numerically
    against the padded layout, both examples in one row, with the model's windows and chunks cut to PROBE_SPAN (a
    reward model's rewards: reward_eos, compare); a vision-language model (vision) with an image in a prompt."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return f"attention implementation {implementation!r} takes no 4-D mask (sdpa and eager do)"
    with probe_spans(model):
        spans = attention_spans(model)
        if isinstance(spans, str):
            return spans
        examples = probe_examples(vision)
        packed = with_image_inputs(pack(examples, 0, row_tokens=sum(segment_lengths(examples))), examples, vision)
        mismatch = "does not honour a custom 4-D mask and position ids" + (" with an image" if vision else "")
        tried = "a custom 4-D mask and position ids"
        expected = with_image_inputs(pad(examples, 0), examples, vision)
        options = dict(scored_head=False, spans=spans, reward_eos=reward_eos)
        return compare(model, packed, expected, dtype, device, tried, mismatch, **options)


def block_attention_problem(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, reward_eos=None
) -> str | None:
    """Why packed rows cannot run through FlexAttention with a block mask, or None when they can: a CUDA device
    (FlexAttention has no backward pass on CPU), a model that declares FlexAttention support, and log-probs equal
    to the padded layout's."""
    name = type(model_class(model)).__name__
    if not getattr(model_class(model), "_supports_flex_attn", False):
        return f"{name} does not declare FlexAttention support"
    if device.type != "cuda":
        return "FlexAttention has no backward pass on CPU"
    packed = pack(PROBE_EXAMPLES, 0, row_tokens=sum(segment_lengths(PROBE_EXAMPLES)), multiple=FLEX_BLOCK)
    tried, mismatch = "a block mask", "computes other log-probs with a block mask"
    with probe_spans(model):
        spans, expected = attention_spans(model), pad(PROBE_EXAMPLES, 0)
        options = dict(scored_head=False, attention="block", spans=spans, reward_eos=reward_eos)
        return compare(model, packed, expected, dtype, device, tried, mismatch, **options)


def with_image_inputs(batch: ModelBatch, examples: list[dict], vision: Vision | None) -> ModelBatch:
    """The batch with a vision-language model's image inputs: the images of each prompt its rows hold, in the order
    the rows hold them (ModelBatch.prompt_examples: in the packed layout each pair's images once)."""
    if vision is not None:
        images = [unpack_images(examples[i].get("images", b"")) for i in batch.prompt_examples]
        batch.image_inputs = vision.image_inputs(batch.input_ids, prompt_tokens(batch), images)
        if batch.segment_ids is not None and vision.bidirectional is not None:  # packed rows: the mask says it
            batch.bidirectional_blocks = bidirectional_blocks(batch, vision)
            batch.blocks_within_span = vision.bidirectional.within_window
        if vision.rope_index is not None and batch.segment_ids is not None:
            batch.image_inputs["position_ids"] = packed_rope_positions(batch, examples, vision)
        elif vision.first_position and batch.segment_ids is not None:  # the model's own positions; the mask's
            batch.image_inputs["position_ids"] = batch.position_ids + vision.first_position  # windows keep theirs
    return batch


def bidirectional_blocks(batch: ModelBatch, vision: Vision) -> torch.Tensor:
    """The blocks of packed rows whose tokens the model lets see each other both ways (Vision.bidirectional): each
    image's tokens (Gemma 3), or each prompt (PaliGemma's prefix)."""
    if vision.bidirectional.tokens == "images":
        return image_runs(batch.input_ids == vision.image_token_id)
    return prompt_blocks(batch)


def packed_rope_positions(batch: ModelBatch, examples: list[dict], vision: Vision) -> torch.Tensor:
    """[3, R, T] 3-D rotary positions of packed rows (Qwen-VL): each sequence's own, as the model gives them to
    prompt + response alone, laid out where the row holds it: the shared prompt's once (a causal prefix, they are
    the same in every sequence), then each response's, which continue from the prompt's. The 1-D positions of the
    batch stay for its mask's windows."""
    per_image = {  # the rows of each image, in the order the batch holds the images
        name: iter(batch.image_inputs[name].split(1)) for name in vision.rope_image_inputs if name in batch.image_inputs
    }
    positions = torch.zeros((3, *batch.input_ids.shape), dtype=torch.long)
    starts = (batch.segment_ids != torch.nn.functional.pad(batch.segment_ids, (1, 0), value=-2)[:, :-1]).nonzero()
    for row, start in starts.tolist():
        index = int(batch.segment_ids[row, start])
        if index < 0:
            continue
        example = examples[index]
        images = len(unpack_images(example.get("images", b"")))
        own = {name: torch.cat([next(rows) for _ in range(images)]) for name, rows in per_image.items() if images}
        prompt, offset = example["prompt"], start + len(example["prompt"])
        for response in example["responses"]:
            sequence = vision.sequence_positions(prompt + response, own)
            positions[:, row, start : start + len(prompt)] = sequence[:, : len(prompt)]
            positions[:, row, offset : offset + len(response)] = sequence[:, len(prompt) :]
            offset += len(response)
    return positions


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
        reward_eos: int | None = None,
        vision: Vision | None = None,
    ) -> "Scorer":
        """As configured (settings: the run's config) where the model allows, checked on the placed model by every
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
        row_tokens, row_multiple = settings.pack_row_tokens, FLEX_BLOCK if settings.compile_blocks else 1
        scorer = cls(
            layout, attention, scored_head, pad_token_id, device, autocast, row_tokens, tail_weight, spans, logit_map,
            reward_eos, tuple(notes), vision, sequence, row_multiple,
        )  # fmt: skip
        for note in notes:
            print(note)
        print(f"scoring: {scorer.describe()}")
        return scorer

    def describe(self) -> str:
        spans = describe_spans(self.spans) if self.spans else ""
        rounded = f"; rows in multiples of {self.row_multiple} tokens" if self.row_multiple > 1 else ""
        attention = (
            f" ({self.attention} attention{'; ' + spans if spans else ''}{rounded})" if self.layout == "packed" else ""
        )
        head = f"scored logits{' ' + self.logit_map.describe() if self.logit_map != IDENTITY else ''}"
        tails = f", response tails weighted {self.tail_weight:g}" if self.tail_weight != 1.0 else ""
        if self.reward_eos is not None:
            head = "reward head on each response's last token"
        elif not self.scored_head:
            head = "all logits"
        sequence = f", each row's tokens over {self.sequence.size} sequence-parallel ranks" if self.sequence else ""
        return f"{self.layout} layout{attention}, {head}{tails}{sequence}"

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
        multiple = FLEX_BLOCK if self.attention == "block" else self.row_multiple
        if self.sequence is not None:  # rows cut into equal slices
            multiple = math.lcm(multiple, self.sequence.size)
        batch = make_batch(self.layout, examples, self.pad_token_id, self.row_budget(examples), multiple)
        batch = with_image_inputs(batch, examples, self.vision)
        if self.sequence is not None:
            batch.sequence_part = sequence_slice(batch, self.sequence.rank, self.sequence.size)
        batch = batch.to(self.device)
        if self.layout == "packed":
            batch.attention_mask = packed_mask(batch, self.attention, self.spans)
        return batch

    def __call__(self, model: torch.nn.Module, batch: ModelBatch, compute: torch.dtype | None, with_sum_sq=False):
        """[R * B] float32 summed log-probs of each example's responses (all first responses, then all second
        ones), or a reward model's rewards, in one forward pass; compute: the model's compute dtype, or None for its
        weights'. with_sum_sq: and their sums of log sum_v p_v^2 (sequence_logps)."""
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
