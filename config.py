"""The typed config: Hydra structured configs (dataclasses in Hydra's ConfigStore) behind the YAML files in
config/, which hold the values and their comments.

Hydra composes `config/config.yaml`, the `model=` and `loss=` group options and the command line onto these
schemas, so a wrong type or an unknown key fails during composition; `load` turns such failures into one line
naming the key, with "did you mean" and the valid keys (configuration/composition.py). Each dataclass then checks its
own values in `__post_init__`, run once by `check` (OmegaConf.to_object builds the dataclasses): train.py's schema
`Config` here, its sections in configuration/sections.py, the checks across keys in configuration/checks.py. Each
loss brings its own schema (losses.LOSSES), registered as `loss_schema/<name>` and named in its YAML's defaults list.
`reproducing_command` writes the command line that composes a run's config again (for its model card)."""

import shlex
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from configuration.checks import (
    check_layout,
    check_loss,
    check_offload,
    check_optimizer,
    check_reference_sync,
    check_rounds,
    check_speed_levers,
    check_winrate,
    check_writable_dir,
)
from configuration.composition import CONFIG_DIR, explain, group_options, normalized, register, selected_options
from configuration.messages import as_override, did_you_mean, expect
from configuration.sections import (
    GenerationConfig,
    LossScaleConfig,
    ModelConfig,
    PlanConfig,
    RoundsConfig,
    WandbConfig,
)
from modeling.adapters import LoraSettings
from modeling.distributed import TRAINERS, mesh_shape, planned_world_size
from pairs.chat_templates import template_kwargs_problem
from reporting.hardware import Hardware
from utils import NON_NEGATIVE, POSITIVE, Range, UserError, check_ranges, ranged

PROCESSES = "a positive number of processes, or null"
# torch's collectives count their deadline in 64-bit nanoseconds (292 years): a longer timeout wraps around and times
# out at once (1e10 s did, when the store connected); 1e9 s is 31 years.
TIMEOUT_LIMIT_SECS = 10**9


