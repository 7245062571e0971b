"""What Hydra's composition of config/*.yaml takes and gives back: each config file's schema registered by name
(`register`: train.py's config.Config, evaluate.py's EvaluateConfig, each loss's as loss_schema/<name>), the config
groups and the option this command line selects of each, the command line written as Hydra reads it (a value with
spaces, a list given without brackets, a boolean held to true or false), and a composition error as one line naming
the key, with "did you mean" and the valid keys (`explain`). config.composed composes with them."""

import dataclasses
import re
import types
import typing

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from configuration.messages import did_you_mean
from core.losses import LOSSES
from utils import REPO_ROOT, UserError

CONFIG_DIR = REPO_ROOT / "config"

OmegaConf.register_new_resolver("repo_path", lambda path: str(REPO_ROOT / path), replace=True)


store = ConfigStore.instance()
# each config file of config/ by name, and its schema: train.py's (config.py registers it) and evaluate.py's
SCHEMAS: dict[str, type] = {}


def register(name: str, schema: type) -> None:
    """A command's own config file, config/<name>.yaml, over `schema` (its defaults list names <name>_schema)."""
    store.store(name=f"{name}_schema", node=schema)
    SCHEMAS[name] = schema


# each loss's schema in a group of its own, which a loss's YAML names (/loss_schema/<name>@_here_): in the `loss` group
# itself, a sweep's loss=glob(dpo*) would make a job of dpo_norm's schema, which no user chooses
for name, component in LOSSES.items():
    store.store(group="loss_schema", name=name, node=component.schema)


# -------------------------------------------------------------------------------------------------------------
# The command line as Hydra should read it, and Hydra's failures as one line


