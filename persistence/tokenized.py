"""Tokenized examples: every source tokenized once per machine, held in flat arrays, and cached on disk across runs.

An example is a prompt and its responses (chosen and rejected for a preference pair; the sft_target alone for SFT;
one completion and its label for labelled completions, KTO's unpaired data), tokenized without special tokens
(tokenizers disagree on BOS), EOS ending each response given as text (a chat template ends the responses it renders
itself, as in TRL), and truncated as the DPO reference does: when prompt plus the longer response exceed max_length,
the prompt is cut to max_prompt_length (its end kept for HH dialogues, its start otherwise), then the responses to
max_length - max_prompt_length.

Speed: texts reach the tokenizer in batches (a fast tokenizer's batch call runs in Rust on every core), each
distinct text once, and truncation is arithmetic on lengths. Memory: `Examples` (core/examples.py) keeps the kept
ids in one flat int32 array (4 bytes a token) and about 50 bytes of lengths and digests an example, never Python
lists; a source streams through in chunks, so building holds one chunk's text at a time.

The cache: one directory per source (a file, a directory's train or test files, a Hub split) under
<cache_dir>/tokenized/, named by a digest of everything its ids depend on: the source (its label, and each file's
content digest or the Hub dataset's own fingerprint), the tokenizer (its saved files: vocabulary, merges, normalisation,
special and added tokens, chat template), the run's chat_template_kwargs, the truncation settings and the format.
Reruns, resumes and sweeps over anything else map its arrays, which every process of a machine then shares through the
page cache. It is written under a temporary name with its files' checksums in meta.json, and renamed into place whole,
so a crash leaves no half of one and two processes building at once leave one good copy; a copy that fails its
checksums, or that was made for another key, is rebuilt, and a line says why.
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
from typing import Callable, Iterable, Iterator

import numpy as np

import storage
from core.examples import NO_IMAGES, PER_EXAMPLE, Examples, example_keys, image_arrays, truncated
from modeling.vision import pack_images
from pairs.formats import LabelledCompletion, PreferencePair
from pairs.sources import Source, dataset_sources, file_digest
from preference_datasets import RowCounts, data_lines, eval_split, iter_pairs, nothing_to_train_on
from utils import UserError, first_line, release_free_memory

FORMAT = 7  # 3: margins; 4: conversational rows rendered as TRL renders them, tools; 5: the prompts' images;
# 6: a prompt's images expanded as one prompt's list (LLaVA-OneVision: several without tiles);
# 7: each example's keep_end (which end a cut prompt keeps), by which sampling cuts a prompt as training does
CHUNK_PAIRS = 2048  # pairs per batch call to the tokenizer, and the text a build holds at a time
# tokenizer_config.json entries that say where a tokenizer was loaded from, not what it is
LOADED_FROM = ("name_or_path", "is_local", "local_files_only", "_commit_hash")


@dataclass(frozen=True)
class Tokenization:
    """What an example's ids depend on besides its source's rows and the tokenizer."""

    max_length: int
    max_prompt_length: int
    sft: bool  # one response per example, the pair's sft_target; else chosen and rejected
    # the run's keyword arguments of every chat template call (pairs.chat_templates.ChatTemplate)
    chat_template_kwargs: dict = dataclasses.field(default_factory=dict)

    def texts(self, pair: PreferencePair | LabelledCompletion) -> list[str | tuple[str, tuple[bytes, ...]]]:
        """The prompt and the responses of a pair's (or a labelled completion's) example; a prompt with images as
        (text, images)."""
        prompt = (pair.prompt, pair.images) if pair.images else pair.prompt
        if isinstance(pair, LabelledCompletion):
            return [prompt, pair.completion]
        return [prompt, pair.sft_target] if self.sft else [prompt, pair.chosen, pair.rejected]

    def describe(self) -> str:
        kind = "sft targets" if self.sft else "pairs"
        return (
            f"{kind}, max_length {self.max_length}, max_prompt_length {self.max_prompt_length}, "
            f"chat_template_kwargs {json.dumps(self.chat_template_kwargs, sort_keys=True)}"
        )


# ---------------------------------------------------------------------------------------------------------
# Tokenizing


def encoder(tokenizer) -> Callable[[list], list[list[int]]]:
    """texts -> the token ids of each (batch_encoder), where a text may be a prompt with images, (text, images),
    whose placeholders a vision-language model's processor expands into each image's tokens (Vision.prompt_ids)."""
    encode, vision = batch_encoder(tokenizer), getattr(tokenizer, "vision", None)
    if vision is None:
        return encode

    def encode_with_images(items: list) -> list[list[int]]:
        plain = [i for i, item in enumerate(items) if isinstance(item, str)]
        ids = dict(zip(plain, encode([items[i] for i in plain])))
        return [ids[i] if i in ids else vision.prompt_ids(*item) for i, item in enumerate(items)]

    return encode_with_images


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


def gather_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The indices start, start + 1, ..., start + count - 1 of every (start, count), back to back."""
    ends = np.cumsum(counts)
    return np.repeat(starts - (ends - counts), counts) + np.arange(ends[-1] if len(ends) else 0)


