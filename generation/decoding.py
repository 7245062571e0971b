"""Our own decode loop for seeded sampling (generation.sampling.Sampler), in place of model.generate where it can serve:
each distinct prompt of a batch prefilled once, its KV cache copied to every row drawn from it (rows = prompt x
temperature x sample, each row its own temperature and uniforms), and a row that finished (its EOS, or
max_new_tokens) leaving the batch, so that the next steps compute only the live rows. A row's tokens are drawn as
SeededSampling draws them, so a completion is the same function of its seed, temperature and prompt as through
model.generate (tested against it in float32).

transformers' own continuous batching (`generate_batch`, transformers 5.24) is not used: it draws every row's
token by torch.multinomial from one generator (model_runner.py), so a row's tokens would depend on the rows beside it
and on the order they were scheduled in, and the seeded draw could only replace it by patching its internals; its
paged decode fast path (block tables) needs Flash Attention on CUDA or XPU: on a CPU it runs its general path,
with no paged-attention kernel."""

import contextlib
import inspect

import torch
import transformers
from torch.distributed.tensor import DTensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from core.layouts import left_padded_prompts

# transformers 5.24 renamed the models' KV-cache argument past_key_values to cache (the old name warns until 5.40): the
# name a model whose forward names neither (a wrapper's **kwargs) is given
TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
DEFAULT_CACHE_ARGUMENT = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"

# generation_config fields that add a logits processor to model.generate (greedy included): where a model's config
# sets one, the old path (which applies them) is kept
PROCESSOR_FIELDS = {
    "repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,),
    "sequence_bias": (None,),
    "renormalize_logits": (None, False),
    "forced_decoder_ids": (None,),
}


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether the model's weights are shared out over ranks (FSDP, tensor parallelism: DTensors), so that each of
    its forward passes needs every rank."""
    return any(isinstance(parameter, DTensor) for parameter in model.parameters())


def own_loop_problem(model: torch.nn.Module, vision) -> str | None:
    """Why the own decode loop cannot serve this model (the Sampler then keeps model.generate), or None. A model
    whole on each of several ranks is served: each rank decodes its rows alone, finished rows leaving its batch."""
    if vision is not None:
        return "a vision-language model (its images enter through generate's inputs)"
    if is_sharded(model):
        return "sharded over the ranks (generate's synced_gpus keeps every rank in each forward pass)"
    config = getattr(model, "generation_config", None)
    for field, defaults in PROCESSOR_FIELDS.items():
        if getattr(config, field, None) not in defaults:
            return f"its generation_config sets {field}"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


def cache_argument(model: torch.nn.Module) -> str:
    """The name the model's forward reads its KV cache by: `cache` (transformers' models from 5.24) or
    `past_key_values` (before 5.24, and remote code written for it). A cache passed by a name a forward does not read
    falls into its **kwargs unread, and each decode step would attend to its own token alone."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT model passes it on
    parameters = inspect.signature(base.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in parameters), DEFAULT_CACHE_ARGUMENT)


