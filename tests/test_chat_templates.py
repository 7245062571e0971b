"""Conversational rows with tools and chat_template_kwargs (pairs.chat_templates.ChatTemplate): prompts and responses
rendered as TRL 1.16 renders them (trl.data_utils.apply_chat_template, on templates that read `tools` and
`enable_thinking`: tests/assets/chat_templates), a row's keyword arguments over the run's, the tokenized cache keyed
by the run's, and a tool-calling run that trains and shows its rendered tools."""

import json
import math
import shutil
from pathlib import Path

import pytest
import transformers
from trl.data_utils import apply_chat_template, extract_prompt

from conftest import TINY_DIR, records, tiny_run_overrides, write_jsonl
from persistence.tokenized import Tokenization, load_examples
from preference_datasets import parse_rows

TEMPLATES = Path(__file__).parent / "assets" / "chat_templates"


def tool(name: str, description: str, argument: str) -> dict:
    """A tool schema, as transformers' get_json_schema writes one."""
    parameters = {"type": "object", "properties": {argument: {"type": "string"}}, "required": [argument]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


WEATHER = tool("get_weather", "The weather in a city", "city")
CLOCK = tool("get_time", "The time in a time zone", "zone")


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def call(city: str) -> dict:
    """An assistant turn that calls get_weather."""
    function = {"name": "get_weather", "arguments": {"city": city}}
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": function}]}


def tool_result(text: str) -> dict:
    return {"role": "tool", "name": "get_weather", "content": text}


def tokenizer_with(template: str | None):
    """The tiny tokenizer with one of tests/assets/chat_templates (None: its own, which reads neither)."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    if template is not None:
        tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


def trl_rendering(row: dict, run_kwargs: dict, tokenizer) -> dict:
    """TRL 1.16's text of a row: DPOTrainer's prompt extraction where the prompt is implicit, the row's tools (a JSON
    string loaded as DPOTrainer loads it), and chat_template_kwargs: the run's under the row's."""
    example = {key: row[key] for key in ("prompt", "chosen", "rejected", "completion", "label") if key in row}
    if "prompt" not in example:
        example = extract_prompt(example)
    example["chat_template_kwargs"] = {**run_kwargs, **row.get("chat_template_kwargs", {})}
    tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
    return apply_chat_template(example, tokenizer, tools=tools)


TOOL_PAIRS = [
    # the prompt given; chosen calls the tool, reads its result and answers
    {
        "prompt": [user("Is it raining in Paris?")],
        "chosen": [call("Paris"), tool_result("rain, 12 C"), assistant("Yes, it is raining in Paris.")],
        "rejected": [assistant("I cannot know that.")],
        "tools": [WEATHER, CLOCK],
    },
    # the prompt implicit, ending with a tool's result; the tools a JSON string
    {
        "chosen": [user("Weather in Oslo?"), call("Oslo"), tool_result("snow"), assistant("It is snowing.")],
        "rejected": [user("Weather in Oslo?"), call("Oslo"), tool_result("snow"), assistant("Sunny!")],
        "tools": json.dumps([WEATHER]),
    },
    # no tools, and an empty list of them: the template renders no tool turn
    {"prompt": [user("Hi")], "chosen": [assistant("Hello!")], "rejected": [assistant("Go away.")], "tools": None},
    {"prompt": [user("Hi")], "chosen": [assistant("Hello.")], "rejected": [assistant("What?")], "tools": []},
]
THINKING_PAIRS = [
    # the run's enable_thinking=false: a /no_think turn, and an empty thought in the generation prompt alone
    {"prompt": [user("2 + 2?")], "chosen": [assistant("4")], "rejected": [assistant("5")]},
    # the row's own enable_thinking=true overrides the run's
    {
        "chosen": [user("3 + 3?"), assistant("6")],
        "rejected": [user("3 + 3?"), assistant("7")],
        "chat_template_kwargs": {"enable_thinking": True},
    },
]


def unpaired(rows: list[dict]) -> list[dict]:
    """Labelled completions (KTO's data) of pair rows: chosen desirable, rejected not; their tools and kwargs kept."""
    labelled = []
    for row in rows:
        row = {**row, **extract_prompt(row)} if "prompt" not in row else row
        extra = {key: row[key] for key in ("tools", "chat_template_kwargs") if key in row}
        for completion, label in ((row["chosen"], True), (row["rejected"], False)):
            labelled.append({"prompt": row["prompt"], "completion": completion, "label": label, **extra})
    return labelled


@pytest.mark.parametrize(
    "template, rows, run_kwargs",
    [
        ("tools", TOOL_PAIRS, {}),
        ("tools", unpaired(TOOL_PAIRS), {}),
        ("thinking", THINKING_PAIRS, {"enable_thinking": False}),
        ("thinking", unpaired(THINKING_PAIRS), {"enable_thinking": False}),
        # one mechanism: a template given through the run's kwargs, as any other argument of apply_chat_template
        (None, THINKING_PAIRS, {"enable_thinking": False, "chat_template": (TEMPLATES / "thinking.jinja").read_text()}),
    ],
    ids=["tools-pairs", "tools-labelled", "thinking-pairs", "thinking-labelled", "template-in-kwargs"],
)
def test_conversational_rows_render_as_trl_renders_them(template, rows, run_kwargs):
    tokenizer = tokenizer_with(template)
    examples = parse_rows([(f"row {i}", row) for i, row in enumerate(rows)], "rows", tokenizer, run_kwargs)
    assert len(examples) == len(rows)
    for row, example in zip(rows, examples):
        expected = trl_rendering(row, run_kwargs, tokenizer)
        names = ("prompt", "completion") if "completion" in row else ("prompt", "chosen", "rejected")
        assert {name: getattr(example, name) for name in names} == {name: expected[name] for name in names}
        assert not example.append_eos  # the template ends each response: <|im_end|>\n
        tools = json.loads(row["tools"]) if isinstance(row.get("tools"), str) else row.get("tools")
        assert example.with_tools == bool(tools)
        assert all(json.dumps(schema) in example.prompt for schema in tools or [])  # the template's tojson
    prompts = [example.prompt for example in examples]
    if template == "tools":  # a tool call is the response's; no tools, no tool turn
        assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in getattr(examples[0], names[1])
        assert not prompts[-1].startswith("<|im_start|>system")
    else:  # the run's enable_thinking=false where the row says nothing, the row's true where it does
        assert "/no_think" in prompts[0] and "/no_think" not in prompts[-1]
        assert prompts[0].endswith("<|im_start|>assistant\n")  # the empty thought is not the prompt's: it is cut


def test_the_runs_chat_template_kwargs_key_the_tokenized_cache(tmp_path, capsys):
    # A cache built with other chat_template_kwargs holds other text: it must not be read back.
    tokenizer = tokenizer_with("thinking")
    rows = [
        {"prompt": [user(f"{i} + 1?")], "chosen": [assistant(f"{i + 1}")], "rejected": [assistant("0")]}
        for i in range(6)
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)

    def load(kwargs: dict):
        examples = load_examples([str(path)], tokenizer, Tokenization(64, 32, False, kwargs), 0, 2, tmp_path / "c")
        out = capsys.readouterr().out
        return examples["train"], "(tokenized earlier:" in out

    thinking, hit = load({})
    assert not hit and "/no_think" not in tokenizer.decode(thinking[0]["prompt"])
    quiet, hit = load({"enable_thinking": False})
    assert not hit and "/no_think" in tokenizer.decode(quiet[0]["prompt"])
    again, hit = load({"enable_thinking": False})
    assert hit and again.take(range(len(again))) == quiet.take(range(len(quiet)))
    assert load({})[1]


def tool_rows(n: int) -> list[dict]:
    """n tool-calling pairs: chosen calls get_weather for the city asked about, rejected refuses."""
    cities = ["Paris", "Oslo", "Lima", "Rome", "Kyiv", "Doha"]
    return [
        {
            "prompt": [user(f"Weather in {cities[i % 6]}, day {i}?")],
            "chosen": [call(cities[i % 6])],
            "rejected": [assistant("No idea.")],
            "tools": [WEATHER],
        }
        for i in range(n)
    ]


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_a_tool_calling_dataset_trains_and_shows_its_rendered_tools(tmp_path, run_main, loss):
    # The proof: tool-calling rows with a template that renders tools train, and the data lines show the
    # first row as the template rendered it, tool schemas included (pairs for dpo, labelled completions for kto).
    model = tmp_path / "tiny-tools"
    shutil.copytree(TINY_DIR, model)
    shutil.copy(TEMPLATES / "tools.jinja", model / "chat_template.jinja")
    rows = tool_rows(24) if loss == "dpo" else unpaired(tool_rows(12))
    data = write_jsonl(tmp_path / "tools.jsonl", rows)
    result = run_main(*tiny_run_overrides(tmp_path, data), f"model.name_or_path={model}", f"loss={loss}")
    assert result.returncode == 0, result.stderr
    kind = "pairs" if loss == "dpo" else "labelled completions"
    assert f"data: {data}: 24 {kind} from 24 rows, 24 of them with tools (tokenized, cached in" in result.stdout
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    rendered = tokenizer.apply_chat_template(
        rows[0]["prompt"], tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert json.dumps(WEATHER) in rendered
    shown = "    prompt     " + rendered.replace("\n", "\\n")
    assert f"  the first row with tools ({data}:1), as the chat template renders it" in result.stdout
    assert shown + "\n" in result.stdout
    trained = records(tmp_path / "run", "train")
    assert [r["step"] for r in trained] == [8, 16] and all(math.isfinite(r["loss/train"]) for r in trained)
