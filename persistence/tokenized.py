"""Tokenized examples: every source tokenized once per machine, held in flat arrays, and cached on disk across runs.

An example is a prompt and its responses (chosen and rejected for a preference pair; the sft_target alone for SFT;
one completion and its label for labelled completions, KTO's unpaired data),
tokenized without special tokens (tokenizers disagree on BOS), EOS ending each response, and truncated as the DPO
reference does: when prompt plus the longer response exceed max_length, the prompt is cut to max_prompt_length (its
end kept for HH dialogues, its start otherwise), then the responses to max_length - max_prompt_length.

Speed: texts reach the tokenizer in batches (a fast tokenizer's batch call runs in Rust on every core), each
distinct text once, and truncation is arithmetic on lengths. Memory: `Examples` keeps the kept ids in one flat int32
array (4 bytes a token) and about 50 bytes of lengths and digests an example, never Python lists; a source streams
through in chunks, so building holds one chunk's text at a time.

The cache: one directory per source (a file, a directory's train or test files, a Hub split) under
<cache_dir>/tokenized/, named by a digest of everything its ids depend on: the source (its label, and each file's
content digest or the Hub dataset's own fingerprint), the tokenizer (its saved files: vocabulary, merges,
normalisation, special and added tokens, chat template), the truncation settings and the format. Reruns, resumes and
sweeps over anything else map its arrays, which every process of a machine then shares through the page cache. It is
written under a temporary name with its files' checksums in meta.json, and renamed into place whole, so a crash
leaves no half of one and two processes building at once leave one good copy; a copy that fails its checksums, or
that was made for another key, is rebuilt, and a line says why.
"""

import dataclasses
import hashlib
import itertools
import json
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from persistence import storage
from preference_datasets import (
    LabelledCompletion,
    PreferencePair,
    RowCounts,
    Source,
    dataset_sources,
    eval_split,
    file_digest,
    iter_pairs,
    nothing_to_train_on,
)
from utils import UserError, first_line, release_free_memory

FORMAT = 3  # 3: the margins array
CHUNK_PAIRS = 2048  # pairs per batch call to the tokenizer, and the text a build holds at a time
PER_EXAMPLE = (
    "offsets",
    "lengths",
    "full_lengths",
    "keys",
    "groups",
    "labels",
    "margins",
)  # the arrays besides the token ids
# tokenizer_config.json entries that say where a tokenizer was loaded from, not what it is
LOADED_FROM = ("name_or_path", "is_local", "local_files_only", "_commit_hash")


@dataclass(frozen=True)
class Tokenization:
    """What an example's ids depend on besides its text and the tokenizer."""

    max_length: int
    max_prompt_length: int
    sft: bool  # one response per example, the pair's sft_target; else chosen and rejected

    def texts(self, pair: PreferencePair | LabelledCompletion) -> list[str]:
        """The prompt and the responses of a pair's (or a labelled completion's) example."""
        if isinstance(pair, LabelledCompletion):
            return [pair.prompt, pair.completion]
        return [pair.prompt, pair.sft_target] if self.sft else [pair.prompt, pair.chosen, pair.rejected]

    def describe(self) -> str:
        kind = "sft targets" if self.sft else "pairs"
        return f"{kind}, max_length {self.max_length}, max_prompt_length {self.max_prompt_length}"


