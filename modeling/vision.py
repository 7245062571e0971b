"""Images in preference pairs: reading them from a row (paths beside the data file, http(s) URLs, bytes, `datasets`
Image features), a vision-language model's processor that expands each image placeholder of a prompt into the image's
tokens, and the pixel inputs of a batch, decoded from the encoded bytes only when the batch is built.

An example's images travel as their encoded files (PNG, JPEG, ...), packed into one byte string (pack_images):
the tokenized cache maps them like token ids, the example's key digests them (a changed image changes the key), and
no decoded image outlives the batch that needs it."""

import dataclasses
import inspect
import io
import os
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image, UnidentifiedImageError

ROPE_CONTEXT = ("mm_token_type_ids", "attention_mask")  # what Vision.sequence_positions builds for a rope_index
IMAGE_COLUMNS = ("images", "image")  # TRL's vision columns: a list of images, or one
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # beside a model with an image processor
MARK_INPUTS = ("token_type_ids", "mm_token_type_ids")  # the per-token inputs that mark a VLM's tokens (Vision.marks)
URL_SCHEMES = ("http://", "https://")
FETCH_SECONDS = 30.0  # an image URL that sends nothing for this long is reported, not waited on
OFFLINE_SETTINGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")  # no network, as the HF libraries


def has_processor(directory: Path) -> bool:
    """Whether a model directory holds an image processor's config beside the tokenizer (a vision-language model's)."""
    return any((Path(directory) / name).exists() for name in PROCESSOR_FILES)


def image_bytes(value: Any) -> bytes:
    """The encoded file of one image cell: a path (made absolute where the data file was read:
    pairs.sources.with_image_paths), an http(s) URL (fetched), bytes, or a `datasets` Image feature
    ({"bytes": ..., "path": ...}, or the PIL image a Hub dataset decodes it to). ValueError, saying which, for
    anything unreadable."""
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image: decoded already, so no check to make
        encoded = io.BytesIO()
        value.save(encoded, format="PNG")
        return encoded.getvalue()
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
    elif is_url(value):
        data = fetched(value)
    elif isinstance(value, str):
        try:
            data = Path(value).read_bytes()
        except OSError as error:
            raise ValueError(f"image {value!r} cannot be read ({error.strerror or error})") from None
    else:
        raise ValueError(f"an image is a {type(value).__name__}, expected a path, bytes or {{'bytes': ...}}")
    decode(data, value if isinstance(value, str) else "an image given as bytes")  # unreadable: said now, not mid-run
    return data


def is_url(value: Any) -> bool:
    return isinstance(value, str) and value.lower().startswith(URL_SCHEMES)


def offline_setting() -> str | None:
    """The environment variable that tells the Hugging Face libraries to stay off the network, where one is set."""
    return next(
        (name for name in OFFLINE_SETTINGS if os.environ.get(name, "").upper() in ("1", "ON", "YES", "TRUE")), None
    )


def fetched(url: str) -> bytes:
    """An image URL's bytes, fetched once, while the data is tokenized: the tokenized cache keeps them, so reruns
    fetch nothing. Offline (offline_setting), or when the URL does not answer within FETCH_SECONDS, a ValueError
    naming it and how to give the file instead."""
    instead = "download it and give its path (relative to the data file) in its place"
    setting = offline_setting()
    if setting is not None:
        raise ValueError(
            f"image {url} is a URL, and {setting} is set: nothing is fetched offline; {instead}, or unset {setting}"
        )
    try:
        with urllib.request.urlopen(url, timeout=FETCH_SECONDS) as response:
            return response.read()
    except urllib.error.HTTPError as error:
        reason = f"HTTP {error.code} {error.reason}"
    except urllib.error.URLError as error:
        reason = str(error.reason)
    except (OSError, ValueError) as error:  # a timeout while reading, a connection reset, a malformed URL
        reason = str(error) or type(error).__name__
    raise ValueError(f"image {url} could not be fetched ({reason}); {instead}")


