"""The typed config: Hydra structured configs (dataclasses in Hydra's ConfigStore) behind the YAML files in
config/, which hold the values and their comments.

Hydra composes `config/config.yaml`, the `model=` and `loss=` group options and the command line onto these
schemas, so a wrong type or an unknown key fails during composition; `load` turns such failures into one line
naming the key, with "did you mean" and the valid keys. Each dataclass then checks its own values in
`__post_init__`, run once by `check` (OmegaConf.to_object builds the dataclasses). Each loss brings its own schema
(losses.LOSSES), registered as `loss/<name>_schema` and named in its YAML's defaults list."""

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError
from omegaconf.nodes import BooleanNode, FloatNode, IntegerNode, StringNode

from core.generations import check_judge
from core.layouts import LAYOUTS
from core.liger import liger_problem
from core.losses import LOSSES
from core.optim import build_optimizer
from core.rewards import check_reward
from core.scoring import ATTENTIONS
from modeling.adapters import LoraSettings
from modeling.distributed import TRAINERS, mesh_shape, planned_world_size
from modeling.precision import parse_dtype
from preference_datasets import template_kwargs_problem
from reporting.report import micro_batch_gib
from utils import NON_NEGATIVE, POSITIVE, REPO_ROOT, Range, UserError, check_ranges, first_line, ranged

CONFIG_DIR = REPO_ROOT / "config"

OmegaConf.register_new_resolver("repo_path", lambda path: str(REPO_ROOT / path), replace=True)


def expect(condition: bool, key: str, value, expectation: str) -> None:
    if not condition:
        raise UserError(f"{key}={value} must be {expectation}")


def did_you_mean(value: str, valid) -> str:
    hint = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
    return f" (did you mean '{hint[0]}'?)" if hint else ""


def check_writable_dir(key: str, path: str) -> None:
    """A directory that can be created: no existing part of the path is a regular file."""
    for parent in [Path(path), *Path(path).parents]:
        if parent.exists():
            expect(parent.is_dir(), key, path, f"a directory, but {parent} is a file")
            return


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    tokenizer_name_or_path: Optional[str] = MISSING
    archive: Optional[str] = MISSING
    block_name: Optional[str] = MISSING
    policy_dtype: str = MISSING
    fsdp_policy_mp: Optional[str] = MISSING
    reference_dtype: Optional[str] = MISSING
    random_init: bool = MISSING
    trust_remote_code: bool = MISSING

    fsdp_reduce_dtype: Optional[str] = MISSING
    freeze_vision: bool = True  # a vision-language model's vision tower trains (false) or stays as loaded (true)

    def __post_init__(self):
        for key in ("policy_dtype", "fsdp_policy_mp"):  # the dtypes gradients flow through
            if getattr(self, key) == "float16":
                raise UserError(
                    f"model.{key}=float16 would train without loss scaling, so small gradients underflow to zero: "
                    "use bfloat16 (GPUs from Ampere on, CPUs with AVX512-BF16) or float32"
                )
        parse_dtype(self.policy_dtype, "model.policy_dtype")
        parse_dtype(self.fsdp_reduce_dtype, "model.fsdp_reduce_dtype")
        for key in ("reference_dtype", "fsdp_policy_mp"):
            parse_dtype(getattr(self, key), f"model.{key}", allow_auto=True)


@dataclass
class WandbConfig:
    enabled: bool = MISSING
    entity: Optional[str] = MISSING
    project: str = MISSING


@dataclass
class GenerationConfig:
    max_new_tokens: int = ranged(POSITIVE)
    do_sample: bool = MISSING
    temperature: float = ranged(POSITIVE)
    top_p: float = ranged(Range(0, 1, low_open=True))

    def __post_init__(self):
        check_ranges(self, "generation.")