@dataclass
class Examples:
    """n tokenized examples in flat arrays; R responses each.

    token_parts:  int32 token ids, flat: one array per cached source (memory-mapped) or tokenized chunk
    part:         [n] int32, which of token_parts holds each example's ids
    offsets:      [n] int64, where its ids start there: the prompt's, then each response's, back to back
    lengths:      [n, 1 + R] int32, ids kept of the prompt and of each response (EOS included)
    full_lengths: [n, 1 + R] int32, the same before truncation
    keys:         [n] S16, a digest of the kept ids and their lengths: the reference cache's key
    groups:       [n] int64, a digest of the prompt's text: a prompt's pairs are held out together, SFT takes one
    labels:       [n] int8, a labelled completion's label (1 desirable, 0 not); -1 for a pair
    margins:      [n] float32, a pair's margin from the data (a `margin` column, which reward models read; 0 without)
    """

    token_parts: list[np.ndarray]
    part: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray
    full_lengths: np.ndarray
    keys: np.ndarray
    groups: np.ndarray
    labels: np.ndarray
    margins: np.ndarray

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, i: int) -> dict:
        """{"prompt": ids, "responses": [ids, ...], "key": 16 bytes, and "margin": float for a pair or "label": bool
        for a labelled completion}: an example as the layouts take it."""
        lengths = self.lengths[i].tolist()
        start = int(self.offsets[i])
        ids = self.token_parts[self.part[i]][start : start + sum(lengths)].tolist()
        bounds = list(itertools.accumulate(lengths, initial=0))
        prompt, *responses = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
        example = {"prompt": prompt, "responses": responses, "key": self.keys[i : i + 1].tobytes()}
        if self.labels[i] >= 0:
            example["label"] = bool(self.labels[i])
        else:
            example["margin"] = float(self.margins[i])
        return example

    @property
    def labelled(self) -> bool:
        """Whether these are labelled completions (KTO's unpaired data), not pairs."""
        return bool(len(self.labels)) and bool(self.labels[0] >= 0)

    def take(self, indices: Iterable[int]) -> list[dict]:
        return [self[i] for i in indices]

    def select(self, indices) -> "Examples":
        """The examples at `indices` (an index array, a range or a boolean mask), sharing the token ids."""
        indices = np.asarray(indices)
        per_example = {name: getattr(self, name)[indices] for name in ("part", *PER_EXAMPLE)}
        return Examples(self.token_parts, **per_example)

    @property
    def n_tokens(self) -> int:
        """Token ids kept, over every example."""
        return int(self.lengths.sum())

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays, the token ids of every part included (mapped or not)."""
        arrays = [*self.token_parts, self.part, *(getattr(self, name) for name in PER_EXAMPLE)]
        return sum(array.nbytes for array in arrays)

    @staticmethod
    def empty(n_responses: int) -> "Examples":
        lengths = np.zeros((0, 1 + n_responses), np.int32)
        nothing = (np.zeros(0, np.int32), np.zeros(0, np.int64), lengths, lengths, empty_keys(0), no_groups())
        return Examples([], *nothing, np.zeros(0, np.int8), np.zeros(0, np.float32))

    @staticmethod
    def concatenate(parts: Sequence["Examples"], n_responses: int) -> "Examples":
        """The examples of `parts`, in order; their token ids are not copied."""
        token_parts, which = [], []
        for examples in parts:
            which.append(examples.part + len(token_parts))
            token_parts.extend(examples.token_parts)
        if not parts:
            return Examples.empty(n_responses)
        if len({(p.lengths.shape[1], p.labelled) for p in parts if len(p)}) > 1:
            raise UserError("the datasets mix preference pairs and labelled completions: train on one kind at a time")
        per_example = {name: np.concatenate([getattr(p, name) for p in parts]) for name in PER_EXAMPLE}
        return Examples(token_parts, np.concatenate(which).astype(np.int32), **per_example)


def empty_keys(n: int) -> np.ndarray:
    return np.zeros(n, dtype="S16")


def no_groups() -> np.ndarray:
    return np.zeros(0, np.int64)


# ---------------------------------------------------------------------------------------------------------
# Tokenizing


def batch_encoder(tokenizer) -> Callable[[list[str]], list[list[int]]]:
    """texts -> the token ids of each, no special tokens added, in one batch call: the ids `tokenizer(text)` gives.
    A fast tokenizer's Rust backend is called directly, on every core and without transformers' per-text
    conversion (15% of the time); on its own copy, set as transformers sets it for such a call (no truncation, no
    padding, special tokens in the text split or not as the tokenizer says), so no other call's settings apply."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return lambda texts: tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    own = type(backend).from_str(backend.to_str())
    own.no_truncation()
    own.no_padding()
    own.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
    encode_batch = getattr(own, "encode_batch_fast", own.encode_batch)  # without character offsets, where it can
    return lambda texts: [encoding.ids for encoding in encode_batch(texts, add_special_tokens=False)]


def truncated(full: np.ndarray, max_length: int, max_prompt_length: int) -> np.ndarray:
    """[n, 1 + R] ids kept of the prompt and of each response, from their counts before truncation: when the prompt
    and the longest response exceed max_length, the prompt is cut to max_prompt_length; if they still do, every
    response to max_length - max_prompt_length (the DPO reference's rule)."""
    prompt, responses = full[:, 0], full[:, 1:]
    longest = responses.max(axis=1)
    prompt = np.where(prompt + longest > max_length, np.minimum(prompt, max_prompt_length), prompt)
    cut = (prompt + longest > max_length)[:, None]
    responses = np.where(cut, np.minimum(responses, max_length - max_prompt_length), responses)
    return np.column_stack([prompt, responses])


