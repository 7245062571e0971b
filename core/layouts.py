"""How tokenized examples become model inputs: the padded layout, and the prompt-shared packed layout.

A tokenized example is {"prompt": ids, "responses": [ids, ...]} (two responses for a preference pair: chosen,
rejected; one for SFT). Each layout returns a `ModelBatch` built on the host from lengths alone, whose scored tokens
are listed explicitly and grouped by sequence. Sequences are numbered response-major (all chosen, then all
rejected), so the per-sequence log-probs split with `.chunk(2)`.

padded: one row per (example, response), [prompt | response | pad]; the prompt is computed once per response.
packed: one segment per example, [prompt | response_1 | response_2], segments packed into rows with no attention
    across them and padding only at the tail of a row. Response tokens attend to the prompt and to earlier tokens
    of their own response; each response's positions restart right after the prompt, so every token sees exactly
    the context and position it has in the padded layout (Wang & Hegde 2024, "Accelerating Direct Preference
    Optimization with Prefix Sharing"). Who may attend to whom is a function of per-token ids (`packed_mask_mod`):
    evaluated densely it is the [R, 1, T, T] mask SDPA takes; handed to FlexAttention it becomes a block mask that
    skips fully masked blocks and never holds a [T, T] tensor. A layer with a sliding window or chunked attention
    sees less (`AttentionSpan`), measured in the position ids, which are the padded layout's positions.
"""

from dataclasses import dataclass

import torch

from core.shapes import Shapes

LAYOUTS = ("packed", "padded")


@dataclass(frozen=True)
class AttentionSpan:
    """How far a layer type's queries see besides the packed layout's rule: only keys fewer than `window`
    positions back (sliding-window attention: Mistral, Gemma 2 and 3, GPT-OSS), only keys in the query's own block
    of `chunk` positions (chunked attention: Llama 4); None: no such limit. transformers' masks state both on
    a padded row's indices (`key > query - window`, `key // chunk == query // chunk`), which are a packed token's
    position ids."""

    window: int | None = None
    chunk: int | None = None

    def describe(self) -> str:
        limits = [f"window {self.window}"] if self.window is not None else []
        limits += [f"chunks of {self.chunk}"] if self.chunk is not None else []
        return ", ".join(limits) or "full"


FULL_ATTENTION = AttentionSpan()