@dataclass
class RoundsConfig:
    n: int = ranged(NON_NEGATIVE)
    completions: int = ranged(Range(2), expected="2 or more: a pair is the best and the worst of a prompt's")
    reward: Optional[str] = MISSING
    prompts: Optional[int] = ranged(Range(0, low_open=True, null="for every training prompt each round"))
    eval_prompts: int = ranged(POSITIVE)

    def __post_init__(self):
        check_ranges(self, "rounds.")
        if self.n and self.reward is None:
            raise UserError(
                f"rounds.n={self.n} scores each round's completions: set rounds.reward=module:function (a Python "
                "function of prompt and completion text) or rounds.reward=DIR (a sequence-classification reward model)"
            )
        for key in ("reward", "prompts"):  # set for rounds that would not run
            if not self.n and getattr(self, key) is not None:
                raise UserError(f"rounds.{key}={getattr(self, key)} sets iterative rounds, but rounds.n=0 runs none")
        if self.reward is not None:
            check_reward(self.reward)


@dataclass
class PlanConfig:
    """The machines dry_run=true plans for instead of this one (report.Hardware.planned): the memory per rank it
    prints, and whether the run fits, are theirs."""

    nodes: int = ranged(POSITIVE)
    gpus_per_node: Optional[int] = ranged(Range(0, low_open=True, null="to plan for this machine"))
    gpu_memory_gib: Optional[float] = ranged(Range(0, low_open=True, null="to plan for this machine"))
    host_memory_gib: Optional[float] = ranged(Range(0, low_open=True, null="not to check host memory"))

    def __post_init__(self):
        check_ranges(self, "plan.")
        given = {key: getattr(self, key) for key in ("gpus_per_node", "gpu_memory_gib", "host_memory_gib")}
        if self.nodes != 1 or any(value is not None for value in given.values()):
            for key in ("gpus_per_node", "gpu_memory_gib"):
                if given[key] is None:
                    raise UserError(
                        f"plan.{key}=null: planning for other machines takes plan.gpus_per_node and "
                        "plan.gpu_memory_gib (and plan.nodes, plan.host_memory_gib)"
                    )

    @property
    def active(self) -> bool:
        return self.gpus_per_node is not None

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


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
    micro_batch_memory: Optional[str] = MISSING  # auto, a number of GiB, or null (report.micro_batch_gib)
    max_grad_norm: float = ranged(Range(0, low_open=True, infinite="to clip nothing"))
    max_nonfinite_steps: int = ranged(POSITIVE)
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
    activation_checkpointing: bool = MISSING
    compile_blocks: bool = MISSING
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


def check_rounds(config: Config) -> None:
    """What rounds (rounds.py) take: a pair loss, each round's reference computed once from the policy that
    starts it (cached: no second model), and sampling."""
    n = f"rounds.n={config.rounds.n}"
    trains = {"sft": "the policy on sft targets", "reward": "a reward model"}.get(LOSSES[config.loss.name].objective)
    if trains:
        raise UserError(f"{n} trains the policy on generated pairs; loss={config.loss.name} trains {trains}")
    if config.loss.needs_reference() and not config.reference_cache:
        raise UserError(
            f"{n}: each round's reference is the policy that starts it, its log-probs computed once and cached: "
            "set reference_cache=true"
        )
    if config.loss.needs_reference() and config.model.reference_dtype != "auto":
        raise UserError(
            f"{n}: each round's reference is the policy that starts it, computing like it: "
            f"model.reference_dtype={config.model.reference_dtype} must be auto"
        )
    if config.sample_during_eval:
        raise UserError(
            f"{n}: sample_during_eval=true samples the first reference, not a round's; each round's completions "
            "and rewards are in the run directory's rounds/ instead"
        )
    if not config.generation.do_sample:
        raise UserError(f"{n} samples {config.rounds.completions} completions a prompt: generation.do_sample=true")


