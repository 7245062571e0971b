"""Our own decode loop for seeded sampling (core.generations.Sampler), in place of model.generate where it can serve:
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

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from core.layouts import left_padded_prompts

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


def own_loop_problem(model: torch.nn.Module, vision, world_size: int) -> str | None:
    """Why the own decode loop cannot serve this model (the Sampler then keeps model.generate), or None."""
    if vision is not None:
        return "a vision-language model (its images enter through generate's inputs)"
    if world_size > 1:
        return "sharded over several ranks (generate's synced_gpus keeps every rank in step)"
    config = getattr(model, "generation_config", None)
    for field, defaults in PROCESSOR_FIELDS.items():
        if getattr(config, field, None) not in defaults:
            return f"its generation_config sets {field}"
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


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
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def grown(self, buffer: torch.Tensor) -> torch.Tensor:
        larger = buffer.new_empty(*buffer.shape[:2], self.capacity, buffer.shape[3])
        larger[:, :, : buffer.shape[2]] = buffer
        return larger

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            length = self.keys.shape[-2]
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)


def reserved_cache(model: torch.nn.Module, capacity: int) -> DynamicCache:
    """The model's DynamicCache with each plain layer a ReservedLayer of `capacity` positions (sliding-window and
    other special layers kept as they are)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [ReservedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


@torch.no_grad()
def decode(model, prompts: list[list[int]], draw, max_new_tokens: int, pad_token_id: int, eos_token_id: int,
           device: torch.device) -> list[list[int]]:  # fmt: skip
    """The completions of rows of prompts (each ending with the EOS where it stopped): draw(logits [R, V], step,
    rows [R]) -> [R] tokens, rows being the indices of the live rows. Equal prompts are prefilled once."""
    distinct: dict[tuple, int] = {}
    which = torch.tensor([distinct.setdefault(tuple(prompt), len(distinct)) for prompt in prompts])
    ids, mask = left_padded_prompts([{"prompt": list(prompt)} for prompt in distinct], pad_token_id)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate numbers them
    cache = reserved_cache(model, ids.shape[1] + max_new_tokens)
    ids, mask, positions = ids.to(device), mask.to(device), positions.to(device)
    output = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache,
                   use_cache=True, logits_to_keep=1)  # fmt: skip
    which = which.to(device)
    if len(distinct) < len(prompts) or not torch.equal(which, torch.arange(len(prompts), device=device)):
        cache.reorder_cache(which)  # each row its prompt's cache
    logits, mask = output.logits[which, -1], mask[which]
    next_position = positions[which, -1] + 1
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
            kept = keep.nonzero().flatten()
            cache.batch_select_indices(kept)
            live, tokens, mask, next_position = live[kept], tokens[kept], mask[kept], next_position[kept]
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
        output = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                       cache=cache, use_cache=True)  # fmt: skip
        logits, next_position = output.logits[:, -1], next_position + 1
    return completions
