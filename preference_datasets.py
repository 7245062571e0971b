"""Preference data: sources (Hub datasets and local files) read into preference pairs, the held-out split, and the
order of training. Tokenizing them, once per machine and cached, is tokenized.py's.

Every source becomes a stream of `PreferencePair`s. Formats are recognised by their columns:
  hh:             chosen, rejected             whole dialogues; the prompt is the shared text up to and
                                               including the last "\\n\\nAssistant:" (Anthropic HH-RLHF)
  explicit:       prompt, chosen, rejected     strings
  conversational: [prompt,] chosen, rejected   lists of {"role", "content"} messages, rendered with the
                                               tokenizer's chat template
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


@dataclass(frozen=True)
class LabelledCompletion:
    """One response to a prompt, desirable (label true) or not: unpaired feedback."""

    prompt: str
    completion: str
    label: bool
    truncation_mode: str


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


def parse_conversational(row: dict, chat_template: Callable[[list[dict]], str]) -> list[PreferencePair]:
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
    return [make_pair(chat_template(messages), chosen[-1]["content"], rejected[-1]["content"], "keep_start")]


def parse_unpaired(row: dict, chat_template: Callable[[list[dict]], str]) -> list[LabelledCompletion]:
    """prompt, completion, label: strings, or lists of messages (the completion's last one the assistant's answer,
    the prompt rendered with the chat template); label a JSON boolean."""
    prompt, completion, label = row["prompt"], row["completion"], row["label"]
    if not isinstance(label, bool):
        raise ValueError(f"label is {label!r}, expected true or false")
    if isinstance(completion, list):
        if not isinstance(prompt, list) or not all(isinstance(m, dict) for m in [*prompt, *completion]):
            raise ValueError("conversational rows hold lists of {'role': ..., 'content': ...} in prompt and completion")
        if not completion or completion[-1].get("role") != "assistant":
            raise ValueError("the last message of completion is not an assistant message")
        prompt, completion = chat_template(prompt + completion[:-1]), completion[-1]["content"]
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ValueError(f"{name} is a {type(value).__name__}, expected a string")
    if not completion.strip():
        raise RowSkipped("empty response")
    return [LabelledCompletion(prompt, completion, label, "keep_start")]


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
    prompt: str, chosen: str, rejected: str, truncation_mode: str, sft_target: str | None = None
) -> PreferencePair:
    for name, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str):
            raise ValueError(f"{name} is a {type(value).__name__}, expected a string")
    if not chosen.strip() or not rejected.strip():
        raise RowSkipped("empty response")
    if chosen == rejected:
        raise RowSkipped("chosen == rejected")
    return PreferencePair(prompt, chosen, rejected, chosen if sft_target is None else sft_target, truncation_mode)


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


def detect_parser(row: dict, tokenizer) -> Callable[[dict], list[PreferencePair]]:
    """Choose the row parser from a row's columns; a pair format's `margin` column is read too (with_margin)."""
    parse = pair_parser(row, tokenizer)
    labelled = {"prompt", "completion", "label"} <= set(row)
    return with_margin(parse) if "margin" in row and not labelled else parse


def pair_parser(row: dict, tokenizer) -> Callable[[dict], list[PreferencePair]]:
    columns = set(row)
    if {"history", "human_ref_A", "human_ref_B", "labels", "score_A", "score_B"} <= columns:
        return parse_shp
    if {"question", "answers"} <= columns:
        return parse_se
    if {"prompt", "completion", "label"} <= columns:
        return lambda r: parse_unpaired(r, lambda messages: render_chat(tokenizer, messages))
    if {"chosen", "rejected"} <= columns:
        if isinstance(row["chosen"], list):
            return lambda r: parse_conversational(r, lambda messages: render_chat(tokenizer, messages))
        return parse_explicit if "prompt" in columns else parse_hh
    raise ValueError(
        f"unrecognised columns {sorted(columns)}; expected chosen+rejected (+prompt), "
        "SHP's history/human_ref_A/human_ref_B/labels/score_A/score_B, SE's question/answers, "
        "or prompt/completion/label (labelled completions, for loss=kto or loss=apo_zero_unpaired)"
    )


def render_chat(tokenizer, messages: list[dict]) -> str:
    if tokenizer.chat_template is None:
        raise ValueError("conversational rows need a tokenizer with a chat template, and this one has none")
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


class RowCounts:
    """What a source's rows gave: pairs, rows, and rows skipped by reason with the first of each."""

    def __init__(self, source: str):
        self.source, self.pairs, self.rows = source, 0, 0
        self.skipped, self.first_skipped = Counter(), {}
        self.kind = "pairs"  # or "labelled completions"

    def line(self) -> str:
        """The data line every run prints per source."""
        reasons = self.reasons()
        return f"data: {self.source}: {self.pairs} {self.kind} from {self.rows} rows" + (
            f"; skipped {sum(self.skipped.values())} rows: {reasons}" if self.skipped else ""
        )

    def reasons(self) -> str:
        return ", ".join(f"{n} {reason} (first: {self.first_skipped[reason]})" for reason, n in self.skipped.items())

    def check(self) -> None:
        """A one-line error when no row gave a usable pair."""
        if not self.pairs:
            skipped = f" (skipped: {self.reasons()})" if self.skipped else ""
            raise UserError(f"{self.source}: no usable preference pairs in {self.rows} rows{skipped}")


def iter_pairs(rows: Iterable[tuple[str, Any]], tokenizer, counts: RowCounts) -> Iterator[PreferencePair]:
    """The pairs of (location, row) items, streamed; bad rows raise UserError naming the location, unusable ones
    are skipped and counted in `counts`."""
    parser = None
    for location, row in rows:
        counts.rows += 1
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            parser = parser or detect_parser(row, tokenizer)
            pairs = parser(row)
        except RowSkipped as reason:
            counts.skipped[str(reason)] += 1
            counts.first_skipped.setdefault(str(reason), location)
            continue
        except KeyError as key:
            raise UserError(f"{location}: missing column {key.args[0]}") from None
        except (ValueError, TypeError, AttributeError) as error:
            raise UserError(f"{location}: {error}") from None
        counts.pairs += len(pairs)
        if pairs and isinstance(pairs[0], LabelledCompletion):
            counts.kind = "labelled completions"
        yield from pairs


def parse_rows(rows: Iterable[tuple[str, Any]], source: str, tokenizer) -> list[PreferencePair]:
    """Every pair of (location, row) items (see iter_pairs), with the source's data line printed."""
    counts = RowCounts(source)
    pairs = list(iter_pairs(rows, tokenizer, counts))
    print(counts.line())
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
                    yield f"{path}:{number}", row
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
            yield f"{path} row {number}", row
    else:
        import pyarrow
        import pyarrow.parquet

        number = 0
        try:  # a row group at a time: a file larger than memory streams through
            for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=4096):
                for row in batch.to_pylist():
                    number += 1
                    yield f"{path} row {number}", row
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
        lambda: " ".join(f"{file}:{file_digest(file)}" for file in files),
    )


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
    name: str, tokenizer, seed: int, n_eval_examples: int | None, cache_dir: Path
) -> dict[str, list[PreferencePair]]:
    """{"train": pairs, "test": pairs} of a dataset (see dataset_sources), read whole; a source without a test split
    has n_eval_examples pairs held out (eval_split). Runs read their data tokenized and cached instead
    (tokenized.load_examples), through the same sources and split."""
    sources = dataset_sources(name, cache_dir)
    splits = {split: parse_rows(source.rows(), source.label, tokenizer) for split, source in sources.items()}
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
