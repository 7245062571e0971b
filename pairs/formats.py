"""The formats of preference data: the pair types every source becomes, and the parser of each format, from one row
(a dict) to its pairs. Formats are recognised by their columns (detect_parser):
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

import dataclasses
import html.parser
import math
from dataclasses import dataclass
from typing import Callable

from pairs.chat_templates import ChatTemplate, refuse_template_columns

ASSISTANT_TAG = "\n\nAssistant:"


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
