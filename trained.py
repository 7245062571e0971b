"""A trained model loaded from wherever it was saved, placed on a topology as training places it (sharded over
FSDP's ranks, each reading its shards): a run's checkpoint (`step-N`, its shards; `LATEST`, whose export is a
from_pretrained directory), a from_pretrained directory or Hub name, or a peft adapter directory (its base loaded,
the adapter merged in). evaluate.py loads its candidates, baseline and reference with it; export.py reads a LoRA
checkpoint's policy with checkpoint_policy."""

import json
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from configuration.sections import ModelConfig
from core.losses import LOSSES
from modeling import weights
from modeling.adapters import apply_lora, require_peft
from modeling.distributed import Topology
from modeling.model_dirs import is_reward_model_dir, resolve_model_dir
from modeling.models import load_model, prepare_model, random_init_dir, transformers_config
from modeling.placement import Placement, place
from modeling.precision import decide_precision, parse_dtype
from modeling.tokenizers import load_tokenizer
from persistence import checkpoint
from persistence.checkpoint_loading import is_legacy
from persistence.checkpoint_parts import ModelWeights
from reporting import sweep_report
from utils import UserError, first_line, get_local_dir

ADAPTER_CONFIG = "adapter_config.json"  # peft's
# what a run's reference is made of: the runs of a sweep's frontier must share it (seed: a random initialisation's)
REFERENCE_KEYS = ("model.name_or_path", "model.archive", "model.random_init")


def run_config(checkpoint_dir: Path) -> DictConfig:
    """The resolved config.yaml of the run the checkpoint belongs to (its parent directory)."""
    path = checkpoint_dir.parent / "config.yaml"
    if not path.exists():
        raise UserError(f"{path} does not exist: a checkpoint's shards are read with its run's config, beside it")
    return OmegaConf.load(path)


