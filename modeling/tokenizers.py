"""The run's tokenizer (load_tokenizer), and a vision-language model's processor with it (tokenizer.vision), found
where the model's config is (model_dirs.resolve_model_dir)."""

import os
from pathlib import Path

import transformers
from omegaconf import DictConfig

from modeling import weights
from modeling.model_dirs import resolve_model_dir
from modeling.vision import Vision
from utils import UserError

# the files one of which every tokenizer directory holds: a fast tokenizer's, a slow one's vocabulary or model
TOKENIZER_FILES = ("tokenizer*", "vocab.*", "merges.txt", "*.model", "*.tiktoken")


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
