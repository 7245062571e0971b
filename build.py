"""Building a run: every part the training loop needs, made once from the checked config, in one place (the
reference's: references.py). train.py, the benchmarks (bench/) and the tests build through here; the Trainer
(trainers.py) runs what it is given. The dry run (`dry_run`) reads the same config, data and precision and plans the
memory of a meta-device policy (`meta_policy`), reading no weights.

The order matters where noted: local rank 0 loads first (it fills the caches the others then read); the reference's
log-probs come from the policy's initial weights, before any step; the optimizer is built after FSDP has sharded the
policy (it then holds the shards each rank owns)."""

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from core.attention import model_class
from core.examples import Examples
from core.liger import liger_line
from core.loss_scale import LossScale, ScaleSettings
from core.losses import LOSSES
from core.objective import build_objective
from core.optim import build_optimizer, build_scheduler
from core.router_loss import find_routers
from core.scoring import Scorer, ScoringSettings
from core.step import BatchLoss, Data, check_kto_prompts
from generation.sampling import Sampler
from judging.held_out import Evaluator
from judging.rewards import reads_images
from modeling import weights
from modeling.adapters import (
    add_reference_adapter,
    apply_lora,
    quantization_config,
)
from modeling.distributed import TRAINERS, Topology, mesh_shape
from modeling.models import planned_model, prepare_model, transformers_config
from modeling.placement import Placement, language_blocks, levers_off_line, place
from modeling.precision import (
    Precision,
    auto_compute_dtype,
    choose_compute_dtype,
    decide_precision,
    slow_precision_note,
)
from modeling.reference_sync import schedule_line
from modeling.tokenizers import load_tokenizer
from modeling.vision import freeze_vision_tower, vision_tower
from pairs.formats import PreferencePair
from persistence import checkpoint, reference_cache
from persistence.checkpoint_loading import preflight
from persistence.tokenized import Tokenization, first_of_each_group, load_examples, tokenize_pairs
from preference_datasets import batch_schedule
from references import build_reference, live_reference_model
from reporting.data_report import data_report, shape_report
from reporting.fit_check import fit_verdict
from reporting.hardware import GIB, Hardware
from reporting.memory_plan import Workload
from reporting.micro_batches import choose_micro_batches, micro_batch_budget, with_accumulation
from reporting.telemetry import ModelFlops, PeakRate, peak_flops
from utils import UserError, get_local_dir


@dataclass
class RunParts:
    """What the Trainer runs: ready, placed and decided."""

    config: DictConfig
    topology: Topology
    tokenizer: object
    objective: object
    precision: Precision
    data: Data
    policy: torch.nn.Module  # placed on the topology
    scorer: Scorer
    reference: object | None
    reference_model: torch.nn.Module | None  # kept to score live or to sample from
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batch_loss: BatchLoss
    evaluator: Evaluator
    sampler: Sampler  # the run's: the evals' win rate and samples, and a run of rounds
    flops: ModelFlops
    peak_flops: PeakRate
    accumulation: int  # micro-batches a step: gradient_accumulation_steps, or more where micro_batch_memory chooses
    loss_scale: LossScale | None  # a float16 policy's dynamic loss scale (None: no float16 gradients to scale)


