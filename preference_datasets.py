"""Preference data: sources (Hub datasets and local files) read into preference pairs, the held-out split, and the
order of training. Tokenizing them, once per machine and cached, is tokenized.py's.

Every source becomes a stream of `PreferencePair`s. Formats are recognised by their columns:
  hh:             chosen, rejected             whole dialogues; the prompt is the shared text up to and
                                               including the last "\\n\\nAssistant:" (Anthropic HH-RLHF)
  explicit:       prompt, chosen, rejected     strings
  conversational: [prompt,] chosen, rejected   lists of {"role", "content"} messages, rendered with the
                                               tokenizer's chat template as TRL renders them (ChatTemplate),
                                               optionally with `tools` and `chat_template_kwargs` columns
  shp:            history, human_ref_A, human_ref_B, labels, score_A, score_B   (Stanford SHP)
  se:             question, answers[{text, pm_score}]                           (Stack Exchange preferences)
and labelled completions (thumbs up or down on single answers, for KTO) become `LabelledCompletion`s:
  unpaired:       prompt, completion, label    strings, or message lists (conversational), and true/false
"""

import codecs
import dataclasses
import gzip
import hashlib
import html.parser
import json
import math
import os
import random
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from utils import REPO_ROOT, UserError, first_line

HUB_DATASETS = {"hh": "Anthropic/hh-rlhf", "shp": "stanfordnlp/SHP", "se": "HuggingFaceH4/stack-exchange-preferences"}
DEMO_DIR = REPO_ROOT / "data" / "demo"
FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet")
TEST_SPLIT_NAMES = ("test", "eval", "validation", "valid", "dev")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+(:[\w.-]+)?$")  # org/name, optionally :split
ASSISTANT_TAG = "\n\nAssistant:"
# A byte-order mark opening a text file names its encoding (Windows editors, spreadsheet exports and PowerShell's `>`
# write one); without one, UTF-8. Longest first: UTF-32-LE's mark begins with UTF-16-LE's.
BYTE_ORDER_MARKS = (
    (codecs.BOM_UTF32_LE, "utf-32"),
    (codecs.BOM_UTF32_BE, "utf-32"),
    (codecs.BOM_UTF8, "utf-8-sig"),
    (codecs.BOM_UTF16_LE, "utf-16"),
    (codecs.BOM_UTF16_BE, "utf-16"),
)


@dataclass(frozen=True)
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str
    sft_target: str  # the response SFT trains on for this prompt
    truncation_mode: str  # "keep_end" keeps the end of an over-long prompt, "keep_start" its start
    margin: float = 0.0  # how far apart the pair was rated (a `margin` column): reward models read it
    append_eos: bool = True  # EOS ends each response; false where a chat template rendered them and ended them
    with_tools: bool = False  # the prompt was rendered with tool schemas
    images: tuple[bytes, ...] = ()  # the prompt's images, encoded files, one per placeholder in order


@dataclass(frozen=True)
class LabelledCompletion:
    """One response to a prompt, desirable (label true) or not: unpaired feedback."""

    prompt: str
    completion: str
    label: bool
    truncation_mode: str
    append_eos: bool = True
    with_tools: bool = False
    images: tuple[bytes, ...] = ()


class RowSkipped(Exception):
    """A row that cannot train (e.g. an empty response); it is counted and skipped, never fatal."""


# ---------------------------------------------------------------------------------------------------------
# Chat templates: conversational rows into text


# apply_chat_template's arguments that the rendering sets itself, which chat_template_kwargs may not set
RENDERING_ARGUMENTS = ("conversation", "tokenize", "add_generation_prompt", "continue_final_message")


def template_kwargs_problem(kwargs: dict) -> str | None:
    """Why these keyword arguments cannot go to every apply_chat_template call, or None."""
    taken = [key for key in kwargs if key in RENDERING_ARGUMENTS]
    if taken:
        return (
            f"sets {', '.join(taken)}, which the rendering sets itself (the prompt alone with the generation prompt, "
            "prompt and response together without)"
        )
    return None


def tool_list(tools: Any) -> list | None:
    """A row's tools as the chat template takes them: a list of tool schemas (JSON objects; callables from Python),
    given as such or as a JSON string of one; None for none, an empty list included (as TRL: a template may render
    tool boilerplate for an empty list)."""
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as error:
            raise ValueError(f"tools is a string but not JSON ({error.msg} at character {error.pos})") from None
    expected = "expected a list of tool schemas (JSON objects), or a JSON string of one"
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools is a {type(tools).__name__}, {expected}")
    for tool in tools or []:
        if not isinstance(tool, dict) and not callable(tool):
            raise ValueError(f"tools holds a {type(tool).__name__}, {expected}")
    return tools or None