class ReservedLayer(DynamicLayer):
    """A layer's KV cache in buffers reserved for the prompt and its whole completion: each step writes its keys and
    values in place, and attention reads a view of the filled part. DynamicLayer's torch.cat copies the whole cache
    at every step instead: on a CPU, most of a decode step's time at 128 rows (profiled: 56%). It serves decode's
    operations (update, the length, reorder_cache, batch_select_indices); a step past `capacity` grows the buffers."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.key_buffer = key_states.new_empty(*key_states.shape[:2], self.capacity, key_states.shape[3])
        self.value_buffer = value_states.new_empty(*value_states.shape[:2], self.capacity, value_states.shape[3])
        self.keys, self.values = self.key_buffer[:, :, :0], self.value_buffer[:, :, :0]
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.keys.shape[-2]
        end = start + key_states.shape[-2]
        if end > self.key_buffer.shape[-2]:
            self.capacity = max(end, 2 * self.capacity)
            self.key_buffer, self.value_buffer = self.grown(self.key_buffer), self.grown(self.value_buffer)
        rows = key_states.shape[0]  # the buffers' first rows (see batch_select_indices)
        self.key_buffer[:rows, :, start:end] = key_states
        self.value_buffer[:rows, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:rows, :, :end], self.value_buffer[:rows, :, :end]
        return self.keys, self.values

    def grown(self, buffer: torch.Tensor) -> torch.Tensor:
        larger = buffer.new_empty(*buffer.shape[:2], self.capacity, buffer.shape[3])
        larger[:, :, : buffer.shape[2]] = buffer
        return larger

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Row i becomes row indices[i]. Where rows leave (no more indices than rows), only the rows whose place
        changes are copied, within the buffers (decode moves the last live rows into the places of finished ones), and
        the cache is a view of the buffers' first rows; else (each prompt's cache copied to its rows) the buffers are
        gathered anew."""
        if not self.is_initialized:
            return
        length = self.keys.shape[-2]
        if len(indices) > self.key_buffer.shape[0]:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
        else:
            moved = (indices != torch.arange(len(indices), device=indices.device)).nonzero().flatten()
            for buffer in (self.key_buffer, self.value_buffer):
                buffer[moved] = buffer[indices[moved]]  # gathered first: a row moved may be another's source
        rows = len(indices)
        self.keys, self.values = self.key_buffer[:rows, :, :length], self.value_buffer[:rows, :, :length]

    def write_prompts(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: int, width: int):
        """The keys and values [len(rows), heads, L, D] of some of a batch's prompts, prefilled apart (left-padded to
        their longest, L), written into their rows left-padded to the batch's `width`: positions before the last L
        hold zeros (the masks hide them, and a zero, unlike a reserved buffer's garbage, times a weight of 0 is 0)."""
        if not self.is_initialized:
            self.device, self.is_initialized = keys.device, True
            self.key_buffer = keys.new_zeros(batch, keys.shape[1], max(self.capacity, width), keys.shape[3])
            self.value_buffer = values.new_zeros(batch, values.shape[1], max(self.capacity, width), values.shape[3])
        self.key_buffer[rows, :, width - keys.shape[-2] : width] = keys
        self.value_buffer[rows, :, width - values.shape[-2] : width] = values
        self.keys, self.values = self.key_buffer[:, :, :width], self.value_buffer[:, :, :width]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


def reserved_cache(model: torch.nn.Module, capacity: int) -> DynamicCache:
    """The model's DynamicCache with each plain layer a ReservedLayer of `capacity` positions (sliding-window and
    other special layers kept as they are)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


# What a forward pass costs beside its tokens, in padded tokens: prompts of unequal lengths are prefilled in groups
# of neighbouring lengths where a group saves more padding than this. On a CPU a forward's GEMMs of few rows run well
# below the rate of many rows' (32 HH prompts of 16 to 123 tokens, one padded batch: 41% padding); on a GPU a
# forward's kernel launches cost more than a small model's padded tokens.
GROUP_COST = {"cpu": 256}
GROUP_COST_ELSEWHERE = 4096

# On a CPU, the LM head's GEMM of a decode step's rows by the whole vocabulary runs in column blocks of this many
# tokens: MKL multiplies 128 rows by SmolLM2's [49,152, 576] head at 65 GFLOP/s in one GEMM and 100 in blocks of
# 2,048 (a 2-core AVX2 EPYC), each logit the same dot product.
VOCAB_BLOCK = 2048


def length_groups(lengths: list[int], cost: int) -> list[list[int]]:
    """The prompts (indices into lengths) in groups of neighbouring lengths with the fewest padded tokens plus `cost`
    a group: the best split of the lengths in order, by dynamic programming over its n (n + 1) / 2 candidate groups."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    best, cut = [0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            total = best[start] + (end - start) * lengths[order[end - 1]] + cost
            if total < best[end]:
                best[end], cut[end] = total, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def prefill(model, prompts: list[tuple], pad_token_id: int, capacity: int, device: torch.device):
    """(cache, logits [P, V] of each prompt's last position, mask [P, W], positions [P, W]) of distinct prompts
    left-padded to one width W, the cache reserved for W + capacity positions. Prompts of unequal lengths are
    prefilled in length groups (length_groups), each group's keys and values written into the batch's layout; a
    model with special cache layers (a sliding window, a recurrent state) is prefilled in one batch."""
    ids, mask = left_padded_prompts([{"prompt": list(prompt)} for prompt in prompts], pad_token_id)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers them
    cache, argument = reserved_cache(model, ids.shape[1] + capacity), cache_argument(model)
    groups = [list(range(len(prompts)))]
    if all(type(layer) is ReservedLayer for layer in cache.layers):
        cost = GROUP_COST.get(device.type, GROUP_COST_ELSEWHERE)
        groups = [sorted(group) for group in length_groups([len(prompt) for prompt in prompts], cost)]
    logits = None
    for group in groups:
        group_ids, group_mask = left_padded_prompts([{"prompt": list(prompts[i])} for i in group], pad_token_id)
        part = cache if len(groups) == 1 else DynamicCache(config=model.config)  # one group (in order): in place
        output = model(input_ids=group_ids.to(device), attention_mask=group_mask.to(device), **{argument: part},
                       position_ids=positions[group, -group_ids.shape[1] :].to(device), use_cache=True,
                       logits_to_keep=1)  # fmt: skip
        rows = torch.tensor(group, device=device)
        if part is not cache:
            for layer, written in zip(cache.layers, part.layers):
                layer.write_prompts(rows, written.keys, written.values, len(prompts), ids.shape[1])
        if logits is None:
            logits = output.logits.new_empty(len(prompts), output.logits.shape[-1])
        logits[rows] = output.logits[:, -1]
    return cache, logits, mask.to(device), positions.to(device)