def load_data(
    config: DictConfig, tokenizer, objective, cache_dir: Path, pairs: dict | None = None, report: bool = True
) -> Data:
    """The run's examples, tokenized once per machine and cached (tokenized.load_examples), or given as `pairs`
    ({"train": ..., "test": ...}, tokenized in memory); SFT's one example per prompt; the first n_eval_examples held
    out ones for eval; the training schedule. report: print the data report."""
    chat_template_kwargs = OmegaConf.to_container(config.chat_template_kwargs)
    settings = Tokenization(config.max_length, config.max_prompt_length, objective.sft_targets, chat_template_kwargs)
    if pairs is None:
        splits = load_examples(config.datasets, tokenizer, settings, config.seed, config.n_eval_examples, cache_dir)
    else:
        splits = {split: tokenize_pairs(split_pairs, tokenizer, settings) for split, split_pairs in pairs.items()}
    if settings.sft:
        splits = {split: first_of_each_group(examples) for split, examples in splits.items()}
    train, evals = splits["train"], splits["test"]
    if train.labelled and not objective.reads_labels:
        raise UserError(
            f"datasets={list(config.datasets)} hold labelled completions (prompt, completion, label): "
            f"only {' and '.join(f'loss={name}' for name, loss in LOSSES.items() if loss.labelled)} train on them"
        )
    if objective.needs_kl_estimate and config.batch_size < 2:
        raise UserError(
            f"batch_size={config.batch_size}: loss=kto estimates its reference point from each batch's mismatched "
            "prompts and responses, which takes at least 2 examples"
        )
    evals = evals.select(range(min(len(evals), config.n_eval_examples or len(evals))))
    if objective.needs_kl_estimate:
        for examples in (train, evals):
            check_kto_prompts(examples, config.max_prompt_length)
    if config.rounds.n and train.with_images:
        check_round_images(config, train)
    schedule = batch_schedule(len(train), config.batch_size, config.seed, config.n_epochs, config.n_examples)
    if report:
        print(data_report(train, evals, tokenizer, config.max_length, config.max_prompt_length))
    size = config.eval_batch_size
    eval_batches = [evals.take(range(i, min(i + size, len(evals)))) for i in range(0, len(evals), size)]
    if objective.needs_kl_estimate and len(eval_batches) > 1 and len(eval_batches[-1]) == 1:
        eval_batches[-2:] = [eval_batches[-2] + eval_batches[-1]]  # one example has no mismatched partner
    return Data(train, eval_batches, schedule)


def check_round_images(config: DictConfig, train: Examples) -> None:
    """One line where rounds on prompts with images would lose them: a reward model that reads text alone (a text
    model's directory), or a prompt that a generated completion could cut (from_ids cuts a prompt to
    max_prompt_length where prompt and completion exceed max_length, and its image tokens with it). A function of
    the text (module:function) reads the text, as it says."""
    n, reward = f"rounds.n={config.rounds.n}", config.rounds.reward
    if Path(reward).is_dir() and not reads_images(reward):
        raise UserError(
            f"{n}: rounds.reward={reward} is a text model and the prompts have images: it would score their text "
            "alone; train a reward model that sees them (loss=reward from Gemma 3: docs/reward_models.md)"
        )
    new_tokens, prompts = config.generation.max_new_tokens, train.lengths[:, 0]
    cut = (train.image_lengths > 0) & (prompts > config.max_prompt_length) & (prompts + new_tokens > config.max_length)
    if cut.any():
        tokens = int(prompts[cut].max())
        raise UserError(
            f"{n}: a prompt with images is {tokens} tokens, its images' included, and with a completion of "
            f"generation.max_new_tokens={new_tokens} exceeds max_length={config.max_length}, which would cut it to "
            f"max_prompt_length={config.max_prompt_length}: raise max_length to {tokens + new_tokens} or "
            f"max_prompt_length to {tokens}"
        )


def rank_data(config: DictConfig, topology: Topology, tokenizer, objective, cache_dir: Path, pairs=None) -> Data:
    """The run's data on this rank (load_data): the first rank of each machine tokenizes into the cache, and the
    other ranks of its machine then map it, instead of each tokenizing it again."""
    with topology.main_first():
        return load_data(config, tokenizer, objective, cache_dir, pairs, report=topology.is_main)


