"""docs/trl.md maps TRL's config fields to keys here, and stays true to both: every field that TRL's DPOConfig,
KTOConfig and RewardConfig define themselves has a row and no row names a field TRL lacks, every loss_type TRL takes
has a row, every TrainingArguments row is a field of transformers', and every key, loss option and value the tables
give exists in this config and passes its checks."""

import dataclasses
import re
from pathlib import Path

import pytest
import transformers
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

import config
from configuration.checks import check_optimizer
from configuration.composition import CONFIG_DIR, hydra_read, schema_type
from core.losses import LOSSES
from utils import UserError

TRL_DOC = Path(__file__).resolve().parents[1] / "docs" / "trl.md"
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$")
CODE = re.compile(r"`([^`]+)`")
# The tables of docs/trl.md by heading: those of config fields, and those of loss_type values
CONFIG_TABLES = {"DPOConfig": "`DPOConfig`", "KTOConfig": "`KTOConfig`", "RewardConfig": "`RewardConfig`"}
ARGUMENTS_TABLE = "`TrainingArguments`"
LOSS_TYPE_TABLES = {"DPOConfig": "DPOConfig `loss_type` values", "KTOConfig": "KTOConfig `loss_type` values"}
DEFAULT_LOSS = "dpo"  # the option a `loss.KEY` is checked against when its span names no `loss=NAME`


def tables(text: str) -> dict[str, list[list[str]]]:
    """Each heading's table rows, as lists of cells (first, ours, notes), header and rule left out."""
    found, heading, header_seen = {}, None, False
    for line in text.splitlines():
        match = HEADING.match(line)
        if match:
            heading, header_seen = match.group(1), False
        elif line.startswith("|") and heading is not None:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not header_seen or set(line) <= set("|- "):
                header_seen = True  # the header row; the rule row after it
                continue
            found.setdefault(heading, []).append(cells)
    return found


TABLES = tables(TRL_DOC.read_text(encoding="utf-8"))


def first_column(heading: str) -> list[str]:
    """The names in the first column of a table: each cell's one code span."""
    rows = TABLES.get(heading)
    assert rows, f"docs/trl.md has no table under '{heading}'"
    names = [CODE.fullmatch(row[0]) for row in rows]
    assert all(names), f"docs/trl.md under '{heading}': a first cell that is not one `name`"
    return [name.group(1) for name in names]


def own_fields(config_class) -> set[str]:
    """The fields a TRL config defines itself: its dataclass fields less transformers.TrainingArguments'."""
    inherited = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    return {field.name for field in dataclasses.fields(config_class)} - inherited


def trl():
    return pytest.importorskip("trl", reason="trl is not installed: the TRL side of docs/trl.md cannot be checked")


@pytest.mark.parametrize("name", list(CONFIG_TABLES))
def test_every_field_a_trl_config_defines_has_a_row(name):
    listed = first_column(CONFIG_TABLES[name])
    assert len(listed) == len(set(listed)), f"docs/trl.md lists a {name} field twice"
    fields, version = own_fields(getattr(trl(), name)), trl().__version__
    assert not fields - set(listed), f"TRL {version}'s {name} fields missing from docs/trl.md: {fields - set(listed)}"
    assert not set(listed) - fields, f"docs/trl.md lists {name} fields TRL {version} lacks: {set(listed) - fields}"


def trl_loss_types(config_class) -> set[str]:
    """The loss_type values a TRL config takes: its field's `choices`, or else the values its help lists."""
    field = {field.name: field for field in dataclasses.fields(config_class)}["loss_type"]
    return set(field.metadata.get("choices") or re.findall(r"`'(\w+)'`", field.metadata["help"]))


@pytest.mark.parametrize("name", list(LOSS_TYPE_TABLES))
def test_every_trl_loss_type_has_a_row(name):
    values = trl_loss_types(getattr(trl(), name))
    assert "kto" in values or "sigmoid" in values, f"no loss_type values read from TRL's {name}: {values}"
    listed = set(first_column(LOSS_TYPE_TABLES[name]))
    assert listed == values, f"{name} loss_type: TRL has {values - listed} unlisted, the table {listed - values} extra"


def test_every_training_arguments_row_is_a_transformers_field():
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    listed = first_column(ARGUMENTS_TABLE)
    assert len(listed) == len(set(listed)), "docs/trl.md lists a TrainingArguments field twice"
    assert not set(listed) - fields, f"not transformers {transformers.__version__} fields: {set(listed) - fields}"


ABSENT = object()


def loss_problems(option: str, keys: dict[str, str | None]) -> list[str]:
    """What is wrong with `loss=option` given `loss.KEY=VALUE` (VALUE None: the key alone): an unknown option or key,
    or a value its schema refuses, each checked as Hydra would compose it (the option's YAML on its schema)."""
    path = CONFIG_DIR / "loss" / f"{option}.yaml"
    if not path.exists():
        return [f"loss={option}: no such loss option"]
    values = OmegaConf.load(path)
    del values["defaults"]
    node = OmegaConf.merge(OmegaConf.structured(LOSSES[values.name].schema), values)
    problems = []
    for key, value in keys.items():
        try:
            if value is None and OmegaConf.select(node, key, default=ABSENT) is ABSENT:
                problems.append(f"loss.{key}: not a key of loss={option}")
            elif value is not None:
                OmegaConf.update(node, key, hydra_read(value), merge=True)
        except OmegaConfBaseException as error:
            problems.append(f"loss.{key}={value} under loss={option}: {str(error).splitlines()[0]}")
    try:
        OmegaConf.to_object(node)
    except (OmegaConfBaseException, UserError) as error:
        problems.append(f"loss={option} {keys}: {str(error).splitlines()[0]}")
    return problems