def row_images(row: dict) -> tuple[bytes, ...]:
    """The encoded images of a row's `images` (a list) or `image` column, in order; () without either."""
    cells = []
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value is None or value == [] or value == "":
            continue
        cells += value if isinstance(value, list) else [value]
    return tuple(image_bytes(cell) for cell in cells)


def decode(data: bytes, what: str = "an image"):
    """A PIL image in RGB from an encoded file."""
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{what} is not an image that can be decoded") from None
    except OSError as error:
        raise ValueError(f"{what} is not an image that can be decoded ({error})") from None
    return image.convert("RGB")


def pack_images(images: tuple[bytes, ...]) -> bytes:
    """Images as one byte string: each one's length (4 bytes, little-endian), then its bytes."""
    return b"".join(struct.pack("<I", len(data)) + data for data in images)


def unpack_images(packed: bytes | memoryview) -> list[bytes]:
    images, position = [], 0
    while position < len(packed):
        (length,) = struct.unpack_from("<I", packed, position)
        images.append(bytes(packed[position + 4 : position + 4 + length]))
        position += 4 + length
    return images


@dataclass(frozen=True)
class BidirectionalBlocks:
    """Which tokens a family's attention lets see each other both ways, over the causal mask, as transformers'
    modeling code composes it.

    tokens:        "images": each image's tokens; "prompt": the whole prompt, its images and its text
    within_window: whether a sliding layer's window bounds a block too: window AND (causal OR block), or
                   (window AND causal) OR block, where a block's tokens see each other at any distance
    """

    tokens: str
    within_window: bool


# Each family's BidirectionalBlocks, by its config's model_type; a family not listed is causal.
#   Gemma 3: each image's tokens (its token_type_ids mark them, 1), within a sliding layer's window
#     (create_masks_for_vision_model composes them so).
#   PaliGemma: the prefix (image tokens, BOS, the prompt and "\n"; its token_type_ids are 0 there and 1 on the suffix,
#     the response, which stays causal), at any distance: PaliGemma 2's sliding layers lay the prefix over the
#     window (create_sliding_window_causal_mask's block_sequence_ids). transformers 5.24 makes the prefix
#     bidirectional whenever token_type_ids are given, in train and eval mode, with labels or without, and every
#     token causal without them (transformers 4 did it only with labels, and without labels let every token see
#     every other, the response's too). PaliGemma trained with the prefix bidirectional and the suffix causal, so every
#     forward here gets that, the policy's (train mode) and the reference's (eval mode) alike: the prefix marked in
#     padded rows (Vision.marks), each prompt a block of the packed mask.
BIDIRECTIONAL_BLOCKS = {
    "gemma3": BidirectionalBlocks("images", within_window=True),
    "paligemma": BidirectionalBlocks("prompt", within_window=False),
}
# The position a family's own forward gives a sequence's first token where it is not 0 (PaliGemma counts from 1):
# packed rows give the model those, as rotary embeddings round differently at other absolute positions (in float32
# a tiny PaliGemma's packed log-probs were 1.5e-5 off its own forward's from 0, 8e-6 from 1, as padded rows').
FIRST_POSITIONS = {"paligemma": 1}


