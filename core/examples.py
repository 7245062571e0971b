"""Tokenized examples as a step reads them: n examples held in flat arrays (`Examples`), each keyed by a digest of
its kept ids (the reference cache's key), and examples made from token ids (`from_ids`: a round's generated pairs,
KTO's mismatched examples), truncated by the DPO reference's rule. Text becomes ids, and ids a cache on disk, in
persistence/tokenized.py."""

import hashlib
import itertools
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from utils import UserError

PER_EXAMPLE = (
    "offsets",
    "lengths",
    "full_lengths",
    "keys",
    "groups",
    "labels",
    "margins",
    "keep_end",
    "image_offsets",
    "image_lengths",
)  # the arrays besides the token ids and the images


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
    keep_end:     [n] bool, which end a cut prompt keeps: its end (HH's format, from_ids' pairs) or its start (every
                  other format); sampling cuts a prompt too long for a model's positions the same way
    image_parts:  uint8, the prompts' images (modeling.vision.pack_images), flat: one array per token part
    image_offsets: [n] int64, where its prompt's images start in its part's image array
    image_lengths: [n] int64, their bytes (0: a prompt without images)
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
    keep_end: np.ndarray
    image_parts: list[np.ndarray] | None = None  # None: text only, no image in any part
    image_offsets: np.ndarray | None = None
    image_lengths: np.ndarray | None = None

    def __post_init__(self):
        if self.image_parts is None:
            self.image_parts = [NO_IMAGES] * len(self.token_parts)
        if self.image_offsets is None:
            self.image_offsets = np.zeros(len(self.part), np.int64)
            self.image_lengths = np.zeros(len(self.part), np.int64)

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, i: int) -> dict:
        """{"prompt": ids, "responses": [ids, ...], "key": 16 bytes, "keep_end": bool (which end a cut prompt keeps),
        and "margin": float for a pair or "label": bool for a labelled completion}: an example as the layouts take
        it."""
        lengths = self.lengths[i].tolist()
        start = int(self.offsets[i])
        ids = self.token_parts[self.part[i]][start : start + sum(lengths)].tolist()
        bounds = list(itertools.accumulate(lengths, initial=0))
        prompt, *responses = [ids[a:b] for a, b in zip(bounds, bounds[1:])]
        example = {"prompt": prompt, "responses": responses, "key": self.keys[i : i + 1].tobytes(),
                   "keep_end": bool(self.keep_end[i])}  # fmt: skip
        if self.image_lengths[i]:
            start = int(self.image_offsets[i])
            example["images"] = self.image_parts[self.part[i]][start : start + int(self.image_lengths[i])].tobytes()
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
        return Examples(self.token_parts, **per_example, image_parts=self.image_parts)

    @property
    def with_images(self) -> bool:
        return bool(self.image_lengths.any())

    def prompt_counts(self, token_id: int) -> np.ndarray:
        """[n] how often token_id occurs in each example's kept prompt (a vision-language prompt's image tokens),
        from the positions where it occurs: no copy of the ids beyond a boolean per id."""
        counts = np.zeros(len(self), np.int64)
        for index, tokens in enumerate(self.token_parts):
            mine = np.flatnonzero(self.part == index)
            hits = np.flatnonzero(tokens == token_id)
            starts = self.offsets[mine]
            ends = starts + self.lengths[mine, 0]
            counts[mine] = np.searchsorted(hits, ends) - np.searchsorted(hits, starts)
        return counts

    @property
    def n_tokens(self) -> int:
        """Token ids kept, over every example."""
        return int(self.lengths.sum())

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays, the token ids of every part included (mapped or not)."""
        arrays = [*self.token_parts, *self.image_parts, self.part, *(getattr(self, name) for name in PER_EXAMPLE)]
        return sum(array.nbytes for array in arrays)

    @staticmethod
    def empty(n_responses: int) -> "Examples":
        lengths = np.zeros((0, 1 + n_responses), np.int32)
        nothing = (np.zeros(0, np.int32), np.zeros(0, np.int64), lengths, lengths, empty_keys(0), no_groups())
        return Examples([], *nothing, np.zeros(0, np.int8), np.zeros(0, np.float32), np.zeros(0, bool))

    @staticmethod
    def concatenate(parts: Sequence["Examples"], n_responses: int) -> "Examples":
        """The examples of `parts`, in order; their token ids are not copied."""
        token_parts, image_parts, which = [], [], []
        for examples in parts:
            which.append(examples.part + len(token_parts))
            token_parts.extend(examples.token_parts)
            image_parts.extend(examples.image_parts)
        if not parts:
            return Examples.empty(n_responses)
        if len({(p.lengths.shape[1], p.labelled) for p in parts if len(p)}) > 1:
            raise UserError("the datasets mix preference pairs and labelled completions: train on one kind at a time")
        per_example = {name: np.concatenate([getattr(p, name) for p in parts]) for name in PER_EXAMPLE}
        return Examples(token_parts, np.concatenate(which).astype(np.int32), **per_example, image_parts=image_parts)


NO_IMAGES = np.zeros(0, np.uint8)


def empty_keys(n: int) -> np.ndarray:
    return np.zeros(n, dtype="S16")


def no_groups() -> np.ndarray:
    return np.zeros(0, np.int64)


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


def example_keys(
    tokens: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, images: list[bytes] | None = None
) -> np.ndarray:
    """[n] S16: a digest of each example's kept ids, of how they split into prompt and responses, and of its
    prompt's images (each example's packed bytes, where there are any): a changed image changes the key."""
    keys = empty_keys(len(offsets))
    totals = lengths.sum(axis=1)
    for i, (start, total) in enumerate(zip(offsets.tolist(), totals.tolist())):
        digest = hashlib.blake2b(lengths[i].tobytes(), digest_size=16)
        digest.update(tokens[start : start + total].tobytes())
        if images and images[i]:
            digest.update(b"images" + images[i])
        keys[i] = digest.digest()
    return keys


def image_arrays(images: list[bytes]) -> tuple[list[np.ndarray] | None, np.ndarray, np.ndarray]:
    """(image_parts, image_offsets, image_lengths) of Examples holding each example's packed images (b"": none) in
    one part."""
    lengths = np.fromiter(map(len, images), np.int64, len(images))
    parts = [np.frombuffer(b"".join(images), np.uint8)] if lengths.any() else None
    return parts, np.cumsum(lengths) - lengths, lengths


def from_ids(
    prompts: list[list[int]],
    responses: list[list[list[int]]],
    groups: np.ndarray,
    max_length: int,
    max_prompt_length: int,
    images: list[bytes] | None = None,
) -> Examples:
    """Examples of prompts and responses given as token ids (KTO's mismatched examples; a round's generated pairs,
    rounds.py), truncated by the tokenization's rule with the prompt's end kept (nearest the responses; keep_end)
    and keyed like every example (example_keys). groups: [n] each prompt's group (persistence.tokenized.text_group);
    images: each prompt's packed images (b"": none), which a prompt keeps: the caller makes sure such prompts are not
    cut (step.check_kto_prompts)."""
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
    images = images or [b""] * len(prompts)
    keys = example_keys(tokens, offsets, kept, images)
    labels, margins = np.full(len(prompts), -1, np.int8), np.zeros(len(prompts), np.float32)
    return Examples(
        [tokens], np.zeros(len(prompts), np.int32), offsets, kept, full, keys, groups, labels, margins,
        np.ones(len(prompts), bool), *image_arrays(images),
    )  # fmt: skip
