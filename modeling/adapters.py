"""LoRA adapters (Hu et al. 2021, arXiv:2106.09685) through peft: the policy is the base model plus adapters, and
the reference is the same base with the adapters disabled, so no second model is held.

Adapters start at zero (peft initialises B = 0), so at step one policy and reference are the same function and
adapter dropout cannot make them differ: the DPO loss starts at ln 2. Checkpoints hold only the trainable
(adapter) weights; the final export holds the adapter in peft's format and the merged model."""

import copy
import importlib.util
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
from omegaconf import MISSING
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from modeling import weights
from utils import POSITIVE, Range, UserError, check_ranges, ranged

QUANTIZATIONS = ("4bit",)
REFERENCE_ADAPTER = "reference"  # TR-DPO's moving reference under LoRA (ReferenceAdapter)


@dataclass
class LoraSettings:
    enabled: bool = MISSING
    rank: int = ranged(POSITIVE)
    alpha: float = ranged(POSITIVE)
    dropout: float = ranged(Range(0, 1, high_open=True))
    target_modules: Optional[list[str]] = MISSING  # null: every linear layer but the LM head
    quantize: Optional[str] = MISSING

    def __post_init__(self):
        check_ranges(self, "lora.")
        if self.enabled:
            require_peft("lora.enabled=true trains LoRA adapters")
        if self.quantize is not None and self.quantize not in QUANTIZATIONS:
            raise UserError(f"lora.quantize={self.quantize} is not a quantization; expected null or 4bit")
        if self.quantize and not self.enabled:
            raise UserError(f"lora.quantize={self.quantize} quantizes the base of LoRA adapters: set lora.enabled=true")
        if self.quantize and not torch.cuda.is_available():
            raise UserError(f"lora.quantize={self.quantize} (QLoRA) needs a CUDA GPU and bitsandbytes")


def require_peft(what: str) -> None:
    """One line where peft, an optional dependency (docs/configuration.md#optional-packages), is not installed."""
    if importlib.util.find_spec("peft") is None:
        raise UserError(f"{what} through peft, which is not installed: pip install 'peft>=0.17'")


def quantization_config(settings: LoraSettings):
    """transformers' BitsAndBytesConfig for QLoRA's 4-bit NF4 base (Dettmers et al. 2023), or None."""
    if not settings.quantize:
        return None
    try:
        # optional: CUDA machines only (lora.quantize=4bit)
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise UserError("lora.quantize=4bit needs bitsandbytes: pip install bitsandbytes") from None
    # on use, with bitsandbytes
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.bfloat16,
        bnb_4bit_use_double_quant=True,
    )


def apply_lora(model: nn.Module, settings: LoraSettings, seed: int = 0) -> nn.Module:
    """The model with LoRA adapters on target_modules (default_targets: all linear layers but the head; a
    vision-language model's language model's), initialised from `seed` (init_adapters); only the adapters train, and
    a reward model's scalar head, whole (peft's trainable copy of it: modules_to_save)."""
    # on use: peft costs ~5 s to import, and only LoRA runs need it
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if settings.quantize:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    targets = list(settings.target_modules) if settings.target_modules is not None else default_targets(model)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        task_type="SEQ_CLS" if weights.is_reward_model(model) else "CAUSAL_LM",
    )
    try:
        model = get_peft_model(model, config)
    except ValueError as error:  # e.g. a target module the model does not have
        raise UserError(f"lora.target_modules={settings.target_modules}: {str(error).splitlines()[0]}") from None
    init_adapters(model, seed)
    return model


def default_targets(model: nn.Module) -> str:
    """The modules LoRA adapts where lora.target_modules is null: peft's "all-linear" (every linear layer but the
    head); a vision-language model's language model's linear layers only, as a pattern peft matches against the full
    module names. Its vision tower and projector are left as loaded: `all-linear` would adapt the tower too, which
    model.freeze_vision keeps frozen in full fine-tuning; lora.target_modules may still name their modules."""
    if not weights.is_vision_language(model.config):
        return "all-linear"
    decoder = model.get_decoder()
    prefix = next(name for name, module in model.named_modules() if module is decoder)
    linear = {name.rsplit(".", 1)[-1] for name, module in decoder.named_modules() if isinstance(module, nn.Linear)}
    return rf"{re.escape(prefix)}\..*\.({'|'.join(sorted(linear))})"


def init_adapters(model: nn.Module, seed: int) -> None:
    """(Re)initialise every adapter by peft's own rule (A as nn.Linear's default, B zero) from `seed`, in module order,
    so that every trainer and rank count starts from the same adapters. Over a base on the meta device (built empty,
    weights.py), peft has left the adapters there too: they get memory on the CPU first, and placement shards them."""
    from peft.tuners.lora import LoraLayer  # on use: peft costs ~5 s to import, and only LoRA runs need it

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for layer in model.modules():
            if not isinstance(layer, LoraLayer):
                continue
            for name in layer.adapter_layer_names:
                adapters = getattr(layer, name)
                if any(p.is_meta for p in adapters.parameters()):
                    adapters.to_empty(device="cpu")
            for adapter in layer.lora_A.keys() | layer.lora_embedding_A.keys():
                layer.reset_lora_parameters(adapter, True)