def check_layout(config: Config) -> None:
    """layout, packed_attention and pack_row_tokens: names that exist, the packed layout's keys only with it, the
    block mask only where FlexAttention has a backward."""
    if config.layout not in LAYOUTS:
        raise UserError(
            f"layout={config.layout} is not a layout{did_you_mean(config.layout, LAYOUTS)}; "
            f"expected one of {', '.join(LAYOUTS)}"
        )
    if config.packed_attention not in ATTENTIONS:
        raise UserError(
            f"packed_attention={config.packed_attention} is not an attention path"
            f"{did_you_mean(config.packed_attention, ATTENTIONS)}; expected one of {', '.join(ATTENTIONS)}"
        )
    if config.layout == "padded" and (config.packed_attention != "auto" or config.pack_row_tokens is not None):
        key, value = (
            ("pack_row_tokens", config.pack_row_tokens)
            if config.pack_row_tokens is not None
            else ("packed_attention", config.packed_attention)
        )
        what = "rows" if key == "pack_row_tokens" else "attention"
        raise UserError(f"{key}={value} sets the {what} of layout=packed, but layout=padded")
    if config.packed_attention == "block" and not torch.cuda.is_available():
        raise UserError(
            "packed_attention=block needs a CUDA GPU: FlexAttention has no backward pass on CPU (torch 2.13), and "
            "its CPU forward measured slower than the dense mask; use auto or dense"
        )


def check_winrate(config: Config) -> None:
    """eval_winrate_prompts judges the policy's completions against the reference's: it takes a judge, a reference
    to sample from, and a run of a policy that generates (not a reward model, not rounds, whose reference moves)."""
    n = f"eval_winrate_prompts={config.eval_winrate_prompts}"
    if not config.eval_winrate_prompts:
        key = "judge" if config.judge is not None else "judge_template"
        raise UserError(f"{key}={getattr(config, key)} judges the win rate at each eval, but eval_winrate_prompts=0")
    if config.judge is None:
        raise UserError(f"{n} needs judge=DIR (a reward model or an instruct model) or judge=module:function")
    if LOSSES[config.loss.name].objective != "pairs" or not config.loss.needs_reference():  # sft, reward: no reference
        raise UserError(
            f"{n} compares the policy with its reference, and loss={config.loss.name} has none: compare its "
            "checkpoints with the starting model by evaluate.py"
        )
    if config.rounds.n:
        raise UserError(f"{n}: each round's reference is the policy that starts it; rounds log their own rewards")
    check_judge(config.judge, config.judge_template)


def check_speed_levers(config: "Config") -> None:
    """micro_batch_memory's value, and compute_weight_copies and liger_kernel where the run can take them."""
    micro_batch_gib(config.micro_batch_memory)
    if config.compute_weight_copies:
        check_weight_copies(config)
    problem = liger_problem(torch.cuda.is_available()) if config.liger_kernel else None
    if problem:
        raise UserError(problem)


def check_weight_copies(config: "Config") -> None:
    """compute_weight_copies=true replaces autocast's casts of the weights: it takes autocast on one process
    (BasicTrainer; FSDP's mixed precision casts each block once per gather) and a compute dtype other than the
    weights'; compiled blocks would trace its bookkeeping."""
    if config.trainer != "BasicTrainer":
        raise UserError(
            f"compute_weight_copies=true replaces autocast's weight casts on one process; {config.trainer} is not "
            "tested with it (FSDPTrainer casts each block's weights once per gather already): use BasicTrainer"
        )
    compute, weights = config.model.fsdp_policy_mp, config.model.policy_dtype
    if compute is None or compute == weights:
        raise UserError(
            f"compute_weight_copies=true with model.fsdp_policy_mp={as_override(compute)}: the policy computes in "
            f"its weights' dtype ({weights}), so there is nothing to cast or copy; set model.fsdp_policy_mp=bfloat16 "
            "or auto"
        )
    if config.compile_blocks:
        raise UserError(
            "compute_weight_copies=true with compile_blocks=true: the copies' bookkeeping (each weight's version) "
            "would break the compiled blocks' graphs; choose one"
        )


def check_loss(loss, sample_during_eval: bool) -> None:
    """The loss config is the named loss's, and what it trains can do what the run asks of it."""
    if loss.name not in LOSSES or type(loss) is not LOSSES[loss.name].schema:
        raise UserError(f"loss.name={loss.name} names another loss than its keys; choose it with loss={loss.name}")
    if LOSSES[loss.name].objective == "reward" and sample_during_eval:
        raise UserError(
            "sample_during_eval=true samples from the policy, but loss=reward trains a reward model, which scores "
            "text and generates none: set sample_during_eval=false"
        )


