"""The wording of the config's one-line errors: `expect` (key=value must be ...), `did_you_mean` (the valid name
nearest a wrong one), and `as_override`, a value as the command line writes it, which the errors quote and the
command that composes a run again (config.reproducing_command) is written in. Below the config's checks and its
Hydra composition, which both word their errors so."""

import difflib

from utils import UserError


def expect(condition: bool, key: str, value, expectation: str) -> None:
    if not condition:
        raise UserError(f"{key}={value} must be {expectation}")


def did_you_mean(value: str, valid) -> str:
    hint = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


def as_override(value) -> str:
    """A value as it would be written on the command line: true, null, [0.9,0.95], {a:1}."""
    if isinstance(value, bool) or value is None:
        return str(value).lower().replace("none", "null")
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_override(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{as_override(item)}" for key, item in value.items()) + "}"
    return str(value)