def refuse_template_columns(row: dict) -> None:
    """A row of strings renders with no chat template, so its tools or chat_template_kwargs would be dropped
    silently: a ValueError instead."""
    for column, given in (
        ("tools", tool_list(row.get("tools"))),
        ("chat_template_kwargs", row.get("chat_template_kwargs")),
    ):
        if given:
            raise ValueError(
                f"the row has {column}, but its texts are strings, which no chat template renders: give its prompt "
                "and responses as lists of messages"
            )


@dataclass(frozen=True)
class ChatTemplate:
    """How conversational rows become text: the tokenizer's chat template, called as TRL 1.16 calls it (DPOTrainer's
    and KTOTrainer's tokenization, trl.data_utils.apply_chat_template), with the same keyword arguments on every
    call for a row: the run's chat_template_kwargs, overridden by the row's `tools` column, then by its own
    `chat_template_kwargs` column (TRL's order for the row's two)."""

    tokenizer: Any
    run_kwargs: dict  # the run's chat_template_kwargs

    def row_kwargs(self, row: dict) -> dict:
        """The keyword arguments of every apply_chat_template call for `row` (ValueError where they are malformed)."""
        own = row.get("chat_template_kwargs")
        if own is not None and not isinstance(own, dict):
            raise ValueError(
                f"chat_template_kwargs is a {type(own).__name__}, expected an object of keyword arguments for the "
                'chat template, e.g. {"enable_thinking": false}'
            )
        tools = {} if row.get("tools") is None else {"tools": row["tools"]}
        kwargs = {**self.run_kwargs, **tools, **(own or {})}
        problem = template_kwargs_problem(kwargs)
        if problem:
            raise ValueError(f"chat_template_kwargs {problem}")
        if "tools" in kwargs:
            kwargs["tools"] = tool_list(kwargs["tools"])
        return kwargs

    def render(self, row: dict, prompt: list[dict], responses: list[list[dict]]) -> tuple[str, list[str], bool]:
        """(prompt text, each response's text, whether tools were rendered) of a row's prompt messages and responses
        (each a list of messages following the prompt). The prompt is rendered with the generation prompt, and each
        response after it, whole; the prompt's text is what all of these share at their start (a template may end
        the generation prompt otherwise than the assistant turn that follows it: DeepSeek-R1, Gemma), each
        response's text the rest of its rendering, its end-of-turn markup included."""
        kwargs = self.row_kwargs(row)
        alone = self.apply(prompt, kwargs, add_generation_prompt=True)
        if kwargs.get("tools") and alone == self.apply(prompt, {**kwargs, "tools": None}, add_generation_prompt=True):
            raise ValueError(
                "the row has tools, but the tokenizer's chat template does not render them (the prompt reads the "
                "same without them): use a tokenizer whose chat template renders tools (model.tokenizer_name_or_path)"
            )
        whole = [self.apply(prompt + response, kwargs) for response in responses]
        shared = os.path.commonprefix([alone, *whole])
        return shared, [text[len(shared) :] for text in whole], bool(kwargs.get("tools"))

    def apply(self, messages: list[dict], kwargs: dict, add_generation_prompt: bool = False) -> str:
        if self.tokenizer.chat_template is None and "chat_template" not in kwargs:
            raise ValueError("conversational rows need a tokenizer with a chat template, and this one has none")
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


# ---------------------------------------------------------------------------------------------------------
# Row parsers: one row (a dict) -> pairs. Missing columns raise KeyError, caught and reported by the caller.


def split_hh_dialogue(dialogue: str) -> tuple[str, str]:
    """(prompt, response): the prompt runs up to and including the last "\\n\\nAssistant:"."""
    end = dialogue.rfind(ASSISTANT_TAG)
    if end < 0:
        raise ValueError(f"no {ASSISTANT_TAG!r} marker in the dialogue")
    end += len(ASSISTANT_TAG)
    return dialogue[:end], dialogue[end:]


def parse_hh(row: dict) -> list[PreferencePair]:
    prompt, chosen = split_hh_dialogue(row["chosen"])
    if not row["rejected"].startswith(prompt):
        raise RowSkipped("rejected does not continue chosen's prompt")
    return [make_pair(prompt, chosen, row["rejected"][len(prompt) :], "keep_end")]


