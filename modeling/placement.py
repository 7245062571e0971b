"""Placing a model on the topology: parallelism as functions that take a model and the mesh and return it placed
(torchtitan's arrangement). The transformer blocks are the unit of everything here: tensor parallelism splits their
projections by the model's own plan, activation checkpointing recomputes them, FSDP shards them."""

import contextlib
import functools
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from modeling import weights
from modeling.distributed import Topology
from modeling.float8 import convert_float8
from modeling.models import InitialWeights
from modeling.precision import ComputeWeights, parse_dtype
from modeling.sequence_parallel import check_sequence_parallel
from modeling.vision import vision_tower
from utils import UserError, get_local_dir


def find_blocks(model: torch.nn.Module, block_name: str | None) -> list[torch.nn.Module]:
    """The model's transformer blocks: modules of class `block_name`, or, when it is null, of the classes the
    model declares in `_no_split_modules`. They are the unit of activation checkpointing and FSDP sharding."""
    known = list(getattr(model, "_no_split_modules", None) or [])
    names = [block_name] if block_name else known
    if not names:
        raise UserError(
            f"model.block_name is null and {type(model).__name__} declares no _no_split_modules: "
            "set model.block_name to its transformer block class"
        )
    blocks = [module for module in model.modules() if type(module).__name__ in names]
    if not blocks:
        raise UserError(
            f"model.block_name={block_name} matches no module of {type(model).__name__}"
            + (f"; its blocks: {', '.join(known)}" if known else "")
        )
    return blocks


def language_blocks(model: torch.nn.Module, block_name: str | None) -> list[torch.nn.Module]:
    """find_blocks' blocks but a vision-language model's vision tower's: the layers that every text token passes
    through, which the FLOP and memory counts scale with (the tower's see image patches)."""
    tower = vision_tower(model)
    inside = {id(module) for module in tower.modules()} if tower is not None else set()
    blocks = find_blocks(model, block_name)
    return [block for block in blocks if id(block) not in inside] or blocks  # or model.block_name names the tower's


def checkpoint_blocks(model: torch.nn.Module, block_name: str | None) -> None:
    """Recompute each block's activations in the backward pass (non-reentrant checkpointing). The block's forward
    is wrapped in place, so parameter names and state dicts are unchanged."""
    for block in find_blocks(model, block_name):
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False)


class CompiledGraphs:
    """torch.compile's backend for the blocks: inductor, each graph it compiles counted, timed and told in one line (a
    new input shape, grad mode or dtype compiles another; the blocks of one class share theirs; a graph over dynamic
    shapes takes their sizes as inputs, and says so). One for the process: the policy's and a live reference's
    blocks count together."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0

    def __call__(self, graph: torch.fx.GraphModule, inputs: list):
        from torch._inductor.compile_fx import compile_fx  # imported when a graph first compiles: slow to import

        self.count += 1
        start = time.perf_counter()
        compiled = compile_fx(graph, inputs)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        shapes = ", ".join("x".join(map(str, x.shape)) for x in inputs if isinstance(x, torch.Tensor) and x.dim() > 1)
        dynamic = "; dynamic shapes" if any(isinstance(x, (int, torch.SymInt)) for x in inputs) else ""
        print(f"compile_blocks: graph {self.count} compiled in {seconds:.1f} s (inputs {shapes or 'scalars'}{dynamic})")
        return compiled


COMPILED_GRAPHS = CompiledGraphs()
# graphs a block's code may compile: one per bucket (core/shapes.py) and grad mode (training, the no-grad passes);
# past dynamo's default of 8, the blocks would run eagerly
RECOMPILE_LIMIT = 64


def lever_on(setting, device_type: str) -> bool:
    """Whether a lever set to auto, true or false (a bool from an older run's config) is on here: auto on CUDA.
    compile_blocks: a GPU step's time is kernel launches and unfused elementwise kernels (torchtitan: +16% tokens/s
    on Llama-3.1-8B), and on a CPU it measured slower; shape_buckets (core/shapes.py): on a GPU a new shape costs
    host time and compiled graphs, on a CPU the padding's FLOPs cost more (docs/speed.md)."""
    setting = str(setting).lower()
    return device_type == "cuda" if setting == "auto" else setting == "true"


STEP_LEVERS = ("shape_buckets", "compile_blocks", "sync_free_steps")  # auto: on CUDA, off elsewhere (lever_on)