def check_offload(trainer: str, planned: bool, lora: bool) -> None:
    """fsdp_cpu_offload=true moves what FSDP shards (parameters, gradients, optimizer state) from the GPUs to the
    host: it takes FSDPTrainer, GPUs (or a dry run that plans for them: planned) and a full fine-tune."""
    if not TRAINERS[trainer].fsdp:
        raise UserError(
            f"fsdp_cpu_offload=true offloads what FSDPTrainer shards to the host; {trainer} shards nothing: "
            "use trainer=FSDPTrainer"
        )
    if not torch.cuda.is_available() and not planned:
        raise UserError(
            "fsdp_cpu_offload=true with no CUDA GPU here: there is nothing to offload to (CPU ranks keep "
            "their parameters, gradients and optimizer state in host memory already); set fsdp_cpu_offload=false"
        )
    if lora:
        raise UserError(
            "fsdp_cpu_offload=true with lora.enabled=true: LoRA trains small adapters beside a frozen base that "
            "FSDP shards over the GPUs already; offload is for a full fine-tune's weights, gradients and "
            "optimizer state: set fsdp_cpu_offload=false"
        )


def check_reference_sync(steps: int, loss, rounds: int) -> None:
    """TR-DPO (reference_sync.py) moves the run's one reference: the loss reads one, and no round sets its own."""
    if not loss.needs_reference():
        raise UserError(
            f"reference_sync_steps={steps} moves the reference towards the policy, but loss={loss.name} reads no "
            "reference: set reference_sync_steps=null"
        )
    if rounds:
        raise UserError(
            f"reference_sync_steps={steps} with rounds.n={rounds}: each round's reference is the policy that starts "
            "it; set reference_sync_steps=null"
        )


def check_optimizer(name: str, knobs: dict, lr: float) -> None:
    """torch.optim.<name> takes `knobs` (+optimizer_kwargs.NAME=VALUE): their names (optim.optimizer_class) and values,
    which torch checks when it builds one (a negative weight_decay, a nan eps, betas outside [0, 1)): built here on a
    stand-in parameter, so that a value it refuses is one line before anything starts."""
    try:
        build_optimizer(name, [torch.nn.Parameter(torch.zeros(2, 2))], lr, dict(knobs))
    except (ValueError, TypeError) as error:
        given = " ".join(f"+optimizer_kwargs.{key}={as_override(value)}" for key, value in knobs.items()) or f"lr={lr}"
        them = "them" if len(knobs) > 1 else "it"
        raise UserError(f"{given}: torch.optim.{name} refuses {them} ({first_line(error)})") from None


def as_override(value) -> str:
    """A value as it would be written on the command line: true, null, [0.9,0.95], {a:1}."""
    if isinstance(value, bool) or value is None:
        return str(value).lower().replace("none", "null")
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(as_override(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{as_override(item)}" for key, item in value.items()) + "}"
    return str(value)


store = ConfigStore.instance()
store.store(name="config_schema", node=Config)
SCHEMAS = {"config": Config}  # each config file of config/ by name, and its schema: train.py's and evaluate.py's


def register(name: str, schema: type) -> None:
    """A command's own config file, config/<name>.yaml, over `schema` (its defaults list names <name>_schema)."""
    store.store(name=f"{name}_schema", node=schema)
    SCHEMAS[name] = schema


for name, component in LOSSES.items():
    store.store(group="loss", name=f"{name}_schema", node=component.schema)


# -------------------------------------------------------------------------------------------------------------
# Loading: the command line composed onto the schema, with one-line errors


def group_options() -> dict[str, list[str]]:
    """Each config group (config/<group>/) and its options (the YAML files)."""
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in CONFIG_DIR.iterdir() if d.is_dir()}