def parse_explicit(row: dict) -> list[PreferencePair]:
    return [make_pair(row["prompt"], row["chosen"], row["rejected"], "keep_start")]


def parse_conversational(row: dict, chat: ChatTemplate) -> list[PreferencePair]:
    chosen, rejected = row["chosen"], row["rejected"]
    if "prompt" in row:  # explicit prompt: chosen and rejected hold just the assistant's turn
        messages = row["prompt"]
    else:  # implicit prompt: every turn but the last is shared
        messages = chosen[:-1]
        if rejected[:-1] != messages:
            raise ValueError("chosen and rejected conversations differ before their last message")
    for message in [*messages, *chosen, *rejected]:
        if not isinstance(message, dict):
            raise ValueError(f"a message is a {type(message).__name__}, expected {{'role': ..., 'content': ...}}")
    for name, conversation in (("chosen", chosen), ("rejected", rejected)):
        if not conversation or conversation[-1].get("role") != "assistant":
            raise ValueError(f"the last message of {name} is not an assistant message")
    if "prompt" not in row:
        chosen, rejected = chosen[-1:], rejected[-1:]
    prompt, (chosen, rejected), with_tools = chat.render(row, messages, [chosen, rejected])
    return [make_pair(prompt, chosen, rejected, "keep_start", append_eos=False, with_tools=with_tools)]


def parse_unpaired(row: dict, chat: ChatTemplate) -> list[LabelledCompletion]:
    """prompt, completion, label: strings, or lists of messages (the completion ending with the assistant's answer)
    rendered with the chat template (ChatTemplate.render); label a JSON boolean."""
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise ValueError(f"label is {label!r}, expected true or false")
    conversational, with_tools = isinstance(completion, list), False
    if conversational:
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in [*prompt, *completion]):
            raise ValueError("conversational rows hold lists of {'role': ..., 'content': ...} in prompt and completion")
        if not completion or completion[-1].get("role") != "assistant":
            raise ValueError("the last message of completion is not an assistant message")
        prompt, (completion,), with_tools = chat.render(row, prompt, [completion])
    else:
        refuse_template_columns(row)
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ValueError(f"{name} is a {type(value).__name__}, expected a string")
    if not completion.strip():
        raise RowSkipped("empty response")
    return [LabelledCompletion(prompt, completion, label, "keep_start", not conversational, with_tools)]


def parse_shp(row: dict) -> list[PreferencePair]:
    # SHP (Ethayarajh et al. 2022): keep pairs whose score ratio is at least 2, as the DPO paper did.
    score_a, score_b = row["score_A"], row["score_B"]
    if max(score_a, score_b) < 2 * min(score_a, score_b):
        raise RowSkipped("score ratio below 2")
    prompt = "\n\nHuman: " + row["history"] + ASSISTANT_TAG
    a, b = " " + row["human_ref_A"], " " + row["human_ref_B"]
    chosen, rejected = (a, b) if row["labels"] == 1 else (b, a)
    return [make_pair(prompt, chosen, rejected, "keep_start")]


def parse_se(row: dict) -> list[PreferencePair]:
    answers = [(" " + strip_html(a["text"]), a["pm_score"]) for a in row["answers"]]
    prompt = "\n\nHuman: " + strip_html(row["question"]) + ASSISTANT_TAG
    sft_target = max(answers, key=lambda a: a[1])[0]
    pairs = []
    for i, (text_i, score_i) in enumerate(answers):
        for text_j, score_j in answers[i + 1 :]:
            if score_i == score_j:  # a tie expresses no preference (the reference ordered ties arbitrarily)
                continue
            chosen, rejected = (text_i, text_j) if score_i > score_j else (text_j, text_i)
            pairs.append(make_pair(prompt, chosen, rejected, "keep_start", sft_target))
    if not pairs:
        raise RowSkipped("no two answers with different scores")
    return pairs


def make_pair(
    prompt: str,
    chosen: str,
    rejected: str,
    truncation_mode: str,
    sft_target: str | None = None,
    append_eos: bool = True,
    with_tools: bool = False,
) -> PreferencePair:
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str):
            raise ValueError(f"{name} is a {type(value).__name__}, expected a string")
    if not chosen.strip() or not rejected.strip():
        raise RowSkipped("empty response")
    if chosen == rejected:
        raise RowSkipped("chosen == rejected")
    sft_target = chosen if sft_target is None else sft_target
    return PreferencePair(prompt, chosen, rejected, sft_target, truncation_mode, 0.0, append_eos, with_tools)