def checkpoint_policy(checkpoint_dir: Path, topology: Topology, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The policy of a run's checkpoint, its model built as the run built it (LoRA adapters included) in `dtype`
    (None: the run's policy_dtype) and sharded over this command's processes, each reading its shards."""
    config = run_config(checkpoint_dir)
    dtype = dtype or parse_dtype(config.model.policy_dtype, "model.policy_dtype")
    cache_dir = get_local_dir(config.local_dirs)
    reward = LOSSES[config.loss.name].objective == "reward"  # a reward model's base: a sequence classifier
    with topology.main_first():
        policy, initial = prepare_model(config.model, dtype, cache_dir, config.seed, reward=reward)
    if config.get("lora", {}).get("enabled", False):
        policy = apply_lora(policy, config.lora, config.seed)
    policy = place(policy, Placement.of_run(config), topology, None, initial)
    part = ModelWeights(policy)
    if is_legacy(checkpoint_dir):
        part.load_whole(weights.read_reference_format(checkpoint_dir / "policy.pt", "export")["state"], broadcast=False)
    else:
        part.load(checkpoint_dir / "policy")
    return policy


def model_settings(name_or_path: str, dtype: torch.dtype) -> ModelConfig:
    """The `model:` section (configuration.sections.ModelConfig) of a from_pretrained directory or Hub name, loaded
    in `dtype` as it is."""
    return ModelConfig(
        name_or_path=str(name_or_path), tokenizer_name_or_path=None, archive=None, block_name=None,
        policy_dtype=str(dtype).removeprefix("torch."), fsdp_policy_mp=None, reference_dtype=None,
        fsdp_reduce_dtype="float32", random_init=False, trust_remote_code=False, freeze_vision=True,
    )  # fmt: skip


def kind(spec: str) -> str:
    """ "checkpoint" (a run's step-N: shards and no export), "adapter" (peft's) or "model" (a from_pretrained
    directory, LATEST's export included, or a Hub name)."""
    path = Path(spec)
    if (path / checkpoint.MARKER).exists() and not weights.has_safetensors(path) or is_legacy(path):
        return "checkpoint"
    if (path / ADAPTER_CONFIG).exists():
        return "adapter"
    return "model"


def adapter_base(directory: Path) -> str:
    """The base model an adapter directory names (peft's base_model_name_or_path)."""
    try:
        base = json.loads((directory / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as error:
        raise UserError(f"{directory / ADAPTER_CONFIG} cannot be read ({error})") from None
    if not base:
        raise UserError(f"{directory / ADAPTER_CONFIG} names no base_model_name_or_path: its base is unknown")
    return base


def check_generates(spec: str, saved_as: str, cache_dir: Path) -> None:
    """A one-line error where `spec` is a reward model (a sequence classifier: a loss=reward run's), which scores
    text and generates none."""
    path = Path(spec)
    if saved_as == "checkpoint":
        reward = LOSSES[run_config(path).loss.name].objective == "reward"
    elif saved_as == "adapter":
        reward = json.loads((path / ADAPTER_CONFIG).read_text()).get("task_type") == "SEQ_CLS"
    else:
        reward = is_reward_model_dir(resolve_model_dir(spec, cache_dir))
    if reward:
        raise UserError(f"{spec} is a reward model, which generates nothing: a judge (judge={spec}), not a candidate")


def load_trained(spec: str, topology: Topology, dtype: torch.dtype, cache_dir: Path) -> torch.nn.Module:
    """The model `spec` names (see kind), in `dtype`, placed on the topology, in eval mode; a reward model is one
    line."""
    saved_as = kind(spec)
    check_generates(spec, saved_as, cache_dir)
    if saved_as == "checkpoint":
        model = checkpoint_policy(Path(spec), topology, dtype)
    elif saved_as == "adapter":  # the base whole on each process, the adapter merged in, then placed
        require_peft(f"{spec} is a peft adapter, loaded")
        from peft import PeftModel  # on use: peft costs ~5 s to import, and only adapters need it

        settings = model_settings(adapter_base(Path(spec)), dtype)
        try:
            base = load_model(settings, dtype, cache_dir, seed=0)
        except OSError as error:
            problem = first_line(error)
            raise UserError(f"{spec}: its base {settings.name_or_path} cannot be loaded ({problem})") from None
        merged = PeftModel.from_pretrained(base, spec).merge_and_unload()
        model = place(merged, Placement(), topology, None, None)
    else:
        settings = model_settings(spec, dtype)
        with topology.main_first():
            model, initial = prepare_model(settings, dtype, cache_dir, seed=0)
        model = place(model, Placement(), topology, None, initial)
    return model.eval()


def run_reference(run: DictConfig, cache_dir: Path) -> str:
    """Where the reference model of a run (its resolved config) loads from: its SFT archive, else its model; a random
    initialisation (model.random_init), which no directory holds, rebuilt as the run built it, from its model config,
    weights dtype and seed, and written once to cache_dir's models/ (call it under Topology.main_first)."""
    model = run.model
    if model.archive is not None:
        return str(model.archive)
    if not model.random_init:
        return str(model.name_or_path)
    dtype = decide_precision(model, autocast=False, auto_compute=lambda: None).reference_weights
    config = transformers_config(model, cache_dir)
    return str(random_init_dir(config, dtype, run.seed, cache_dir, model.trust_remote_code))


def trained_tokenizer(spec: str, cache_dir: Path):
    """The tokenizer (and processor) a model was trained with: a checkpoint's own copy, an adapter's base's, or the
    model directory's."""
    saved_as = kind(spec)
    if saved_as == "checkpoint" and not (Path(spec) / "tokenizer_config.json").exists():
        return load_tokenizer(run_config(Path(spec)).model, cache_dir)
    source = adapter_base(Path(spec)) if saved_as == "adapter" else spec
    return load_tokenizer(model_settings(source, torch.float32), cache_dir)


def reference_differs(settings: dict, other: dict) -> str | None:
    """The first setting (flat key) that makes two runs' references differ, or None: they share one."""
    keys = [*REFERENCE_KEYS, *(("seed",) if settings.get("model.random_init") else ())]
    return next((key for key in keys if other.get(key) != settings.get(key)), None)


def runs_reference(config: DictConfig) -> DictConfig | None:
    """With evaluate.py's reference=null, the config of the first candidate's run where every candidate is a
    checkpoint of a run (its config.yaml beside it) and all those runs were trained against one reference: the KL's
    reference is then theirs. None otherwise."""
    paths = [Path(spec) for spec in config.candidates]
    if config.reference is not None or not all((path.parent / "config.yaml").exists() for path in paths):
        return None
    runs = [run_config(path) for path in paths]
    flat = [sweep_report.flat(OmegaConf.to_container(run, resolve=True)) for run in runs]
    return runs[0] if all(reference_differs(flat[0], other) is None for other in flat) else None