def levers_off_line(config, device_type: str) -> str | None:
    """The line for the step's levers that auto leaves off on this device (None: none is): a CPU's padding costs
    FLOPs and its compiled blocks measured slower (docs/speed.md); on CUDA each lever that is on says so itself."""
    if lever_on("auto", device_type):
        return None
    off = [key for key in STEP_LEVERS if str(config.get(key, "auto")).lower() == "auto"]
    if not off:
        return None
    return (
        f"{', '.join(off)}: off (auto turns them on with CUDA only; on a {device_type.upper()} they measured no "
        "faster: python -m bench --levers, docs/speed.md); =true turns one on"
    )


def compile_blocks(model: torch.nn.Module, block_name: str | None, static: bool = False, cache: str | None = None):
    """torch.compile each transformer block in place (nn.Module.compile: parameter names and state dicts unchanged),
    as torchtitan does: one region the size of a block, compiled once for all blocks of its class, FSDP's hooks left
    outside it; whole (fullgraph: a graph break fails at once instead of splitting the block). static (shape
    buckets: a few shapes, each repeated): one graph per bucket, no dynamic shapes; else torch.compile's default,
    static at first and dynamic after a change, packed rows rounded up to multiples of 128 tokens. cache: inductor's
    cache directory (inductor_cache), so that a second run starts warm."""
    if cache is not None:
        inductor_cache(cache)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
    for block in find_blocks(model, block_name):
        block.compile(backend=COMPILED_GRAPHS, fullgraph=True, dynamic=False if static else None)