@dataclass
class ModelBatch:
    """Shapes: R rows of T tokens; K kept positions per row; N scored tokens, grouped by sequence (all tokens of
    sequence 0, then of sequence 1, ...); S = responses x examples sequences. Everything is built on the host;
    nothing here needs a device round trip to use.

    input_ids:        [R, T]
    position_ids:     [R, T] (packed), or None: 0..T-1 in every row (padded)
    attention_mask:   [R, T] 0/1 (padded); packed: None as laid out, the mask following from segment_ids and
                      branch_ids (set on the device by scoring.Scorer.batch, dense or block)
    segment_ids:      [R, T] the example each token belongs to, -1 for padding (packed), or None
    branch_ids:       [R, T] 0 for a prompt token, r + 1 for a token of response r (packed), or None
    keep_positions:   [R, K] positions whose hidden states predict a scored token (a short row repeats its last)
    score_rows:       [N] index into the R * K kept hidden states of the one that predicts each scored token
    score_positions:  [N] flat index into R * T of the same hidden state
    score_targets:    [N] the scored token ids
    sequence_lengths: [S] scored tokens of each sequence
    shared_lengths:   [S] of those, the ones within its example's shortest response (the first min over responses
                      of sequence_lengths; the rest is the response's tail, which LD-DPO weighs down)
    first_positions:  [S] flat index into R * T of each sequence's first response token
    last_positions:   [S] flat index into R * T of each sequence's last token, where a reward model reads its score
    prompt_examples:  the example of each prompt the rows hold, in the order the model reads them (row by row):
                      whose images a vision-language model encodes, in that order (padded: every prompt twice)
    image_inputs:     a vision-language model's image inputs of those images (pixel_values, ...), or None
    bidirectional_blocks: [R, T] (packed) the block each token belongs to, -1 for none: the tokens of a block see
                      each other both ways, where a model's attention lets them (Gemma 3: each image's tokens,
                      image_runs; PaliGemma: each prompt, prompt_blocks), or None
    blocks_within_span: whether a layer's window or chunks bound the blocks too (packed_mask_mod)
    sequence_part:    with sequence parallelism, this rank's slice of the rows (SequenceSlice), or None
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    segment_ids: torch.Tensor | None
    branch_ids: torch.Tensor | None
    keep_positions: torch.Tensor
    score_rows: torch.Tensor
    score_positions: torch.Tensor
    score_targets: torch.Tensor
    sequence_lengths: torch.Tensor
    shared_lengths: torch.Tensor
    first_positions: torch.Tensor
    last_positions: torch.Tensor
    prompt_examples: list[int] | None = None
    image_inputs: dict[str, torch.Tensor] | None = None
    bidirectional_blocks: torch.Tensor | None = None
    blocks_within_span: bool = True
    sequence_part: "SequenceSlice | None" = None

    def to(self, device: torch.device) -> "ModelBatch":
        moved = {name: to_device(v, device) if torch.is_tensor(v) else v for name, v in vars(self).items()}
        if self.image_inputs is not None:
            moved["image_inputs"] = {name: to_device(v, device) for name, v in self.image_inputs.items()}
        if self.sequence_part is not None:
            moved["sequence_part"] = self.sequence_part.to(device)
        return ModelBatch(**moved)

    @property
    def n_sequences(self) -> int:
        return self.sequence_lengths.numel()

    @property
    def n_tokens(self) -> int:
        """Token positions the model computes, padding included."""
        return self.input_ids.numel()


def image_runs(is_image: torch.Tensor) -> torch.Tensor:
    """[R, T] the number of each run of image tokens in its row (0, 1, ...), -1 for other tokens: an image's tokens
    are contiguous, and two images are always parted by text (their start and end markers)."""
    starts = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    return torch.where(is_image, starts.long().cumsum(dim=1) - 1, -1)


def prompt_blocks(batch: ModelBatch) -> torch.Tensor:
    """[R, T] of packed rows: each prompt's tokens numbered by their example (its segment), -1 for the others."""
    return torch.where(prompt_tokens(batch), batch.segment_ids, -1)


