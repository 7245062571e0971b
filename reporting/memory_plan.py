"""The estimate of peak memory per rank that `dry_run=true` prints (build.dry_run) and the fit check reads
(fit_check.py): its device's while training (the host's, on a CPU), and its host's while the weights are read and
while a checkpoint is written, from the policy's shapes and the run's largest micro-batch, with what a vision-language
model's image encoder keeps."""

import dataclasses
import math
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf

from core.examples import Examples
from core.layouts import batch_shape
from core.optim import build_optimizer
from modeling.distributed import TRAINERS
from modeling.placement import find_blocks, language_blocks
from modeling.precision import Precision
from modeling.vision import model_image_token, vision_projector, vision_tower
from modeling.weights import rank_file_bytes
from reporting.hardware import GIB, Hardware, plural


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
    model), its training examples and their schedule, its dtypes, whether it keeps a live reference model, and the
    micro-batches a step (None: the config's gradient_accumulation_steps; micro_batch_memory may choose more)."""

    config: DictConfig
    policy: torch.nn.Module
    train: Examples
    schedule: list[list[int]]
    precision: Precision
    live_reference: bool
    accumulation: int | None = None

    @property
    def micro_batches(self) -> int:
        return self.accumulation or self.config.gradient_accumulation_steps


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

    micro = max(1, config.batch_size // (work.micro_batches * dp))
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