@dataclass
class Vision:
    """A vision-language model's processor, as the data and the batches use it.

    processor:      transformers' processor (tokenizer and image processor)
    image_token_id: the id each image's tokens carry in a prompt
    placeholder:    the text that stands for one image in a prompt (the processor's image token)
    """

    processor: Any
    image_token_id: int
    placeholder: str
    type_inputs: tuple[str, ...] = ()  # the model's inputs that mark tokens (Vision.for_model)
    bidirectional: BidirectionalBlocks | None = None  # the family's BIDIRECTIONAL_BLOCKS, or None: causal
    first_position: int = 0  # the family's FIRST_POSITIONS
    rope_index: Any = None  # the model's 3-D rotary positions of a sequence (Qwen-VL's get_rope_index), or None
    # the inputs the model's forward names (Vision.for_model; None: any): what else the image processor gives (Gemma
    # 3's num_crops) is no input of the model, and generate refuses it
    model_inputs: tuple[str, ...] | None = None
    rope_arguments: tuple[str, ...] = ()  # the arguments rope_index names

    @classmethod
    def of(cls, processor) -> "Vision | None":
        """The processor's Vision, or None for a processor without images (a text model's tokenizer). The
        placeholder is what a prompt's text holds for an image: the processor's image token, or, where the processor
        opens each image with a token of its own (Gemma 3's <start_of_image>), that one."""
        if getattr(processor, "image_processor", None) is None or getattr(processor, "image_token", None) is None:
            return None
        tokenizer = processor.tokenizer
        placeholder = getattr(processor, "boi_token", None) or processor.image_token
        return cls(processor, tokenizer.convert_tokens_to_ids(processor.image_token), placeholder)

    def for_model(self, model: torch.nn.Module) -> "Vision":
        """This Vision with what the model reads besides pixels: the inputs that mark tokens (Gemma 3's and
        PaliGemma's token_type_ids, Qwen-VL's mm_token_type_ids), which tokens its attention lets see each other both
        ways (its family's BIDIRECTIONAL_BLOCKS), and its positions (FIRST_POSITIONS; Qwen-VL's 3-D ones)."""
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        accepted = inspect.signature(inner.forward).parameters
        names = tuple(name for name in MARK_INPUTS if name in accepted)
        # the id the model replaces with image features (a processor may name another)
        image_token_id = model_image_token(inner.config)
        image_token_id = self.image_token_id if image_token_id is None else image_token_id
        family = getattr(inner.config, "model_type", None)
        rope_index = getattr(getattr(inner, "model", None), "get_rope_index", None)
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)  # not **kwargs
        parameters = inspect.signature(rope_index).parameters.values() if rope_index is not None else ()
        return dataclasses.replace(
            self, type_inputs=names, image_token_id=image_token_id, bidirectional=BIDIRECTIONAL_BLOCKS.get(family),
            first_position=FIRST_POSITIONS.get(family, 0), rope_index=rope_index, model_inputs=tuple(accepted),
            rope_arguments=tuple(p.name for p in parameters if p.kind in named),
        )  # fmt: skip

    @property
    def rope_image_inputs(self) -> tuple[str, ...]:
        """The image inputs rope_index names (Qwen-VL's image_grid_thw: a row per image), which sequence_positions
        is given per sequence; the marks and the mask it builds itself."""
        return tuple(name for name in self.rope_arguments if name not in ("input_ids", *ROPE_CONTEXT))

    def sequence_positions(self, ids: list[int], image_inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[3, L] the model's 3-D rotary positions of one sequence (rope_index), given its images' rows (in order) of
        the image inputs rope_index names (rope_image_inputs). Of the image tokens' marks and the attention mask it
        is given those it names: each family's rope_index takes its own set (Qwen2-VL's all, Qwen2.5-Omni's no
        marks)."""
        input_ids = torch.tensor([ids])
        context = {"mm_token_type_ids": (input_ids == self.image_token_id).long()}
        context["attention_mask"] = torch.ones_like(input_ids)
        named = {name: value for name, value in context.items() if name in self.rope_arguments}
        positions, _ = self.rope_index(input_ids, **named, **image_inputs)
        return positions[:, 0]

    def check_placeholders(self, prompt: str, n_images: int) -> None:
        """ValueError when the prompt's image placeholders and the row's images differ in number."""
        placeholders = prompt.count(self.placeholder)
        if placeholders != n_images:
            raise ValueError(
                f"the prompt has {placeholders} image placeholder{'s' * (placeholders != 1)} ({self.placeholder!r}) "
                f"and the row {n_images} image{'s' * (n_images != 1)}"
            )

    def prompt_ids(self, prompt: str, images: tuple[bytes, ...]) -> list[int]:
        """The prompt's token ids, each placeholder expanded into its image's tokens (no special tokens added, as
        for text). The images go to the processor as one prompt's list, as TRL's collator gives them: a family may
        expand an image of a prompt with several otherwise than a prompt's only one (LLaVA-OneVision: no tiles)."""
        self.check_placeholders(prompt, len(images))
        inputs = self.processor(
            text=[prompt], images=[[decode(data) for data in images]], add_special_tokens=False, return_tensors="np"
        )
        return inputs["input_ids"][0].tolist()

    def image_inputs(
        self, input_ids: torch.Tensor, prompt_tokens: torch.Tensor, images: list[list[bytes]]
    ) -> dict[str, torch.Tensor]:
        """The model's image inputs for rows `input_ids` [R, T] holding the prompts whose `images` are given, in
        order, a list per prompt: pixel_values and what else its processor gives for them (pixel_inputs), decoded
        now, for this batch only; and the inputs that mark tokens (marks)."""
        return self.marks(input_ids, prompt_tokens) | self.pixel_inputs(images)

    def marks(self, input_ids: torch.Tensor, prompt_tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's type_inputs for rows `input_ids` [R, T] whose prompts' tokens are `prompt_tokens` [R, T]
        (bool), as its processor marks them: PaliGemma's token_type_ids 0 on the prefix (a prompt: images and text)
        and 1 on the rest (the suffix: a response, and padding); the others' 1 on image tokens and 0 on text."""
        if self.bidirectional is not None and self.bidirectional.tokens == "prompt":
            marks = (~prompt_tokens).long()
        else:
            marks = (input_ids == self.image_token_id).long()
        return {name: marks for name in self.type_inputs}

    def pixel_inputs(self, images: list[list[bytes]]) -> dict[str, torch.Tensor]:
        """pixel_values and what else the processor gives for these prompts' images, in order, a list per prompt
        (none: {}): grouped as prompt_ids groups them, and through the processor, not its image processor alone, with
        the image settings it passes on (Aya Vision's and InternVL's tiles), so that each image is processed as it
        was expanded. The processor is given each prompt's placeholders as its text (InternVL's needs a text); of its
        outputs, the image processor's that the model takes are kept (Gemma 3's num_crops is no input of the model,
        and generate refuses it)."""
        images = [prompt for prompt in images if prompt]
        if not images:
            return {}
        decoded = [[decode(data) for data in prompt] for prompt in images]
        text = [self.placeholder * len(prompt) for prompt in images]
        outputs = self.processor(text=text, images=decoded, add_special_tokens=False, padding=True, return_tensors="pt")
        names = self.processor.image_processor.model_input_names
        taken = [name for name in names if self.model_inputs is None or name in self.model_inputs]
        return {name: value for name, value in outputs.items() if name in taken and isinstance(value, torch.Tensor)}


def model_image_token(config) -> int | None:
    """The id a vision-language model's config gives its image tokens (image_token_id, or image_token_index), or
    None."""
    return next((getattr(config, key) for key in ("image_token_id", "image_token_index") if hasattr(config, key)), None)


VISION_TOWERS = ("vision_tower", "visual", "vision_model")  # what transformers' VLMs call their image encoder
# what they call the module that maps its features to the language model's embeddings: LLaVA's and Gemma 3's,
# Idefics3's, and Qwen-VL's, inside its tower
VISION_PROJECTORS = ("multi_modal_projector", "connector", "merger")


def vision_tower(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's image encoder (LLaVA's vision_tower, Qwen-VL's visual, Idefics' vision_model), or
    None for a text model; a LoRA policy's, of its base model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft's wrapper
    inner = getattr(base, "model", base)
    return next((getattr(inner, name) for name in VISION_TOWERS if hasattr(inner, name)), None)


def vision_projector(model: torch.nn.Module) -> torch.nn.Module | None:
    """A vision-language model's projector (VISION_PROJECTORS: beside its image encoder, or, Qwen-VL's merger, inside
    it), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    owners = (getattr(base, "model", base), vision_tower(model))
    return next((getattr(owner, name) for owner in owners for name in VISION_PROJECTORS if hasattr(owner, name)), None)


def freeze_vision_tower(model: torch.nn.Module) -> int:
    """The image encoder's parameters frozen (as loaded, never updated; the projector and the language model
    train): the preference signal is about the answers, and the encoder was trained on far more images than a
    preference set holds. The number of parameters frozen."""
    tower = vision_tower(model)
    frozen = 0
    for parameter in tower.parameters() if tower is not None else ():
        parameter.requires_grad_(False)
        frozen += parameter.numel()
    return frozen