def schema_type(key: str, groups: dict[str, str], name: str = "config"):
    """The schema's type for a dotted key of config file `name` (loss keys: in the selected loss's schema), or
    None."""
    kind, parts = SCHEMAS[name], key.split(".")
    if parts[0] == "loss" and "loss" in groups:
        loss_name = OmegaConf.load(CONFIG_DIR / "loss" / f"{groups['loss']}.yaml").name  # the option's loss
        kind, parts = LOSSES[loss_name].schema, parts[1:]
    for part in parts:
        types = {f.name: f.type for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else {}
        if part not in types:
            return None
        kind = types[part]
    return kind


def selected_options(args: list[str], name: str = "config") -> dict[str, str]:
    """The option of each group that this command line selects (else the config file's default): the groups the
    file's defaults list names."""
    defaults = OmegaConf.load(CONFIG_DIR / f"{name}.yaml").defaults
    selected = {next(iter(entry)): entry[next(iter(entry))] for entry in defaults if isinstance(entry, DictConfig)}
    groups = {group: options for group, options in group_options().items() if group in selected}
    for key, value in (arg.split("=", 1) for arg in args if "=" in arg):
        if key in groups:
            if value not in groups[key]:
                raise UserError(
                    f"unknown {key} '{value}'{did_you_mean(value, groups[key])}; valid: {', '.join(groups[key])}"
                )
            selected[key] = value
    return selected


def normalized(args: list[str], groups: dict[str, str], name: str = "config") -> list[str]:
    """The command line as Hydra should read it: each value as `hydra_value` writes it (a list key given without
    brackets is a list, a string key's value the text given), boolean keys held to true or false (OmegaConf alone
    would take 1 or 'yes'); an argument that is no override is one line that says how to quote a value with spaces."""
    result = []
    for position, arg in enumerate(args):
        key, equals, value = arg.partition("=")
        if not equals and not key.startswith("~"):  # ~key deletes a key; anything else takes key=value
            raise UserError(not_an_override(args, position, groups, name))
        kind = schema_type(key.lstrip("+"), groups, name) if equals and not key.startswith("~") else None
        if kind is bool and value.lower() not in ("true", "false"):
            raise UserError(f"{key}={value} must be true or false")
        arg = f"{key}={hydra_value(value, kind)}" if equals else arg
        example = {list: "['a b','c']", dict: "{name:'a b'}"}.get(typing.get_origin(optional_inner(kind)))
        if example and hydra_read(arg.partition("=")[2]) is UNREADABLE:  # else Hydra's message names the spot
            raise UserError(
                f"the command line: Hydra cannot read {arg}; quote each value for it in single quotes, inside "
                f'the shell\'s double ones: "{key}={example}"'
            )
        result.append(arg)
    return result


def not_an_override(args: list[str], position: int, groups: dict[str, str], name: str = "config") -> str:
    """The error for args[position], which holds no `=`: a key without its value, or most often the rest of a value
    with spaces that the shell split, so the line shows that value quoted whole."""
    arg = args[position]
    if arg.lstrip("-") in groups or schema_type(arg.lstrip("-"), groups, name) is not None:
        return f"the command line: {arg} has no value; give {arg.lstrip('-')}=VALUE"
    start = next((i for i in range(position - 1, -1, -1) if "=" in args[i]), None)
    if start is None:
        return f"the command line: {arg} is not an override; give key=value, e.g. local_run_dir=runs/a"
    end = next((i for i in range(position, len(args)) if "=" in args[i]), len(args))
    whole = " ".join(args[start:end])
    return (
        f"the command line: {arg} is not an override (key=value); a value with spaces is one argument only quoted "
        f'for the shell: "{whole}"'
    )


def optional_inner(kind):
    """X for Optional[X], else kind."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)
    return kind


UNREADABLE = object()


def hydra_read(value: str):
    """What Hydra's grammar makes of `value` on the right of `key=`: one value (a str, number, bool, None, list or
    dict), or UNREADABLE (a syntax error, or a sweep: train.py runs one job)."""
    try:
        override = OverridesParser.create().parse_override(f"key={value}")
    except HydraException:
        return UNREADABLE
    return UNREADABLE if override.is_sweep_override() else override.value()


def hydra_value(value: str, kind) -> str:
    """`value`, as the shell handed it over, written so that Hydra reads what it says for a key of type `kind`:
    null stays null; a list key given without brackets is the list of its comma-separated items (each as `literal`
    writes it) unless Hydra's own syntax spans the commas (quotes, an interpolation); a string key's value is
    `literal`; any other value that Hydra cannot read is quoted, for the schema to name the key it does not fit."""
    read = hydra_read(value)
    if read is None:
        return value
    inner = optional_inner(kind)
    if typing.get_origin(inner) is list and not value.startswith("["):
        items, listed = value.split(","), hydra_read(f"[{value}]")
        if listed is not UNREADABLE and len(listed) != len(items):
            return f"[{value}]"
        return "[" + ",".join(literal(item, in_list=True) for item in items) + "]"
    if inner is str:
        return literal(value)
    if read is UNREADABLE and not value.startswith(("[", "{")):  # brackets and braces: Hydra's lists and mappings
        return hydra_quoted(value)
    return value


def literal(value: str, in_list: bool = False) -> str:
    """A string value (in_list: an item of a list) in Hydra's grammar: as given where Hydra reads back that very
    string (interpolations too) or where it is written in Hydra's syntax on purpose (quoted, backslash-escaped,
    null); else single-quoted, where Hydra would fail on it (spaces, non-ASCII letters, brackets) or make another
    value of it (2024_01_05 an integer, 1.50 the number 1.5, true a boolean, surrounding spaces trimmed)."""
    read = hydra_read(f"[{value}]" if in_list else value)
    if in_list:
        read = read[0] if isinstance(read, list) and len(read) == 1 else UNREADABLE
    on_purpose = isinstance(read, str) and (value.lstrip().startswith(("'", '"')) or "\\" in value)
    return value if read == value and isinstance(read, str) or read is None or on_purpose else hydra_quoted(value)


def hydra_quoted(value: str) -> str:
    """`value` as a single-quoted string in Hydra's override grammar: quotes escaped, and the backslashes before a
    quote (or the closing one) doubled, so that it reads back exactly as `value`."""
    escaped = re.sub(r"(\\*)'", lambda match: match.group(1) * 2 + "\\'", value)
    return "'" + re.sub(r"(\\+)$", lambda match: match.group(1) * 2, escaped) + "'"


TYPE_NAMES = {
    IntegerNode: "an integer",
    FloatNode: "a number",
    BooleanNode: "true or false",
    ListConfig: "a list, e.g. [a,b]",
    DictConfig: "a mapping, e.g. {key: value}",
    StringNode: "a string",
}
ITEM_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def item_type_name(key: str, groups: dict[str, str], name: str = "config") -> str | None:
    """What an item of a list key must be, for `key` naming one (datasets[1]), from the schema; else None."""
    base, indexed, _ = key.partition("[")
    kind = optional_inner(schema_type(base, groups, name)) if indexed else None
    return ITEM_NAMES.get(typing.get_args(kind)[0]) if typing.get_origin(kind) is list else None


def explain(error: Exception, args: list[str], groups: dict[str, str], name: str = "config") -> str:
    """One line for a composition error: the key, what it must be, and the valid keys."""
    cause = error.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.full_key:
        key = cause.full_key
        group = key.partition(".")[0]
        where = f"{group}={groups[group]}" if group in groups else "the config"
        valid = (
            [f.name for f in dataclasses.fields(cause.object_type)]
            if dataclasses.is_dataclass(cause.object_type)
            else []
        )
        leaf = key.rpartition(".")[2]
        listed = f"; valid: {', '.join(valid)}" if valid else ""
        return f"unknown key '{key}' in {where}{did_you_mean(leaf, valid)}{listed}"
    if isinstance(cause, ValidationError) and cause.full_key:
        key = cause.full_key
        value = next(
            (arg.partition("=")[2] for arg in reversed(args) if arg.lstrip("+").partition("=")[0] == key), cause.value
        )
        owner = cause.object_type
        metadata = {f.name: f.metadata for f in dataclasses.fields(owner)} if dataclasses.is_dataclass(owner) else {}
        expected = metadata.get(key.rpartition(".")[2], {}).get("expected")
        expected = (
            expected
            or TYPE_NAMES.get(type(cause.child_node))
            or item_type_name(key, groups, name)
            or f"of type {type(cause.child_node).__name__}"
        )
        return f"{key}={value} must be {expected}"
    text = str(error).strip().splitlines()
    return f"the command line: {text[0] if text else type(error).__name__}"


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