def span_problems(span: str, base) -> list[str]:
    """What is wrong with one code span of our column: each word a group (`loss`), an override `KEY=VALUE` or a key
    `KEY`, checked against the schema (loss keys against the span's `loss=NAME`, else DEFAULT_LOSS), values against
    the key's type in the composed default config `base`; `+optimizer_kwargs.NAME=VALUE` against torch's AdamW."""
    words = [word.partition("=")[::2] for word in span.split()]
    option = next((value for key, value in words if key == "loss" and value), DEFAULT_LOSS)
    loss_keys = {key.removeprefix("loss."): value or None for key, value in words if key.startswith("loss.")}
    names_a_loss = any(key == "loss" and value for key, value in words)
    problems = loss_problems(option, loss_keys) if names_a_loss or loss_keys else []
    for key, value in words:
        if key == "loss" or key.startswith("loss."):
            continue
        if key.startswith("+optimizer_kwargs."):
            knob = key.removeprefix("+optimizer_kwargs.")
            try:
                check_optimizer("AdamW", {knob: hydra_read(value)}, 1e-5)
            except UserError as error:
                problems.append(str(error))
        elif schema_type(key, {"loss": option}) is None:
            problems.append(f"{key}: not a key of the config")
        elif value:
            try:
                OmegaConf.update(base.copy(), key, hydra_read(value), merge=True)
            except OmegaConfBaseException as error:
                problems.append(f"{key}={value}: {str(error).splitlines()[0]}")
    return problems


@pytest.fixture(scope="module")
def default_config():
    return config.composed([])


def test_every_key_the_tables_name_exists_here(default_config):
    checked, problems = 0, []
    for heading in [*CONFIG_TABLES.values(), ARGUMENTS_TABLE, *LOSS_TYPE_TABLES.values()]:
        for row in TABLES[heading]:
            assert len(row) == 3, f"docs/trl.md under '{heading}': a row of {len(row)} cells, not 3: {row}"
            first, ours, notes = row
            spans = CODE.findall(ours)
            assert notes, f"docs/trl.md under '{heading}': {first} has no notes"
            assert spans or ours == "none", f"docs/trl.md under '{heading}': {first}'s key is neither `key` nor none"
            for span in spans:
                checked += 1
                problems += [f"{heading} {first}: {problem}" for problem in span_problems(span, default_config)]
    assert checked, "no key found in docs/trl.md's tables"
    assert not problems, "docs/trl.md names what the config lacks:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "span, expected",
    [
        ("loss.no_such_key", "not a key of loss=dpo"),
        ("loss=no_such_loss", "no such loss option"),
        ("loss.tau", "not a key of loss=dpo"),  # discopop's key, checked against the default loss
        ("loss=f_dpo loss.f_divergence=js_divergence", "is not one of"),  # TRL's name, not ours
        ("loss=ipo loss.length_normalized=maybe", "loss.length_normalized=maybe"),
        ("loss=mpo loss.terms.dpo.weight=-1", "must be a positive number"),
        ("layot=padded", "not a key of the config"),
        ("reference_cache=sometimes", "reference_cache=sometimes"),
        ("+optimizer_kwargs.no_such_knob=1", "has no setting no_such_knob"),
        ("+optimizer_kwargs.eps=-1", "refuses it"),
    ],
)
def test_the_key_check_catches_what_the_config_lacks(span, expected, default_config):
    problems = span_problems(span, default_config)
    assert any(expected in problem for problem in problems), problems


def test_the_key_check_passes_real_keys_and_values(default_config):
    span = "loss=f_dpo loss.f_divergence=alpha loss.alpha=0.5 layout=padded +optimizer_kwargs.betas=[0.9,0.95]"
    assert span_problems(span, default_config) == []


DEFAULTS_TABLE = "Defaults that differ from TRL's"


def default_problems(span: str) -> list[str]:
    """What is wrong with a span `KEY=VALUE ...` that states our defaults: a key whose default (under the span's
    `loss=NAME`, else the default loss) is not VALUE."""
    words = [word.partition("=")[::2] for word in span.split()]
    option = next((value for key, value in words if key == "loss"), DEFAULT_LOSS)
    defaults = config.composed([f"loss={option}"])
    problems = []
    for key, value in words:
        found = OmegaConf.select(defaults, key, default=ABSENT)
        if key != "loss" and (found is ABSENT or found != hydra_read(value)):
            problems.append(f"{key}={value}: the default is {'no key' if found is ABSENT else found}")
    return problems


def test_every_default_that_differs_from_trl_has_a_row_with_trls_override(default_config):
    rows = TABLES.get(DEFAULTS_TABLE)
    assert rows, f"docs/trl.md has no table under '{DEFAULTS_TABLE}'"
    assert CODE.findall(rows[0][0]) == ["model.freeze_vision=true"], "the vision tower's row comes first"
    problems = []
    for row in rows:
        assert len(row) == 3 and all(row), f"docs/trl.md under '{DEFAULTS_TABLE}': not 3 filled cells: {row}"
        ours, _, theirs = row
        spans = CODE.findall(theirs)
        assert spans or theirs.startswith("none"), f"{ours}: TRL's behaviour is neither an override nor none"
        problems += [problem for span in CODE.findall(ours) for problem in default_problems(span)]
        problems += [f"{ours}: {problem}" for span in spans for problem in span_problems(span, default_config)]
    assert not problems, f"docs/trl.md under '{DEFAULTS_TABLE}':\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "span, expected",
    [("model.freeze_vision=false", "the default is True"), ("loss=ipo loss.beta=0.5", "the default is 0.1")],
)
def test_the_defaults_check_catches_a_default_the_config_lacks(span, expected):
    assert any(expected in problem for problem in default_problems(span)), default_problems(span)