class _TextOnly(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts = []

    def handle_data(self, data):
        self.parts.append(data)


def strip_html(text: str) -> str:
    parser = _TextOnly()
    parser.feed(text)
    parser.close()
    return "".join(parser.parts).strip()


def with_margin(parse: Callable[[dict], list[PreferencePair]]) -> Callable[[dict], list[PreferencePair]]:
    """A pair parser that also reads the row's `margin` column, a finite number (Llama 2's rating margin, which
    loss=reward subtracts from the reward difference)."""

    def parse_with_margin(row: dict) -> list[PreferencePair]:
        margin = row["margin"]
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
            raise ValueError(f"margin is {margin!r}, expected a finite number")
        return [dataclasses.replace(pair, margin=float(margin)) for pair in parse(row)]

    return parse_with_margin


def text_pairs(parse: Callable[[dict], list[PreferencePair]]) -> Callable[[dict], list[PreferencePair]]:
    """A parser of pairs given as strings: it refuses a row's tools and chat_template_kwargs
    (refuse_template_columns)."""

    def parse_text(row: dict) -> list[PreferencePair]:
        refuse_template_columns(row)
        return parse(row)

    return parse_text


def detect_parser(row: dict, chat: ChatTemplate) -> Callable[[dict], list[PreferencePair]]:
    """Choose the row parser from a row's columns; a pair format's `margin` column is read too (with_margin)."""
    parse = pair_parser(row, chat)
    labelled = {"prompt", "completion", "label"} <= set(row)
    return with_margin(parse) if "margin" in row and not labelled else parse


def pair_parser(row: dict, chat: ChatTemplate) -> Callable[[dict], list[PreferencePair]]:
    columns = set(row)
    if {"history", "human_ref_A", "human_ref_B", "labels", "score_A", "score_B"} <= columns:
        return parse_shp
    if {"question", "answers"} <= columns:
        return parse_se
    if {"prompt", "completion", "label"} <= columns:
        return lambda r: parse_unpaired(r, chat)
    if {"chosen", "rejected"} <= columns:
        if isinstance(row["chosen"], list):
            return lambda r: parse_conversational(r, chat)
        return text_pairs(parse_explicit if "prompt" in columns else parse_hh)
    raise ValueError(
        f"unrecognised columns {sorted(columns)}; expected chosen+rejected (+prompt), "
        "SHP's history/human_ref_A/human_ref_B/labels/score_A/score_B, SE's question/answers, "
        "or prompt/completion/label (labelled completions, for loss=kto or loss=apo_zero_unpaired)"
    )


SHOWN_CHARACTERS = 4000  # of each text of the example a data line shows rendered with tools


def shown_text(text: str) -> str:
    """A rendered text on one line (\\n for each line break), its first SHOWN_CHARACTERS characters."""
    more = len(text) - SHOWN_CHARACTERS
    return text[:SHOWN_CHARACTERS].replace("\n", "\\n") + (f" ... {more} more characters" if more > 0 else "")


def rendered_lines(location: str, example: PreferencePair | LabelledCompletion) -> list[str]:
    """An example rendered with tools as lines under its source's data line, so that the user sees what the chat
    template made of the tool schemas."""
    names = ("prompt", "completion") if isinstance(example, LabelledCompletion) else ("prompt", "chosen", "rejected")
    lines = [f"  the first row with tools ({location}), as the chat template renders it (\\n: a line break):"]
    return lines + [f"    {name:10} {shown_text(getattr(example, name))}" for name in names]


def data_lines(line: str, shown: list[str]) -> str:
    """A source's data line, and the lines showing its first example rendered with tools (none without)."""
    return "\n".join([line, *shown])


class RowCounts:
    """What a source's rows gave: pairs, rows, rows with tools (the first shown rendered), and rows skipped by reason
    with the first of each."""

    def __init__(self, source: str):
        self.source, self.pairs, self.rows = source, 0, 0
        self.skipped, self.first_skipped = Counter(), {}
        self.kind = "pairs"  # or "labelled completions"
        self.with_tools, self.shown = 0, []

    def add(self, location: str, pairs: list[PreferencePair] | list[LabelledCompletion]) -> None:
        """Count what one row gave."""
        self.pairs += len(pairs)
        if pairs and isinstance(pairs[0], LabelledCompletion):
            self.kind = "labelled completions"
        if pairs and pairs[0].with_tools:
            self.with_tools += 1
            self.shown = self.shown or rendered_lines(location, pairs[0])

    def line(self) -> str:
        """The data line every run prints per source."""
        reasons = self.reasons()
        tools = f", {self.with_tools} of them with tools" if self.with_tools else ""
        return f"data: {self.source}: {self.pairs} {self.kind} from {self.rows} rows{tools}" + (
            f"; skipped {sum(self.skipped.values())} rows: {reasons}" if self.skipped else ""
        )

    def reasons(self) -> str:
        return ", ".join(f"{n} {reason} (first: {self.first_skipped[reason]})" for reason, n in self.skipped.items())

    def check(self) -> None:
        """A one-line error when no row gave a usable pair."""
        if not self.pairs:
            skipped = f" (skipped: {self.reasons()})" if self.skipped else ""
            raise UserError(f"{self.source}: no usable preference pairs in {self.rows} rows{skipped}")


def with_images(row: dict, pairs: list, vision) -> list:
    """The row's pairs (or labelled completions) with its images, read now (modeling.vision.row_images), each
    prompt holding one placeholder per image. A model without an image processor refuses rows with images rather
    than train on their text alone, which would teach it preferences about pictures it never saw."""
    from modeling.vision import IMAGE_COLUMNS, row_images

    if vision is None:
        for column in IMAGE_COLUMNS:
            if row.get(column) not in (None, [], ""):
                raise ValueError(
                    f"column {column!r} holds images, and this model takes text only (no image processor beside "
                    "it): it would train on the text without them; use a vision-language model, or drop the column"
                )
        return pairs
    images = row_images(row)
    for pair in pairs:
        vision.check_placeholders(pair.prompt, len(images))
    return [dataclasses.replace(pair, images=images) for pair in pairs] if images else pairs


def iter_pairs(
    rows: Iterable[tuple[str, Any]], tokenizer, counts: RowCounts, chat_template_kwargs: dict | None = None
) -> Iterator[PreferencePair]:
    """The pairs of (location, row) items, streamed; bad rows raise UserError naming the location, unusable ones
    are skipped and counted in `counts`. Conversational rows are rendered with the tokenizer's chat template and
    the run's chat_template_kwargs (ChatTemplate)."""
    vision = getattr(tokenizer, "vision", None)  # a vision-language model's (modeling.models.load_tokenizer)
    renderer = vision.processor if vision is not None else tokenizer  # a processor's template renders image parts
    chat, parser = ChatTemplate(renderer, dict(chat_template_kwargs or {})), None
    for location, row in rows:
        counts.rows += 1
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            parser = parser or detect_parser(row, chat)
            pairs = with_images(row, parser(row), vision)
        except RowSkipped as reason:
            counts.skipped[str(reason)] += 1
            counts.first_skipped.setdefault(str(reason), location)
            continue
        except KeyError as key:
            raise UserError(f"{location}: missing column {key.args[0]}") from None
        except (ValueError, TypeError, AttributeError) as error:
            raise UserError(f"{location}: {error}") from None
        counts.add(location, pairs)
        yield from pairs


def parse_rows(
    rows: Iterable[tuple[str, Any]], source: str, tokenizer, chat_template_kwargs: dict | None = None
) -> list[PreferencePair]:
    """Every pair of (location, row) items (see iter_pairs), with the source's data line printed."""
    counts = RowCounts(source)
    pairs = list(iter_pairs(rows, tokenizer, counts, chat_template_kwargs))
    print(data_lines(counts.line(), counts.shown))
    counts.check()
    return pairs


# ---------------------------------------------------------------------------------------------------------
# Sources


def text_encoding(head: bytes) -> tuple[str, str]:
    """(codec, name) of the text whose first bytes are `head`: the encoding its byte-order mark names, else UTF-8.
    The codec drops the mark."""
    codec = next((codec for mark, codec in BYTE_ORDER_MARKS if head.startswith(mark)), "utf-8")
    return codec, codec.removesuffix("-sig").upper()


def open_binary(path: Path):
    return gzip.open(path) if path.name.endswith(".gz") else open(path, "rb")


def text_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of a text file, gzipped or not, in the encoding `text_encoding` finds. UTF-8 streams line
    by line; UTF-16 and UTF-32 (rarer, and their newlines are not single bytes) are decoded whole."""
    with open_binary(path) as f:
        codec, encoding = text_encoding(f.read(4))
    with open_binary(path) as f:
        if encoding == "UTF-8":
            for number, raw in enumerate(f, start=1):
                try:  # the mark (utf-8-sig) may open the file only
                    yield number, raw.decode(codec if number == 1 else "utf-8")
                except UnicodeDecodeError as error:
                    reason = f"{error.reason} at column {error.start}"
                    raise UserError(f"{path}:{number}: not UTF-8 text ({reason})") from None
            return
        data = f.read()
    try:
        text = data.decode(codec)
    except UnicodeDecodeError as error:
        number = data[: error.start].decode(codec, errors="replace").count("\n") + 1
        raise UserError(f"{path}:{number}: not {encoding} text ({error.reason})") from None
    yield from enumerate(text.split("\n"), start=1)  # only "\n" ends a line: JSON strings may hold U+2028


def with_image_paths(row: Any, base: Path) -> Any:
    """The row with the image paths of its `images` / `image` column made absolute: relative ones are relative to
    the data file's directory (`base`). URLs stay URLs."""
    from modeling.vision import IMAGE_COLUMNS, is_url

    if not isinstance(row, dict) or not any(row.get(column) for column in IMAGE_COLUMNS):
        return row

    def resolved(cell):
        if isinstance(cell, str) and cell and not Path(cell).is_absolute() and not is_url(cell):
            return str(base / cell)
        if isinstance(cell, dict) and not cell.get("bytes") and isinstance(cell.get("path"), str):
            return {**cell, "path": resolved(cell["path"])}
        return cell

    row = dict(row)
    for column in IMAGE_COLUMNS:
        value = row.get(column)
        if value:
            row[column] = [resolved(cell) for cell in value] if isinstance(value, list) else resolved(value)
    return row


def read_file_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """(location, row) for each row of a .jsonl, .jsonl.gz, .json or .parquet file; text in UTF-8, or in the UTF-8,
    UTF-16 or UTF-32 that a byte-order mark opening the file names."""
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        try:
            for number, line in text_lines(path):
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise UserError(f"{path}:{number}: malformed JSON line ({error.msg})") from None
                    yield f"{path}:{number}", with_image_paths(row, path.parent)
        except (EOFError, gzip.BadGzipFile, zlib.error) as error:
            raise UserError(f"{path}: a truncated or corrupt gzip file ({first_line(error)})") from None
    elif name.endswith(".json"):
        data = path.read_bytes()
        codec, encoding = text_encoding(data)
        try:
            rows = json.loads(data.decode(codec))
        except UnicodeDecodeError as error:
            raise UserError(f"{path}: not {encoding} text ({error.reason} at byte {error.start})") from None
        except json.JSONDecodeError as error:
            raise UserError(f"{path}:{error.lineno}: malformed JSON ({error.msg})") from None
        if not isinstance(rows, list):
            raise UserError(f"{path}: expected a JSON list of rows")
        for number, row in enumerate(rows, start=1):
            yield f"{path} row {number}", with_image_paths(row, path.parent)
    else:
        import pyarrow
        import pyarrow.parquet

        number = 0
        try:  # a row group at a time: a file larger than memory streams through
            for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{path} row {number}", with_image_paths(row, path.parent)
        except (pyarrow.ArrowException, OSError) as error:
            raise UserError(f"{path}: not a readable Parquet file ({first_line(error)})") from None


def local_split_files(path: Path) -> dict[str, list[Path]]:
    """{"train": files, "test": files} of a file or directory; "test" is empty when it has no test split."""
    if path.is_file():
        if not path.name.endswith(FILE_SUFFIXES):
            raise UserError(f"{path}: unsupported file type; expected one of {', '.join(FILE_SUFFIXES)}")
        return {"train": [path], "test": []}
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_SUFFIXES))
    if not files:
        raise UserError(f"{path}: no {', '.join(FILE_SUFFIXES)} files in this directory")
    test = [p for p in files if p.name.lower().startswith(TEST_SPLIT_NAMES)]
    return {"train": [p for p in files if p not in test], "test": test}