def gather_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices start, start + 1, ..., start + count - 1 of every (start, count), back to back."""
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(ends[-1] if len(ends) else 0)


def example_keys(tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """[n] S16: a digest of each example's kept ids and of how they split into prompt and responses."""
    keys = empty_keys(len(offsets))
    totals = lengths.sum(axis=1)
    for i, (start, total) in enumerate(zip(offsets.tolist(), totals.tolist())):
        digest = hashlib.blake2b(lengths[i].tobytes(), digest_size=16)
        digest.update(tokens[start : start + total].tobytes())
        keys[i] = digest.digest()
    return keys


def mismatched(examples: list[dict], max_length: int, max_prompt_length: int) -> list[dict]:
    """KTO's KL examples (Ethayarajh et al. 2024): each example's prompt with the next one's responses (the last
    with the first's), truncated and keyed as `from_ids` does, so that the reference cache holds them as it holds
    pairs."""
    responses = [examples[(index + 1) % len(examples)]["responses"] for index in range(len(examples))]
    groups = np.zeros(len(examples), np.int64)
    made = from_ids([example["prompt"] for example in examples], responses, groups, max_length, max_prompt_length)
    return made.take(range(len(made)))


def from_ids(
    prompts: list[list[int]],
    responses: list[list[list[int]]],
    groups: np.ndarray,
    max_length: int,
    max_prompt_length: int,
) -> Examples:
    """Examples of prompts and responses given as token ids (KTO's mismatched examples; a round's generated pairs,
    rounds.py), truncated by the tokenization's rule with the prompt's end kept (nearest the responses) and keyed
    like every example (example_keys). groups: [n] each prompt's group (tokenized.text_group)."""
    width = 1 + (len(responses[0]) if responses else 2)  # no examples: of a pair's width
    full = np.array([[len(prompt), *map(len, rs)] for prompt, rs in zip(prompts, responses)], np.int32)
    full = full.reshape(len(prompts), width)
    kept = truncated(full, max_length, max_prompt_length).astype(np.int32)
    flat = []
    for prompt, rs, lengths in zip(prompts, responses, kept.tolist()):
        flat += prompt[len(prompt) - lengths[0] :]
        for response, n in zip(rs, lengths[1:]):
            flat += response[:n]
    tokens = np.array(flat, dtype=np.int32)
    offsets = np.cumsum(kept.sum(axis=1), dtype=np.int64) - kept.sum(axis=1)
    keys = example_keys(tokens, offsets, kept)
    labels, margins = np.full(len(prompts), -1, np.int8), np.zeros(len(prompts), np.float32)
    return Examples([tokens], np.zeros(len(prompts), np.int32), offsets, kept, full, keys, groups, labels, margins)