@contextlib.contextmanager
def blocked_head(model: torch.nn.Module):
    """The model's LM head computed in VOCAB_BLOCK column blocks, within the context, where it is a float32
    torch.nn.Linear on a CPU (else as it is)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if type(head) is not torch.nn.Linear or weight.device.type != "cpu" or weight.dtype != torch.float32:
        yield
        return

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        logits = rows.new_empty(len(rows), head.out_features)
        for start in range(0, head.out_features, VOCAB_BLOCK):
            block = slice(start, start + VOCAB_BLOCK)
            if head.bias is None:
                torch.mm(rows, weight[block].t(), out=logits[:, block])
            else:
                torch.addmm(head.bias[block], rows, weight[block].t(), out=logits[:, block])
        return logits.view(*hidden.shape[:-1], head.out_features)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward


def hole_filling_order(keep: torch.Tensor) -> torch.Tensor:
    """The rows kept (keep [R] bool) as indices of a new order: the kept rows in place, and into the place of each
    row that left among the first keep.sum(), one of the kept rows past them. The KV cache then copies as many rows as
    left (ReservedLayer.batch_select_indices), not every row after the first that left."""
    kept = int(keep.sum())
    order = torch.arange(kept, device=keep.device)
    order[(~keep[:kept]).nonzero().flatten()] = keep[kept:].nonzero().flatten() + kept
    return order


@torch.no_grad()
def decode(model, prompts: list[list[int]], draw, max_new_tokens: int, pad_token_id: int, eos_token_id: int,
           device: torch.device) -> list[list[int]]:  # fmt: skip
    """The completions of rows of prompts (each ending with the EOS where it stopped): draw(logits [R, V], step,
    rows [R]) -> [R] tokens, rows being the indices of the live rows. Equal prompts are prefilled once."""
    distinct: dict[tuple, int] = {}
    which = torch.tensor([distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts], device=device)
    argument = cache_argument(model)
    with blocked_head(model):
        cache, logits, mask, positions = prefill(model, list(distinct), pad_token_id, max_new_tokens, device)
        if len(distinct) < len(prompts) or not torch.equal(which, torch.arange(len(prompts), device=device)):
            cache.reorder_cache(which)  # each row its prompt's cache
        logits, mask, next_position = logits[which], mask[which], positions[which, -1] + 1
        live = torch.arange(len(prompts), device=device)
        completions: list[list[int]] = [[] for _ in prompts]
        for step in range(max_new_tokens):
            tokens = draw(logits, step, live).to(device)
            for row, token in zip(live.tolist(), tokens.tolist()):
                completions[row].append(token)
            keep = tokens != eos_token_id
            if step == max_new_tokens - 1 or not keep.any():
                break
            if not keep.all():  # finished rows leave the batch
                kept = hole_filling_order(keep)
                cache.batch_select_indices(kept)
                live, tokens, mask, next_position = live[kept], tokens[kept], mask[kept], next_position[kept]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            output = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                           use_cache=True, **{argument: cache})  # fmt: skip
            logits, next_position = output.logits[:, -1], next_position + 1
    return completions