def load_from_hub(name: str, repo: str, split: str | None, cache_dir: Path):
    """datasets.load_dataset(repo, split=split): a Dataset, or a DatasetDict of every split for split=None."""
    import datasets

    try:
        return datasets.load_dataset(repo, cache_dir=str(cache_dir), split=split)
    except Exception as error:  # offline, missing, or gated: the datasets library raises many types
        shown = f"'{name}'" if name == repo else f"'{name}' ({repo})"
        raise UserError(
            f"could not load dataset {shown} from the Hugging Face Hub "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "give a local copy instead, e.g. datasets=[path/to/file.jsonl.gz]"
        ) from None


@dataclass
class Source:
    """One stream of rows, read as one: a file, a directory's train or test files, or a split of a Hub dataset."""

    label: str  # how the data lines name it
    rows: Callable[[], Iterator[tuple[str, Any]]]  # (location, row) items, read anew at each call
    fingerprint: Callable[[], str]  # what the rows are: each file's name and content digest, or the Hub dataset's own


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def files_source(label: str, files: list[Path]) -> Source:
    return Source(
        label,
        lambda: (item for file in files for item in read_file_rows(file)),
        lambda: " ".join(f"{file}:{file_digest(file)}{image_files_digest(file)}" for file in files),
    )


def image_files_digest(file: Path) -> str:
    """A digest of the image files a data file's rows name by path (none: ""): a changed image changes what its
    examples are, as a changed row does. Each file by its size and modification time, as make judges a file, not by
    its bytes: this runs at every start, and reading every image of a large set (RLAIF-V's 80k) each time would cost
    more than the cache saves. Examples' keys, which the reference cache reads, digest the bytes themselves."""
    from modeling.vision import IMAGE_COLUMNS

    if not file.name.endswith((".jsonl", ".jsonl.gz", ".json")) or b'"image' not in file_head(file):
        return ""
    digest, paths = hashlib.sha256(), 0
    for _, row in read_file_rows(file):
        cells = [row.get(column) for column in IMAGE_COLUMNS] if isinstance(row, dict) else []
        for cell in (cell for value in cells for cell in (value if isinstance(value, list) else [value])):
            path = cell.get("path") if isinstance(cell, dict) and not cell.get("bytes") else cell
            if isinstance(path, str) and Path(path).is_file():
                stat = Path(path).stat()
                digest.update(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode())
                paths += 1
    return f" images {digest.hexdigest()}" if paths else ""


