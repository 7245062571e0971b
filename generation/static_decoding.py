"""The static decode loop (generation.sampling.Sampler's default where it serves): the own loop's prefill and KV-cache
layout (generation.decoding), with every decode step a fixed set of tensor operations that the device runs without
asking the host anything, so that on CUDA the step is captured once per batch bucket as a CUDA graph and replayed.

- The KV cache is reserved for the prompt and the whole completion ([slots, kv_heads, W + max_new_tokens, head_dim],
  decoding.ReservedLayer's buffers after the prefill, W the longest prompt), each step writing its keys and values at
  one column that a device tensor holds (StaticLayer). A slot attends to its own columns: from where its prompt starts
  (the prompts are left-padded to W) to the current column, a mask built on the device from the two.
- A batch of R rows runs in slots padded up to a bucket (BUCKETS on CUDA; on a CPU, where a padded row costs its
  matmuls and there is no graph to reuse, every size is a bucket). A row that draws its EOS hands its slot to the
  padding row, R, in the step itself (its tokens, uniforms and log-probs then go to row R, which nothing reads); every
  CHECK_EVERY steps the host reads which slots are live, and where they fit a smaller bucket, the live rows move into
  its first slots (decoding.hole_filling_order) and that bucket's graph steps on.
- The draw reads each row's uniforms, drawn up front from its seed, at the step a device tensor counts
  (seeded_draw.RowDraws): on CUDA the stable-sort draw, a few kernels and no host round trip; on a CPU the numpy draw
  of seeded_draw.probs_draw, the host being the device.
- Attention runs through decode_attention.grouped_attention (installed for the decode steps alone): each group of
  query heads over its key/value head in one call, no copy of the cache per query head.

A row's tokens are those of decoding.decode (tested token for token in float32): the same prefill, the same cache,
the same draws; padded and finished slots compute rows nothing reads."""

import contextlib
from dataclasses import dataclass

import torch

from generation.decode_attention import attention_for_decode
from generation.decoding import ReservedLayer, blocked_head, cache_argument, hole_filling_order, prefill
from modeling.mask_dispatch import own_implementation

# The batch sizes a CUDA graph is captured for: a batch of R rows runs in the smallest bucket that holds it, and moves
# to a smaller one once its live rows fit. Larger batches take multiples of the largest.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)

# On CUDA the host reads which slots are live every this many steps (a sync): a finished row keeps its slot, computing
# a row that nothing reads, for at most this many steps.
CHECK_EVERY = 8

# The devices whose batches run in buckets, checked every CHECK_EVERY steps: where the step is a graph. Elsewhere every
# size is a bucket and the host checks every step (a CPU computes a padded row's matmuls, and has no graph to reuse).
PADDED_DEVICES = {"cuda"}

# rope types whose frequencies depend on the longest position seen (rescaled on the host): not capturable
HOST_ROPE = ("dynamic", "longrope")


