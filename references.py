"""The run's reference, assembled: where the loss reads the reference's log-probs (computed once from the initial
weights and cached on disk, scored live, or TR-DPO's moving reference) and the reference model kept beside the policy;
the cache's key (what changes the numbers' rounding) and its filling on the micro-batches training will use; and a
round's reference, the cached log-probs of the weights that start it (rounds.py, through the Trainer). build.py builds
a run's with it."""

from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig

from core.liger import liger_line
from core.scoring import Scorer
from core.step import Data, mismatched
from modeling.adapters import AdaptersDisabled, ReferenceAdapter, is_adapted
from modeling.distributed import Topology
from modeling.models import prepare_model
from modeling.placement import Placement, lever_on, place
from modeling.precision import Precision, device_key
from modeling.reference_sync import SyncedReference, schedule_line
from persistence import reference_cache
from utils import UserError


def live_reference_model(config: DictConfig, needs_reference: bool) -> bool:
    """Whether the run loads a reference model of its own: to score live (reference_cache=false), to sample from or
    to move towards the policy (reference_sync_steps), unless LoRA's base serves (the policy with its adapters
    disabled, or with its reference adapter)."""
    kept = not config.reference_cache or config.sample_during_eval or config.reference_sync_steps is not None
    kept = kept or config.eval_winrate_prompts > 0  # to sample from
    return needs_reference and not config.lora.enabled and kept


def build_reference(
    config, topology, data, objective, precision, policy, scorer, cache_dir, initial_weights, accumulation: int
):
    """(where the reference's log-probs come from, the reference model kept or None). The log-probs are cached
    (initial_weights: the digest of the weights they are computed for, None for no cache) or computed live; a moving
    reference (reference_sync_steps, reference_sync.py) is live after its first update, which only the steps before
    it read the cache for. The reference model is loaded to score live, to sample from or to move, or is the LoRA
    policy's base (adapters disabled) or base and reference adapter."""
    synced = config.reference_sync_steps is not None

    def load_reference() -> torch.nn.Module:  # placed, frozen; never with LoRA (the policy's base serves)
        with topology.main_first():
            model, initial = prepare_model(config.model, precision.reference_weights, cache_dir, config.seed)
        placement = Placement.of_run(config)
        model = place(model.requires_grad_(False), placement, topology, precision.reference_compute, initial)
        if config.liger_kernel:
            print(liger_line(model, precision.reference_compute, topology, not topology.fsdp, "reference"))
        return model

    reference_model = None
    if objective.needs_reference and is_adapted(policy):  # LoRA: the base, with the reference adapter if it moves
        reference_model = ReferenceAdapter(policy) if synced else AdaptersDisabled(policy)
    elif live_reference_model(config, objective.needs_reference):
        reference_model = load_reference()
    cached = live = None
    if initial_weights is not None:
        n_responses = data.train_examples.lengths.shape[1] - 1
        computation = reference_computation(config, precision, scorer, topology, n_responses, accumulation)
        path = reference_cache.cache_path(cache_dir, initial_weights, computation)
        # the initial policy itself computes them where the reference computes like it: no reference is loaded
        like_policy = lambda: (policy, precision.policy_compute)  # noqa: E731
        kept_or_loaded = lambda: (reference_model or load_reference(), precision.reference_compute)  # noqa: E731
        compute_with = like_policy if precision.reference_like_policy else kept_or_loaded
        read = replace(data, schedule=data.schedule[: config.reference_sync_steps]) if synced else data
        entries = fill_reference_cache(
            config, accumulation, topology, read, objective, scorer, path, initial_weights, computation, compute_with
        )
        cached = reference_cache.CachedReference(entries, topology.device)
    if objective.needs_reference and (not config.reference_cache or synced):
        live = reference_cache.LiveReference(reference_model, scorer, precision.reference_compute)
    if not (objective.needs_reference and synced):
        return (live if live is not None else cached), reference_model
    owner = policy if is_adapted(policy) else reference_model  # where the weights that move are
    every, alpha = config.reference_sync_steps, config.reference_mixup_alpha
    print(schedule_line(every, alpha, len(data.schedule), cached is not None, is_adapted(policy)))
    return SyncedReference(live, cached, policy, owner, every, alpha), reference_model


