"""What a run will do, told before it does it: the data report every run prints before training, and the estimate
of peak memory per process that `dry_run=true` prints (build.dry_run)."""

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from distributed import TRAINERS, mesh_shape
from layouts import batch_shape
from optim import build_optimizer
from placement import find_blocks
from precision import Precision
from tokenized import Examples

GIB = 2**30
SHOWN_TOKENS = 24  # of a long segment, the decoded example shows this many tokens at each end


def data_report(
    train: Examples, evals: Examples, tokenizer, max_length: int, max_prompt_length: int, header: str | None = None
) -> str:
    """Token lengths (before truncation) of prompts and responses, how many examples were truncated, and the first
    training example decoded token by token, so that a tokenization problem shows at a glance. Computed on the
    examples' length arrays: a million examples take milliseconds. header: a first line instead of the counts (a
    round's, rounds.py)."""
    full = np.concatenate([train.full_lengths, evals.full_lengths])
    kept = np.concatenate([train.lengths, evals.lengths])
    names = ["prompt", "chosen", "rejected"] if full.shape[1] == 3 else ["prompt", "target"]
    kind = ""
    if train.labelled:
        names = ["prompt", "response"]  # the completion (8 letters: the columns stay aligned)
        desirable = int((train.labels == 1).sum())
        kind = f" (labelled completions: {desirable} desirable, {len(train) - desirable} undesirable in training)"
    lines = [
        header or f"data report: {len(train)} training and {len(evals)} eval examples{kind}",
        "  tokens     p50    p90    p99    max",
    ]
    for i, name in enumerate(names):
        cuts = np.percentile(full[:, i], [50, 90, 99])  # linear interpolation between ranks ("inclusive")
        lines.append(f"  {name:8} {cuts[0]:5.0f}  {cuts[1]:5.0f}  {cuts[2]:5.0f}  {full[:, i].max():5d}")
    truncated = int((kept.sum(axis=1) < full.sum(axis=1)).sum())
    lines.append(
        f"  truncated: {truncated} of {len(full)} examples (prompt + longest response over max_length="
        f"{max_length}; prompts cut to max_prompt_length={max_prompt_length})"
    )
    example = train[0]
    lines.append("  first training example, token by token (| between tokens; the responses are scored):")
    for name, ids in zip(names, [example["prompt"], *example["responses"]]):
        lines.append(f"    {name:8} {len(ids):4d} tokens: {decoded_tokens(ids, tokenizer)}")
    return "\n".join(lines)


def decoded_tokens(ids: list[int], tokenizer) -> str:
    pieces = [tokenizer.decode([i]).replace("\n", "\\n") for i in ids]
    if len(pieces) > 2 * SHOWN_TOKENS:
        hidden = len(pieces) - 2 * SHOWN_TOKENS
        pieces = [*pieces[:SHOWN_TOKENS], f" ... {hidden} more ... ", *pieces[-SHOWN_TOKENS:]]
    return "|".join(pieces)


def memory_estimate(
    config: DictConfig,
    world_size: int,
    policy: torch.nn.Module,
    train: Examples,
    schedule: list[list[int]],
    precision: Precision,
    live_reference: bool,
) -> tuple[str, dict[str, float]]:
    """(what it assumes, {part: bytes}): peak memory of one process, from the policy's shapes (meta_policy) and the
    run's largest micro-batch. Activations follow Korthikanti et al. 2022 ("Reducing
    Activation Recomputation in Large Transformer Models"): 34 x hidden bytes per token and layer in 16-bit compute,
    without the attention scores (scaled dot-product attention does not keep them); activation checkpointing keeps
    each layer's input and one layer's activations. Not counted: the framework itself (CUDA context, Python and
    torch: ~0.5-1 GiB)."""
    model_config = policy.config
    weights_dtype = precision.policy_weights
    n_parameters = sum(p.numel() for p in policy.parameters())
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    blocks = find_blocks(policy, config.model.block_name)
    block, n_layers, hidden = blocks[0], len(blocks), model_config.hidden_size

    parallelism = TRAINERS[config.trainer]
    dp, tp = mesh_shape(config.trainer, world_size, config.tensor_parallel_size)
    shards = dp * tp if parallelism.fsdp else tp  # tensor parallelism splits the blocks only: an upper bound below
    element = torch.finfo(weights_dtype).bits // 8
    compute = precision.policy_compute or weights_dtype
    compute_bytes = torch.finfo(compute).bits // 8

    micro = config.batch_size // (config.gradient_accumulation_steps * dp)
    shapes = [
        batch_shape(config.layout, train.lengths[indices[start : start + micro]])
        for indices in schedule
        for start in range(0, len(indices), micro)
    ]
    rows = max(n_rows * length for n_rows, length in shapes)
    # packed rows on a CPU take a dense [R, 1, T, T] mask: bool, and the additive one in the compute dtype (on CUDA
    # the block mask holds a few integers per 128 x 128 block instead)
    dense_masks = config.layout == "packed" and (config.packed_attention == "dense" or not torch.cuda.is_available())
    mask = max(n_rows * length**2 for n_rows, length in shapes) * (1 + compute_bytes)
    per_layer = 34 * hidden * compute_bytes / 2
    activations = rows * (
        2 * hidden * compute_bytes * n_layers + per_layer if config.activation_checkpointing else per_layer * n_layers
    )
    vocab = model_config.vocab_size
    logits = 0 if config.scored_logits_only else rows * vocab * (compute_bytes + 2 * 4)  # + float32 log-softmax
    reference_bytes = torch.finfo(precision.reference_weights).bits // 8
    autocast_copies = not parallelism.fsdp and compute != weights_dtype
    states, fused = optimizer_states(config)
    fused = fused and (parallelism.fsdp or tp == 1)  # tensor parallelism alone mixes DTensors and plain tensors
    parts = {
        "policy weights": n_parameters * element / shards,
        "gradients": n_trainable * element / shards,
        f"{config.optimizer} state": states * n_trainable * element / shards,
        # torch's multi-tensor (foreach) step holds an intermediate per parameter, e.g. AdamW's denominators; the
        # fused one updates each element in place
        "optimizer step intermediates": 0 if fused else n_trainable * element / shards,
        "reference weights": n_parameters * reference_bytes / shards if live_reference else 0,
        "gathered block (FSDP)": 2 * sum(p.numel() for p in block.parameters()) * compute_bytes
        if parallelism.fsdp
        else 0,
        # autocast keeps a compute-dtype copy of each weight it casts, for the whole forward and backward pass
        "autocast weight copies": n_parameters * compute_bytes / tp if autocast_copies else 0,
        f"activations ({rows} token positions)": activations,
        "attention mask (packed, dense)": mask if dense_masks else 0,
        "full logits": logits,
    }
    header = (
        f"{n_parameters / 1e6:.1f}M parameters, {n_trainable / 1e6:.2f}M trainable; {weights_dtype} weights, "
        f"{compute} compute; {config.trainer} dp {dp} x tp {tp}; {config.layout} layout"
    )
    return header, parts


def optimizer_states(config: DictConfig) -> tuple[int, bool]:
    """(tensors the optimizer keeps per parameter tensor (AdamW: 2, SGD with momentum: 1), whether its step is
    fused), as build_optimizer makes it for a plain 2-element parameter, counted after one step."""
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer(
        config.optimizer, [parameter], config.lr, OmegaConf.to_container(config.optimizer_kwargs)
    )
    parameter.grad = torch.ones(2)
    optimizer.step()
    states = sum(torch.is_tensor(v) and v.numel() == 2 for v in optimizer.state[parameter].values())
    return states, bool(optimizer.defaults.get("fused"))
