"""The sections of the run's config, each a dataclass behind one key of config/config.yaml (model, wandb,
generation, rounds, plan) that checks its own values in `__post_init__`; train.py's schema (config.Config) holds them,
and evaluate.py's takes `wandb` too."""

from dataclasses import dataclass
from typing import Optional

from omegaconf import MISSING

from judging.rewards import check_reward
from modeling.precision import parse_dtype
from utils import NON_NEGATIVE, POSITIVE, Range, UserError, check_ranges, ranged


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
    fp8: Optional[str] = None  # tensorwise or rowwise: the policy's linear layers in float8 (modeling/float8.py)

    def __post_init__(self):
        if self.policy_dtype == "float16":  # the master weights: the optimizer's updates would round away
            raise UserError(
                "model.policy_dtype=float16 would keep the trained weights in float16, where most optimizer updates "
                "round away: keep float32 weights and compute in float16 with model.fsdp_policy_mp=float16 (loss "
                "scaled: loss_scale.*)"
            )
        parse_dtype(self.policy_dtype, "model.policy_dtype")
        parse_dtype(self.fsdp_reduce_dtype, "model.fsdp_reduce_dtype")
        for key in ("reference_dtype", "fsdp_policy_mp"):
            parse_dtype(getattr(self, key), f"model.{key}", allow_auto=True)


@dataclass
class LossScaleConfig:
    """Dynamic loss scaling, applied where the policy computes in float16 (core/loss_scale.py)."""

    init: float = ranged(Range(1), expected="1 or more")
    growth_interval: int = ranged(POSITIVE)
    growth_factor: float = ranged(Range(1, low_open=True), expected="above 1")
    backoff_factor: float = ranged(Range(0, 1, low_open=True, high_open=True), expected="between 0 and 1")
    min_scale: float = ranged(Range(1), expected="1 or more: a scale below 1 shrinks gradients towards zero")

    def __post_init__(self):
        check_ranges(self, "loss_scale.")
        if self.min_scale > self.init:
            raise UserError(f"loss_scale.min_scale={self.min_scale:g} is above loss_scale.init={self.init:g}")


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
    server: Optional[str] = MISSING
    server_timeout: float = ranged(Range(0, low_open=True))

    def __post_init__(self):
        check_ranges(self, "rounds.")
        if self.n and self.reward is None:
            raise UserError(
                f"rounds.n={self.n} scores each round's completions: set rounds.reward=module:function (a Python "
                "function of prompt and completion text) or rounds.reward=DIR (a sequence-classification reward model)"
            )
        # keys set for rounds that would not run, every one named: a sweep's rounds.n=0 job keeps the rounds.reward
        # its other jobs need, and its line must name rounds.server too, not the first key alone
        unread = ("reward", "prompts", "server") if not self.n else ()
        given = [f"rounds.{key}={getattr(self, key)}" for key in unread if getattr(self, key) is not None]
        if given:
            verb = "sets" if len(given) == 1 else "set"
            raise UserError(f"{' and '.join(given)} {verb} iterative rounds, but rounds.n=0 runs none")
        if self.reward is not None:
            check_reward(self.reward)
        missing = [field for field in ("{model}", "{port}") if self.server is not None and field not in self.server]
        if missing:
            raise UserError(
                f"rounds.server={self.server!r} lacks {' and '.join(missing)}: the command must serve the round's "
                "policy, {model}, on the port given, {port} (e.g. 'vllm serve {model} --port {port}')"
            )


@dataclass
class PlanConfig:
    """The machines dry_run=true plans for instead of this one (reporting.hardware.Hardware.planned): the memory per
    rank it prints, and whether the run fits, are theirs."""

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