def file_head(file: Path) -> bytes:
    """The start of a data file as stored, decompressed where it is gzip: enough to see its columns. A truncated or
    corrupt gzip file gives none: reading its rows says so in one line (read_file_rows)."""
    try:
        with open_binary(file) as stream:
            return stream.read(1 << 16)
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return b""


def hub_source(data, label: str) -> Source:
    """The rows of a `datasets.Dataset`, fingerprinted by the datasets library (it changes with the data and with
    every transform applied to it)."""
    return Source(
        label, lambda: ((f"{label} row {i + 1}", row) for i, row in enumerate(data)), lambda: data._fingerprint
    )


def named_hub_split(name: str, split: str, cache_dir: Path) -> Source:
    """hh, shp or se: a split of the Hub dataset the DPO reference trained on."""
    hub_name = HUB_DATASETS[name]
    if name == "se":
        # SE has only a train split; the reference holds out its first 1% after a fixed shuffle as test.
        data = load_from_hub(name, hub_name, "train", cache_dir).shuffle(seed=42)
        cut = int(len(data) * 0.01)
        data = data.select(range(cut) if split == "test" else range(cut, len(data)))
    else:
        data = load_from_hub(name, hub_name, split, cache_dir)
    return hub_source(data, f"{hub_name}[{split}]")