def build(config: DictConfig, topology: Topology, pairs: dict[str, list[PreferencePair]] | None = None) -> RunParts:
    """Every part of the run on this rank; pairs: the data ({"train": ..., "test": ...}) instead of config.datasets."""
    cache_dir = get_local_dir(config.local_dirs)
    objective = build_objective(config.loss)
    autocast = not topology.fsdp  # FSDP's MixedPrecisionPolicy casts the parameters instead
    precision = run_precision(config, topology, cache_dir, autocast)
    with topology.main_first():
        tokenizer = load_tokenizer(config.model, cache_dir)
        policy, initial = prepare_model(  # on the meta device: weights are read once it is placed
            config.model, precision.policy_weights, cache_dir, config.seed, quantization_config(config.lora),
            objective.reward_model,
        )  # fmt: skip
    text_config = policy.config.get_text_config()  # a vision-language model's language model's, where it pools
    if objective.reward_model and text_config.pad_token_id is None:  # its own pooling needs one (scoring)
        text_config.pad_token_id = tokenizer.pad_token_id
    if config.model.freeze_vision and vision_tower(policy) is not None:
        print(f"vision tower: frozen ({freeze_vision_tower(policy) / 1e6:.3g}M parameters; model.freeze_vision)")
    if config.lora.enabled:  # after model.archive: the adapters go on the SFT weights
        policy = apply_lora(policy, config.lora, config.seed)
        if config.reference_sync_steps is not None:  # before placement: sharded like the policy's own adapters
            add_reference_adapter(policy)
    routers = find_routers(model_class(policy), config.loss.router_aux_loss_coef)
    if routers is not None and topology.sp_size > 1:
        raise UserError(
            f"the router loss counts each expert's tokens per micro-batch, which sequence_parallel_size="
            f"{topology.sp_size} cuts over ranks: set loss.router_aux_loss_coef=0 or sequence_parallel_size=1"
        )
    if routers is not None:
        print(f"router loss: {routers.describe()} (aux_loss)")
    if config.resume_from is not None:  # fail now rather than after tokenizing and the reference pass
        resume = Path(config.resume_from)
        offload = config.fsdp_cpu_offload
        topology.run_on_main(lambda: preflight(resume, policy, config.batch_size, offload))
    data = rank_data(config, topology, tokenizer, objective, cache_dir, pairs)
    print(f"{len(data.schedule)} steps of {config.batch_size} examples")
    live = live_reference_model(config, objective.needs_reference)
    accumulation = check_fit(config, topology, policy, data, precision, live)  # micro-batches a step

    # rounds (rounds.py) fill a reference cache for each round's pairs, not the datasets'
    cached = objective.needs_reference and config.reference_cache and not config.rounds.n
    flops = ModelFlops.of(policy, language_blocks(policy, config.model.block_name))
    weights_dtype = next(policy.parameters()).dtype
    policy = place(policy, Placement.of_run(config), topology, precision.policy_compute, initial, is_policy=True)
    if config.liger_kernel:
        print(liger_line(policy, precision.policy_compute, topology, autocast, "liger_kernel"))
    initial_weights = reference_cache.weights_digest(policy, topology) if cached else None
    # The layout, attention and head checks run on the placed model: on its device, once, decided by rank 0.
    reward_eos = tokenizer.eos_token_id if objective.reward_model else None
    scorer = Scorer.create(
        policy, ScoringSettings.of_run(config), tokenizer.pad_token_id, topology, autocast, precision.policy_compute,
        objective.tail_weight, reward_eos, tokenizer.vision,
    )  # fmt: skip
    report_step_levers(config, topology, data, accumulation, scorer)  # now that the layout is known

    reference, reference_model = build_reference(
        config, topology, data, objective, precision, policy, scorer, cache_dir, initial_weights, accumulation
    )
    peak = topology.broadcast(
        topology.run_on_main(lambda: peak_flops(topology.device, precision.policy_compute or weights_dtype, cache_dir))
    )
    print(f"MFU is measured against {peak.describe()}")
    # After sharding and before any forward pass: FSDP then hands the optimizer the shards each rank owns.
    trainable = [p for p in policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
    optimizer = build_optimizer(config.optimizer, trainable, config.lr, OmegaConf.to_container(config.optimizer_kwargs))
    if config.fsdp_cpu_offload:
        print(offload_line(policy, config.optimizer))
    scheduler = build_scheduler(optimizer, config.warmup_steps)
    loss_scale = run_loss_scale(config, precision, topology)
    max_lengths = (config.max_length, config.max_prompt_length)
    batch_loss = BatchLoss(
        objective, scorer, policy, precision.policy_compute, reference, topology, max_lengths, routers
    )
    sampled_in = precision.policy_compute if precision.autocast else None  # FSDP casts the weights itself
    sampler = Sampler(tokenizer, topology, config.generation.max_new_tokens, config.eval_batch_size, sampled_in)
    evaluator = Evaluator(config, topology, tokenizer, data.eval_batches, batch_loss, accumulation, sampler)
    return RunParts(
        config, topology, tokenizer, objective, precision, data, policy, scorer, reference, reference_model,
        optimizer, scheduler, batch_loss, evaluator, sampler, flops, peak, accumulation, loss_scale,
    )  # fmt: skip


def report_step_levers(config: DictConfig, topology: Topology, data, accumulation: int, scorer: Scorer) -> None:
    """The training step's levers told: in one line the ones `auto` leaves off on this device; with shape buckets,
    the shapes an epoch's micro-batches take and the padding they cost."""
    if line := levers_off_line(config, topology.device.type):
        print(line)
    if scorer.buckets and topology.is_main:
        print(shape_report(data.train_examples.lengths, data.schedule, accumulation * topology.dp_size, scorer))


def offload_line(policy: torch.nn.Module, optimizer: str) -> str:
    """Where fsdp_cpu_offload put this rank's shards of the policy's parameters (their gradients and the optimizer's
    state follow them), counted on the placed model."""
    shards = [parameter.to_local() for parameter in policy.parameters()]
    host = [shard for shard in shards if shard.device.type == "cpu"]
    pinned = sum(shard.numel() * shard.element_size() for shard in host if shard.is_pinned())
    return (
        f"fsdp_cpu_offload: {len(host)} of {len(shards)} parameter shards in host memory ({pinned / GIB:.2f} GiB "
        f"pinned), with their gradients and {optimizer} state; the optimizer steps on the host"
    )


def run_loss_scale(config: DictConfig, precision: Precision, topology: Topology) -> LossScale | None:
    """A float16 policy's dynamic loss scale (loss_scale.*), said in one line; None where no gradient is float16.
    Across ranks the sharded scaler: gradients are sharded, and one rank may hold the only overflow."""
    if not precision.loss_scaled:
        return None
    settings = ScaleSettings(**OmegaConf.to_container(config.loss_scale))
    print(f"loss scale: dynamic, from {settings.init:g} (loss_scale.*), for the policy's float16 compute")
    return LossScale(settings, topology.device, distributed=topology.world_size > 1)


def run_precision(config: DictConfig, topology: Topology, cache_dir: Path, autocast: bool) -> Precision:
    """The run's dtypes (decide_precision, `auto` decided by rank 0), with one line where an explicit compute dtype
    runs far slower on this device than `auto`'s choice (slow_precision_note)."""
    precision = decide_precision(
        OmegaConf.to_object(config.model), autocast, lambda: auto_compute_dtype(topology, cache_dir, autocast)
    )
    setting = config.model.fsdp_policy_mp
    note = topology.run_on_main(lambda: slow_precision_note(setting, precision, topology.device, cache_dir))
    if note:
        print(note)
    return precision


def check_fit(config: DictConfig, topology: Topology, policy, data: Data, precision: Precision, live: bool) -> int:
    """The micro-batches a step, as micro_batch_memory chooses them (choose_accumulation; every rank takes the
    smallest budget of all ranks, so that they agree); then stop in one line, before any weight is read, where the run
    cannot fit this machine's memory (reporting/fit_check.py)."""
    hardware = Hardware.here(topology.world_size)
    mesh = (topology.dp_size, topology.sp_size, topology.tp_size)
    work = Workload(config, policy, data.train_examples, data.schedule, precision, live)
    accumulation = choose_accumulation(work, hardware, mesh, agree=lambda budget: min(topology.all_gather(budget)))
    _, problem = fit_verdict(with_accumulation(work, accumulation), hardware, mesh)
    if problem is not None:
        raise UserError(problem)
    return accumulation


def choose_accumulation(work: Workload, hardware: Hardware, mesh: tuple[int, int, int], agree=lambda x: x) -> int:
    """The micro-batches a step: micro_batch_memory's choice (micro_batches.choose_micro_batches), printed, else
    gradient_accumulation_steps; agree: the budget of every rank from this one's (the smallest of all ranks'). A value
    the run passes on: the checked config keeps what was given."""
    budget = micro_batch_budget(work.config.micro_batch_memory, hardware)
    if budget is None:
        return work.config.gradient_accumulation_steps
    count, line = choose_micro_batches(work, work.config.trainer, mesh, hardware.gpu_bytes is not None, agree(budget))
    print(line)
    return count


def dry_run(config: DictConfig, world_size: int) -> None:
    """The run's assembly up to its weights: config, tokenizer, data and precision checked and reported, the steps,
    each rank's memory on the machines the run would use (this one, or plan.*'s) and whether it fits them; no weights
    loaded, nothing written but the caches. A run that would not fit is a UserError, after its memory is shown."""
    print(OmegaConf.to_yaml(config))
    cache_dir = get_local_dir(config.local_dirs)
    objective = build_objective(config.loss)
    autocast = not TRAINERS[config.trainer].fsdp
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # planned GPUs (plan.*) of 16 GiB and more compute auto in bfloat16, as every such GPU since Ampere runs it fast
    planned = Hardware.planned(config.plan)
    auto = (lambda: torch.bfloat16) if planned else (lambda: choose_compute_dtype(device, cache_dir)[0])
    precision = decide_precision(OmegaConf.to_object(config.model), autocast, auto)
    note = None if planned else slow_precision_note(config.model.fsdp_policy_mp, precision, device, cache_dir)
    if note:
        print(note)
    planned_model(config.model, cache_dir)
    tokenizer = load_tokenizer(config.model, cache_dir)
    data = load_data(config, tokenizer, objective, cache_dir)
    n_evals = sum(map(len, data.eval_batches))
    print(
        f"steps: {len(data.schedule)} optimizer steps of {config.batch_size} examples "
        f"({len(data.schedule) * config.batch_size} examples), an eval every {config.eval_every} examples on {n_evals}"
    )
    if config.reference_sync_steps is not None:
        every, alpha, lora = config.reference_sync_steps, config.reference_mixup_alpha, config.lora.enabled
        print(schedule_line(every, alpha, len(data.schedule), config.reference_cache, lora))
    policy = meta_policy(config, precision, cache_dir, objective.reward_model)
    resume = checkpoint.newest(Path(config.local_run_dir)) if config.resume_from == "auto" else config.resume_from
    if resume is not None:  # the checks a run makes before anything else
        preflight(Path(resume), policy, config.batch_size, config.fsdp_cpu_offload)
        print(f"resume: {resume} fits this run")
    hardware = planned or Hardware.here(world_size)
    mesh = mesh_shape(config.trainer, world_size, config.tensor_parallel_size, config.sequence_parallel_size)
    live = live_reference_model(config, objective.needs_reference)
    work = Workload(config, policy, data.train_examples, data.schedule, precision, live)
    work = with_accumulation(work, choose_accumulation(work, hardware, mesh))
    plan, problem = fit_verdict(work, hardware, mesh)
    print("\n".join(plan.lines(hardware)))
    if problem is not None:
        raise UserError(problem)
    print(
        f"fits: {plan.device_peak() / GIB:.1f} GiB a {'GPU' if plan.on_gpu else 'rank'} and "
        f"{plan.host_peak() * hardware.ranks_per_node / GIB:.1f} GiB of host memory a node at most, besides the "
        "framework (Python, torch, the CUDA context: about 0.5-3 GiB a rank)"
    )
    print("dry run: no weights were loaded and nothing was trained")


def meta_policy(config: DictConfig, precision: Precision, cache_dir: Path, reward: bool = False) -> torch.nn.Module:
    """The policy (or reward model) as the run builds it (its vision tower frozen or not, its LoRA adapters), on the
    meta device: shapes, no weights."""
    model_config = transformers_config(config.model, cache_dir, reward)
    with torch.device("meta"):
        model = weights.model_class(reward, model_config).from_config(model_config, dtype=precision.policy_weights)
        if config.model.freeze_vision and vision_tower(model) is not None:  # as build() freezes it
            freeze_vision_tower(model)
        if not config.lora.enabled:
            return model
        model = apply_lora(model, config.lora, config.seed)
        if config.reference_sync_steps is not None:
            add_reference_adapter(model)
        return model