def bucket(rows: int, device: torch.device) -> int:
    """The slots a batch of `rows` live rows runs in: the smallest bucket that holds them on PADDED_DEVICES, `rows`
    elsewhere."""
    if device.type not in PADDED_DEVICES:
        return rows
    largest = BUCKETS[-1]
    return next((size for size in BUCKETS if size >= rows), -(-rows // largest) * largest)


def static_loop_problem(model: torch.nn.Module) -> str | None:
    """Why the static loop cannot serve a model that decoding.decode serves (None: it can): its attention must be
    plain softmax attention over one full cache a layer (no sliding window, no recurrent state, no soft-cap)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    config = model.config
    attention = own_implementation(config._attn_implementation)  # a training run's mask dispatch set aside
    if attention not in ("sdpa", "eager"):
        return f"its attention is {attention}, not sdpa or eager"
    if any(type(layer) is not DynamicLayer for layer in DynamicCache(config=config).layers):
        return "it has cache layers other than full attention (a sliding window, a recurrent state)"
    for name in ("attn_logit_softcapping", "attention_chunk_size"):
        if getattr(config, name, None) is not None:
            return f"its config sets {name}"
    return None


def graphs_problem(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why the decode step is not captured as a CUDA graph (None: it is)."""
    if device.type != "cuda":
        return "not on CUDA"
    rope = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope in HOST_ROPE:
        return f"its {rope} rope rescales on the host"
    return None


class StaticLayer(ReservedLayer):
    """A layer's KV cache, a decoding.ReservedLayer's buffers after the prefill, written at the column the batch's
    `slots.column` ([1] long, on the device) holds and read as the first `slots.span` columns of its live slots: the
    same buffers and views at every step, so a captured step replays on them."""

    def __init__(self, reserved: ReservedLayer, slots: "Slots"):
        super().__init__(reserved.capacity)
        self.key_buffer, self.value_buffer = reserved.key_buffer, reserved.value_buffer
        self.keys, self.values = reserved.keys, reserved.values
        self.device, self.is_initialized, self.slots = reserved.device, True, slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        n, span, column = self.slots.count, self.slots.span, self.slots.column
        self.key_buffer[:n].index_copy_(2, column, key_states)
        self.value_buffer[:n].index_copy_(2, column, value_states)
        return self.key_buffer[:n, :, :span], self.value_buffer[:n, :, :span]


@dataclass
class Slots:
    """A batch's decode state, all on the device, [S] a slot: `rows` (the row a slot holds; R: none), `tokens` (its
    last drawn token), `positions` (that token's position), `starts` (the column its prompt starts at); `step` (the
    token being drawn, 0-d), `column` ([1]: where the last token's keys go), `drawn` ([R + 1, max_new_tokens] every
    row's tokens), `columns` (0 .. W + max_new_tokens - 1). count and span (host ints): the slots stepping, and the
    columns attention reads (all of them where the step is a graph)."""

    rows: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    starts: torch.Tensor
    step: torch.Tensor
    column: torch.Tensor
    drawn: torch.Tensor
    columns: torch.Tensor
    count: int
    span: int

    def record(self, tokens: torch.Tensor, eos_token_id: int) -> None:
        """Each slot's drawn token [count] into its row, and the step moved on; a slot that drew its EOS now holds the
        padding row. Tensor operations alone: a captured step records the same way."""
        n, padding = self.count, self.drawn.shape[0] - 1
        rows = self.rows[:n]
        self.drawn.index_put_((rows, self.step.expand(n)), tokens)
        self.rows[:n] = torch.where(tokens == eos_token_id, padding, rows)
        self.tokens[:n] = tokens
        self.positions[:n] += 1
        self.step += 1
        self.column += 1

    def keep(self, order: torch.Tensor, count: int) -> None:
        """The slots `order` (indices into the current slots) become the first ones; count of them step on."""
        for slot_tensor in (self.rows, self.tokens, self.positions, self.starts):
            slot_tensor[: len(order)] = slot_tensor[order]
        self.count = count


def decode_step(model, cache, argument: str, slots: Slots, draw, eos_token_id: int) -> None:
    """One decode step of the slots: the forward pass of each slot's last token, the draw, the record. The mask: a
    slot reads its columns from its prompt's start to the current column."""
    n, span = slots.count, slots.span
    columns = slots.columns[:span]
    mask = (columns >= slots.starts[:n, None]) & (columns <= slots.column)
    output = model(input_ids=slots.tokens[:n, None], attention_mask=mask[:, None, None, :], use_cache=True,
                   position_ids=slots.positions[:n, None], **{argument: cache})  # fmt: skip
    slots.record(draw(output.logits[:, -1], slots.step, slots.rows[:n]), eos_token_id)


class StepGraphs:
    """The decode step as one CUDA graph per bucket (torch.cuda.graphs): the first step of a bucket runs eagerly on a
    side stream (the warm-up the capture needs, a real step), then is captured; later steps replay it. Every bucket's
    graph shares one memory pool (they never run at once). Under autocast the capture disables autocast's cast
    cache, whose copies a graph would hold on to."""

    def __init__(self, step):
        self.step, self.graphs, self.pool = step, {}, torch.cuda.graph_pool_handle()

    def __call__(self, count: int) -> None:
        if count in self.graphs:
            self.graphs[count].replay()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), uncached_autocast():
            self.step()
        self.graphs[count] = graph


def uncached_autocast():
    """Autocast as it stands on CUDA, with its cast cache off (the torch docs' rule for capturing under autocast)."""
    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def first_slots(prompts: list[list[int]], device: torch.device) -> tuple[dict, torch.Tensor, int]:
    """(the distinct prompts in order of first use, [S] the distinct prompt each slot starts from, S): the slots of
    the R rows and the bucket's padding slots, which copy the first prompt."""
    distinct: dict[tuple, int] = {}
    which = [distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts]
    count = bucket(len(prompts), device)
    return distinct, torch.tensor(which + [0] * (count - len(prompts)), device=device), count


@torch.no_grad()
def static_decode(model, prompts: list[list[int]], draw, max_new_tokens: int, pad_token_id: int, eos_token_id: int,
                  device: torch.device) -> list[list[int]]:  # fmt: skip
    """decoding.decode's completions by the static loop: draw(logits [S, V], step (an int or a 0-d device tensor),
    rows [S] (the row of each slot; R: padding)) -> [S] tokens on the device, a function of tensors alone where the
    step is a CUDA graph."""
    n_rows = len(prompts)
    distinct, which, count = first_slots(prompts, device)
    argument = cache_argument(model)
    with blocked_head(model):
        cache, logits, mask, positions = prefill(model, list(distinct), pad_token_id, max_new_tokens, device)
        width = mask.shape[1]
        if len(distinct) < count or not torch.equal(which, torch.arange(count, device=device)):
            cache.reorder_cache(which)  # each slot its prompt's cache
        rows = torch.cat([torch.arange(n_rows, device=device), torch.full((count - n_rows,), n_rows, device=device)])
        graphs = graphs_problem(model, device) is None
        slots = Slots(rows=rows, tokens=torch.zeros_like(rows), positions=positions[which, -1].clone(),
                      starts=(width - mask.sum(-1))[which], step=torch.zeros((), dtype=torch.long, device=device),
                      column=torch.full((1,), width - 1, device=device),
                      drawn=torch.zeros(n_rows + 1, max_new_tokens, dtype=torch.long, device=device),
                      columns=torch.arange(width + max_new_tokens, device=device), count=count,
                      span=width + max_new_tokens if graphs else width)  # fmt: skip
        slots.record(draw(logits[which], slots.step, rows), eos_token_id)
        cache.layers = [StaticLayer(layer, slots) for layer in cache.layers]
        step = lambda: decode_step(model, cache, argument, slots, draw, eos_token_id)  # noqa: E731
        run = StepGraphs(step) if graphs else lambda _: step()
        every = CHECK_EVERY if device.type in PADDED_DEVICES else 1
        with attention_for_decode(model):
            for done in range(1, max_new_tokens):
                if done % every == 0 and not shrink(cache, slots, n_rows, device):
                    break
                if not graphs:
                    slots.span = width + done
                run(slots.count)
    return [row[: row.index(eos_token_id) + 1] if eos_token_id in row else row for row in slots.drawn[:n_rows].tolist()]


def shrink(cache, slots: Slots, n_rows: int, device: torch.device) -> bool:
    """Whether any slot is live (a host read of the slots' rows); where the live ones fit a smaller bucket, they move
    into its first slots, the cache's rows with them, and the rest of the bucket is padding."""
    live = slots.rows[: slots.count] < n_rows
    n_live = int(live.sum())
    if n_live == 0:
        return False
    smaller = bucket(n_live, device)
    if smaller < slots.count:
        spare = (~live).nonzero().flatten()[: smaller - n_live]
        order = torch.cat([hole_filling_order(live), spare])
        cache.batch_select_indices(order)
        slots.keep(order, smaller)
        slots.rows[n_live:smaller] = n_rows
    return True
