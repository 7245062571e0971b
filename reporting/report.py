"""What a run will do, told before it does it: the data report every run prints before training, and the estimate
of peak memory per process that `dry_run=true` prints (build.dry_run)."""

import copy
import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from core.examples import Examples
from core.layouts import batch_shape
from core.optim import build_optimizer
from modeling.distributed import TRAINERS
from modeling.placement import find_blocks, language_blocks, tensor_parallel_plan
from modeling.precision import Precision
from modeling.vision import model_image_token, vision_projector, vision_tower
from modeling.weights import rank_file_bytes
from utils import UserError

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
    if full.shape[1] == 3 and not train.labelled and len(train):
        lines.append(length_bias(train.full_lengths[:, 1], train.full_lengths[:, 2]))
    example = train[0]
    lines.append("  first training example, token by token (| between tokens; the responses are scored):")
    for name, ids in zip(names, [example["prompt"], *example["responses"]]):
        lines.append(f"    {name:8} {len(ids):4d} tokens: {decoded_tokens(ids, tokenizer)}")
    return "\n".join(lines)


LENGTH_BIAS = 2 / 3  # above it, the pairs teach length (Park et al. 2024, arXiv:2403.19159)


def length_bias(chosen: np.ndarray, rejected: np.ndarray) -> str:
    """The pairs' length bias: the share whose chosen response is longer (in tokens, before truncation) and the mean
    ratio of chosen to rejected length; above LENGTH_BIAS, what DPO learns of it and the losses that control it."""
    longer = float((chosen > rejected).mean())
    ratio = float(np.mean(chosen / np.maximum(rejected, 1)))
    line = f"  length bias: the chosen response is longer in {longer:.0%} of training pairs, {ratio:.2f}x on average"
    if longer > LENGTH_BIAS:
        line += (
            "; DPO learns length from such data (its implicit reward rises with it): consider loss=ld_dpo or a "
            "length-normalised loss (dpo_norm, simpo), and judge by length-controlled win rates (evaluate.py)"
        )
    return line


def decoded_tokens(ids: list[int], tokenizer) -> str:
    pieces = [tokenizer.decode([i]).replace("\n", "\\n") for i in ids]
    if len(pieces) > 2 * SHOWN_TOKENS:
        hidden = len(pieces) - 2 * SHOWN_TOKENS
        pieces = [*pieces[:SHOWN_TOKENS], f" ... {hidden} more ... ", *pieces[-SHOWN_TOKENS:]]
    return "|".join(pieces)