def prompt_tokens(batch: ModelBatch) -> torch.Tensor:
    """[R, T] bool: where the rows hold a prompt's tokens. Packed: each segment's branch 0; padded: row s holds
    sequence s, its prompt before its first response token."""
    if batch.segment_ids is not None:
        return (batch.branch_ids == 0) & (batch.segment_ids >= 0)
    rows, length = batch.input_ids.shape
    device = batch.input_ids.device
    prompt_lengths = batch.first_positions - torch.arange(rows, device=device) * length
    return torch.arange(length, device=device)[None, :] < prompt_lengths[:, None]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor on `device`; to a GPU through pinned memory, asynchronously: the host goes on preparing the next
    micro-batch instead of waiting for the GPU to drain its queue (a copy from pageable memory waits)."""
    if device.type != "cuda" or tensor.device == device:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def make_batch(
    layout: str,
    examples: list[dict],
    pad_token_id: int,
    row_tokens: int | None = None,
    multiple: int = 1,
    bucketed: bool = False,
) -> ModelBatch:
    """The examples laid out (pack or pad); a packed batch's dimensions rounded up to shapes.Shapes' buckets where
    bucketed (padded rows keep their own length: the reference computation)."""
    if layout != "packed":
        return pad(examples, pad_token_id)
    return pack(examples, pad_token_id, row_tokens, multiple, bucketed)


def left_padded_prompts(examples: list[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask): [B, P] prompts padded on the left, for generation. Masks come from lengths,
    never from comparing with pad_token_id (pad may equal EOS)."""
    length = max(len(ex["prompt"]) for ex in examples)
    input_ids = torch.full((len(examples), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, ex in enumerate(examples):
        if ex["prompt"]:
            input_ids[row, -len(ex["prompt"]) :] = torch.tensor(ex["prompt"])
            attention_mask[row, -len(ex["prompt"]) :] = 1
    return input_ids, attention_mask


def scored_tokens(prompt_end: int, prompt_length: int, response: list[int], offset: int) -> list[tuple[int, int]]:
    """(predicting position, token) of each scored token of a response whose first token is at `offset` and whose
    prompt ends just before `prompt_end`. The first token is predicted by the last prompt token (in the packed
    layout the same one for every response); with an empty prompt nothing predicts it, and it is not scored (as in
    the padded layout)."""
    predictors = [prompt_end - 1 if prompt_length else -1] + list(range(offset, offset + len(response) - 1))
    return [(p, token) for p, token in zip(predictors, response) if p >= 0]


def scored_fields(
    scored: list[tuple[int, int, int, int]],
    spans: list[tuple[int, int, int]],
    n_examples: int,
    n_responses: int,
    shape,
    kept_width=lambda n: n,
) -> dict:
    """The scored-token fields of a ModelBatch of `shape` (rows, length) from (sequence, row, position, token) and
    each sequence's (sequence, flat positions of its response's first and last tokens), sequences numbered
    response-major; kept_width: K from the most positions a row keeps (shapes.Shapes.kept rounds it up)."""
    scored = sorted(scored, key=lambda s: s[0])  # grouped by sequence (a stable sort keeps each one's token order)
    n_rows, length = shape
    kept = [sorted({p for _, row, p, _ in scored if row == r}) or [0] for r in range(n_rows)]
    width = kept_width(max(map(len, kept)))
    column = [{p: i for i, p in enumerate(positions)} for positions in kept]
    counts = [0] * (n_responses * n_examples)
    for sequence, _, _, _ in scored:
        counts[sequence] += 1
    lengths = torch.tensor(counts, dtype=torch.long)
    shared = lengths.view(n_responses, n_examples).min(dim=0).values.repeat(n_responses)
    return dict(
        keep_positions=torch.tensor([positions + positions[-1:] * (width - len(positions)) for positions in kept]),
        score_rows=torch.tensor([row * width + column[row][p] for _, row, p, _ in scored], dtype=torch.long),
        score_positions=torch.tensor([row * length + p for _, row, p, _ in scored], dtype=torch.long),
        score_targets=torch.tensor([token for _, _, _, token in scored], dtype=torch.long),
        sequence_lengths=lengths,
        shared_lengths=shared,
        first_positions=torch.tensor([first for _, first, _ in sorted(spans)], dtype=torch.long),
        last_positions=torch.tensor([last for _, _, last in sorted(spans)], dtype=torch.long),
    )


def pad(examples: list[dict], pad_token_id: int) -> ModelBatch:
    """Rows [prompt | response | pad], all first responses, then all second responses."""
    sequences = [(ex["prompt"], ex["responses"][r]) for r in range(len(examples[0]["responses"])) for ex in examples]
    length = max(len(prompt) + len(response) for prompt, response in sequences)
    input_ids = torch.full((len(sequences), length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    scored, spans = [], []
    for row, (prompt, response) in enumerate(sequences):
        tokens = prompt + response
        input_ids[row, : len(tokens)] = torch.tensor(tokens)
        attention_mask[row, : len(tokens)] = 1
        scored += [(row, row, p, token) for p, token in scored_tokens(len(prompt), len(prompt), response, len(prompt))]
        spans.append((row, row * length + len(prompt), row * length + len(tokens) - 1))
    fields = scored_fields(scored, spans, len(examples), len(examples[0]["responses"]), tuple(input_ids.shape))
    prompts = [i for _ in examples[0]["responses"] for i in range(len(examples))]  # the rows' order
    return ModelBatch(input_ids, None, attention_mask, None, None, **fields, prompt_examples=prompts)


def pack_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Segments (by index) packed into rows of at most `budget` tokens: first-fit decreasing, which leaves at most
    a few percent of a row empty for typical length mixes. A segment longer than the budget gets a row alone."""
    rows, room = [], []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for row, free in enumerate(room):
            if lengths[index] <= free:
                rows[row].append(index)
                room[row] -= lengths[index]
                break
        else:
            rows.append([index])
            room.append(budget - lengths[index])
    return rows


def segment_lengths(examples: list[dict]) -> list[int]:
    return [len(ex["prompt"]) + sum(map(len, ex["responses"])) for ex in examples]


def batch_shape(
    layout: str, lengths, row_tokens: int | None = None, multiple: int = 1, bucketed: bool = False
) -> tuple[int, int]:
    """(rows, row length) of the batch `make_batch` lays out for examples of these lengths ([B, 1 + R]: prompt and
    responses), from the lengths alone."""
    lengths = [list(map(int, row)) for row in lengths]
    if layout == "padded":
        return len(lengths) * (len(lengths[0]) - 1), max(row[0] + r for row in lengths for r in row[1:])
    segments, shapes = [sum(row) for row in lengths], Shapes(bucketed, multiple)
    rows = pack_rows(segments, row_tokens or shapes.budget(max(segments)))
    return shapes.rows(len(rows)), shapes.length(max(sum(segments[i] for i in row) for row in rows))


def pack(
    examples: list[dict], pad_token_id: int, row_tokens: int | None = None, multiple: int = 1, bucketed: bool = False
) -> ModelBatch:
    """Segments [prompt | response_1 | response_2 ...] packed into rows of `row_tokens` (default: the longest
    segment), the row length rounded up to a `multiple`; bucketed: the rows, their length (and the budget the
    longest segment sets) and the kept positions per row rounded up to shapes.Shapes' buckets, the extra rows empty.
    With a dense mask each row's attention costs T x T, so
    longer rows trade padding for wasted attention: on SmolLM2 and HH pairs at max_length 256 (2-core AVX512-BF16
    CPU), budgets of 1x, 1.5x, 2x and 100x the longest segment took 3.9, 4.4, 4.6 and 4.1 s per 4-pair forward +
    backward (padded: 9.3 s). A block mask skips the masked blocks, so there one row holds the whole micro-batch
    (see scoring.Scorer.row_budget)."""
    n_examples, shapes = len(examples), Shapes(bucketed, multiple)
    lengths = segment_lengths(examples)
    rows = pack_rows(lengths, row_tokens or shapes.budget(max(lengths)))
    length = shapes.length(max(sum(lengths[i] for i in row) for row in rows))
    n_rows = shapes.rows(len(rows))
    input_ids = torch.full((n_rows, length), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((n_rows, length), dtype=torch.long)
    segment_ids = torch.full((n_rows, length), -1, dtype=torch.long)
    branch_ids = torch.zeros((n_rows, length), dtype=torch.long)
    scored, spans = [], []
    for row, members in enumerate(rows):
        start = 0
        for index in members:
            prompt, responses = examples[index]["prompt"], examples[index]["responses"]
            input_ids[row, start : start + len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            position_ids[row, start : start + len(prompt)] = torch.arange(len(prompt))
            segment_ids[row, start : start + lengths[index]] = index
            offset = start + len(prompt)
            for r, response in enumerate(responses):
                span = slice(offset, offset + len(response))
                input_ids[row, span] = torch.tensor(response, dtype=torch.long)
                position_ids[row, span] = torch.arange(len(prompt), len(prompt) + len(response))
                branch_ids[row, span] = r + 1
                tokens = scored_tokens(start + len(prompt), len(prompt), response, offset)
                scored += [(r * n_examples + index, row, p, token) for p, token in tokens]
                spans.append((r * n_examples + index, row * length + offset, row * length + offset + len(response) - 1))
                offset += len(response)
            start += lengths[index]
    n_responses, shape = len(examples[0]["responses"]), tuple(input_ids.shape)
    fields = scored_fields(scored, spans, n_examples, n_responses, shape, shapes.kept)
    prompts = [index for members in rows for index in members]  # each prompt once, as the rows hold them
    return ModelBatch(input_ids, position_ids, None, segment_ids, branch_ids, **fields, prompt_examples=prompts)


def packed_mask_mod(
    segment_ids: torch.Tensor,
    branch_ids: torch.Tensor,
    position_ids: torch.Tensor,
    span: AttentionSpan = FULL_ATTENTION,
    bidirectional_blocks: torch.Tensor | None = None,
    blocks_within_span: bool = True,
):
    """FlexAttention's mask_mod(batch, head, query, key) -> whether query may attend to key, for packed rows:
    the same segment, causal, and a response sees the prompt and its own branch, never another response; within
    the layer type's span of positions; and, given bidirectional_blocks, every token of a block sees every other
    token of that block, later ones too (Gemma 3's bidirectional images, PaliGemma's prefix): within the span
    (blocks_within_span: Gemma 3's composition, window AND (causal OR block)) or beyond it (PaliGemma's, (window AND
    causal) OR block), as transformers composes each family's. A padding query attends to itself only: a query with
    no key gives NaN in SDPA, which would reach the gradients."""

    def mask_mod(b, h, q, k):
        real = segment_ids[b, q] >= 0
        same_segment = segment_ids[b, q] == segment_ids[b, k]
        visible_branch = (branch_ids[b, k] == 0) | (branch_ids[b, q] == branch_ids[b, k])
        seen = k <= q
        if bidirectional_blocks is not None:
            block = bidirectional_blocks[b, q]
            same_block = (block >= 0) & (block == bidirectional_blocks[b, k])
            if blocks_within_span:
                seen = seen | same_block
        if span.window is not None:
            seen = seen & (position_ids[b, q] - position_ids[b, k] < span.window)
        if span.chunk is not None:
            seen = seen & (position_ids[b, q] // span.chunk == position_ids[b, k] // span.chunk)
        if bidirectional_blocks is not None and not blocks_within_span:
            seen = seen | same_block
        return (real & same_segment & visible_branch & seen) | (~real & (q == k))

    return mask_mod


def dense_mask(batch: ModelBatch, span: AttentionSpan = FULL_ATTENTION) -> torch.Tensor:
    """[R, 1, T, T] bool, True where a query may attend a key: packed_mask_mod evaluated at every pair, on the
    batch's device."""
    rows, length = batch.input_ids.shape
    device = batch.input_ids.device
    b = torch.arange(rows, device=device)[:, None, None]
    q = torch.arange(length, device=device)[None, :, None]
    k = torch.arange(length, device=device)[None, None, :]
    mask_mod = packed_mask_mod(
        batch.segment_ids, batch.branch_ids, batch.position_ids, span, batch.bidirectional_blocks,
        batch.blocks_within_span,
    )  # fmt: skip
    return mask_mod(b, None, q, k)[:, None]


@dataclass
class SequenceSlice:
    """One rank's slice of a packed batch's rows (sequence parallelism, modeling/sequence_parallel.py): its [R, T / n]
    contiguous tokens and positions, and the scored tokens whose predicting position lies in it, laid out as
    ModelBatch lays out the whole batch's (keep_positions [R, K'], score_rows, score_positions and score_targets
    [M], on the slice's tokens), with their index among the whole batch's [N] scored tokens (score_index)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    keep_positions: torch.Tensor
    score_rows: torch.Tensor
    score_positions: torch.Tensor
    score_targets: torch.Tensor
    score_index: torch.Tensor

    def to(self, device: torch.device) -> "SequenceSlice":
        return SequenceSlice(**{name: to_device(value, device) for name, value in vars(self).items()})


def sequence_slice(batch: ModelBatch, rank: int, size: int) -> SequenceSlice:
    """Slice `rank` of `size` of a packed batch whose row length divides by `size`. The target of a slice's last
    token is the next slice's first: each scored token's id is listed with the position that predicts it, so no
    token crosses ranks."""
    rows, length = batch.input_ids.shape
    width = length // size
    start = rank * width
    row, column = batch.score_positions // length, batch.score_positions % length
    here = ((column >= start) & (column < start + width)).nonzero().squeeze(1)
    flat = row[here] * width + column[here] - start
    # each row's kept positions: every position that predicts a token here, once, in order
    kept = torch.unique(flat)
    kept_rows = kept // width
    counts = torch.bincount(kept_rows, minlength=rows)
    keep_width = max(1, int(counts.max())) if len(kept) else 1
    index_in_row = torch.arange(len(kept)) - (counts.cumsum(0) - counts)[kept_rows]
    keep_positions = torch.zeros((rows, keep_width), dtype=torch.long)
    keep_positions[kept_rows, index_in_row] = kept % width
    # a short row repeats its last kept position, as scored_fields lays them out
    repeat = torch.minimum(torch.arange(keep_width)[None, :], (counts - 1).clamp(min=0)[:, None])
    found = torch.searchsorted(kept, flat)
    return SequenceSlice(
        input_ids=batch.input_ids[:, start : start + width],
        position_ids=batch.position_ids[:, start : start + width],
        keep_positions=keep_positions.gather(1, repeat),
        score_rows=kept_rows[found] * keep_width + index_in_row[found],
        score_positions=flat,
        score_targets=batch.score_targets[here],
        score_index=here,
    )
