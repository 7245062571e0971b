"""The load-balancing loss of a mixture-of-experts policy's routers, added to every objective's loss.

Switch Transformer's auxiliary loss (Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6), as transformers computes it for
its MoE causal LMs (`load_balancing_loss_func`) and TRL adds it (`router_aux_loss_coef`): with E experts, k chosen
per token, and over every token of every MoE layer, f_e the fraction of the k-choices that went to expert e and P_e
the mean router probability of expert e, the loss is E sum_e f_e P_e (k when the routing is uniform). Only P carries
a gradient: the choices are an argmax.

Which tokens. Padding counts for nothing. Each real token counts as often as the padded layout computes it: a packed
row computes a pair's prompt once for both responses, the padded layout once per response, so a packed prompt token
counts twice (once per response of its example). The loss is then the same in both layouts, and equal to
transformers' function on the padded rows, which is what TRL computes; the router sees each (prompt, response)
sequence whole, as in the padded batch.

Which batch. f and P are means over the whole optimizer step (or eval batch), over every rank and micro-batch, so that
the loss and its gradient are the same for any accumulation and rank count (and the balance is asked of the batch,
not of each micro-batch: Qiu et al. 2025, arXiv:2501.11873, show that per-micro-batch balance holds back expert
specialisation). f of the whole batch must be known before the first backward: with one micro-batch per rank it
comes from that forward, summed over ranks; with several, from one no-grad forward of them before the step
(step.BatchLoss.couple), as aot's sort does. Each micro-batch then adds E sum_e f_e S_e / T, with S_e its part of the
batch's summed router probabilities and T the batch's token count: the parts add up to the batch's loss.
"""

import contextlib
from dataclasses import dataclass

import torch

from core.layouts import ModelBatch, to_device
from utils import UserError


@dataclass
class RouterCounts:
    """What the loss reads of the whole batch, detached: the weighted k-choices of each expert and the weighted
    token count, both summed over every MoE layer."""

    choices: torch.Tensor  # [E] float32
    tokens: torch.Tensor  # [] float32

    def __add__(self, other: "RouterCounts") -> "RouterCounts":
        return RouterCounts(self.choices + other.choices, self.tokens + other.tokens)


@dataclass
class RouterSums:
    """One forward's share: its weighted sums of router probabilities [E] (with their gradient), and its counts."""

    probabilities: torch.Tensor
    counts: RouterCounts


@dataclass(frozen=True)
class Routers:
    """Where a model's router logits come from and how the loss reads them: the module class transformers records
    them from (its `_can_record_outputs["router_logits"]`: the output `index` of each `target` module, optionally
    only those whose name holds `name_part`), E experts and k choices per token; the loss's weight."""

    target: type
    index: int
    name_part: str | None
    n_experts: int
    top_k: int
    coefficient: float

    def describe(self) -> str:
        return f"{self.coefficient:g} x the load-balancing loss of {self.n_experts} experts, top {self.top_k}"

    def loss(self, sums: RouterSums, batch: RouterCounts) -> torch.Tensor:
        """[] E sum_e f_e S_e / T: this forward's part of the batch's load-balancing loss (f = choices / T)."""
        return self.n_experts * (batch.choices / batch.tokens * sums.probabilities).sum() / batch.tokens

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The model's routers: its modules of the class transformers records router logits from."""
        named = model.named_modules()
        return [
            m for name, m in named if isinstance(m, self.target) and (self.name_part is None or self.name_part in name)
        ]

    @contextlib.contextmanager
    def recorded(self, routers: list[torch.nn.Module]):
        """The logits of `routers` (modules) in the forwards inside this block, appended to the yielded list layer by
        layer as each router runs ([tokens, E] each); nothing is recorded once it is left (a recomputing backward,
        under activation checkpointing, adds nothing)."""
        logits = []

        def record(module, inputs, output):
            logits.append(output[self.index] if isinstance(output, tuple) else output)

        handles = [router.register_forward_hook(record) for router in routers]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()

    def sums(self, logits: list[torch.Tensor], weights: torch.Tensor) -> RouterSums:
        """The weighted sums of one forward's recorded `logits` (each layer's [R * T, E], tokens in row order);
        weights: [R * T] float32, how often each token counts (token_weights)."""
        probabilities = torch.zeros(self.n_experts, device=weights.device)
        choices = torch.zeros(self.n_experts, device=weights.device)
        for layer in logits:
            layer_probabilities = torch.softmax(layer.float(), dim=-1)
            chosen = torch.topk(layer_probabilities.detach(), self.top_k, dim=-1).indices  # [tokens, k]
            choices = choices.index_add(0, chosen.flatten(), weights.repeat_interleave(self.top_k))
            probabilities = probabilities + weights @ layer_probabilities
        tokens = weights.sum() * len(logits)
        return RouterSums(probabilities, RouterCounts(choices, tokens))


def find_routers(model: torch.nn.Module, coefficient: float | None) -> Routers | None:
    """The routers whose loss a run on `model` (the transformers model, not a wrapper) adds, or None. coefficient:
    loss.router_aux_loss_coef; None takes the model config's router_aux_loss_coef where the config has
    output_router_logits (transformers' MoE models: as TRL does), and 0 turns the loss off. A coefficient set for a
    model whose router logits transformers does not record is a one-line UserError."""
    config = model.config.get_text_config()
    if coefficient is None:
        coefficient = getattr(config, "router_aux_loss_coef", 0.0) if hasattr(config, "output_router_logits") else 0.0
    if not coefficient:
        return None
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    n_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if recorder is None or not n_experts or not top_k:
        raise UserError(
            f"loss.router_aux_loss_coef={coefficient}: {type(model).__name__} has no router logits to balance "
            "(not a mixture-of-experts model transformers records them for); set it to 0 or null"
        )
    target = getattr(recorder, "target_class", recorder)
    name_part = getattr(recorder, "layer_name", None)
    return Routers(target, getattr(recorder, "index", 0), name_part, int(n_experts), int(top_k), float(coefficient))


def token_weights(batch: ModelBatch, examples: list[dict], n_real: int) -> torch.Tensor:
    """[R * T] float32: how often each computed token counts in the loss. Padded rows: 1 for a real token, 0 for
    padding. Packed rows: a prompt token once per response of its example, a response token once, padding 0. The
    tokens of examples past the first n_real (a rank's padding copies, modeling.distributed.Topology.shard) count
    0."""
    # per-example numbers made on the host and sent ahead, as the batch's own indices are (layouts.to_device)
    device = batch.input_ids.device
    real = to_device(torch.arange(len(examples)) < n_real, device)
    if batch.segment_ids is None:  # padded: row r is response r // B of example r % B
        rows = real.repeat(batch.input_ids.shape[0] // len(examples))
        return (batch.attention_mask.float() * rows[:, None]).flatten()
    responses = to_device(torch.tensor([len(example["responses"]) for example in examples]), device)
    segment = batch.segment_ids.clamp(min=0)
    weights = torch.where(batch.branch_ids == 0, responses[segment], 1) * real[segment]
    return torch.where(batch.segment_ids >= 0, weights, 0).float().flatten()
