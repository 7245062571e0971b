"""The reward that scores iterative rounds' completions (rounds.py), from `rounds.reward`: `module:function`, a Python
function of the prompt's and the completion's text returning a number, or a directory holding a
sequence-classification reward model with one output (its logit is the reward; a vision-language reward model's, of
the prompt's images too). Either way a reward is called on lists of prompts, completions and the prompts' images,
and returns one finite float each. `brevity` below is one to start from: rounds.reward=judging.rewards:brevity."""

import importlib
import math
import os
import sys
from pathlib import Path

import torch

from generation.prompt_groups import prompt_scorer, scores_by_prompt
from modeling import weights
from modeling.distributed import Topology
from modeling.vision import Vision, unpack_images
from utils import UserError, first_line


def brevity(prompt: str, completion: str) -> float:
    """Minus the completion's length in characters: rounds learn to answer shorter (and to stop)."""
    return -float(len(completion))


def check_reward(spec: str, key: str = "rounds.reward") -> None:
    """A one-line error unless `spec` names a model directory or an importable function (config.py checks it before
    anything starts); key: the setting that names it."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"{key}={spec} is a directory without config.json: not a reward model")
        return
    reward_function(spec, key)


def reads_images(spec: str) -> bool:
    """Whether rounds.reward=`spec` sees the prompts' images: a vision-language reward model's directory (one that
    transformers' sequence classifier of its family reads images with: modeling.weights.reads_images)."""
    from transformers import AutoConfig  # on use: the auto classes cost ~0.7 s of every start to import

    if not Path(spec).is_dir():
        return False
    config = AutoConfig.from_pretrained(spec)
    return weights.is_vision_language(config) and weights.reads_images(config)


def reward_function(spec: str, key: str = "rounds.reward"):
    """The function `module:function` names; the module is looked up where the command runs, then on sys.path."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise UserError(f"{key}={spec} is neither a directory nor module:function (e.g. my_rewards:brevity)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an ImportError, or the module's own code failing
        raise UserError(f"{key}={spec}: cannot import {module_name} ({first_line(error)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"{key}={spec}: {module_name} has no function {name}")
    return function


def load_reward(spec: str, device: torch.device, batch_size: int, max_length: int, key: str = "rounds.reward"):
    """rewards(prompts, completions) -> [float] for `key`=`spec` (rounds.reward, or a judge's)."""
    if Path(spec).is_dir():
        return ModelReward(Path(spec), device, batch_size, max_length, key)
    return FunctionReward(spec, key)


class FunctionReward:
    def __init__(self, spec: str, key: str = "rounds.reward"):
        self.setting, self.function = f"{key}={spec}", reward_function(spec, key)

    def __call__(self, prompts: list[str], completions: list[str], images: list[bytes] | None = None) -> list[float]:
        """The function of each prompt's and completion's text; a function reads no image (`images`, the prompts'
        as ModelReward takes them, are not its input)."""
        rewards = []
        for prompt, completion in zip(prompts, completions):
            try:
                value = self.function(prompt, completion)
            except Exception as error:  # the user's code: its failure named in one line, its traceback chained
                raise UserError(
                    f"{self.setting} raised {type(error).__name__} ({first_line(error)}) when called as "
                    "function(prompt, completion) with two strings"
                ) from error
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(
                    f"{self.setting} returned {value!r} for the completion {completion[:40]!r}: expected "
                    "a finite number"
                )
            rewards.append(float(value))
        return rewards


class ModelReward:
    """A sequence-classification model's one output on prompt + completion, in float32, computed as training computes
    it (generation.prompt_groups: the completions of one prompt in one packed segment, where the model allows it): the
    prompt's and the completion's ids tokenized apart and joined as training joins them, read at the completion's
    last token, the prompt's start cut where the two exceed max_length. A vision-language reward model (Gemma 3's)
    sees each prompt's images as training shows them: the prompt's text holds each image's tokens as the policy's
    processor expanded them, and is kept whole (the completion's end kept within what it leaves of max_length)."""

    def __init__(
        self, directory: Path, device: torch.device, batch_size: int, max_length: int, key="rounds.reward",
        dtype: torch.dtype = torch.float32,
    ):  # fmt: skip
        # on use: the auto classes cost ~0.7 s of every start to import
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoProcessor, AutoTokenizer

        self.setting = f"{key}={directory}"
        try:
            config = AutoConfig.from_pretrained(directory)
            if config.num_labels != 1:
                raise UserError(f"{self.setting} has {config.num_labels} outputs; a reward model has one")
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=dtype)
            processor = AutoProcessor.from_pretrained(directory) if reads_images(str(directory)) else None
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(
                f"{self.setting}: cannot load a sequence-classification model ({first_line(error)})"
            ) from None
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        text_config = model.config.get_text_config()  # a vision-language model's language model's, where it pools
        if text_config.pad_token_id is None:  # its own pooling needs one, though the head is read here
            text_config.pad_token_id = self.pad_token_id
        self.model = model.to(device).eval()
        self.vision = None
        self.image_tokens: dict[bytes, int] = {}  # a prompt's images -> the image tokens this model makes of them
        if processor is not None:
            processor.tokenizer = self.tokenizer  # one tokenizer: its pad token as set here
            self.vision = Vision.of(processor).for_model(model)
        self.eos_token_id = self.tokenizer.eos_token_id  # a completion ending with it is read before it, as in training
        self.device, self.batch_size, self.max_length = device, batch_size, max_length
        self.topology = Topology("BasicTrainer", device=device)  # one process reads it (a round's rank 0, a judge's)
        self.scorer = prompt_scorer(self.model, self.topology, self.pad_token_id, self.vision, self.eos_token_id)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], images: list[bytes] | None = None) -> list[float]:
        """images: each prompt's (modeling.vision.pack_images; b"": none)."""
        images = images or [b""] * len(prompts)
        examples = []
        for prompt, completion, packed in zip(self.encode(prompts), self.encode(completions), images):
            if packed:
                self.check_image_tokens(prompt, packed)
            room = self.max_length - len(prompt) if packed else self.max_length  # a prompt with images stays whole
            if room < 1:
                raise UserError(
                    f"{self.setting}: a prompt with images is {len(prompt)} tokens here, its images' included, and "
                    f"leaves no room for a completion within max_length={self.max_length}"
                )
            completion = completion[-room:]
            room = self.max_length - len(completion)
            prompt = prompt[max(0, len(prompt) - room) :] if room else []
            examples.append({"prompt": prompt, "responses": [completion], "images": packed})
        prompts, completions = [ex["prompt"] for ex in examples], [ex["responses"][0] for ex in examples]
        images = [ex["images"] for ex in examples]
        return scores_by_prompt(self.scorer, self.model, self.topology, prompts, completions, images, self.batch_size)

    def check_image_tokens(self, prompt: list[int], packed: bytes) -> None:
        """A one-line error unless the prompt holds as many image tokens as this model's processor makes of its
        images (packed: pack_images), counted once per distinct images (a round scores k completions of each
        prompt): a text model sees none, and another family's processor expands an image into other tokens."""
        if self.vision is None:
            raise UserError(
                f"{self.setting} is a text model and the prompts have images: it would score their text alone"
            )
        images = unpack_images(packed)
        if packed not in self.image_tokens:
            own = self.vision.prompt_ids(self.vision.placeholder * len(images), tuple(images))
            self.image_tokens[packed] = own.count(self.vision.image_token_id)
        found, expected = prompt.count(self.vision.image_token_id), self.image_tokens[packed]
        if found != expected:
            raise UserError(
                f"{self.setting}: a prompt with {len(images)} image{'s' * (len(images) != 1)} holds {found} image "
                f"tokens as the policy's processor made them, and this model's processor makes {expected}"
            )