def text_group(text: str) -> int:
    """A 64-bit digest of a prompt's text (lone surrogates, which JSON can hold, included)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def prompt_group(prompt: str, images: bytes) -> int:
    """A 64-bit digest of a prompt: its text, and its packed images where it has any (one question asked of many
    images is as many prompts)."""
    if not images:
        return text_group(prompt)
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass") + images, digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


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
    eos_count = np.array([int(pair.append_eos) for pair in pairs], np.int64)
    full[:, 1:] += eos_count[:, None]  # EOS ends each response, unless a chat template ended it
    kept = truncated(full, settings.max_length, settings.max_prompt_length)
    keep_end = np.array([pair.truncation_mode == "keep_end" for pair in pairs], bool)
    # gathered in order: the prompt's kept ids, then per response its kept ids and, unless cut, its EOS
    segments = [(text_starts[which[:, 0]] + np.where(keep_end, full[:, 0] - kept[:, 0], 0), kept[:, 0])]
    for r in range(1, which.shape[1]):
        from_text = np.minimum(kept[:, r], full[:, r] - eos_count)
        segments += [(text_starts[which[:, r]], from_text), (np.full(len(pairs), eos), kept[:, r] - from_text)]
    starts = np.stack([start for start, _ in segments], axis=1).reshape(-1)
    counts = np.stack([count for _, count in segments], axis=1).reshape(-1)
    tokens = flat[gather_ranges(starts, counts)]
    offsets = np.cumsum(kept.sum(axis=1)) - kept.sum(axis=1)
    kept, full = kept.astype(np.int32), full.astype(np.int32)
    images = [pack_images(pair.images) for pair in pairs]
    lost = [i for i, pair in enumerate(pairs) if pair.images and kept[i, 0] < full[i, 0]]
    if lost:  # a cut prompt loses image tokens, or leaves them without the text they belong to
        raise UserError(
            f"a prompt with images is {int(full[lost[0], 0])} tokens, its images' included, and max_length "
            f"{settings.max_length} / max_prompt_length {settings.max_prompt_length} would cut it: raise them"
        )
    keys = example_keys(tokens, offsets, kept, images)
    groups = np.fromiter(
        (prompt_group(pair.prompt, packed) for pair, packed in zip(pairs, images)), np.int64, len(pairs)
    )
    labels = np.array([getattr(pair, "label", -1) for pair in pairs], dtype=np.int8)
    margins = np.array([getattr(pair, "margin", 0.0) for pair in pairs], dtype=np.float32)
    return Examples(
        [tokens], np.zeros(len(pairs), np.int32), offsets, kept, full, keys, groups, labels, margins, keep_end,
        *image_arrays(images),
    )  # fmt: skip


def chunks(items: Iterable, size: int) -> Iterator[list]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, size)):
        yield chunk


def tokenize_pairs(pairs: Iterable[PreferencePair], tokenizer, settings: Tokenization) -> Examples:
    """The examples of `pairs`, in memory (a run's data is read through the cache instead: load_examples)."""
    encode = encoder(tokenizer)
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
        print(data_lines(f"{meta['data_line']} (tokenized earlier: {directory})", meta["shown"]))
        return examples
    if why:
        print(f"tokenized data: rebuilding {directory}, since {why}")
        storage.remove_tree(directory)
    try:
        examples, meta = build_cache(source, tokenizer, settings, directory, key)
    except storage.WriteFailed as error:  # a full or read-only cache directory: the run goes on without the cache
        examples, counts = tokenize_source(source, tokenizer, settings)
        print(data_lines(f"{counts.line()} (tokenized in memory, not cached: {error})", counts.shown))
        return examples
    print(data_lines(f"{meta['data_line']} (tokenized, cached in {directory})", meta["shown"]))
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
    size = meta["image_bytes"]  # an empty file cannot be mapped
    images = np.memmap(directory / "images.bin", dtype=np.uint8, mode="r", shape=(size,)) if size else NO_IMAGES
    return Examples([tokens], np.zeros(meta["examples"], np.int32), **per_example, image_parts=[images])


def source_chunks(source: Source, tokenizer, settings: Tokenization, counts: RowCounts) -> Iterator[Examples]:
    """The source's examples, a chunk of CHUNK_PAIRS rows at a time (counted in `counts`, checked at its end)."""
    encode = encoder(tokenizer)
    for pairs in chunks(iter_pairs(source.rows(), tokenizer, counts, settings.chat_template_kwargs), CHUNK_PAIRS):
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
            parts, written, image_bytes = [], 0, 0
            with open(temporary / "tokens.bin", "wb") as tokens_file, open(temporary / "images.bin", "wb") as images:
                for chunk in source_chunks(source, tokenizer, settings, counts):
                    tokens_file.write(chunk.token_parts[0].tobytes())
                    images.write(chunk.image_parts[0].tobytes())
                    moved = dict(offsets=chunk.offsets + written, image_offsets=chunk.image_offsets + image_bytes)
                    parts.append(dataclasses.replace(chunk, token_parts=[], image_parts=[], **moved))
                    written += len(chunk.token_parts[0])
                    image_bytes += len(chunk.image_parts[0])
            examples = Examples.concatenate(parts, 1 if settings.sft else 2)
            for name in PER_EXAMPLE:
                np.save(temporary / f"{name}.npy", getattr(examples, name), allow_pickle=False)
            files = ["tokens.bin", "images.bin", *(f"{name}.npy" for name in PER_EXAMPLE)]
            meta = {
                "format": FORMAT,
                "key": key,
                "data_line": counts.line(),
                "shown": counts.shown,
                "examples": len(examples),
                "tokens": written,
                "image_bytes": image_bytes,
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


def tokenize_source(source: Source, tokenizer, settings: Tokenization) -> tuple[Examples, RowCounts]:
    """(the source's examples in memory, what its rows gave): for a cache that cannot be written."""
    counts = RowCounts(source.label)
    parts = list(source_chunks(source, tokenizer, settings, counts))
    return Examples.concatenate(parts, 1 if settings.sft else 2), counts


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
