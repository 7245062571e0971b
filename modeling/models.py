"""Loading policy / reference models: from the Hub, a local directory (where model_dirs.py finds its files), a random
initialisation of a config (`model.random_init`), or a dry run's published shapes. A model is built on the meta device
and its weights are read once it is placed, each rank its own shards (weights.py), under their names in the files or
transformers' renaming rules; a model whose files cannot be read so is loaded whole (from_pretrained); model.archive's
weights go over them."""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig

from modeling import weights
from modeling.adapters import base_model_name
from modeling.model_dirs import (
    SMOLLM2_HUB_ID,
    cached_snapshot,
    hub_unreachable,
    resolve_model_dir,
    weights_dir,
    written_model,
)
from modeling.reward_head import init_reward_head, reward_head
from modeling.tokenizers import has_tokenizer
from utils import REPO_ROOT, UserError

SHAPES_DIR = REPO_ROOT / "assets" / "configs"  # large models' published config.json, for dry runs without their files


def published_shapes(name_or_path: str) -> Path | None:
    """assets/configs/NAME for a Hub id ORG/NAME whose published config.json the repository holds
    (huggyllama/llama-7b: assets/configs/llama-7b), else None."""
    shapes = SHAPES_DIR / name_or_path.rstrip("/").rsplit("/", 1)[-1].lower()
    return shapes if (shapes / "config.json").is_file() else None


def planned_model(model_config: DictConfig, cache_dir: Path) -> None:
    """For a dry run, which needs a model's shapes and a tokenizer to count the data's tokens, not its weights: a Hub
    model that is not downloaded is planned from its published shapes (assets/configs/), and a directory without a
    tokenizer counts tokens with the default model's, each said in a line; offline, a model with neither its files
    nor shapes here is one line naming where shapes are read from."""
    name = model_config.name_or_path
    if not os.path.isdir(name) and cached_snapshot(name, cache_dir) is None:
        shapes = published_shapes(name)
        if shapes is not None:
            print(f"dry run: {name} is not downloaded; its shapes from {shapes} (the published config.json)")
            model_config.name_or_path = str(shapes)
        elif (offline := hub_unreachable()) is not None:
            held = ", ".join(sorted(path.name for path in SHAPES_DIR.iterdir()))
            raise UserError(
                f"could not load model '{name}' ({offline}), and assets/configs/ holds no shapes for it (it holds "
                f"{held}): give model.name_or_path=assets/configs/NAME or a directory holding the model's config.json"
            )
    directory = Path(model_config.name_or_path)
    if model_config.tokenizer_name_or_path is None and directory.is_dir() and not has_tokenizer(directory):
        print(
            f"dry run: {directory} holds no tokenizer; the data's tokens are counted with {SMOLLM2_HUB_ID}'s "
            "(model.tokenizer_name_or_path=... counts them with another)"
        )
        model_config.tokenizer_name_or_path = SMOLLM2_HUB_ID


