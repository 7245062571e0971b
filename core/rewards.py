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

from core.scoring import head_returns_rewards
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
    """A sequence-classification model's one output on prompt + completion, in float32, read where training reads it
    (scoring.reward_positions): at the completion's last token, the prompt's and the completion's ids tokenized
    apart and joined as training joins them, the prompt's start cut where the two exceed max_length."""

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
        self.device, self.batch_size, self.max_length = device, batch_size, max_length

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str]) -> list[float]:
        rows = [(p + c)[-self.max_length :] for p, c in zip(self.encode(prompts), self.encode(completions))]
        rewards = []
        for start in range(0, len(rows), self.batch_size):
            batch = rows[start : start + self.batch_size]
            length = max(map(len, batch))
            input_ids = torch.full((len(batch), length), self.pad_token_id, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), length), dtype=torch.long)
            for row, ids in enumerate(batch):
                input_ids[row, : len(ids)], attention_mask[row, : len(ids)] = torch.tensor(ids), 1
            positions = torch.tensor([row * length + len(ids) - 1 for row, ids in enumerate(batch)])
            inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=positions)
            with head_returns_rewards(self.model, positions.to(self.device)):
                rewards += self.model(**{k: v.to(self.device) for k, v in inputs.items()}).loss.cpu().tolist()
        return rewards