@dataclass
class Config:
    """Every top-level key, in config.yaml's order; comments and values are in config.yaml."""

    seed: int = ranged(Range(0, 2**32 - 1))  # numpy's and torch's seeds are unsigned 32-bit
    exp_name: str = MISSING
    batch_size: int = ranged(POSITIVE)
    eval_batch_size: int = ranged(POSITIVE)
    debug: bool = MISSING
    dry_run: bool = MISSING
    datasets: list[str] = MISSING
    chat_template_kwargs: dict[str, Any] = MISSING
    wandb: WandbConfig = MISSING
    local_dirs: list[str] = MISSING
    local_run_dir: Optional[str] = MISSING
    resume_from: Optional[str] = MISSING
    save_every: Optional[int] = ranged(Range(0, low_open=True, null="to save at each eval"))
    keep_last: Optional[int] = ranged(Range(0, low_open=True, null="to keep every checkpoint"))
    save_async: bool = MISSING
    sample_during_eval: bool = MISSING
    n_eval_model_samples: int = ranged(POSITIVE)
    generation: GenerationConfig = MISSING
    eval_winrate_prompts: int = ranged(NON_NEGATIVE)
    judge: Optional[str] = MISSING
    judge_template: Optional[str] = MISSING
    do_first_eval: bool = MISSING
    lr: float = ranged(POSITIVE)
    gradient_accumulation_steps: int = ranged(POSITIVE)
    micro_batch_memory: Optional[str] = MISSING  # auto, a number of GiB, or null (reporting.micro_batches)
    max_grad_norm: float = ranged(Range(0, low_open=True, infinite="to clip nothing"))
    max_nonfinite_steps: int = ranged(POSITIVE)
    loss_scale: LossScaleConfig = MISSING
    max_length: int = ranged(POSITIVE)
    max_prompt_length: int = ranged(POSITIVE)
    n_epochs: Optional[int] = ranged(Range(0, low_open=True, null="to train by n_examples"))
    n_examples: Optional[int] = ranged(Range(0, low_open=True, null="to train by n_epochs"))
    n_eval_examples: Optional[int] = ranged(Range(0, low_open=True, null="for a whole test split"))
    trainer: str = MISSING
    nproc: Optional[int] = ranged(Range(0, low_open=True, null="for one per GPU"), expected=PROCESSES)
    tensor_parallel_size: Optional[int] = ranged(
        Range(0, low_open=True, null="for the trainer's default"), expected="a positive integer, or null"
    )
    sequence_parallel_size: int = ranged(POSITIVE)
    distributed_timeout_secs: float = ranged(Range(0, TIMEOUT_LIMIT_SECS, low_open=True))
    fsdp_cpu_offload: bool = MISSING
    optimizer: str = MISSING
    optimizer_kwargs: dict[str, Any] = MISSING
    warmup_steps: int = ranged(NON_NEGATIVE)
    sync_free_steps: str = MISSING  # auto, true or false (training/device_steps.py)
    activation_checkpointing: bool = MISSING
    compile_blocks: str = MISSING  # auto, true or false (modeling.placement.lever_on)
    shape_buckets: str = MISSING  # auto, true or false
    compute_weight_copies: bool = MISSING
    liger_kernel: bool = MISSING
    layout: str = MISSING
    packed_attention: str = MISSING
    pack_row_tokens: Optional[int] = ranged(
        Range(0, low_open=True, null="for the layout's default"), expected="a positive number of tokens, or null"
    )
    scored_logits_only: bool = MISSING
    reference_cache: bool = MISSING
    reference_sync_steps: Optional[int] = ranged(Range(0, low_open=True, null="to keep the reference fixed"))
    reference_mixup_alpha: float = ranged(Range(0, 1, low_open=True))
    eval_every: int = ranged(POSITIVE)
    plots: bool = MISSING
    minimum_log_interval_secs: float = ranged(Range(0, infinite="to log only where an eval or checkpoint may follow"))
    rounds: RoundsConfig = MISSING
    plan: PlanConfig = MISSING
    lora: LoraSettings = MISSING
    model: ModelConfig = MISSING
    loss: Any = MISSING  # one of losses.LOSSES' schemas

    def __post_init__(self):
        check_ranges(self)
        if self.n_epochs is None and self.n_examples is None:
            raise UserError("set n_epochs or n_examples: training stops at whichever comes first")
        expect(
            0 < self.max_prompt_length < self.max_length,
            "max_prompt_length",
            self.max_prompt_length,
            f"positive and below max_length={self.max_length}",
        )
        if not self.datasets:
            raise UserError("datasets=[] names no dataset; give at least one, e.g. datasets=[demo]")
        problem = template_kwargs_problem(self.chat_template_kwargs)
        if problem:
            raise UserError(f"chat_template_kwargs={as_override(self.chat_template_kwargs)} {problem}")
        if not self.local_dirs:
            raise UserError("local_dirs=[] names no directory; give at least one for run outputs and caches")
        for i, directory in enumerate(self.local_dirs):
            check_writable_dir(f"local_dirs[{i}]", directory)
        if self.local_run_dir is not None:
            check_writable_dir("local_run_dir", self.local_run_dir)
        if self.resume_from == "auto" and self.local_run_dir is None:
            raise UserError(
                "resume_from=auto continues the run in local_run_dir, but local_run_dir=null names a new directory "
                "each time; set local_run_dir=DIR and re-run the same command after a crash"
            )
        if self.save_async and self.debug:
            raise UserError("save_async=true writes checkpoints in the background, but debug=true writes none")
        if self.trainer not in TRAINERS:
            raise UserError(
                f"unknown trainer '{self.trainer}'{did_you_mean(self.trainer, TRAINERS)}; valid: {', '.join(TRAINERS)}"
            )
        check_layout(self)
        if self.model.fsdp_reduce_dtype != "float32" and not TRAINERS[self.trainer].fsdp:
            raise UserError(
                f"model.fsdp_reduce_dtype={self.model.fsdp_reduce_dtype} sets how FSDPTrainer reduces gradients; "
                f"{self.trainer} does not shard them: leave it at float32, or use trainer=FSDPTrainer"
            )
        if self.fsdp_cpu_offload:
            check_offload(self.trainer, self.plan.active, self.lora.enabled)
        check_optimizer(self.optimizer, self.optimizer_kwargs, self.lr)
        check_speed_levers(self)
        if self.lora.enabled and self.model.reference_dtype != "auto":
            raise UserError(
                f"model.reference_dtype={self.model.reference_dtype} with lora.enabled=true: the reference is the "
                "policy's base with its adapters disabled, so it computes like the policy (model.reference_dtype=auto)"
            )
        check_loss(self.loss, self.sample_during_eval)
        if self.eval_winrate_prompts or self.judge is not None or self.judge_template is not None:
            check_winrate(self)
        if self.reference_sync_steps is not None:
            check_reference_sync(self.reference_sync_steps, self.loss, self.rounds.n)
        if self.plan.active:
            self.check_plan()
        self.check_batches(self.plan.world_size if self.plan.active else planned_world_size(self.trainer, self.nproc))
        if self.rounds.n:
            check_rounds(self)

    def check_plan(self) -> None:
        """plan.* stands for the machines a dry run plans for: a run runs on the machine it is on."""
        if not self.dry_run:
            raise UserError(
                f"plan.gpus_per_node={self.plan.gpus_per_node} describes machines for dry_run=true to plan for; "
                "a run uses the machines it runs on: set dry_run=true, or leave plan.* at null"
            )
        if self.nproc is not None:
            raise UserError(f"nproc={self.nproc} with plan.*: the planned world is plan.nodes x plan.gpus_per_node")
        if TRAINERS[self.trainer].one_process and self.plan.world_size > 1:
            raise UserError(
                f"{self.trainer} runs on one process, but plan.* has {self.plan.world_size} GPUs; use "
                "trainer=FSDPTrainer"
            )

    def check_batches(self, world_size: int) -> None:
        """Batches split evenly over data-parallel ranks and accumulation steps; evals fall on step boundaries."""
        data_ranks, sp, tp = mesh_shape(
            self.trainer, world_size, self.tensor_parallel_size, self.sequence_parallel_size
        )
        if sp > 1 and self.layout != "packed":
            raise UserError(
                f"sequence_parallel_size={sp} cuts packed rows into slices, each rank given the whole rows' mask; "
                "layout=padded rows take masks built from a rank's own tokens: use layout=packed"
            )
        if self.lora.enabled and tp > 1:
            raise UserError(
                f"lora.enabled=true with {tp}-way tensor parallelism: peft's LoRA layers have no tensor-parallel "
                "plan; use trainer=FSDPTrainer (tensor_parallel_size=null) or BasicTrainer"
            )
        if self.lora.quantize and world_size > 1:
            raise UserError(
                f"lora.quantize={self.lora.quantize} runs on one process (BasicTrainer): FSDP does not "
                "shard bitsandbytes' 4-bit weights here"
            )
        per_step = self.gradient_accumulation_steps * data_ranks
        for key in ("batch_size", "eval_batch_size"):
            value = getattr(self, key)
            multiple = f"a positive multiple of gradient_accumulation_steps x data-parallel ranks = {per_step}"
            expect(value > 0 and value % per_step == 0, key, value, multiple)
        for key in ("eval_every", "save_every"):
            value = getattr(self, key)
            expect(
                value is None and key == "save_every" or value > 0 and value % self.batch_size == 0,
                key,
                value,
                f"a positive multiple of batch_size={self.batch_size}" + (", or null" if key == "save_every" else ""),
            )