def inductor_cache(directory: str) -> None:
    """Inductor's on-disk cache (compiled graphs, kernels, autotuning) in `directory`, one per CPU capability limit
    (a kernel cached under another ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA computes wrong values on the CPU),
    unless TORCHINDUCTOR_CACHE_DIR names another than inductor's default."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # on use: inductor is slow to import

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) != default_cache_dir():
        return
    limits = "-".join(os.environ.get(name, "none") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(directory, "inductor", limits)


TENSOR_PARALLEL_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def tensor_parallel_plan(
    model: torch.nn.Module, tp_size: int, world_size: int, trainer: str
) -> dict[str, ParallelStyle]:
    """A `parallelize_module` plan for the base model (a vision-language model's language model), from the
    column/row split that transformers declares for the architecture (`config.base_model_tp_plan`: Megatron-LM's split
    of attention and MLP projections, Shoeybi et al. 2019). Embeddings, norms and the LM head stay whole on every
    rank."""
    name = type(model).__name__
    config = model.config.get_text_config()  # a vision-language model's: its language model's
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        where = "its config" if config is model.config else "its language model's config (text_config)"
        raise UserError(
            f"{name} has no tensor-parallel plan ({where} has no base_model_tp_plan); use trainer=FSDPTrainer"
        )
    unsupported = sorted(set(plan.values()) - set(TENSOR_PARALLEL_STYLES))
    if unsupported:
        raise UserError(
            f"{name}'s tensor-parallel plan uses {', '.join(unsupported)}; TensorParallelTrainer implements "
            f"{', '.join(TENSOR_PARALLEL_STYLES)}; use trainer=FSDPTrainer"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if heads is not None and heads % tp_size:
            over = f"the world size {tp_size}" if tp_size == world_size else f"tensor_parallel_size={tp_size}"
            raise UserError(
                f"{trainer} splits attention heads over ranks, but {name} has {key}={heads}, not a multiple of {over}"
            )
    return {pattern: TENSOR_PARALLEL_STYLES[style]() for pattern, style in plan.items()}


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, trainer: str) -> nn.Module:
    """Split the base model's attention and MLP projections over the tp ranks (the model's own tp plan); a
    vision-language model's language model's, by its text config's plan, the vision tower and projector whole on
    every rank as the embeddings are. Each split weight goes to the device as its shard, never whole."""
    plan = tensor_parallel_plan(model, tp_mesh.size(), dist.get_world_size(), trainer)
    target = model.get_decoder() if weights.is_vision_language(model.config) else model.base_model
    parallelize_module(target, tp_mesh, plan)
    return model


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    block_name: str | None,
    compute_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    offload: bool = False,
):
    """Shard each transformer block (a vision-language model's vision tower's layers too: _no_split_modules names
    them), then the root, over dp_mesh (FSDP2's `fully_shard`; the dp ranks, or the dp x sp ranks:
    Topology.fsdp_mesh); a frozen tower's units hold no gradient, and the root mixes frozen and trained parameters,
    which FSDP2 reduces only where they train. Parameters are gathered in compute_dtype (None: the weights' dtype);
    gradients are reduce-scattered in reduce_dtype (None: the compute dtype) and accumulated into the sharded float32
    gradients; buffers, e.g. Llama's rotary frequencies, keep their dtype.

    offload (fsdp_cpu_offload): the sharded parameters, their gradients and so the optimizer's state live in pinned
    host memory (FSDP2's CPUOffloadPolicy): each unit's shards are copied to the GPU for its all-gather, its
    reduce-scattered gradients back to the host, and the optimizer steps there. Pinned, so that the copies overlap
    the computation; the parameters must be materialized on the host (weights.materialize, host_parameters)."""
    mixed_precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=reduce_dtype or compute_dtype)
    placement = dict(mesh=dp_mesh, mp_policy=mixed_precision)
    placement["offload_policy"] = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    if vision_tower(model) is not None:
        # LLaVA's forward returns its image features (image_hidden_states) as views of the projector's output, one
        # per image, and FSDP2 warns at each forward that an in-place op on a view of the root's output would skip
        # its hook: nothing reads that output, let alone changes it in place.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    if compute_dtype == torch.float16:
        shard_norms_in_float32(model, placement)
    for block in find_blocks(model, block_name):
        fully_shard(block, **placement)
    # The root (embeddings, final norm, head) reshards after each forward too, unlike FSDP2's default: evals,
    # sampling and the reference run forwards without a backward, which would leave it gathered.
    return fully_shard(model, **placement, reshard_after_forward=True)


def shard_norms_in_float32(model: nn.Module, placement: dict) -> None:
    """Under float16 compute, each normalisation layer an FSDP unit of its own, gathered and computed in float32 and
    handing float16 on: its statistics and scale keep float32's range and precision, as they do under autocast
    (the other trainers), which runs normalisation in float32. A few small all-gathers more per block."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, output_dtype=torch.float16)
    for module in list(model.modules()):
        if type(module).__name__.endswith("Norm") and any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, **{**placement, "mp_policy": policy})


@contextlib.contextmanager
def root_gathered(model: nn.Module):
    """The FSDP root's own parameters (embeddings, head, final norm; a vision-language model's projector and its
    tower's outer norms) gathered for the context, and sharded again after it; nothing for an unsharded model.
    transformers' generate runs some of them outside the model's forward, where FSDP's hooks, which gather them, do
    not fire: a vision-language model's image features before the first step, peft's input embeddings. The blocks
    still gather themselves in their own forwards, one at a time."""
    root = next((module for module in model.modules() if isinstance(module, FSDPModule)), None)
    if root is None:
        yield
        return
    # A root that has run no forward yet (a reference whose log-probs were cached) is set up as FSDP's root now:
    # a block called first, outside it (the tower's, for the image features), would take itself for the root.
    root._get_fsdp_state()._lazy_init()
    root.set_reshard_after_forward(False, recurse=False)
    root.unshard()
    try:
        yield
    finally:
        root.reshard()
        root.set_reshard_after_forward(True, recurse=False)  # as apply_fsdp placed it


def parallelize(
    model: nn.Module,
    topology: Topology,
    compute_dtype: torch.dtype | None,
    block_name: str | None,
    activation_checkpointing: bool,
    reduce_dtype: torch.dtype | None = None,
    offload: bool = False,
    compiled: bool = False,
    static_shapes: bool = False,
    inductor_dir: str | None = None,
) -> nn.Module:
    """The model placed on this topology: tensor parallel first (FSDP then shards the tp shards), activation
    checkpointing per block, torch.compile per block (compiled, static_shapes, inductor_dir: compile_blocks), then
    FSDP (offload: its shards kept on the host, apply_fsdp), or else moved whole to the device. A model still on the
    meta device (built empty, weights.py) is placed as it is: only then does each rank allocate its shards
    (weights.materialize).

    With gradient accumulation FSDP reduce-scatters after every micro-batch (FSDP2's default, kept): skipping the
    reduction until the last micro-batch would hold every block's whole unsharded gradient on every rank meanwhile
    (for a 7B model, 14 GB in bfloat16, 28 GB in float32), for one reduction's worth of communication saved."""
    if topology.sp_size > 1:
        check_sequence_parallel(model, topology.sp_size, topology.tp_size)
    if topology.tp_size > 1:
        apply_tensor_parallel(model, topology.mesh["tp"], topology.trainer)
    if activation_checkpointing:
        checkpoint_blocks(model, block_name)
    if compiled:
        compile_blocks(model, block_name, static_shapes, inductor_dir)
    if topology.fsdp:
        return apply_fsdp(model, topology.fsdp_mesh, block_name, compute_dtype, reduce_dtype, offload)
    return model if weights.is_empty(model) else model.to(topology.device)


@dataclass(frozen=True)
class Placement:
    """What placing a model reads of a run's settings (`place`): the blocks' class (model.block_name), the dtype
    FSDP reduces gradients in, and the levers on the policy (activation checkpointing, CPU offload, compiled blocks,
    compute-weight copies). A model placed to generate and score, not to train, takes the defaults."""

    block_name: str | None = None
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    compile_blocks: str = "false"  # auto, true or false (lever_on)
    shape_buckets: str = "false"  # the Scorer's buckets (core/shapes.py): compiled blocks then take static shapes
    local_dirs: tuple[str, ...] = ()  # the run's: its cache directory holds inductor's cache (compile_blocks)
    compute_weight_copies: bool = False
    fp8: str | None = None  # model.fp8: the policy's linear layers in float8 (modeling/float8.py)

    @classmethod
    def of_run(cls, config) -> "Placement":
        """A run's (its checked config, or the config.yaml of a run written by an older version, which may lack the
        later keys: their defaults then, as that version placed it)."""
        return cls(
            block_name=config.model.block_name,
            reduce_dtype=parse_dtype(config.model.fsdp_reduce_dtype, "model.fsdp_reduce_dtype"),
            activation_checkpointing=config.get("activation_checkpointing", False),
            cpu_offload=config.get("fsdp_cpu_offload", False),
            compile_blocks=config.get("compile_blocks", False),
            shape_buckets=config.get("shape_buckets", False),
            local_dirs=tuple(config.get("local_dirs", ())),
            compute_weight_copies=config.get("compute_weight_copies", False),
            fp8=config.model.get("fp8"),
        )


def place(
    model: nn.Module,
    placement: Placement,
    topology: Topology,
    compute: torch.dtype | None,
    initial: InitialWeights | None,
    is_policy: bool = False,
) -> nn.Module:
    """The model placed on the topology (parallelize); compute: the dtype it computes in (None: its weights'). An
    empty model (prepare_model) then gets memory for its shards (on the host with CPU offload), and each rank reads
    them from `initial`'s files. Activation checkpointing and compute-weight copies are the policy's (is_policy)."""
    checkpointing = is_policy and placement.activation_checkpointing
    kept = weights.real_tensors(model) if initial is not None else {}  # buffers, LoRA adapters: placed, then put back
    offload = placement.cpu_offload
    if is_policy and placement.fp8:  # before sharding: FSDP then gathers the float8 layers' weights as float8
        convert_float8(model, placement.fp8, topology.device, topology.fsdp)
    compiled, device = lever_on(placement.compile_blocks, topology.device.type), topology.device.type
    inductor_dir = str(get_local_dir(list(placement.local_dirs))) if compiled and placement.local_dirs else None
    model = parallelize(
        model, topology, compute, placement.block_name, checkpointing, placement.reduce_dtype, offload,
        compiled, lever_on(placement.shape_buckets, device), inductor_dir,
    )  # fmt: skip
    if initial is not None:
        with topology.main_first():
            directory = initial.fetch()
        weights.materialize(model, topology.device, kept, host_parameters=offload)
        initial.read_into(model, set(kept), directory)
    if placement.compute_weight_copies and compute is not None:
        layers = ComputeWeights(compute).apply(model)
        dtype = str(compute).removeprefix("torch.")
        print(f"compute_weight_copies: {layers} linear layers compute on {dtype} copies of their weights")
    elif placement.compute_weight_copies and is_policy:
        print("compute_weight_copies=true: the policy computes in its weights' dtype here: nothing to cast or copy")
    return model
