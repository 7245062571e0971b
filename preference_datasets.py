"""Preference data, the entry point to it: a dataset's sources (files, directories and Hub datasets:
pairs/sources.py) read into preference pairs by the parser of their format (pairs/formats.py, which lists the
formats), with their images and counted per source; the held-out split; and the order of training. Tokenizing them,
once per machine and cached, is persistence/tokenized.py's."""

import dataclasses
import random
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

from modeling.vision import IMAGE_COLUMNS, row_images
from pairs.chat_templates import ChatTemplate
from pairs.formats import LabelledCompletion, PreferencePair, RowSkipped, detect_parser
from pairs.sources import TEST_SPLIT_NAMES, dataset_sources, local_split_files
from utils import UserError

# ---------------------------------------------------------------------------------------------------------
# Rows into pairs, with their images, counted per source


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
    vision = getattr(tokenizer, "vision", None)  # a vision-language model's (modeling.tokenizers.load_tokenizer)
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
# The held-out split


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
