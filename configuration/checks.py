"""The checks across keys of the run's config, that no one section can make alone: rounds, the layout, the win rate,
the speed levers, the loss, CPU offload, the reference's sync and the optimizer's settings (torch builds one to check
them), and a writable directory. Each takes the values it checks, or train.py's config (config.Config, whose
`__post_init__` runs them) as `config`; each raises a UserError of one line."""

from pathlib import Path

import torch

from configuration.messages import as_override, did_you_mean, expect
from core.attention import ATTENTIONS
from core.layouts import LAYOUTS
from core.liger import liger_problem
from core.losses import LOSSES
from core.optim import build_optimizer
from judging.judges import check_judge
from modeling.distributed import TRAINERS
from modeling.float8 import float8_problem
from modeling.placement import STEP_LEVERS, lever_on
from reporting.micro_batches import micro_batch_gib
from utils import UserError, first_line

LEVER_SETTINGS = ("auto", "true", "false")  # a lever on where it pays (auto: CUDA), or as set


def check_writable_dir(key: str, path: str) -> None:
    """A directory that can be created: no existing part of the path is a regular file."""
    for parent in [Path(path), *Path(path).parents]:
        if parent.exists():
            expect(parent.is_dir(), key, path, f"a directory, but {parent} is a file")
            return


def check_rounds(config) -> None:
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
    if config.rounds.server and config.lora.quantize:
        raise UserError(
            f"rounds.server samples a round's policy written as a model, and lora.quantize={config.lora.quantize} "
            "has none to write (its adapter merged into a 4-bit base): set rounds.server=null to sample with our loop"
        )


def check_layout(config) -> None:
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


def check_winrate(config) -> None:
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


def check_speed_levers(config) -> None:
    """micro_batch_memory's, compile_blocks', shape_buckets' and sync_free_steps' values, and compute_weight_copies,
    liger_kernel and model.fp8 where the run can take them."""
    micro_batch_gib(config.micro_batch_memory)
    for key in STEP_LEVERS:
        value = str(getattr(config, key)).lower()
        expect(value in LEVER_SETTINGS, key, getattr(config, key), f"one of {', '.join(LEVER_SETTINGS)}")
    if config.compute_weight_copies:
        check_weight_copies(config)
    problem = liger_problem(torch.cuda.is_available()) if config.liger_kernel else None
    tensor_parallel = config.trainer == "TensorParallelTrainer" or (config.tensor_parallel_size or 1) > 1
    lora = config.lora.enabled, bool(config.lora.quantize)
    problem = problem or float8_problem(config.model.fp8, tensor_parallel, *lora)
    if problem:
        raise UserError(problem)


def check_weight_copies(config) -> None:
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
    if lever_on(config.compile_blocks, "cuda" if torch.cuda.is_available() else "cpu"):
        raise UserError(
            f"compute_weight_copies=true with compile_blocks={config.compile_blocks}: the copies' bookkeeping (each "
            "weight's version) would break the compiled blocks' graphs; choose one (compile_blocks=false)"
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