def reference_computation(
    config: DictConfig, precision: Precision, scorer: Scorer, topology: Topology, n_responses: int, accumulation: int
) -> str:
    """Everything that changes the rounding of the reference's log-probs (the cache file's second key), the device's
    kernels included: a cache directory shared by machines of other CPUs or GPUs keeps one file for each; and the
    responses an example has (pairs or labelled completions: a table holds one width)."""
    micro = [size // accumulation for size in (config.batch_size, config.eval_batch_size)]
    compute = precision.policy_compute if precision.reference_like_policy else precision.reference_compute
    how = "autocast" if scorer.autocast else "FSDP"
    weights = str(precision.reference_weights).removeprefix("torch.")
    return (
        f"{weights} weights, {compute or 'no'} {how} compute, {scorer.describe()}, {topology.describe()}, "
        f"micro-batches of {micro[0]} and {micro[1]}, seed {config.seed}, on {device_key(topology.device)}, "
        f"{n_responses} responses an example"
        + (", compiled blocks" if lever_on(config.compile_blocks, topology.device.type) else "")
        + (", Liger-Kernel" if config.liger_kernel else "")
        + (f", float8 {config.model.get('fp8')}" if precision.reference_like_policy and config.model.get("fp8") else "")
    )


def fill_reference_cache(
    config, accumulation: int, topology, data: Data, objective, scorer, path, weights, computation, compute_with
) -> dict:
    """Reference log-probs of every pair that training and eval use, by pair key (reference_cache.fill), computed on
    the same micro-batches as the first epoch's steps and the evals, so that at step 0 a reference computing like the
    policy agrees with it to the last bit; for KTO also the mismatched examples (step.mismatched) of every step
    and eval batch, as its KL estimate scores them. compute_with() gives (model, compute dtype), called only if any
    is missing."""
    first_use = list(dict.fromkeys(i for indices in data.schedule for i in indices))
    batches = [(batch, config.eval_batch_size) for batch in data.eval_batches]
    if objective.needs_kl_estimate:
        lengths = (config.max_length, config.max_prompt_length)
        steps = [data.train_examples.take(indices) for indices in data.schedule]
        batches += [(mismatched(examples, *lengths), config.batch_size) for examples in steps]
        batches += [(mismatched(batch, *lengths), config.eval_batch_size) for batch in data.eval_batches]
    return reference_cache.fill(
        path,
        weights,
        computation,
        data.train_examples,
        first_use,
        batches,
        config.batch_size,
        accumulation,
        compute_with,
        scorer,
        topology,
    )


def round_reference(
    config, accumulation: int, topology: Topology, data: Data, objective, scorer: Scorer, precision: Precision,
    policy: torch.nn.Module, directory: Path, digest: str | None,
) -> tuple[reference_cache.CachedReference, str]:  # fmt: skip
    """A round's reference and its weights' digest: the log-probs, of data's pairs and eval batches, of the weights
    whose digest is `digest` (None: the policy's now, which compute what the file in `directory` misses; given: a
    resume inside a round, whose starting weights are gone, so the file must hold them all)."""
    resumed, digest = digest is not None, digest or reference_cache.weights_digest(policy, topology)
    computation = reference_computation(config, precision, scorer, topology, 2, accumulation)
    path = reference_cache.cache_path(directory, digest, computation)

    def compute_with():
        if resumed:  # the weights that started the round are gone: only their cached numbers would do
            raise UserError(
                f"{path}, the reference log-probs of the round this checkpoint is in, is missing or was made "
                "otherwise; resume from the checkpoint that ends the round before"
            )
        return policy, precision.policy_compute

    entries = fill_reference_cache(
        config, accumulation, topology, data, objective, scorer, path, digest, computation, compute_with
    )
    return reference_cache.CachedReference(entries, topology.device), digest