def disable_dropout(model: torch.nn.Module) -> None:
    """Zero nn.Dropout modules whose rate is hard-coded rather than read from the config."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


@dataclass
class InitialWeights:
    """Where an empty model's weights come from, read once it is placed, each rank its own shards (weights.py):
    safetensors files (a local model, a Hub model's, a random initialisation written once), or, for files that cannot
    be read so, the whole model as from_pretrained loads it, copied shard by shard; model.archive's weights over them.
    Nothing is fetched or read before read_into, so that a run's fit is checked first (build.check_fit)."""

    model_config: DictConfig
    dtype: torch.dtype
    cache_dir: Path
    seed: int
    sharded: bool  # False: from_pretrained, whole, on every process (the fallback)
    reward: bool = False  # a reward model (weights.model_class)
    conversions: tuple = ()  # transformers' renaming rules for the model's class (loading_conversions)

    @property
    def archive(self) -> Path | None:
        return None if self.model_config.archive is None else Path(self.model_config.archive)

    def fetch(self) -> Path | None:
        """The files' directory, made local: a random initialisation written, a Hub model's safetensors downloaded
        (by the first process of each machine: call it under Topology.main_first); None for from_pretrained's."""
        if not self.sharded:
            return None
        if self.model_config.random_init:
            config = transformers_config(self.model_config, self.cache_dir)  # a causal LM's files serve a reward model
            trust = self.model_config.trust_remote_code
            return random_init_dir(config, self.dtype, self.seed, self.cache_dir, trust)
        return weights_dir(self.model_config.name_or_path, self.cache_dir, download=True)

    def read_into(self, model: torch.nn.Module, kept: set[str], directory: Path | None) -> None:
        """Fill the placed, materialized model (weights.materialize) from `directory` (fetch()); `kept`: the tensors
        that held values before placement (buffers, LoRA adapters), which keep them unless the files have them."""
        if directory is not None:
            names, problems = stored_names(model, weights.stored_shapes(directory), kept, self.conversions)
            if problems:
                raise UserError(f"{directory} does not fit {weights.class_name(model)} ({problems[0]})")
            own = weights.tensors(model)
            weights.read_files(model, directory, {name: stored for name, stored in names.items() if name in own})
        else:
            c = self.model_config
            state = whole_model(c, model.config, self.dtype, self.cache_dir, None, self.reward, self.seed).state_dict()
            names, _ = stored_names(model, {name: value.shape for name, value in state.items()}, kept)
            own = weights.tensors(model)
            weights.assign_full(model, {name: state[stored] for name, stored in names.items() if name in own})
        if self.archive is not None:
            read_archive(model, self.archive, kept)


def read_archive(model: torch.nn.Module, archive: Path, kept: set[str]) -> None:
    """model.archive's weights into a materialized model: a checkpoint directory of a whole model (its policy/
    shards, read like any files), or a reference-format policy.pt, mapped, not read: each rank copies its own slices of
    each tensor."""
    setting = f"model.archive: {archive}"
    if archive.is_dir():
        source = archive / "policy"
        if not source.is_dir():
            raise UserError(f"{setting} is a directory but not a checkpoint (no policy/)")
        shapes = weights.stored_shapes(source)
    else:
        state = weights.read_reference_format(archive, "model.archive", mmap=True)["state"]
        shapes = {name: value.shape for name, value in state.items()}
    names, problems = stored_names(model, shapes, kept, whole_state=True)
    problems += [f"{name} is unexpected" for name in sorted(set(shapes) - set(names.values()))]
    if problems:
        raise UserError(f"{setting} does not fit this {weights.class_name(model)} ({problems[0]})")
    own = {name: stored for name, stored in names.items() if name in weights.tensors(model)}
    if archive.is_dir():
        weights.read_files(model, source, own)
    else:
        weights.assign_full(model, {name: state[stored] for name, stored in own.items()})
    print(f"loaded weights from {archive}")


def stored_names(
    model: torch.nn.Module,
    shapes: dict[str, torch.Size | None],
    kept: set[str],
    conversions: tuple = (),
    whole_state: bool = False,
) -> tuple[dict[str, str], list[str]]:
    """(persistent model tensor name -> its name in the files, what does not fit). A tensor is found under its own
    name, its name in the base model of a LoRA policy, or that without the base model's prefix (GPT-2's Hub files say
    h.0.attn, not transformer.h.0.attn), in the files as they are or as transformers renames them while loading
    (`conversions`: loading_conversions; a name it renames into the model's wins, as in from_pretrained). A parameter
    found nowhere does not fit, unless it is `kept` (it holds values: LoRA's adapters); a buffer found nowhere keeps
    its computed value, as in from_pretrained. A tied weight is found under either of its names. whole_state: the
    files are a whole state dict (model.archive), buffers included."""
    prefix = f"{getattr(model, 'base_model_prefix', '')}."
    own, parameters = weights.tensors(model), dict(model.named_parameters())
    stored = {**{name: name for name in shapes}, **renamed_by_transformers(shapes, conversions)}
    names, problems = {}, []
    for name, tensor in model.state_dict(keep_vars=True).items():
        base = base_model_name(name)
        found = next((stored[n] for n in (base, base.removeprefix(prefix)) if n in stored), None)
        if found is None:
            if name in own and name not in kept and (whole_state or name in parameters):
                problems.append(f"{base} is missing")
        elif shapes[found] is not None and tuple(shapes[found]) != tuple(tensor.shape):
            problems.append(f"{found} has shape {list(shapes[found])}, expected {list(tensor.shape)}")
        else:
            names[name] = found
    return names, problems


def loading_conversions(model: torch.nn.Module) -> tuple:
    """transformers' own rules for the names a checkpoint of the model's class may hold, as from_pretrained applies
    them (`conversion_mapping.get_model_conversion_mapping`: those of the class and of each sub-model, and the legacy
    ones): e.g. a llava-hf checkpoint's language_model.model.layers.0..., vision_tower.vision_model... and
    language_model.lm_head, which transformers 5's LlavaForConditionalGeneration names model.language_model.layers.0...,
    model.vision_tower... and lm_head (and which its save_pretrained writes back). Read from the model as built, before
    placement: FSDP2 renames a placed module's class, which the rules are looked up by."""
    # on use: transformers' renaming rules cost ~1.5 s to import, and only sharded loads read them
    from transformers.conversion_mapping import get_model_conversion_mapping

    return tuple(get_model_conversion_mapping(model))


def renamed_by_transformers(names, conversions: tuple) -> dict[str, str]:
    """{the name from_pretrained gives a tensor of the files: its name there}, for each name that `conversions`
    rename (transformers' rename_source_key: every renaming in turn, then at most one converter). A tensor that a
    converter takes (merged with others or split, as fused experts) is left out: it is no one tensor of the model,
    to be read in slices, and the model's tensor it makes stays missing (from_pretrained then loads the files)."""
    # on use: ~1.3 s to import, and only sharded loads need it
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    renamings = [rule for rule in conversions if isinstance(rule, WeightRenaming)]
    converters = [rule for rule in conversions if isinstance(rule, WeightConverter)]
    renamed = {}
    for name in names:
        target, converter = rename_source_key(name, renamings, converters)
        if converter is None and target != name:
            renamed[target] = name
    return renamed


def transformers_config(
    model_config: DictConfig, cache_dir: Path, reward: bool = False
) -> transformers.PretrainedConfig:
    """The model's transformers config, with every dropout rate set to 0: dropout would make the policy's and the
    reference's log-probs differ for the same weights; for a reward model, one output."""
    path = resolve_model_dir(model_config.name_or_path, cache_dir)
    common = {"cache_dir": str(cache_dir), "trust_remote_code": model_config.trust_remote_code}
    config = transformers.AutoConfig.from_pretrained(path, **common)
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    if reward:
        config.num_labels = 1
    return config


def prepare_model(
    model_config: DictConfig, dtype: torch.dtype, cache_dir: Path, seed: int, quantization=None, reward: bool = False
) -> tuple[torch.nn.Module, InitialWeights | None]:
    """The model on the meta device, holding no memory, and where its weights will come from once it is placed
    (InitialWeights); where the files cannot be read shard by shard (no safetensors; tensors named otherwise than the
    model's and than transformers' renaming rules name them, or merged or split while loading) one line says so, and
    every process will load the whole model. A 4-bit base (QLoRA's `quantization`, CUDA, one process) is loaded whole
    now, with None. reward: a reward model (weights.model_class), its head initialised from `seed` unless the files
    hold one."""
    if quantization is not None and (model_config.random_init or model_config.archive is not None):
        raise UserError(
            "lora.quantize loads pretrained weights in 4 bits: model.random_init and model.archive cannot be quantized"
        )
    config = transformers_config(model_config, cache_dir, reward)
    if quantization is not None:
        return whole_model(model_config, config, dtype, cache_dir, quantization, reward, seed), None
    model = weights.empty_model(config, dtype, model_config.trust_remote_code, reward)
    disable_dropout(model)
    if reward:
        init_reward_head(model, seed)
    archive = model_config.archive
    if archive is not None and not Path(archive).exists():
        raise UserError(f"model.archive: {archive} does not exist")
    sharded, conversions = True, loading_conversions(model)
    if not model_config.random_init:  # a random initialisation holds the model's own tensors
        directory = weights_dir(model_config.name_or_path, cache_dir, download=False)
        if (directory / "generation_config.json").exists():  # as from_pretrained: eos and pad tokens for sampling
            model.generation_config = transformers.GenerationConfig.from_pretrained(directory)
        shapes = listed_shapes(directory)
        kept = set(weights.real_tensors(model))  # the tensors the files need not hold (a new reward head)
        problems = ["no safetensors files"] if shapes is None else stored_names(model, shapes, kept, conversions)[1]
        if problems:
            print(
                f"{model_config.name_or_path}: {problems[0]} (its files, for {weights.class_name(model)}): every "
                "process loads the whole model with from_pretrained, which converts them, and keeps its shards"
            )
            sharded = False
    return model, InitialWeights(model_config, dtype, cache_dir, seed, sharded, reward, conversions)


def listed_shapes(directory: Path) -> dict[str, torch.Size | None] | None:
    """The tensors of a model's safetensors files by name, with their shapes where the files are here (a Hub model's
    index lists the names before its files are downloaded: shapes None), or None: no safetensors files."""
    if weights.has_safetensors(directory):
        return weights.stored_shapes(directory)
    index = directory / weights.INDEX
    if index.exists():
        return dict.fromkeys(json.loads(index.read_text())["weight_map"])
    return None


def load_model(
    model_config: DictConfig, dtype: torch.dtype, cache_dir: Path, seed: int, quantization=None, reward: bool = False
) -> torch.nn.Module:
    """The whole model, in this process (prepare_model, read on the CPU): for one process, and the tests."""
    model, initial = prepare_model(model_config, dtype, cache_dir, seed, quantization, reward)
    if initial is not None:
        kept = weights.real_tensors(model)
        weights.materialize(model, torch.device("cpu"), kept)
        initial.read_into(model, set(kept), initial.fetch())
    return model


def whole_model(
    model_config: DictConfig, config, dtype: torch.dtype, cache_dir: Path, quantization=None, reward=False, seed=0
):
    """The model as from_pretrained loads it, whole (quantization: on this process's GPU); a reward model whose
    files hold no head gets init_reward_head's, the same on every process."""
    path = resolve_model_dir(model_config.name_or_path, cache_dir)
    common = {"cache_dir": str(cache_dir), "trust_remote_code": model_config.trust_remote_code}
    device = {"device_map": {"": torch.cuda.current_device()}} if quantization is not None else {}
    if os.path.isdir(path) and not any(Path(path).glob("*.safetensors")) and not any(Path(path).glob("*.bin")):
        raise UserError(
            f"model.name_or_path={model_config.name_or_path} holds no weights (no *.safetensors or *.bin file); a "
            "config alone is what a random initialisation starts from: model.random_init=true builds its weights "
            "from the run's seed (evaluate.py's reference=null rebuilds its runs' own)"
        )
    model, loading = weights.model_class(reward, config).from_pretrained(
        path, config=config, dtype=dtype, quantization_config=quantization, output_loading_info=True, **device, **common
    )
    if reward and any(name.split(".")[0] == "score" for name in loading["missing_keys"]):
        init_reward_head(model, seed)
        reward_head(model).to(next(model.parameters()).device)
    disable_dropout(model)
    return model


def random_init_dir(config, dtype: torch.dtype, seed: int, cache_dir: Path, trust_remote_code: bool) -> Path:
    """A random initialisation of `config` from `seed` in `dtype` (the same weights for every trainer and rank
    count), written once to <cache_dir>/models/ as safetensors and read from there like any model. The model is built
    whole once, by one process of each machine: a random initialisation is for tests and benchmarks."""
    key = f"{config.to_json_string()}|{dtype}|{seed}|{torch.__version__}|{transformers.__version__}"
    target = cache_dir / "models" / f"random-init-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if not (target / "config.json").exists():
        torch.manual_seed(seed)
        model = weights.model_class(False, config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
        transformers.utils.logging.disable_progress_bar()  # stderr is for errors: one line each
        try:
            with written_model(target) as tmp:
                model.save_pretrained(tmp)
        finally:
            transformers.utils.logging.enable_progress_bar()
    return target