register("config", Config)  # config/config.yaml's defaults list names config_schema


# -------------------------------------------------------------------------------------------------------------
# Loading: the command line composed onto the schema, with one-line errors. Here, beside Config, and not in
# configuration/: whatever composes config/config.yaml (reproducing_command too) imports config.py, so it finds
# train.py's schema registered.


def composed(args: list[str], name: str = "config") -> DictConfig:
    """The command line (Hydra overrides, e.g. `loss.beta=0.1 model=tiny`) composed onto config file `name`'s
    schema: keys and types checked, values not yet (`check`)."""
    groups = selected_options(args, name)
    try:
        with initialize_config_dir(str(CONFIG_DIR), version_base="1.3"):
            return compose(name, overrides=normalized(args, groups, name))
    except (HydraException, OmegaConfBaseException) as error:
        raise UserError(explain(error, args, groups, name)) from None  # the values as given


def load(args: list[str], name: str = "config") -> DictConfig:
    """The config of this command line (config/<name>.yaml's: train.py's, or evaluate.py's), checked."""
    config = composed(args, name)
    check(config, REQUIRED_EXAMPLES.get(name, REQUIRED_EXAMPLES["config"]))
    return config


def processes(config: DictConfig) -> int:
    """How many processes a checked config's run takes: the machines plan.* describes (dry_run=true for other
    machines), else this machine's (modeling.distributed.planned_world_size)."""
    planned = Hardware.planned(config.plan)
    return planned.world_size if planned else planned_world_size(config.trainer, config.nproc)