def hub_sources(name: str, cache_dir: Path) -> dict[str, Source]:
    """Any Hub dataset `org/name` (its train split, and its test split where it has one) or `org/name:split`
    (that split only)."""
    repo, _, split = name.partition(":")
    data = load_from_hub(name, repo, split or None, cache_dir)
    if split:
        return {"train": hub_source(data, f"{repo}[{split}]")}
    if "train" not in data:
        raise UserError(f"{repo} has no 'train' split; choose one of {', '.join(data)} with {repo}:SPLIT")
    test = next((s for s in data if s.lower().startswith(TEST_SPLIT_NAMES)), None)
    named = {"train": "train"} | ({"test": test} if test else {})
    return {key: hub_source(data[s], f"{repo}[{s}]") for key, s in named.items()}


def dataset_sources(name: str, cache_dir: Path) -> dict[str, Source]:
    """{"train": source, and "test": source where the dataset has a test split} of a dataset name: hh, shp, se,
    demo, a local file or directory, or any Hub dataset `org/name[:split]`."""
    if name in HUB_DATASETS:
        return {split: named_hub_split(name, split, cache_dir) for split in ("train", "test")}
    path = DEMO_DIR if name == "demo" else Path(name)
    if path.exists():
        return {
            split: files_source(f"{path} ({split} files)" if path.is_dir() else str(path), files)
            for split, files in local_split_files(path).items()
            if files
        }
    if HUB_ID.match(name) and not name.endswith(FILE_SUFFIXES):
        return hub_sources(name, cache_dir)
    raise UserError(
        f"unknown dataset '{name}': expected one of {', '.join([*HUB_DATASETS, 'demo'])}, a Hub dataset "
        f"org/name[:split], or an existing {'/'.join(FILE_SUFFIXES)} file or directory"
    )


