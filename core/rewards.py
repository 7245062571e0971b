"""The reward that scores iterative rounds' completions (rounds.py), from `rounds.reward`: `module:function`, a Python
function of the prompt's and the completion's text returning a number, or a directory holding a
sequence-classification reward model with one output (its logit is the reward). Either way a reward is called on
lists of prompts and completions and returns one finite float each. `brevity` below is one to start from:
rounds.reward=core.rewards:brevity."""

import importlib
import math
import os
import sys
from pathlib import Path

import torch

from core.layouts import pad
from core.scoring import sequence_rewards
from utils import UserError, first_line


def brevity(prompt: str, completion: str) -> float:
    """Minus the completion's length in characters: rounds learn to answer shorter (and to stop)."""
    return -float(len(completion))


def check_reward(spec: str) -> None:
    """A one-line error unless `spec` names a model directory or an importable function (config.py checks it before
    anything starts)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").exists():
            raise UserError(f"rounds.reward={spec} is a directory without config.json: not a reward model")
        return
    reward_function(spec)


def reward_function(spec: str):
    """The function `module:function` names; the module is looked up where the command runs, then on sys.path."""
    module_name, colon, name = spec.partition(":")
    if not colon or not module_name or not name:
        raise UserError(f"rounds.reward={spec} is neither a directory nor module:function (e.g. my_rewards:brevity)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an ImportError, or the module's own code failing
        raise UserError(f"rounds.reward={spec}: cannot import {module_name} ({first_line(error)})") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise UserError(f"rounds.reward={spec}: {module_name} has no function {name}")
    return function


def load_reward(spec: str, device: torch.device, batch_size: int, max_length: int):
    """rewards(prompts, completions) -> [float] for rounds.reward=`spec`."""
    if Path(spec).is_dir():
        return ModelReward(Path(spec), device, batch_size, max_length)
    return FunctionReward(spec)


class FunctionReward:
    def __init__(self, spec: str):
        self.spec, self.function = spec, reward_function(spec)

    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        rewards = []
        for prompt, completion in zip(prompts, completions):
            value = self.function(prompt, completion)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UserError(
                    f"rounds.reward={self.spec} returned {value!r} for the completion {completion[:40]!r}: expected "
                    "a finite number"
                )
            rewards.append(float(value))
        return rewards


class ModelReward:
    """A sequence-classification model's one output on prompt + completion, in float32, computed as training computes
    it (padded rows of scoring.sequence_rewards): the prompt's and the completion's ids tokenized apart and joined as
    training joins them, read at the completion's last token, the prompt's start cut where the two exceed
    max_length."""

    def __init__(self, directory: Path, device: torch.device, batch_size: int, max_length: int):
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        setting = f"rounds.reward={directory}"
        try:
            labels = AutoConfig.from_pretrained(directory).num_labels
            if labels != 1:
                raise UserError(f"{setting} has {labels} outputs; a reward model has one")
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            model = AutoModelForSequenceClassification.from_pretrained(directory, dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(f"{setting}: cannot load a sequence-classification model ({first_line(error)})") from None
        self.pad_token_id = self.tokenizer.pad_token_id
        if self.pad_token_id is None:
            self.pad_token_id = self.tokenizer.eos_token_id
        if model.config.pad_token_id is None:  # its own pooling needs one, though the head is read here
            model.config.pad_token_id = self.pad_token_id
        self.model = model.to(device).eval()
        self.eos_token_id = self.tokenizer.eos_token_id  # a completion ending with it is read before it, as in training
        self.device, self.batch_size, self.max_length = device, batch_size, max_length

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        examples = []
        for prompt, completion in zip(self.encode(prompts), self.encode(completions)):
            completion = completion[-self.max_length :]
            room = self.max_length - len(completion)
            examples.append({"prompt": prompt[len(prompt) - room :] if room else [], "responses": [completion]})
        rewards = []
        for start in range(0, len(examples), self.batch_size):
            batch = pad(examples[start : start + self.batch_size], self.pad_token_id).to(self.device)
            rewards += sequence_rewards(self.model, batch, None, torch.float32, self.eos_token_id).cpu().tolist()
        return rewards