def text_group(text: str) -> int:
    """A 64-bit digest of a prompt's text (lone surrogates, which JSON can hold, included)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def tokenize_chunk(pairs: list[PreferencePair], encode, eos_id: int, settings: Tokenization) -> Examples:
    """The examples of `pairs`, with their ids in one array: each distinct text tokenized once, in one batch call
    (encode: batch_encoder's), then every example's kept ids gathered from those by their truncated lengths."""
    texts = [settings.texts(pair) for pair in pairs]
    position = {text: i for i, text in enumerate(dict.fromkeys(itertools.chain.from_iterable(texts)))}
    ids = encode(list(position))
    which = np.array([[position[text] for text in example] for example in texts], dtype=np.int64)  # [n, 1 + R]
    text_lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    eos = int(text_lengths.sum())  # the EOS id goes after every text's ids, to be gathered like them
    flat = np.fromiter(itertools.chain(itertools.chain.from_iterable(ids), [eos_id]), np.int32)
    text_starts = np.cumsum(text_lengths) - text_lengths

    full = text_lengths[which]
    full[:, 1:] += 1  # EOS ends each response
    kept = truncated(full, settings.max_length, settings.max_prompt_length)
    keep_end = np.array([pair.truncation_mode == "keep_end" for pair in pairs])
    # gathered in order: the prompt's kept ids, then per response its kept ids and, unless cut, its EOS
    segments = [(text_starts[which[:, 0]] + np.where(keep_end, full[:, 0] - kept[:, 0], 0), kept[:, 0])]
    for r in range(1, which.shape[1]):
        from_text = np.minimum(kept[:, r], full[:, r] - 1)
        segments += [(text_starts[which[:, r]], from_text), (np.full(len(pairs), eos), kept[:, r] - from_text)]
    starts = np.stack([start for start, _ in segments], axis=1).reshape(-1)
    counts = np.stack([count for _, count in segments], axis=1).reshape(-1)
    tokens = flat[gather_ranges(starts, counts)]
    offsets = np.cumsum(kept.sum(axis=1)) - kept.sum(axis=1)
    kept, full = kept.astype(np.int32), full.astype(np.int32)
    keys = example_keys(tokens, offsets, kept)
    groups = np.fromiter((text_group(pair.prompt) for pair in pairs), np.int64, len(pairs))
    labels = np.array([getattr(pair, "label", -1) for pair in pairs], dtype=np.int8)
    margins = np.array([getattr(pair, "margin", 0.0) for pair in pairs], dtype=np.float32)
    return Examples([tokens], np.zeros(len(pairs), np.int32), offsets, kept, full, keys, groups, labels, margins)


def chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def tokenize_pairs(pairs: Iterable[PreferencePair], tokenizer, settings: Tokenization) -> Examples:
    """The examples of `pairs`, in memory (a run's data is read through the cache instead: load_examples)."""
    encode = batch_encoder(tokenizer)
    parts = [tokenize_chunk(chunk, encode, tokenizer.eos_token_id, settings) for chunk in chunks(pairs, CHUNK_PAIRS)]
    return Examples.concatenate(parts, 1 if settings.sft else 2)


def first_of_each_group(examples: Examples) -> Examples:
    """One example per prompt, the first seen: SFT trains once on each prompt's sft_target."""
    return examples.select(np.sort(np.unique(examples.groups, return_index=True)[1]))


# ---------------------------------------------------------------------------------------------------------
# The cache


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of what the tokenizer is: its saved files (vocabulary, merges, normalisation, special and added
    tokens, chat template) and its EOS id, without where it was loaded from."""
    digest = hashlib.sha256(f"eos {tokenizer.eos_token_id}".encode())
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        for path in sorted(Path(directory).iterdir()):
            content = path.read_bytes()
            if path.name == "tokenizer_config.json":
                settings = {k: v for k, v in json.loads(content).items() if k not in LOADED_FROM}
                content = json.dumps(settings, sort_keys=True).encode()
            digest.update(path.name.encode() + b"\0" + hashlib.sha256(content).digest())
    return digest.hexdigest()


def cache_key(source: Source, tokenizer_digest: str, settings: Tokenization) -> str:
    """Everything a source's tokenized examples depend on, in words."""
    return (
        f"format {FORMAT}; source {source.label}; data {source.fingerprint()}; tokenizer {tokenizer_digest}; "
        f"{settings.describe()}"
    )


def cached_examples(source: Source, tokenizer, tokenizer_digest: str, settings: Tokenization, cache_dir: Path):
    """The source's examples, mapped from the cache, or tokenized now and cached; its data line printed."""
    key = cache_key(source, tokenizer_digest, settings)
    directory = Path(cache_dir) / "tokenized" / hashlib.sha256(key.encode()).hexdigest()[:32]
    examples, meta, why = read_cache(directory, key)
    if examples is not None:
        print(f"{meta['data_line']} (tokenized earlier: {directory})")
        return examples
    if why:
        print(f"tokenized data: rebuilding {directory}, since {why}")
        storage.remove_tree(directory)
    try:
        examples, meta = build_cache(source, tokenizer, settings, directory, key)
    except storage.WriteFailed as error:  # a full or read-only cache directory: the run goes on without the cache
        examples, line = tokenize_source(source, tokenizer, settings)
        print(f"{line} (tokenized in memory, not cached: {error})")
        return examples
    print(f"{meta['data_line']} (tokenized, cached in {directory})")
    return examples


def read_cache(directory: Path, key: str) -> tuple[Examples | None, dict | None, str | None]:
    """(examples, meta, None) from a complete copy made for `key`; (None, None, why it cannot be used), or
    (None, None, None) where there is none."""
    if not directory.exists():
        return None, None, None
    try:
        meta = json.loads((directory / "meta.json").read_text())
        if meta.get("key") != key:
            return None, None, "it was made for other data or settings"
        for name, checksum in meta["checksums"].items():
            if file_digest(directory / name) != checksum:
                return None, None, f"its {name} does not match its checksum (damaged)"
        return mapped(directory, meta), meta, None
    except (OSError, ValueError, KeyError, TypeError) as error:
        return None, None, f"it is unreadable ({type(error).__name__}: {first_line(error)})"


def mapped(directory: Path, meta: dict) -> Examples:
    """The examples of a cache directory, the token ids memory-mapped (shared by the processes of a machine)."""
    tokens = np.memmap(directory / "tokens.bin", dtype=np.int32, mode="r", shape=(meta["tokens"],))
    per_example = {name: np.load(directory / f"{name}.npy", allow_pickle=False) for name in PER_EXAMPLE}
    return Examples([tokens], np.zeros(meta["examples"], np.int32), **per_example)


def source_chunks(source: Source, tokenizer, settings: Tokenization, counts: RowCounts) -> Iterator[Examples]:
    """The source's examples, a chunk of CHUNK_PAIRS rows at a time (counted in `counts`, checked at its end)."""
    encode = batch_encoder(tokenizer)
    for pairs in chunks(iter_pairs(source.rows(), tokenizer, counts), CHUNK_PAIRS):
        yield tokenize_chunk(pairs, encode, tokenizer.eos_token_id, settings)
    counts.check()


def build_cache(source: Source, tokenizer, settings: Tokenization, directory: Path, key: str):
    """(examples, meta) of the source, tokenized chunk by chunk into a temporary directory that is then renamed to
    `directory`, whole; where another process got there first, its copy stands and ours is dropped. A failure to
    write is a storage.WriteFailed naming `directory`, and leaves nothing behind."""
    temporary = directory.with_name(f"{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with storage.writing(directory):
            temporary.mkdir(parents=True)
            counts = RowCounts(source.label)
            parts, written = [], 0
            with open(temporary / "tokens.bin", "wb") as tokens_file:
                for chunk in source_chunks(source, tokenizer, settings, counts):
                    tokens_file.write(chunk.token_parts[0].tobytes())
                    parts.append(dataclasses.replace(chunk, token_parts=[], offsets=chunk.offsets + written))
                    written += len(chunk.token_parts[0])
            examples = Examples.concatenate(parts, 1 if settings.sft else 2)
            for name in PER_EXAMPLE:
                np.save(temporary / f"{name}.npy", getattr(examples, name), allow_pickle=False)
            files = ["tokens.bin", *(f"{name}.npy" for name in PER_EXAMPLE)]
            meta = {
                "format": FORMAT,
                "key": key,
                "data_line": counts.line(),
                "examples": len(examples),
                "tokens": written,
                "checksums": {name: file_digest(temporary / name) for name in files},
            }
            (temporary / "meta.json").write_text(json.dumps(meta, indent=1))
            storage.sync(temporary)
            examples = mapped(temporary, meta)  # a mapping outlives a rename or a deletion of its file
            storage.publish(temporary, directory, "meta.json")
        release_free_memory()  # what the chunks took while they were tokenized
        return examples, meta
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def tokenize_source(source: Source, tokenizer, settings: Tokenization) -> tuple[Examples, str]:
    """(the source's examples in memory, its data line): for a cache that cannot be written."""
    counts = RowCounts(source.label)
    parts = list(source_chunks(source, tokenizer, settings, counts))
    return Examples.concatenate(parts, 1 if settings.sft else 2), counts.line()


# ---------------------------------------------------------------------------------------------------------
# A run's data


def load_examples(
    names: list[str], tokenizer, settings: Tokenization, seed: int, n_eval_examples: int | None, cache_dir: Path
) -> dict[str, Examples]:
    """{"train": examples, "test": examples} of the datasets `names`, concatenated in order: each source mapped from
    the cache or tokenized into it; a source without a test split has n_eval_examples pairs held out, whole
    prompts chosen by seed (preference_datasets.eval_split, on the prompts' digests)."""
    tokenizer_digest = tokenizer_fingerprint(tokenizer)
    n_responses = 1 if settings.sft else 2
    splits = {"train": [], "test": []}
    for name in names:
        sources = dataset_sources(name, cache_dir)
        examples = {
            split: cached_examples(source, tokenizer, tokenizer_digest, settings, cache_dir)
            for split, source in sources.items()
        }
        if "test" not in examples:
            held = np.array(eval_split(examples["train"].groups.tolist(), n_eval_examples, seed, name))
            examples = {"train": examples["train"].select(~held), "test": examples["train"].select(held)}
        for split, value in examples.items():
            splits[split].append(value)
    if not any(len(part) for part in splits["train"]):
        raise UserError(nothing_to_train_on(names))
    kinds = {(part.lengths.shape[1] - 1, part.labelled) for parts in splits.values() for part in parts if len(part)}
    if len(kinds) > 1:  # within a split, and across train and test (a directory's files)
        raise UserError("the datasets mix preference pairs and labelled completions: train on one kind at a time")
    n_responses = next(iter(kinds))[0] if kinds else n_responses
    return {split: Examples.concatenate(parts, n_responses) for split, parts in splits.items()}
