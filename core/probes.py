"""The checks that decide, once per run, whether a model can take the packed layout, its block-mask attention and
the scored-positions-only LM head, and whether a vision-language model can train on this trainer's image inputs.
Each runs the model on two tiny examples both ways, without autocast and with TF32 off, and compares the log-probs
(or a reward model's rewards) within rounding: None when they agree, else one line saying why not, starting with
the model's name. Liger's check (core/liger.py) runs on the same examples and tolerance.
"""

import contextlib
import inspect
import io

import torch
from PIL import Image

from core.attention import FLEX_BLOCK, attention_spans, model_class
from core.heads import head_logit_map, sequence_logps, sequence_rewards
from core.image_inputs import with_image_inputs
from core.layouts import ModelBatch, pack, pad, segment_lengths
from core.logprobs import IDENTITY
from modeling.mask_dispatch import own_implementation
from modeling.vision import MARK_INPUTS, Vision, decode, pack_images, unpack_images
from utils import first_line

# Probe inputs: two examples with prompts of 3 and 1 tokens and responses of 1 to 3 tokens.
PROBE_EXAMPLES = [
    {"prompt": [5, 6, 7], "responses": [[8, 9], [10]]},
    {"prompt": [11], "responses": [[12, 13, 14], [15, 16]]},
]
# The probes' window and chunks: shorter than PROBE_EXAMPLES' sequences, so that a model that ignores them shows it.
PROBE_SPAN = 2


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
    implementation = own_implementation(getattr(model.config, "_attn_implementation", None))
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