def group_options() -> dict[str, list[str]]:
    """Each config group (config/<group>/) and its options (the YAML files)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONFIG_DIR.iterdir() if d.is_dir()}


def schema_type(key: str, groups: dict[str, str], name: str = "config"):
    """The schema's type for a dotted key of config file `name` (loss keys: in the selected loss's schema), or
    None."""
    kind, parts = SCHEMAS[name], key.split(".")
    if parts[0] == "loss" and "loss" in groups:
        loss_name = OmegaConf.load(CONFIG_DIR / "loss" / f"{groups['loss']}.yaml").name  # the option's loss
        kind, parts = LOSSES[loss_name].schema, parts[1:]
    for part in parts:
        types = {f.name: f.type for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else {}
        if part not in types:
            return None
        kind = types[part]
    return kind


def selected_options(args: list[str], name: str = "config") -> dict[str, str]:
    """The option of each group that this command line selects (else the config file's default): the groups the
    file's defaults list names."""
    defaults = OmegaConf.load(CONFIG_DIR / f"{name}.yaml").defaults
    selected = {next(iter(entry)): entry[next(iter(entry))] for entry in defaults if isinstance(entry, DictConfig)}
    groups = {group: options for group, options in group_options().items() if group in selected}
    for key, value in (arg.split("=", 1) for arg in args if "=" in arg):
        if key in groups:
            if value not in groups[key]:
                raise UserError(
                    f"unknown {key} '{value}'{did_you_mean(value, groups[key])}; valid: {', '.join(groups[key])}"
                )
            selected[key] = value
    return selected


def normalized(args: list[str], groups: dict[str, str], name: str = "config") -> list[str]:
    """The command line as Hydra should read it: each value as `hydra_value` writes it (a list key given without
    brackets is a list, a string key's value the text given), boolean keys held to true or false (OmegaConf alone
    would take 1 or 'yes'); an argument that is no override is one line that says how to quote a value with spaces."""
    result = []
    for position, arg in enumerate(args):
        key, equals, value = arg.partition("=")
        if not equals and not key.startswith("~"):  # ~key deletes a key; anything else takes key=value
            raise UserError(not_an_override(args, position, groups, name))
        kind = schema_type(key.lstrip("+"), groups, name) if equals and not key.startswith("~") else None
        if kind is bool and value.lower() not in ("true", "false"):
            raise UserError(f"{key}={value} must be true or false")
        arg = f"{key}={hydra_value(value, kind)}" if equals else arg
        example = {list: "['a b','c']", dict: "{name:'a b'}"}.get(typing.get_origin(optional_inner(kind)))
        if example and hydra_read(arg.partition("=")[2]) is UNREADABLE:  # else Hydra's message names the spot
            raise UserError(
                f"the command line: Hydra cannot read {arg}; quote each value for it in single quotes, inside "
                f'the shell\'s double ones: "{key}={example}"'
            )
        result.append(arg)
    return result


def not_an_override(args: list[str], position: int, groups: dict[str, str], name: str = "config") -> str:
    """The error for args[position], which holds no `=`: a key without its value, or most often the rest of a value
    with spaces that the shell split, so the line shows that value quoted whole."""
    arg = args[position]
    if arg.lstrip("-") in groups or schema_type(arg.lstrip("-"), groups, name) is not None:
        return f"the command line: {arg} has no value; give {arg.lstrip('-')}=VALUE"
    start = next((i for i in range(position - 1, -1, -1) if "=" in args[i]), None)
    if start is None:
        return f"the command line: {arg} is not an override; give key=value, e.g. local_run_dir=runs/a"
    end = next((i for i in range(position, len(args)) if "=" in args[i]), len(args))
    whole = " ".join(args[start:end])
    return (
        f"the command line: {arg} is not an override (key=value); a value with spaces is one argument only quoted "
        f'for the shell: "{whole}"'
    )


def optional_inner(kind):
    """X for Optional[X], else kind."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)
    return kind


UNREADABLE = object()


def hydra_read(value: str):
    """What Hydra's grammar makes of `value` on the right of `key=`: one value (a str, number, bool, None, list or
    dict), or UNREADABLE (a syntax error, or a sweep: train.py runs one job)."""
    try:
        override = OverridesParser.create().parse_override(f"key={value}")
    except HydraException:
        return UNREADABLE
    return UNREADABLE if override.is_sweep_override() else override.value()


def hydra_value(value: str, kind) -> str:
    """`value`, as the shell handed it over, written so that Hydra reads what it says for a key of type `kind`:
    null stays null; a list key given without brackets is the list of its comma-separated items (each as `literal`
    writes it) unless Hydra's own syntax spans the commas (quotes, an interpolation); a string key's value is
    `literal`; any other value that Hydra cannot read is quoted, for the schema to name the key it does not fit."""
    read = hydra_read(value)
    if read is None:
        return value
    inner = optional_inner(kind)
    if typing.get_origin(inner) is list and not value.startswith("["):
        items, listed = value.split(","), hydra_read(f"[{value}]")
        if listed is not UNREADABLE and len(listed) != len(items):
            return f"[{value}]"
        return "[" + ",".join(literal(item, in_list=True) for item in items) + "]"
    if inner is str:
        return literal(value)
    if read is UNREADABLE and not value.startswith(("[", "{")):  # brackets and braces: Hydra's lists and mappings
        return hydra_quoted(value)
    return value


def literal(value: str, in_list: bool = False) -> str:
    """A string value (in_list: an item of a list) in Hydra's grammar: as given where Hydra reads back that very
    string (interpolations too) or where it is written in Hydra's syntax on purpose (quoted, backslash-escaped,
    null); else single-quoted, where Hydra would fail on it (spaces, non-ASCII letters, brackets) or make another
    value of it (2024_01_05 an integer, 1.50 the number 1.5, true a boolean, surrounding spaces trimmed)."""
    read = hydra_read(f"[{value}]" if in_list else value)
    if in_list:
        read = read[0] if isinstance(read, list) and len(read) == 1 else UNREADABLE
    on_purpose = isinstance(read, str) and (value.lstrip().startswith(("'", '"')) or "\\" in value)
    return value if read == value and isinstance(read, str) or read is None or on_purpose else hydra_quoted(value)


def hydra_quoted(value: str) -> str:
    """`value` as a single-quoted string in Hydra's override grammar: quotes escaped, and the backslashes before a
    quote (or the closing one) doubled, so that it reads back exactly as `value`."""
    escaped = re.sub(r"(\\*)'", lambda match: match.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", lambda match: match.group(1) * 2, escaped) + "'"


TYPE_NAMES = {
    IntegerNode: "an integer",
    FloatNode: "a number",
    BooleanNode: "true or false",
    ListConfig: "a list, e.g. [a,b]",
    DictConfig: "a mapping, e.g. {key: value}",
    StringNode: "a string",
}
ITEM_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def item_type_name(key: str, groups: dict[str, str], name: str = "config") -> str | None:
    """What an item of a list key must be, for `key` naming one (datasets[1]), from the schema; else None."""
    base, indexed, _ = key.partition("[")
    kind = optional_inner(schema_type(base, groups, name)) if indexed else None
    return ITEM_NAMES.get(typing.get_args(kind)[0]) if typing.get_origin(kind) is list else None


def explain(error: Exception, args: list[str], groups: dict[str, str], name: str = "config") -> str:
    """One line for a composition error: the key, what it must be, and the valid keys."""
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        key = cause.full_key
        group = key.partition(".")[0]
        where = f"{group}={groups[group]}" if group in groups else "the config"
        valid = (
            [f.name for f in dataclasses.fields(cause.object_type)]
            if dataclasses.is_dataclass(cause.object_type)
            else []
        )
        leaf = key.rpartition(".")[2]
        listed = f"; valid: {', '.join(valid)}" if valid else ""
        return f"unknown key '{key}' in {where}{did_you_mean(leaf, valid)}{listed}"
    if isinstance(cause, ValidationError) and cause.full_key:
        key = cause.full_key
        value = next(
            (arg.partition("=")[2] for arg in reversed(args) if arg.lstrip("+").partition("=")[0] == key), cause.value
        )
        owner = cause.object_type
        metadata = {f.name: f.metadata for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        expected = metadata.get(key.rpartition(".")[2], {}).get("expected")
        expected = (
            expected
            or TYPE_NAMES.get(type(cause.child_node))
            or item_type_name(key, groups, name)
            or f"of type {type(cause.child_node).__name__}"
        )
        return f"{key}={value} must be {expected}"
    text = str(error).strip().splitlines()
    return f"the command line: {text[0] if text else type(error).__name__}"
