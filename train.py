"""Entry point: python train.py [key=value ...] (Hydra; see config/config.yaml)."""
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import difflib
import netrc
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import trainers
from models import load_model, load_tokenizer, parse_dtype
from preference_datasets import get_dataset
from utils import REPO_ROOT, UserError, get_local_dir, get_local_run_dir, set_seed

CONFIG_DIR = REPO_ROOT / "config"
TRAINERS = {"BasicTrainer": trainers.BasicTrainer}
NOT_YET_AVAILABLE_TRAINERS = ("FSDPTrainer", "TensorParallelTrainer")

OmegaConf.register_new_resolver("repo_path", lambda path: str(REPO_ROOT / path))


def check_overrides(args: list[str]) -> None:
    """Reject unknown keys and group options with one line listing the valid ones (Hydra's own messages span
    several lines and do not list them). '+key=value' adds a key and is left to Hydra."""
    base = OmegaConf.load(CONFIG_DIR / "config.yaml")
    groups = {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONFIG_DIR.iterdir() if d.is_dir()}
    selected = {next(iter(entry)): entry[next(iter(entry))] for entry in base.defaults if isinstance(entry, DictConfig)}
    overrides = [arg.split("=", 1) for arg in args if "=" in arg and not arg.startswith(("-", "+", "~", "hydra"))]
    for key, value in overrides:
        if key in groups:
            if value not in groups[key]:
                raise UserError(f"unknown {key} '{value}'; valid: {', '.join(groups[key])}")
            selected[key] = value
    for key, _ in overrides:
        if key in groups:
            continue
        group, _, subkey = key.partition(".")
        if group in groups:
            node, path, where = OmegaConf.load(CONFIG_DIR / group / f"{selected[group]}.yaml"), subkey, f"{group}={selected[group]}"
        else:
            node, path, where = base, key, "the config"
        if OmegaConf.select(node, path, default=KeyError) is KeyError:
            parent_path, _, leaf = path.rpartition(".")
            parent = OmegaConf.select(node, parent_path) if parent_path else node
            valid = [k for k in parent if k not in ("defaults", "hydra")] if isinstance(parent, DictConfig) else []
            hint = difflib.get_close_matches(leaf, valid, n=1)
            raise UserError(
                f"unknown key '{key}' in {where}" + (f" (did you mean '{hint[0]}'?)" if hint else "")
                + (f"; valid: {', '.join(valid)}" if valid else "; add a new key with +" + key + "=VALUE")
            )


def validate(config: DictConfig, world_size: int) -> None:
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set on the command line (e.g. model.name_or_path=ORG/NAME)")
    if config.trainer in NOT_YET_AVAILABLE_TRAINERS:
        raise UserError(f"trainer={config.trainer} is not available yet; available: {', '.join(TRAINERS)}")
    if config.trainer not in TRAINERS:
        raise UserError(f"unknown trainer '{config.trainer}'; valid: {', '.join(TRAINERS)}")
    per_step = config.gradient_accumulation_steps * world_size
    for key in ("batch_size", "eval_batch_size"):
        if config[key] <= 0 or config[key] % per_step:
            raise UserError(f"{key}={config[key]} must be a positive multiple of gradient_accumulation_steps x world size = {per_step}")
    if config.eval_every <= 0 or config.eval_every % config.batch_size:
        raise UserError(f"eval_every={config.eval_every} must be a positive multiple of batch_size={config.batch_size}")
    if config.n_eval_examples is not None and config.n_eval_examples <= 0:
        raise UserError(f"n_eval_examples={config.n_eval_examples} must be positive, or null for a whole test split")
    if config.n_epochs is None and config.n_examples is None:
        raise UserError("set n_epochs or n_examples: training stops at whichever comes first")
    if not 0 < config.max_prompt_length < config.max_length:
        raise UserError(f"max_prompt_length={config.max_prompt_length} must be positive and below max_length={config.max_length}")
    if config.loss.name != "sft" and config.loss.beta <= 0:
        raise UserError(f"loss.beta={config.loss.beta} must be positive")
    if not 0 <= config.loss.get("label_smoothing", 0.0) <= 0.5:
        raise UserError(f"loss.label_smoothing={config.loss.label_smoothing} must be in [0, 0.5]")
    for key in ("policy_dtype", "reference_dtype", "fsdp_policy_mp"):
        parse_dtype(config.model[key], f"model.{key}")
    trainers.optimizer_class(config.optimizer, OmegaConf.to_container(config.optimizer_kwargs))


def prepare_run_dir(config: DictConfig) -> Path:
    run_dir = Path(config.local_run_dir) if config.local_run_dir else get_local_run_dir(config.exp_name, config.local_dirs)
    if (run_dir / "metrics.jsonl").exists() and config.resume_from is None:
        raise UserError(f"{run_dir} already holds a run; choose another local_run_dir or continue it with resume_from={run_dir}/LATEST")
    run_dir.mkdir(parents=True, exist_ok=True)
    config.local_run_dir = str(run_dir)
    OmegaConf.save(config, run_dir / "config.yaml", resolve=True)
    return run_dir


def init_wandb(config: DictConfig, run_dir: Path):
    """A wandb run: online with a login, else offline (one line says so); never a prompt, never a crash."""
    import wandb

    mode = os.environ.get("WANDB_MODE") or None
    if mode is None and not has_wandb_login():
        mode = "offline"
        print(f"wandb: no login found, logging offline to {run_dir}/wandb (upload later with `wandb sync`)")
    kwargs = dict(entity=config.wandb.entity, project=config.wandb.project, name=config.exp_name, dir=str(run_dir),
                  config=OmegaConf.to_container(config, resolve=True), settings=wandb.Settings(init_timeout=30, console="off"))
    try:
        return wandb.init(mode=mode or "online", **kwargs)
    except Exception as error:  # no network, server down, bad key: log offline rather than lose the run
        print(f"wandb: could not start online ({type(error).__name__}), logging offline to {run_dir}/wandb")
        return wandb.init(mode="offline", **kwargs)


def has_wandb_login() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def run(config: DictConfig) -> None:
    validate(config, world_size=1)
    set_seed(config.seed)
    run_dir = prepare_run_dir(config)
    print(f"run directory: {run_dir}")
    cache_dir = get_local_dir(config.local_dirs)

    tokenizer = load_tokenizer(config.model, cache_dir)
    data = {"train": [], "test": []}
    for name in config.datasets:
        for split, pairs in get_dataset(name, tokenizer, config.seed, config.n_eval_examples, cache_dir).items():
            data[split].extend(pairs)

    policy = load_model(config.model, parse_dtype(config.model.policy_dtype, "model.policy_dtype"), cache_dir, config.seed)
    needs_reference = config.loss.name != "sft" and not config.loss.reference_free
    reference = load_model(config.model, parse_dtype(config.model.reference_dtype, "model.reference_dtype"), cache_dir, config.seed) if needs_reference else None
    if reference is not None:
        reference.requires_grad_(False)

    wandb_run = init_wandb(config, run_dir) if config.wandb.enabled and not config.debug else None
    trainer = TRAINERS[config.trainer](config, policy, reference, tokenizer, data, run_dir, wandb_run)
    trainer.train()
    if wandb_run is not None:
        wandb_run.finish()


@hydra.main(version_base="1.3", config_path="config", config_name="config")
def main(config: DictConfig) -> None:
    try:
        run(config)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
