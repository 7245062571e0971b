"""Rewards for the tests of iterative rounds (rounds.py), named as rounds.reward=tests.round_rewards:NAME."""


def lowercase_letters(prompt: str, completion: str) -> float:
    """How many of the completion's characters are the lowercase letters a to z: a deterministic reward that a
    random byte-level model can learn to raise."""
    return float(sum("a" <= character <= "z" for character in completion))


def constant(prompt: str, completion: str) -> float:
    """Every completion ties."""
    return 1.0


def not_a_number(prompt: str, completion: str):
    return "high"