# what a command line that sets the required keys looks like, by config
REQUIRED_EXAMPLES = {
    "config": "model.name_or_path=ORG/NAME",
    "evaluate": "candidates=[runs/dpo/LATEST] judge=runs/rm/LATEST",
}


def check(config: DictConfig, example: str = REQUIRED_EXAMPLES["config"]) -> None:
    """Every value checked once, by the dataclass that owns it."""
    missing = sorted(OmegaConf.missing_keys(config))
    if missing:
        raise UserError(f"{', '.join(missing)} must be set on the command line (e.g. {example})")
    try:
        OmegaConf.to_object(config)
    except OmegaConfBaseException as error:  # e.g. an interpolation that does not resolve
        raise UserError(f"{error.full_key}: {str(error).splitlines()[0]}") from None


# -------------------------------------------------------------------------------------------------------------
# The command line that composes a run's config again

NOT_REPRODUCED = ("local_run_dir", "resume_from", "local_dirs")  # where a run writes, not what it trains


def reproducing_command(run: DictConfig) -> str | None:
    """`python train.py OVERRIDES` that composes this run's config again: the model and loss options nearest to it,
    then every key that differs from them (where the run writes aside); None where the config files here no longer
    compose (a run of another version of them): the card leaves out what it cannot know, and never costs the
    checkpoint it describes."""
    defaults = [f"{key}={value}" for key, value in selected_options([]).items()]
    run_values = OmegaConf.to_container(run, resolve=True)
    options = group_options()
    name = lambda option: OmegaConf.load(CONFIG_DIR / "loss" / f"{option}.yaml").name  # noqa: E731
    losses = [option for option in options["loss"] if name(option) == run.loss.name]
    best = None
    presets = {option: OmegaConf.load(CONFIG_DIR / "model" / f"{option}.yaml") for option in options["model"]}
    models = [
        option
        for option, preset in presets.items()
        if not OmegaConf.is_missing(preset, "name_or_path") and preset.name_or_path == run.model.name_or_path
    ] or options["model"]
    for model in models:
        for loss in losses:
            groups = [f"model={model}", f"loss={loss}"]
            try:
                base = OmegaConf.to_container(composed(groups), resolve=True)
            except UserError:
                return None
            overrides = differences(base, run_values, "", as_override)
            if best is None or len(overrides) < len(best):
                best = [group for group in groups if group not in defaults] + overrides
    return " ".join(["python", "train.py", *map(shlex.quote, best)])


def differences(base: dict, run: dict, prefix: str, written: Callable) -> list[str]:
    """The overrides that turn the config `base` into `run`: changed keys, added ones (+key), removed ones (~key),
    each value as `written` writes it for the command line."""
    found = []
    for key, value in run.items():
        name = f"{prefix}{key}"
        if name in NOT_REPRODUCED:
            continue
        if key not in base:
            found.append(f"+{name}={written(value)}")
        elif isinstance(value, dict) and isinstance(base[key], dict):
            found += differences(base[key], value, f"{name}.", written)
        elif base[key] != value:
            found.append(f"{name}={written(value)}")
    return found + [f"~{prefix}{key}" for key in base if key not in run]