def is_adapted(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def is_quantized(model: nn.Module) -> bool:
    """Whether the model holds bitsandbytes 4-bit weights (QLoRA's base)."""
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def logical_numel(parameter: torch.Tensor) -> int:
    """Elements of the weight a parameter stands for: a 4-bit bitsandbytes weight packs two into each byte."""
    quant_state = getattr(parameter, "quant_state", None)
    return quant_state.shape.numel() if quant_state is not None else parameter.numel()


class AdaptersDisabled(nn.Module):
    """The base model of a LoRA policy: the policy run with its adapters disabled (no copy of any weight)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def computing(self):
        """The context in which the policy computes as this model."""
        return self.policy.disable_adapter()

    def forward(self, *args, **kwargs):
        with self.computing():
            return self.policy(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self.computing():
            return self.policy.generate(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Module:
        return self.policy.get_output_embeddings()

    @property
    def config(self):
        return self.policy.config


class ReferenceAdapter(AdaptersDisabled):
    """A LoRA policy's moving reference (TR-DPO, reference_sync.py): the base with the `reference` adapter set
    (add_reference_adapter) in place of the policy's own, in the same modules: no second base is held."""

    @contextmanager
    def computing(self):
        # Each LoRA layer computes with its active adapter. peft's set_adapter would also mark the adapter it activates
        # trainable and the others frozen, which would toggle requires_grad on FSDP's sharded parameters mid-step:
        # only the active name is switched here, and switched back.
        from peft.tuners.lora import LoraLayer  # on use: peft costs ~5 s to import, and only LoRA runs need it

        layers = [module for module in self.policy.modules() if isinstance(module, LoraLayer)]
        active = [layer._active_adapter for layer in layers]
        for layer in layers:
            layer._active_adapter = [REFERENCE_ADAPTER]
        try:
            yield
        finally:
            for layer, name in zip(layers, active):
                layer._active_adapter = name


def add_reference_adapter(policy: nn.Module) -> None:
    """A second adapter set, `reference`, on every adapted layer: a frozen copy of the policy's adapters as
    init_adapters made them (B zero), so that the reference starts as the initial policy, which is the base; without
    dropout, so that it scores without randomness. reference_sync.py moves it towards the policy's adapters."""
    settings = copy.copy(policy.peft_config["default"])
    settings.lora_dropout = 0.0
    policy.add_adapter(REFERENCE_ADAPTER, settings)
    for layer in policy.modules():
        for attribute in getattr(layer, "adapter_layer_names", ()):
            adapters = getattr(layer, attribute)
            if REFERENCE_ADAPTER not in adapters:
                continue
            own = adapters["default"]  # on the CPU, initialised, also over a base on the meta device
            if isinstance(own, nn.Parameter):  # an embedding's adapters are parameters of a ParameterDict
                adapters[REFERENCE_ADAPTER] = nn.Parameter(own.detach().clone(), requires_grad=False)
            else:
                adapters[REFERENCE_ADAPTER] = copy.deepcopy(own).requires_grad_(False)


def reference_adapter_pairs(policy: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{name: (the reference adapter's tensor of that name, the policy adapter's counterpart)}, by the names
    peft gives them in the policy (`...lora_A.reference.weight` and `...lora_A.default.weight`)."""
    parameters = dict(policy.named_parameters())
    marker = re.compile(rf"(\.lora_\w+)\.{REFERENCE_ADAPTER}(\.|$)")
    return {
        name: (parameter, parameters[marker.sub(r"\1.default\2", name)])
        for name, parameter in parameters.items()
        if marker.search(name)
    }


@torch.no_grad()
def merged_weights(policy: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's weights with each adapter merged in, W + (alpha / r) B A, under the base model's own names:
    what `AutoModelForCausalLM.from_pretrained` loads. Sharded like the policy: each rank computes its own shard of each
    merged weight, from the adapters gathered whole (they are small). Collective."""
    settings = policy.peft_config["default"]
    scaling = settings.lora_alpha / settings.r
    own = weights.tensors(policy)  # a tied weight under one of its names
    merged = {}
    for name, value in policy.state_dict().items():
        if ".lora_" in name or ".original_module." in name or name not in own:  # the head: its trained copy
            continue
        if ".base_layer.weight" in name:
            stem = name.removesuffix(".base_layer.weight")
            a, b = (whole(own[f"{stem}.lora_{x}.default.weight"]).float() for x in "AB")
            value = added(value, scaling * (b @ a))
        merged[base_model_name(name)] = value
    return merged


def base_model_name(name: str) -> str:
    """A LoRA policy's tensor name in its base model: peft wraps each adapted layer's weight in base_layer, and a
    reward model's head in a frozen original_module and a trainable copy under modules_to_save."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
    return name.replace(".modules_to_save.default.", ".")


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every rank (collective), or the tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def added(value: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """value + delta in value's dtype, delta whole on every rank: a sharded value adds its own shard of delta."""
    if not isinstance(value, DTensor):
        return (value.float() + delta.to(value.device)).to(value.dtype)
    local_delta = distribute_tensor(delta.to(value.device), value.device_mesh, value.placements, src_data_rank=None)
    local = (value.to_local().float() + local_delta.to_local()).to(value.dtype)
    return DTensor.from_local(local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride())
