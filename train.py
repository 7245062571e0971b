"""Entry point: python train.py [key=value ...] (Hydra; see config/config.yaml).

BasicTrainer runs in this process. FSDPTrainer and TensorParallelTrainer run on every rank of a
torch.distributed process group: under torchrun this process is one rank; otherwise train.py starts one
worker per GPU (or `nproc` CPU workers) on this machine."""
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import difflib
import logging
import netrc
import os
import sys
from pathlib import Path

import hydra
import torch.distributed as dist
import torch.multiprocessing
from omegaconf import DictConfig, OmegaConf

import trainers
from layouts import LAYOUTS
from models import load_model, load_tokenizer
from precision import parse_dtype
from preference_datasets import get_dataset
from utils import REPO_ROOT, UserError, broadcast_object, free_port, get_local_dir, get_local_run_dir, init_distributed, local_main_first, rank, run_on_main, set_seed

CONFIG_DIR = REPO_ROOT / "config"
TRAINERS = {"BasicTrainer": trainers.BasicTrainer, "FSDPTrainer": trainers.FSDPTrainer, "TensorParallelTrainer": trainers.TensorParallelTrainer}

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


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def world_size(config: DictConfig) -> int:
    """How many processes the run takes: torchrun's world, 1 for BasicTrainer, else `nproc` or one per GPU."""
    if launched_by_torchrun():
        if config.nproc is not None:
            raise UserError(f"nproc={config.nproc} is for train.py's own launcher; under torchrun the world size comes from torchrun (--nproc_per_node, --nnodes)")
        return int(os.environ["WORLD_SIZE"])
    if config.trainer == "BasicTrainer":
        return 1
    if config.nproc is not None and (isinstance(config.nproc, bool) or not isinstance(config.nproc, int) or config.nproc <= 0):
        raise UserError(f"nproc={config.nproc} must be a positive number of processes, or null")
    gpus = torch.cuda.device_count()
    if gpus and config.nproc is not None and config.nproc > gpus:
        raise UserError(f"nproc={config.nproc} but this machine has {gpus} GPUs (one process per GPU)")
    return config.nproc or gpus or 2


INTEGER_KEYS = ("seed", "batch_size", "eval_batch_size", "gradient_accumulation_steps", "eval_every", "n_epochs", "n_examples",
                "n_eval_examples", "n_eval_model_samples", "max_length", "max_prompt_length", "warmup_steps", "generation.max_new_tokens")
BOOLEAN_KEYS = ("scored_logits_only", "reference_cache")
NUMBER_KEYS = ("lr", "max_grad_norm", "minimum_log_interval_secs", "distributed_timeout_secs", "loss.beta", "loss.label_smoothing")


