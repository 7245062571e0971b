"""How a batch's attention reaches the model: a packed batch's masks (the dense [R, 1, T, T] boolean mask, made the
additive float mask the model adds, or FlexAttention's BlockMask, which lists fully masked blocks as skipped), each
layer type's span (a sliding window, attention chunks) read from the model's config, the attention implementation a
block mask needs, and the keyword inputs the model is called with (a vision-language model's language model is handed
its masks by layer type itself). Also model_class, the transformers model inside peft's wrapper, whose config and
class every check reads.

The masks are built once per batch (Scorer.batch) and once per distinct span: the policy and a live reference share
them.
"""

import contextlib

import torch
from torch.nn.attention.flex_attention import create_block_mask

from core.block_masks import tensor_block_mask
from core.layouts import FULL_ATTENTION, AttentionSpan, ModelBatch, dense_mask, packed_mask_mod
from modeling.mask_dispatch import follow_masks
from modeling.vision import vision_tower

ATTENTIONS = ("auto", "dense", "block")
# FlexAttention's tile: block-mask rows are padded to a multiple of it, so that the compiled kernel sees few shapes.
FLEX_BLOCK = 128
# The span each of transformers' layer types (`config.layer_types`) attends over, from the config's constants.
LAYER_SPANS = {
    "full_attention": lambda config: FULL_ATTENTION,
    "sliding_attention": lambda config: AttentionSpan(window=config.sliding_window),
    "chunked_attention": lambda config: AttentionSpan(chunk=config.attention_chunk_size),
}


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean 4-D mask as the float mask transformers adds to attention scores: eager attention adds the mask
    it is given, so a boolean one would be silently ignored there."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)


def block_mask(batch: ModelBatch, span: AttentionSpan = FULL_ATTENTION):
    """FlexAttention's BlockMask of a packed batch, from its per-token ids: fully masked 128 x 128 blocks (beyond a
    window, too) are listed as skipped, and no [T, T] tensor is made. Built from tensors (core.block_masks: no
    compile per row length, nothing evaluated pair by pair); a batch with bidirectional blocks (images) through
    torch's compiled builder, which works block by block (at T = 32k on a CPU, 0.5 s and no extra memory, against
    18 s and 10 GB uncompiled; `python -m bench --attention`)."""
    if batch.bidirectional_blocks is None:
        return tensor_block_mask(batch, span, FLEX_BLOCK)
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


def model_class(model: torch.nn.Module):
    """The transformers model inside peft's wrapper, or the model itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_inputs(batch: ModelBatch, mask_dtype: torch.dtype, attention: str, spans) -> tuple[dict, bool]:
    """(the model's keyword inputs for `batch`, whether its mask is FlexAttention's): a packed batch's mask built
    here unless Scorer.batch built it, a dense one as the model takes it (model_mask)."""
    mask = batch.attention_mask if batch.attention_mask is not None else packed_mask(batch, attention, spans)
    flex = not torch.is_tensor(next(iter(mask.values())) if isinstance(mask, dict) else mask)  # BlockMasks
    if not flex:
        mask = model_mask(mask, mask_dtype)
    inputs = dict(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids, use_cache=False)
    return inputs | (batch.image_inputs or {}), flex


def language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose config the language model's attention layers read (a vision-language model's decoder)."""
    base = model_class(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    return decoder if decoder is not None and hasattr(decoder, "config") else base


def forward_context(model: torch.nn.Module, device: torch.device, autocast_dtype: torch.dtype | None, flex: bool):
    """Autocast in `autocast_dtype` (None: none); for a block mask, the language model's attention made to follow its
    mask, for good (modeling.mask_dispatch: a recomputed forward runs outside this context)."""
    if flex:
        follow_masks(language_model(model))
    stack = contextlib.ExitStack()
    if autocast_dtype:
        stack.enter_context(torch.autocast(device.type, dtype=autocast_dtype))
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
