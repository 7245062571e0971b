"""Rewards for the tests of iterative rounds (rounds.py), named as rounds.reward=tests.round_rewards:NAME."""

import hashlib
import re


def lowercase_letters(prompt: str, completion: str) -> float:
    """How many of the completion's characters are the lowercase letters a to z: a deterministic reward that a
    random byte-level model can learn to raise."""
    return float(sum("a" <= character <= "z" for character in completion))


def constant(prompt: str, completion: str) -> float:
    """Every completion ties."""
    return 1.0


def not_a_number(prompt: str, completion: str):
    return "high"


def not_an_answer(prompt: str, completion: str) -> float:
    """0 for an arithmetic pair's chosen answer (" 12, glad to help."), 1 for anything else: it prefers a random
    model's completions to the chosen answers by construction."""
    return 0.0 if re.fullmatch(r" \d+, glad to help\.", completion) else 1.0


def text_digest(prompt: str, completion: str) -> float:
    """A number of the completion's text alone: two completions tie only where they are the same text."""
    return float(int(hashlib.sha256(completion.encode()).hexdigest()[:12], 16))