def nothing_to_train_on(names: list[str]) -> str:
    """The line for datasets that hold no training example: what a directory of test files alone holds."""
    for name in names:
        path = Path(name)
        if path.is_dir() and not local_split_files(path)["train"]:
            found = ", ".join(str(p.relative_to(path)) for p in local_split_files(path)["test"])
            held_out = ", ".join(f"{prefix}*" for prefix in TEST_SPLIT_NAMES)
            return (
                f"{path}: nothing to train on, only test files ({found}; files named {held_out} are held out for "
                f"eval). Add the training pairs beside them, e.g. {path / 'train.jsonl'}"
            )
    return f"the datasets {', '.join(names)} hold no training example"


def eval_split(groups: list, n_eval: int | None, seed: int, source: str) -> list[bool]:
    """Whether each example of a source without a test split is held out for eval: whole prompts (`groups`: each
    example's prompt, or a digest of it), in an order seeded by `seed`, until n_eval examples are held out. Holding
    out by prompt keeps every pair of a held-out prompt out of training."""
    if n_eval is None:
        raise UserError(f"{source} has no test split: set n_eval_examples to hold out that many pairs for eval")
    order = list(dict.fromkeys(groups))  # first-seen order: the shuffle depends on the count alone
    random.Random(seed).shuffle(order)
    counts = Counter(groups)
    held, n_held = set(), 0
    for group in order:
        if n_held >= n_eval:
            break
        held.add(group)
        n_held += counts[group]
    if n_held == len(groups):
        raise UserError(
            f"{source}: holding out n_eval_examples={n_eval} pairs for eval leaves none of its {len(groups)} pairs "
            "to train on; lower n_eval_examples"
        )
    print(f"data: {source}: {n_held} pairs ({len(held)} prompts) held out for eval")
    return [group in held for group in groups]


def get_dataset(
    name: str,
    tokenizer,
    seed: int,
    n_eval_examples: int | None,
    cache_dir: Path,
    chat_template_kwargs: dict | None = None,
) -> dict[str, list[PreferencePair]]:
    """{"train": pairs, "test": pairs} of a dataset (see dataset_sources), read whole; a source without a test split
    has n_eval_examples pairs held out (eval_split). Runs read their data tokenized and cached instead
    (tokenized.load_examples), through the same sources and split."""
    sources = dataset_sources(name, cache_dir)
    splits = {
        split: parse_rows(source.rows(), source.label, tokenizer, chat_template_kwargs)
        for split, source in sources.items()
    }
    if "train" not in splits:
        raise UserError(nothing_to_train_on([name]))
    if "test" in splits:
        return splits
    pairs = splits["train"]
    held = eval_split([pair.prompt for pair in pairs], n_eval_examples, seed, name)
    return {
        "train": [pair for pair, is_eval in zip(pairs, held) if not is_eval],
        "test": [pair for pair, is_eval in zip(pairs, held) if is_eval],
    }


# ---------------------------------------------------------------------------------------------------------
# The order of training


def batch_schedule(n: int, batch_size: int, seed: int, n_epochs: int | None, n_examples: int | None) -> list[list[int]]:
    """Example indices of every global training batch, in order.

    Epoch e is a permutation seeded by (seed, e); each epoch's incomplete last batch is dropped so that every
    step sees batch_size examples. Training stops after n_epochs or n_examples, whichever comes first.
    """
    if n < batch_size:
        raise UserError(f"the training data has {n} examples, fewer than batch_size={batch_size}")
    steps_per_epoch = n // batch_size
    total = min(
        n_epochs * steps_per_epoch if n_epochs is not None else float("inf"),
        -(-n_examples // batch_size) if n_examples is not None else float("inf"),
    )
    schedule = []
    for epoch in range(-(-int(total) // steps_per_epoch)):
        order = list(range(n))
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
        schedule.extend(order[i * batch_size : (i + 1) * batch_size] for i in range(steps_per_epoch))
    return schedule[: int(total)]