@dataclass(frozen=True)
class Hardware:
    """What a run's ranks have: the nodes, ranks on each, each rank's GPU memory (None: CPU ranks, whose device is the
    host) and each node's host memory (None: not known, not checked); gpu_free_bytes: what this rank's GPU has free
    now (None: not known, as on planned machines)."""

    nodes: int
    ranks_per_node: int
    gpu_bytes: float | None
    host_bytes: float | None
    gpu_free_bytes: float | None = None

    @classmethod
    def here(cls, world_size: int) -> "Hardware":
        """This machine, for a run of world_size ranks: torchrun's ranks per node, else all of them here."""
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        cuda = torch.cuda.is_available()
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
        free = torch.cuda.mem_get_info()[0] if cuda else None
        return cls(max(1, world_size // per_node), per_node, gpu, host_memory(), free)

    @classmethod
    def planned(cls, plan) -> "Hardware | None":
        """The machines `plan.*` describes (dry_run=true for other machines than this one), or None: this one."""
        if plan.gpus_per_node is None:
            return None
        host = None if plan.host_memory_gib is None else plan.host_memory_gib * GIB
        return cls(plan.nodes, plan.gpus_per_node, plan.gpu_memory_gib * GIB, host)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_nodes(self, nodes: int) -> "Hardware":
        return dataclasses.replace(self, nodes=nodes)

    def describe(self, host: bool = True) -> str:
        shown = host and self.host_bytes is not None
        memory = f", {self.host_bytes / GIB:.0f} GiB of host memory a node" if shown else ""
        if self.gpu_bytes is None:
            return f"{plural(self.nodes, 'machine')} x {plural(self.ranks_per_node, 'CPU process')}{memory}"
        gpus = f"{plural(self.ranks_per_node, 'GPU')} of {self.gpu_bytes / GIB:.0f} GiB"
        return f"{plural(self.nodes, 'node')} x {gpus}{memory}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def host_memory() -> float | None:
    """This machine's memory in bytes (Linux: MemTotal), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass
class MemoryPlan:
    """One rank's memory, in bytes, at each moment that can peak: its device's while training (the host's, on a CPU),
    and its host's beyond the framework while the weights are read and while a checkpoint is written; with
    fsdp_cpu_offload, the host also holds a GPU rank's training state (host_training)."""

    header: str
    training: dict[str, float]
    load: dict[str, float]
    save: dict[str, float]
    on_gpu: bool
    host_training: dict[str, float] = dataclasses.field(default_factory=dict)

    def device_peak(self) -> float:
        return sum(self.training.values())

    def host_peak(self) -> float:
        """A GPU rank's host holds what it reads or writes at the time, and its offloaded training state; a CPU
        rank's holds its training state too."""
        transient = max(sum(self.load.values()), sum(self.save.values()))
        resident = sum(self.host_training.values()) if self.on_gpu else self.device_peak()
        return resident + transient

    def fit_problem(self, hardware: Hardware) -> str | None:
        """Why this does not fit one of `hardware`'s ranks, or None: a lower bound (the framework is not counted)."""
        if self.on_gpu and self.device_peak() > hardware.gpu_bytes:
            return f"a GPU needs {self.device_peak() / GIB:.1f} GiB of its {hardware.gpu_bytes / GIB:.0f} GiB"
        node = self.host_peak() * hardware.ranks_per_node
        if hardware.host_bytes is not None and node > hardware.host_bytes:
            return (
                f"a node's {plural(hardware.ranks_per_node, 'rank')} need {node / GIB:.1f} GiB of its "
                f"{hardware.host_bytes / GIB:.0f} GiB of host memory"
            )
        return None

    def lines(self, hardware: Hardware) -> list[str]:
        """The plan as the dry run prints it: each moment's total and parts, per rank."""
        device = "GPU" if self.on_gpu else "host (the CPU's memory)"
        lines = [f"memory per rank on {hardware.describe()} ({self.header}):"]
        offloaded = [("host while training: the offloaded state", self.host_training)] if self.host_training else []
        for title, parts in (
            (f"{device} while training", self.training),
            *offloaded,
            ("host while reading the weights", self.load),
            ("host while saving a checkpoint", self.save),
        ):
            lines.append(f"  {title:44} {sum(parts.values()) / GIB:8.2f} GiB")
            lines += [f"    {name:42} {value / GIB:8.3f} GiB" for name, value in parts.items() if value]
        return lines


@dataclass(frozen=True)
class Workload:
    """What a run trains, as far as its memory goes: the config, the policy's shapes (build.meta_policy, or the empty
    model), its training examples and their schedule, its dtypes, and whether it keeps a live reference model."""

    config: DictConfig
    policy: torch.nn.Module
    train: Examples
    schedule: list[list[int]]
    precision: Precision
    live_reference: bool


def memory_plan(
    work: Workload, trainer: str, mesh: tuple[int, int, int], on_gpu: bool, offload: bool | None = None
) -> MemoryPlan:
    """One rank's memory on a (data-parallel, sequence-parallel, tensor-parallel) mesh, from the policy's shapes
    (meta_policy) and the run's largest micro-batch. Activations follow Korthikanti et al. 2022 ("Reducing Activation
    Recomputation in Large Transformer Models"): 34 x hidden bytes per token and layer in 16-bit compute, without the
    attention scores (scaled dot-product attention does not keep them); activation checkpointing keeps each layer's
    input and one layer's activations; sequence parallelism leaves a rank 1 / sp of each row's tokens. The weights
    are read sharded (weights.py) and written by every rank (checkpoint.py). Not counted: the framework itself (CUDA
    context, Python and torch: ~0.5-3 GiB). offload: FSDP's state on the host (offloaded); None: as the config says
    (fsdp_cpu_offload)."""
    training = device_memory(work, trainer, mesh, on_gpu)
    config, policy, precision = work.config, work.policy, work.precision
    dp, sp, tp = mesh
    fsdp = TRAINERS[trainer].fsdp
    offload = fsdp and (config.fsdp_cpu_offload if offload is None else offload)
    training, host_training = offloaded(training, work, mesh) if offload else (training, {})
    element = torch.finfo(precision.policy_weights).bits // 8
    largest = max(p.numel() for p in policy.parameters()) * element
    trainable = (
        sum(p.numel() for p in policy.parameters() if p.requires_grad) * element / (dp * sp * tp if fsdp else tp)
    )
    # DCP serialises each safetensors file of a rank in memory, after staging a GPU's tensors on the host (offloaded
    # ones are there already)
    rank_file = min(rank_file_bytes(trainable), trainable) * (2 if on_gpu and not offload else 1)
    load = {"a weight's shard, read at a time": largest / (dp * sp if fsdp else 1)}
    save = {"a checkpoint file, serialised": rank_file, "the export: one whole weight at a time": largest}
    if config.save_async:  # the copy a step-N checkpoint is written from while training goes on (checkpoint.py)
        saved = training["gradients"] if config.lora.enabled else training["policy weights"]  # LoRA: its adapters
        save["the copy written in the background (save_async)"] = saved + training[f"{config.optimizer} state"]
    n_parameters = sum(p.numel() for p in policy.parameters())
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    compute = precision.policy_compute or precision.policy_weights
    header = (
        f"{count(n_parameters)} parameters, {count(n_trainable)} trainable; {precision.policy_weights} "
        f"weights, {compute} compute; {trainer} dp {dp}{f' x sp {sp}' if sp > 1 else ''} x tp {tp}; "
        f"{config.layout} layout"
        + (", activation checkpointing" if config.activation_checkpointing else "")
        + (", CPU offload" if offload else "")
    )
    return MemoryPlan(header, training, load, save, on_gpu, host_training)


def offloaded(training: dict[str, float], work: Workload, mesh: tuple[int, int, int]) -> tuple[dict, dict]:
    """(the device's parts, the host's) of an offloaded FSDP rank's training memory (fsdp_cpu_offload): the shards of
    the weights, gradients and optimizer state are on the host, where the optimizer steps; the device keeps the
    gathered blocks, the activations, masks and logits, and the shards of the two blocks on their way between host
    and device (gathered from, reduced to). FSDP pins the weights' and gradients' shards, one allocation each, and
    torch's pinned-memory allocator rounds each up to a power of two bytes (to reuse its blocks)."""
    config, policy, precision = work.config, work.policy, work.precision
    optimizer = (f"{config.optimizer} state", "optimizer step intermediates")
    host_parts = ("policy weights", "gradients", *optimizer, "reference weights")
    device = {name: value for name, value in training.items() if name not in host_parts}
    dp, sp, tp = mesh
    shards = dp * sp  # FSDP shards over the dp x sp ranks
    element = torch.finfo(precision.policy_weights).bits // 8
    block = language_blocks(policy, config.model.block_name)[0]
    device["two blocks' shards, host <-> device"] = (
        2 * sum(p.numel() for p in block.parameters()) * element / shards / tp
    )
    parameters = list(policy.parameters())
    trainable = [p for p in parameters if p.requires_grad]
    reference_element = torch.finfo(precision.reference_weights).bits // 8
    reference = pinned_shards(parameters, shards, tp, reference_element) if work.live_reference else 0
    host = {
        "policy weights (pinned)": pinned_shards(parameters, shards, tp, element),
        "gradients (pinned)": pinned_shards(trainable, shards, tp, element),
        **{name: training[name] for name in optimizer},
        "reference weights (pinned)": reference,
    }
    return device, host


def pinned_shards(parameters: list, dp: int, tp: int, element: int) -> int:
    """Bytes of a rank's pinned shards of `parameters`: FSDP pads each tensor's first dimension to a multiple of dp
    (of the tensor-parallel shard, with tp), and the pinned allocator rounds each to the next power of two."""
    total = 0
    for parameter in parameters:
        rows = parameter.shape[0] if parameter.dim() else 1
        shard = math.ceil(math.ceil(rows / dp) * (parameter.numel() // max(rows, 1)) * element / tp)
        total += 1 << (shard - 1).bit_length() if shard else 0
    return total


def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def device_memory(work: Workload, trainer: str, mesh: tuple[int, int, int], on_gpu: bool) -> dict[str, float]:
    """{part: bytes} one rank's device holds while training."""
    config, policy, precision = work.config, work.policy, work.precision
    model_config = policy.config.get_text_config()  # a vision-language model's: its language model's
    weights_dtype = precision.policy_weights
    n_parameters = sum(p.numel() for p in policy.parameters())
    n_trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    blocks = language_blocks(policy, config.model.block_name)
    block, n_layers, hidden = blocks[0], len(blocks), model_config.hidden_size

    parallelism = TRAINERS[trainer]
    dp, sp, tp = mesh
    shards = dp * sp * tp if parallelism.fsdp else tp  # tensor parallelism splits the blocks only: an upper bound below
    element = torch.finfo(weights_dtype).bits // 8
    compute = precision.policy_compute or weights_dtype
    compute_bytes = torch.finfo(compute).bits // 8

    micro = max(1, config.batch_size // (config.gradient_accumulation_steps * dp))
    shapes = micro_batch_shapes(work, micro, sp)
    # each rank of an sp group holds its slice of the rows' tokens; the mask stays whole on every one
    rows = max(n_rows * length for n_rows, length in shapes) // sp
    # packed rows on a CPU take a dense [R, 1, T, T] mask: bool, and the additive one in the compute dtype, one per
    # layer type (full and sliding-window layers: Gemma 2 and 3, GPT-OSS); on CUDA the block mask holds a few integers
    # per 128 x 128 block instead
    dense_masks = config.layout == "packed" and (config.packed_attention == "dense" or not on_gpu)
    layer_types = len(set(getattr(model_config, "layer_types", None) or ["full_attention"]))
    mask = max(n_rows * length**2 for n_rows, length in shapes) * (1 + compute_bytes) * layer_types
    per_layer = (10 + 24 / tp) * hidden * compute_bytes / 2  # 34 at tp 1: tensor parallelism splits 24 of them
    activations = rows * (
        2 * hidden * compute_bytes * n_layers + per_layer if config.activation_checkpointing else per_layer * n_layers
    )
    vocab = model_config.vocab_size
    # + the float32 log-softmax; a reward model's head reads one position a sequence (no logits)
    reward = work.policy.get_output_embeddings() is None
    logits = 0 if config.scored_logits_only or reward else rows * vocab * (compute_bytes + 2 * 4)
    reference_bytes = torch.finfo(precision.reference_weights).bits // 8
    autocast_copies = not parallelism.fsdp and compute != weights_dtype
    states, fused = optimizer_states(config)
    fused = fused and (parallelism.fsdp or tp == 1)  # tensor parallelism alone mixes DTensors and plain tensors
    return {
        "policy weights": n_parameters * element / shards,
        "gradients": n_trainable * element / shards,
        f"{config.optimizer} state": states * n_trainable * element / shards,
        # torch's multi-tensor (foreach) step holds an intermediate per parameter, e.g. AdamW's denominators; the
        # fused one updates each element in place
        "optimizer step intermediates": 0 if fused else n_trainable * element / shards,
        "reference weights": n_parameters * reference_bytes / shards if work.live_reference else 0,
        "gathered block (FSDP)": 2 * sum(p.numel() for p in block.parameters()) * compute_bytes / tp
        if parallelism.fsdp
        else 0,
        # autocast keeps a compute-dtype copy of each weight it casts, for the whole forward and backward pass
        "autocast weight copies": n_parameters * compute_bytes / tp if autocast_copies else 0,
        f"activations ({rows} token positions{' a rank' if sp > 1 else ''})": activations,
        "vision tower and projector activations": vision_activations(work, micro, compute_bytes),
        "attention mask (packed, dense)": mask if dense_masks else 0,
        "full logits": logits,
    }


def micro_batch_shapes(work: Workload, micro: int, sp: int) -> list[tuple[int, int]]:
    """(rows, tokens a row) of every micro-batch of `micro` examples in the run's schedule (sp: rows padded to a
    multiple of the sequence-parallel size)."""
    layout, lengths = work.config.layout, work.train.lengths
    return [
        batch_shape(layout, lengths[indices[start : start + micro]], multiple=sp)
        for indices in work.schedule
        for start in range(0, len(indices), micro)
    ]


def vision_activations(work: Workload, micro: int, compute_bytes: int) -> float:
    """Bytes that a vision-language model's image encoder (tower) and projector keep for the backward pass, for the
    micro-batch (of `micro` examples) whose prompts hold the most image tokens; 0 for a text model or text data. The
    language model's activations count the image tokens among the prompts' token positions already.

    What is kept depends on what trains. A frozen tower (model.freeze_vision, the default: no parameter of it needs a
    gradient, nor do the pixels) keeps nothing: autograd records no graph where no input needs a gradient (measured:
    not one tensor saved). Its forward's working memory (a layer's activations; every layer's hidden states where the
    model reads an intermediate one) is freed before the language model runs, so it is not part of the training peak.
    A trained tower keeps, at each position it encodes (the patches of each image or tile:
    positions_per_image_token of them behind each image token) and in each layer up to the one whose output the model
    reads (tower_layers_kept), the inputs of its norms, attention and MLP as Korthikanti et al. 2022 count them
    without dropout masks: 8 x hidden + 2 x the MLP's width values (16 x hidden at a 4 x hidden MLP, their 34 bytes
    at 16 bits less 2 of masks), in the compute dtype; with activation checkpointing of its layers, each layer's input
    and one layer's activations. The projector, trained in both cases (Qwen-VL's merger is the tower's and is frozen
    with it), keeps the input of each of its linear layers at each image token: with a frozen tower, all that images
    add. Not counted (a lower bound): the pixels the patch embedding keeps, a class token per image, normalisation and
    softmax statistics, a gated MLP's third input, an activation function's input inside the projector. A padded
    layout's rows repeat a prompt's images for each response, and so encode them once per response (docs/vision.md).
    Against what a forward keeps, on tiny models in float32 on the CPU: 0.55 (trained) and 0.60 (frozen) for LLaVA
    (tests/test_report.py), 0.43 to 0.84 across the families of docs/vision.md."""
    policy, config, train = work.policy, work.config, work.train
    tower, projector = vision_tower(policy), vision_projector(policy)
    image_token = model_image_token(policy.config)
    if tower is None or image_token is None or not train.with_images:
        return 0.0
    counts = train.prompt_counts(image_token)
    if config.layout == "padded":
        counts = counts * (train.lengths.shape[1] - 1)
    image_tokens = max(
        int(counts[indices[start : start + micro]].sum())
        for indices in work.schedule
        for start in range(0, len(indices), micro)
    )
    vision = policy.config.vision_config
    trained = any(p.requires_grad for p in tower.parameters())
    kept = 0.0
    if trained:
        width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL's hidden_size is its merger's
        mlp = getattr(vision, "intermediate_size", None) or width * getattr(vision, "mlp_ratio", 4)
        per_layer = (8 * width + 2 * mlp) * compute_bytes
        layers = tower_layers_kept(policy.config)
        positions = image_tokens * positions_per_image_token(policy.config)
        inside = {id(module) for module in tower.modules()}
        blocks = find_blocks(policy, config.model.block_name)
        checkpointed = config.activation_checkpointing and any(id(block) in inside for block in blocks)
        kept += positions * (width * compute_bytes * layers + per_layer if checkpointed else per_layer * layers)
    if projector is not None and (trained or any(p.requires_grad for p in projector.parameters())):
        inputs = sum(m.in_features for m in projector.modules() if isinstance(m, torch.nn.Linear))
        kept += image_tokens * inputs * compute_bytes
    return kept


def tower_layers_kept(config) -> int:
    """The vision tower's layers whose activations a trained tower keeps: those up to the layer whose output the
    model reads (`vision_feature_layer`, an index into the embeddings' output and each layer's, as LLaVA's -2 reads
    the next-to-last layer's: the last layer's activations go with its unread output), else every layer."""
    vision = config.vision_config
    layers = getattr(vision, "num_hidden_layers", None) or vision.depth
    read = getattr(config, "vision_feature_layer", None)
    if read is None:
        return layers
    return max(index % (layers + 1) for index in (read if isinstance(read, (list, tuple)) else [read]))


def positions_per_image_token(config) -> int:
    """The tower's positions (patches) behind each image token of a prompt, by how the model joins them: Qwen-VL
    merges spatial_merge_size^2 patches into a token, Idefics3 (SmolVLM) shuffles scale_factor^2 of them into one,
    Gemma 3 pools an image's patches into mm_tokens_per_image tokens; LLaVA's families read one patch per token (an
    image split into tiles has each tile's patches among its tokens)."""
    vision = config.vision_config
    if getattr(vision, "spatial_merge_size", None):
        return vision.spatial_merge_size**2
    if getattr(config, "scale_factor", None):
        return config.scale_factor**2
    if getattr(config, "mm_tokens_per_image", None):
        return max(1, (vision.image_size // vision.patch_size) ** 2 // config.mm_tokens_per_image)
    return 1


def fit_verdict(work: Workload, hardware: Hardware, mesh: tuple[int, int, int]) -> tuple[MemoryPlan, str | None]:
    """(the run's memory plan on its mesh, why it does not fit `hardware` with the smallest mesh that would, or
    None). Checked before any weight is read; a lower bound, so a run it refuses could not have fitted."""

    def plan(trainer: str, candidate: tuple[int, int, int]) -> MemoryPlan:
        return memory_plan(work, trainer, candidate, on_gpu=hardware.gpu_bytes is not None)

    current = plan(work.config.trainer, mesh)
    problem = current.fit_problem(hardware)
    if problem is None:
        return current, None
    found = smallest_mesh(work.config, hardware, work.policy, plan) + offload_instead(work, hardware, mesh)
    return current, f"this run does not fit {hardware.describe()}: {problem} ({current.header}); {found}"


def offload_instead(work: Workload, hardware: Hardware, mesh: tuple[int, int, int]) -> str:
    """Where an FSDP run on GPUs does not fit but would with fsdp_cpu_offload=true, on the same GPUs and a host
    memory that is known: a clause that says so, with its memory; else ""."""
    config = work.config
    if config.fsdp_cpu_offload or config.lora.enabled or not TRAINERS[config.trainer].fsdp:
        return ""
    if hardware.gpu_bytes is None or hardware.host_bytes is None:
        return ""
    candidate = memory_plan(work, config.trainer, mesh, on_gpu=True, offload=True)
    if candidate.fit_problem(hardware) is not None:
        return ""
    node = candidate.host_peak() * hardware.ranks_per_node
    return (
        f"; or on these GPUs with fsdp_cpu_offload=true ({candidate.device_peak() / GIB:.1f} GiB a GPU, "
        f"{node / GIB:.1f} GiB of host memory a node)"
    )


MAX_NODES = 256


def smallest_mesh(config: DictConfig, hardware: Hardware, policy: torch.nn.Module, plan) -> str:
    """The fewest nodes of hardware's kind (then the smallest tensor-parallel size within a node, then the smallest
    sequence-parallel size in what is left of it) on which FSDPTrainer fits the run, by plan(trainer, (dp, sp, tp))."""
    per_node = hardware.ranks_per_node
    divisors = [size for size in range(1, per_node + 1) if per_node % size == 0]
    sizes = [1] if config.lora.enabled else divisors
    sizes = [tp for tp in sizes if tp == 1 or splits_heads(policy, tp)]
    heads = policy.config.get_text_config().num_attention_heads
    packed = config.layout == "packed"
    for nodes in range(1, MAX_NODES + 1):
        for tp, sp in [(tp, sp) for tp in sizes for sp in divisors if per_node % (tp * sp) == 0]:
            if sp > 1 and (not packed or heads % (sp * tp)):
                continue
            dp = nodes * per_node // (tp * sp)
            candidate = plan("FSDPTrainer", (dp, sp, tp))
            fitting = hardware.with_nodes(nodes)
            if candidate.fit_problem(fitting) is None:
                step = config.gradient_accumulation_steps * dp
                unit = "GPU" if candidate.on_gpu else "process"
                sequence = f" sequence_parallel_size={sp}" if sp > 1 else ""
                shape = f"dp {dp}{f' x sp {sp}' if sp > 1 else ''} x tp {tp}"
                return (
                    f"the smallest mesh that fits: {fitting.describe(host=False)}, trainer=FSDPTrainer "
                    f"tensor_parallel_size={tp}{sequence} ({shape}: {candidate.device_peak() / GIB:.1f} GiB a {unit}; "
                    f"batch_size a multiple of {step})"
                )
    return f"none of up to {hardware.with_nodes(MAX_NODES).describe(host=False)} fits it"


def splits_heads(policy: torch.nn.Module, tp: int) -> bool:
    """Whether tensor parallelism of size tp can place the policy (its plan, its heads)."""
    try:
        tensor_parallel_plan(policy, tp, tp, "FSDPTrainer")
    except UserError:
        return False
    return True


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


# micro_batch_memory=auto fills this share of the GPU's free memory: the plan is a lower bound (the allocator's
# fragmentation, kernels' workspaces and the attention's own buffers are not in it)
AUTO_MEMORY_SHARE = 0.8


def micro_batch_gib(setting: str | None) -> float | str | None:
    """micro_batch_memory as a number of GiB, "auto" or None; anything else is a one-line UserError."""
    if setting is None or setting == "auto":
        return setting
    try:
        gib = float(setting)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise UserError(f"micro_batch_memory={setting} must be auto, a positive number of GiB, or null")
    return gib


def micro_batch_budget(setting: str | None, hardware: Hardware) -> tuple[float, str, bool] | None:
    """(bytes one rank's training may fill, where that figure comes from, whether it is the user's own) by
    micro_batch_memory, or None: the micro-batches stay as gradient_accumulation_steps cuts them (null; auto on CPU
    ranks)."""
    gib = micro_batch_gib(setting)
    if gib is None or gib == "auto" and hardware.gpu_bytes is None:
        return None
    if gib != "auto":
        return gib * GIB, f"micro_batch_memory={setting}", True
    free = hardware.gpu_bytes if hardware.gpu_free_bytes is None else hardware.gpu_free_bytes
    share = f"{AUTO_MEMORY_SHARE:.0%} of {free / GIB:.1f} GiB free"
    return AUTO_MEMORY_SHARE * free, f"micro_batch_memory=auto: {share}", False


def choose_micro_batches(
    work: Workload, trainer: str, mesh: tuple[int, int, int], on_gpu: bool, budget: tuple[float, str, bool]
) -> tuple[int, str]:
    """(micro-batches a step, the line that says so): the fewest, at least gradient_accumulation_steps, that split
    each rank's share of batch_size and of eval_batch_size evenly and whose plan (memory_plan, at the schedule's
    largest micro-batch in token positions) fits the budget; batch_size stays as it is. Where none fits, a budget
    the user gave is a UserError naming micro_batch_memory; auto leaves the micro-batches as given, for the fit
    check (fit_verdict) to judge against the whole GPU and to name a mesh that fits."""
    config, (dp, sp, _) = work.config, mesh
    share, limit, given = config.batch_size // dp, budget[0], budget[2]
    counts = [
        k
        for k in range(config.gradient_accumulation_steps, share + 1)
        if share % k == 0 and config.eval_batch_size % (k * dp) == 0
    ]
    peaks = {}
    for k in counts:  # the fewest micro-batches first: the first that fits is the choice
        peaks[k] = memory_plan(with_accumulation(work, k), trainer, mesh, on_gpu).device_peak()
        if peaks[k] <= limit:
            break
    else:
        finest = counts[-1]
        short = (
            f"the smallest micro-batches (gradient_accumulation_steps={finest}, {plural(share // finest, 'example')} "
            f"a rank; eval_batch_size={config.eval_batch_size} splits into no more) need {peaks[finest] / GIB:.3g} "
            f"GiB of the {limit / GIB:.3g} GiB budget"
        )
        if given:
            raise UserError(f"{budget[1]}: {short}")
        k = config.gradient_accumulation_steps
        return k, f"micro-batches: {k} a step, as given (gradient_accumulation_steps={k}): {short} ({budget[1]})"
    micro = share // k
    positions = max(rows * length for rows, length in micro_batch_shapes(work, micro, sp)) // sp
    return k, (
        f"micro-batches: {k} a step of {plural(micro, 'example')} a rank (gradient_accumulation_steps={k}), "
        f"at most {positions:,} token positions each; {peaks[k] / GIB:.3g} GiB of the {limit / GIB:.3g} GiB "
        f"budget ({budget[1]})"
    )


def with_accumulation(work: Workload, accumulation: int) -> Workload:
    """`work` with its config's gradient_accumulation_steps set to `accumulation` (a copy: work.config is kept)."""
    config = copy.deepcopy(work.config)
    config.gradient_accumulation_steps = accumulation
    return dataclasses.replace(work, config=config)
