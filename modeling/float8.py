"""FP8 matmuls for the policy (model.fp8=tensorwise|rowwise): its linear layers swapped for torchao's Float8Linear
(Micikevicius et al. 2022, "FP8 Formats for Deep Learning"), which keeps the float32 (or bfloat16) weight as the
parameter and casts the layer's input, weight and output gradient to float8 with a dynamic scale on each matmul:
e4m3 forward, e5m2 for the gradients. `tensorwise` takes one scale per tensor (the fastest on H100/H200), `rowwise`
one per row (finer, for activations with outliers). Hopper and newer (compute capability 8.9 on) run float8 tensor
cores at about twice bfloat16's dense rate; a CPU emulates them (torchao's emulate=True: the same casts and scales,
the matmul in float32), which is how the tests check the path and is no faster than bfloat16.

Not converted: the LM head (its logits feed the float32 log-softmax of every scored token, and a vocabulary-sized
matmul is where FP8's rounding costs the most), a mixture of experts' router (its few logits choose experts), and
layers whose sizes float8 kernels refuse (both dimensions multiples of 16). The reference is never converted: it
only scores, and a cached reference is the initial policy's own log-probs, converted like the policy (ln 2 at step
one). The parameters stay plain tensors: checkpoints, resume and exports hold the high-precision weights, and an
export loads with from_pretrained without torchao. Under FSDP on CUDA the weights are all-gathered in float8 (half
bfloat16's bytes); on a CPU (gloo) in their own dtype."""

import dataclasses

import torch
from torch import nn

from utils import UserError

RECIPES = ("tensorwise", "rowwise")
FP8_CAPABILITY = (8, 9)  # Ada and Hopper on: float8 tensor cores
KERNEL_MULTIPLE = 16  # float8 matmuls need both dimensions of a weight to be multiples of this
ROUTER_NAMES = ("router", "gate")  # a mixture of experts' router: mlp.gate (Qwen-MoE), block_sparse_moe.gate, .router


def float8_problem(recipe: str | None, tensor_parallel: bool, lora: bool, quantized: bool) -> str | None:
    """Why model.fp8=`recipe` cannot run with these settings (one line naming the key), or None. Checked with the
    config, before any model loads; the device is checked when the policy is placed (convert_float8)."""
    if recipe is None:
        return None
    if recipe not in RECIPES:
        return f"model.fp8={recipe} is not a float8 recipe; expected {', '.join(RECIPES)} or null"
    try:
        import torchao.float8  # noqa: F401  # optional: model.fp8 only
    except ImportError:
        return f"model.fp8={recipe} needs torchao: pip install torchao (docs/configuration.md#optional-packages)"
    if lora or quantized:
        what = "lora.quantize=4bit" if quantized else "lora.enabled=true"
        return f"model.fp8={recipe} with {what}: float8 converts full linear layers, not adapters; choose one"
    if tensor_parallel:
        return (
            f"model.fp8={recipe} with tensor parallelism: torchao's float8 layers need their own tensor-parallel plan "
            "(Float8ColwiseParallel), which this trainer's is not; use FSDPTrainer without tensor_parallel_size"
        )
    return None


def converts(module: nn.Module, name: str, head: nn.Module | None) -> bool:
    """Whether the policy's linear layer `name` is converted: not the LM head, not a router, sizes float8 takes."""
    if module is head or not isinstance(module, nn.Linear):
        return False
    if name.rsplit(".", 1)[-1] in ROUTER_NAMES:
        return False
    return module.in_features % KERNEL_MULTIPLE == 0 and module.out_features % KERNEL_MULTIPLE == 0


def convert_float8(model: nn.Module, recipe: str, device: torch.device, fsdp: bool) -> None:
    """The policy's eligible linear layers converted to torchao's Float8Linear in place, before it is sharded (FSDP
    then all-gathers their weights in float8 on CUDA); emulated on a CPU. One line says how many and how. A CUDA device
    below compute capability 8.9 has no float8 tensor cores: one line, and nothing converted."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise UserError(
            f"model.fp8={recipe}: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) has no "
            "float8 tensor cores (8.9 on: L4, L40, H100, H200, B200); use model.fsdp_policy_mp=bfloat16 or float16"
        )
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # optional: model.fp8 only

    emulate = device.type != "cuda"
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe), emulate=emulate, enable_fsdp_float8_all_gather=fsdp and not emulate
    )
    head = model.get_output_embeddings()
    chosen = {name for name, module in model.named_modules() if converts(module, name, head)}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, name: name in chosen)
    linears = sum(isinstance(module, nn.Linear) for module in model.modules())
    how = "emulated on the CPU (correctness, not speed)" if emulate else "float8 tensor cores"
    print(f"model.fp8={recipe}: {len(chosen)} of {linears} linear layers compute in float8 ({how}); the LM head "
          "and routers keep the compute dtype")  # fmt: skip