def validate(config: DictConfig, world_size: int) -> None:
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set on the command line (e.g. model.name_or_path=ORG/NAME)")
    # Hydra reads `batch_size=abc` as a string: name the key here rather than fail later with a TypeError.
    for keys, types, kind in ((INTEGER_KEYS, int, "an integer"), (NUMBER_KEYS, (int, float), "a number")):
        for key in keys:
            value = OmegaConf.select(config, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
                raise UserError(f"{key}={value} must be {kind}")
    for key in ("gradient_accumulation_steps", "distributed_timeout_secs"):
        if config[key] <= 0:
            raise UserError(f"{key}={config[key]} must be positive")
    if config.trainer not in TRAINERS:
        raise UserError(f"unknown trainer '{config.trainer}'; valid: {', '.join(TRAINERS)}")
    if config.trainer == "BasicTrainer" and (world_size > 1 or config.nproc is not None):
        raise UserError(f"BasicTrainer runs on one process; for {config.nproc or world_size} use trainer=FSDPTrainer or trainer=TensorParallelTrainer")
    # A batch is split over the data-parallel ranks (FSDP's are all ranks; tensor-parallel ranks share each batch).
    data_ranks = world_size if TRAINERS[config.trainer].data_parallel else 1
    per_step = config.gradient_accumulation_steps * data_ranks
    for key in ("batch_size", "eval_batch_size"):
        if config[key] <= 0 or config[key] % per_step:
            raise UserError(f"{key}={config[key]} must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = {per_step}")
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
    parse_dtype(config.model.policy_dtype, "model.policy_dtype")
    for key in ("reference_dtype", "fsdp_policy_mp"):
        parse_dtype(config.model[key], f"model.{key}", allow_auto=True)
    if config.layout not in LAYOUTS:
        raise UserError(f"layout={config.layout} is not a layout; expected one of {', '.join(LAYOUTS)}")
    for key in BOOLEAN_KEYS:
        if not isinstance(OmegaConf.select(config, key), bool):
            raise UserError(f"{key}={OmegaConf.select(config, key)} must be true or false")
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
    """One rank's whole run (the only rank, for BasicTrainer)."""
    validate(config, dist.get_world_size() if dist.is_initialized() else 1)
    set_seed(config.seed)
    run_dir = Path(broadcast_object(run_on_main(lambda: str(prepare_run_dir(config)))))
    config.local_run_dir = str(run_dir)
    print(f"run directory: {run_dir}")
    cache_dir = get_local_dir(config.local_dirs)

    with local_main_first():
        tokenizer = load_tokenizer(config.model, cache_dir)
        data = {"train": [], "test": []}
        for name in config.datasets:
            for split, pairs in get_dataset(name, tokenizer, config.seed, config.n_eval_examples, cache_dir).items():
                data[split].extend(pairs)

        policy_dtype = parse_dtype(config.model.policy_dtype, "model.policy_dtype")
        policy = load_model(config.model, policy_dtype, cache_dir, config.seed)
    # auto: the reference is loaded like the policy, and computes like it (see BasicTrainer).
    reference_dtype = parse_dtype(config.model.reference_dtype, "model.reference_dtype", allow_auto=True)
    reference_dtype = policy_dtype if reference_dtype == "auto" else reference_dtype
    load_reference = None
    if config.loss.name != "sft" and not config.loss.reference_free:
        load_reference = lambda: load_model(config.model, reference_dtype, cache_dir, config.seed)  # noqa: E731

    wandb_run = init_wandb(config, run_dir) if config.wandb.enabled and not config.debug and rank() == 0 else None
    trainer = TRAINERS[config.trainer](config, policy, load_reference, tokenizer, data, run_dir, wandb_run)
    trainer.train()
    if wandb_run is not None:
        wandb_run.finish()


def run_rank(config: DictConfig) -> None:
    """Join the process group (set up by torchrun or `spawn_workers`), run, and leave it."""
    init_distributed(config.distributed_timeout_secs)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports for all
    try:
        run(config)
        dist.barrier()  # leave together: rank 0 may still be writing the last checkpoint
    except UserError as error:
        exit_with(error)
    finally:
        dist.destroy_process_group()


def spawned_worker(local_rank: int, nproc: int, port: int, config: DictConfig) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc))
    if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # oversubscribed cores slow every rank
    run_rank(config)


def spawn_workers(config: DictConfig) -> None:
    """Start one rank per GPU (or `nproc` CPU ranks) on this machine and wait for them."""
    nproc = world_size(config)
    validate(config, nproc)  # before starting anything
    OmegaConf.resolve(config)  # the workers have no Hydra context to resolve ${hydra:...} in
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its "terminating process" notes would bury a rank's one-line error
    print(f"{config.trainer}: starting {nproc} processes ({'nccl, one per GPU' if torch.cuda.is_available() else 'gloo, on the CPU'})")
    try:
        torch.multiprocessing.spawn(spawned_worker, args=(nproc, free_port(), config), nprocs=nproc)
    except torch.multiprocessing.ProcessExitedException as error:
        # A rank that stopped on a UserError has printed it; one that was killed has not.
        if error.exit_code is None or error.exit_code < 0:
            print(f"error: rank {error.error_index} was killed ({error.signal_name})", file=sys.stderr)
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)


def exit_with(error: UserError) -> None:
    if rank() == 0:  # every rank meets the same error; one line says it
        print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


@hydra.main(version_base="1.3", config_path="config", config_name="config")
def main(config: DictConfig) -> None:
    try:
        if config.trainer != "BasicTrainer" and not launched_by_torchrun():
            spawn_workers(config)
        else:
            validate(config, world_size(config))
            run_rank(config) if launched_by_torchrun() else run(config)
    except UserError as error:
        exit_with(error)


if __name__ == "__main__":
    try:
        check_overrides(sys.argv[1:])
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    main()
