"""The training loop: DPO / IPO / SFT updates, evaluation, sampling, logging and checkpoints.

BasicTrainer runs on one process. FSDPTrainer and TensorParallelTrainer run the same loop on every rank of a
torch.distributed process group; they differ from it only in how models are placed (`prepare_model`) and in
which ranks share a batch (`data_parallel`)."""
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import inspect
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch.distributed as dist
from torch import nn
import tqdm
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import reference_cache
from layouts import ModelBatch, left_padded_prompts, make_batch
from losses import preference_loss
from models import checkpoint_blocks, find_blocks, tensor_parallel_plan
from precision import choose_compute_dtype, parse_dtype
from preference_datasets import PreferencePair, batch_schedule, sft_examples, tokenize_pair
from scoring import packing_problem, scored_head_problem, sequence_logps
from utils import (
    UserError,
    append_jsonl,
    broadcast_object,
    get_device,
    get_local_dir,
    load_checkpoint_file,
    load_state,
    replace_dir,
    run_on_main,
)


def optimizer_class(name: str, knobs: dict) -> type[torch.optim.Optimizer]:
    """`torch.optim.<name>`, checked to accept `knobs`; one-line errors list the valid names or knobs."""
    optimizers = sorted(n for n, c in vars(torch.optim).items() if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer)
    if name not in optimizers:
        raise UserError(f"unknown optimizer '{name}'; torch.optim has: {', '.join(optimizers)}")
    optimizer = getattr(torch.optim, name)
    accepted = [p for p in inspect.signature(optimizer).parameters if p not in ("params", "lr")]
    unknown = sorted(set(knobs) - set(accepted))
    if unknown:
        raise UserError(f"optimizer {name} has no setting {', '.join(unknown)}; its settings: {', '.join(accepted)}")
    return optimizer


def build_optimizer(name: str, params, lr: float, knobs: dict) -> torch.optim.Optimizer:
    knobs = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}  # e.g. betas
    return optimizer_class(name, knobs)(params, lr=lr, **knobs)


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Scale gradients down to a total L2 norm of at most max_norm; return the norm before clipping.

    Gradients may be plain tensors, FSDP's sharded DTensors, or tensor parallelism's mix of both, which
    torch.nn.utils.clip_grad_norm_ refuses: each group of gradients with one layout gets one norm, reduced over
    the ranks that hold its shards."""
    grads = [p.grad for p in parameters if p.grad is not None]
    groups = defaultdict(list)
    for grad in grads:
        groups[(grad.device_mesh, grad.placements) if isinstance(grad, DTensor) else None].append(grad)
    squares = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float() ** 2)
    total = torch.stack(squares).sum().sqrt().item()
    scale = max_norm / (total + 1e-6)  # torch's rule, so clipping matches clip_grad_norm_
    if scale < 1:
        for grad in grads:
            grad.mul_(scale)
    return total


class BasicTrainer:
    """Trains the policy on one process (CUDA if present, else CPU); the reference model stays frozen."""

    data_parallel = False  # whether each rank trains on its own slice of every batch
    autocast = True  # a compute dtype runs the model under torch.autocast, over its own weights' dtype

    def __init__(
        self,
        config: DictConfig,
        policy: torch.nn.Module,
        load_reference: Callable[[], torch.nn.Module] | None,
        tokenizer,
        data: dict[str, list[PreferencePair]],
        run_dir: Path,
        wandb_run=None,
    ):
        """load_reference: loads the frozen reference (None: the loss needs none); called only if it is needed."""
        self.config = config
        self.run_dir = run_dir
        self.wandb_run = wandb_run
        self.tokenizer = tokenizer
        self.device = get_device()
        self.sft = config.loss.name == "sft"
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.is_main = self.rank == 0
        self.data_rank, self.data_world_size = (self.rank, self.world_size) if self.data_parallel else (0, 1)
        self.cache_dir = get_local_dir(config.local_dirs)
        self.policy_compute = self.choose_precision()
        self.layout, self.scored_logits_only = self.choose_layout(policy)

        self.train_examples = self.tokenize(sft_examples(data["train"]) if self.sft else data["train"])
        eval_examples = self.tokenize(sft_examples(data["test"]) if self.sft else data["test"])
        if config.n_eval_examples is not None:
            eval_examples = eval_examples[: config.n_eval_examples]
        size = config.eval_batch_size
        self.eval_batches = [eval_examples[i : i + size] for i in range(0, len(eval_examples), size)]
        self.schedule = batch_schedule(len(self.train_examples), config.batch_size, config.seed, config.n_epochs, config.n_examples)
        print(f"{len(self.train_examples)} training and {len(eval_examples)} eval examples; {len(self.schedule)} steps of {config.batch_size}")

        # The reference computes like the policy (same weights dtype, same compute dtype) unless a dtype is given:
        # at step 0, policy == reference then holds to the last bit, so rewards are 0 and the loss ln 2.
        reference_dtype = parse_dtype(config.model.reference_dtype, "model.reference_dtype", allow_auto=True)
        self.reference_compute = self.policy_compute if reference_dtype == "auto" else None
        initial_weights = reference_cache.weights_digest(policy) if load_reference and config.reference_cache else None
        self.policy = self.prepare_model(policy, is_policy=True, compute_dtype=self.policy_compute)
        self.reference = self.reference_logps = None
        if load_reference is not None and config.reference_cache:
            self.reference_logps = self.cached_reference_logps(initial_weights, load_reference, reference_dtype)
        if load_reference is not None and (not config.reference_cache or config.sample_during_eval):
            self.reference = self.load_reference(load_reference)
        # Built after sharding and before any forward pass: FSDP then hands it the sharded parameters each rank owns.
        self.optimizer = build_optimizer(config.optimizer, self.policy.parameters(), config.lr, OmegaConf.to_container(config.optimizer_kwargs))
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        self.example_counter = 0
        self.batch_counter = 0
        self.last_eval_at = None
        if config.resume_from is not None:
            self.load_checkpoint(Path(config.resume_from))

    def prepare_model(self, model: torch.nn.Module, is_policy: bool, compute_dtype: torch.dtype | None) -> nn.Module:
        """The model placed for this trainer; compute_dtype: the dtype it computes in (None: its weights')."""
        model = model.to(self.device)
        if is_policy and self.config.activation_checkpointing:
            checkpoint_blocks(model, self.config.model.block_name)
        return model

    def load_reference(self, load: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        return self.prepare_model(load().requires_grad_(False), is_policy=False, compute_dtype=self.reference_compute)

    def choose_precision(self) -> torch.dtype | None:
        """The policy's compute dtype (None: its weights' dtype): model.fsdp_policy_mp, or, for `auto`, bfloat16
        where this device runs it fast. One line says what was chosen and why."""
        setting = parse_dtype(self.config.model.fsdp_policy_mp, "model.fsdp_policy_mp", allow_auto=True)
        if setting != "auto":
            return setting
        dtype, why = run_on_main(lambda: choose_compute_dtype(self.device, self.cache_dir)) or (None, None)
        dtype, why = broadcast_object((dtype, why))  # every rank must compute alike
        how = "float32 weights under autocast" if self.autocast else "FSDP mixed precision over float32 shards"
        chosen = f"bfloat16 compute ({how})" if dtype else "float32"
        print(f"precision: {chosen}, because {why} (model.fsdp_policy_mp=auto)")
        return dtype

    def choose_layout(self, policy: torch.nn.Module) -> tuple[str, bool]:
        """(layout, whether the LM head runs on scored positions only), as configured where the model allows;
        each fallback is one line saying why."""
        c = self.config
        layout, scored = c.layout, c.scored_logits_only
        problem = packing_problem(policy, c.max_length) if layout == "packed" else None
        if problem:
            print(f"layout: padded, not packed: {problem}")
            layout = "padded"
        problem = scored_head_problem(policy) if scored else None
        if problem:
            print(f"logits: computed at every position, not only where a token is scored: {problem}")
            scored = False
        return layout, scored

    # ---------------------------------------------------------------------------------------------------
    # Ranks

    def local_shard(self, items: list) -> tuple[list, int]:
        """This rank's contiguous share of `items` and how many of it are real: a short share is padded with
        copies of items[0], so that every rank runs the same number of forward passes (sharded models need
        all ranks in each one)."""
        size = -(-len(items) // self.data_world_size)
        local = items[self.data_rank * size : (self.data_rank + 1) * size]
        return local + [items[0]] * (size - len(local)), len(local)

    def gather(self, values: dict[str, list]) -> dict[str, list]:
        """Each list concatenated over the data-parallel ranks, in rank order (which is batch order)."""
        if self.data_world_size == 1:
            return dict(values)
        parts = [None] * self.data_world_size
        dist.all_gather_object(parts, dict(values))
        return {name: [v for part in parts for v in part[name]] for name in parts[0]}

    def set_gradient_sync(self, enabled: bool) -> None:
        """Whether the next backward pass reduces gradients across ranks (one process: nothing to reduce)."""

    # ---------------------------------------------------------------------------------------------------
    # Loss

    def tokenize(self, pairs: list[PreferencePair]) -> list[dict]:
        """Token ids of each pair, once per run; `key` identifies the ids for the reference cache."""
        c = self.config
        examples = [tokenize_pair(pair, self.tokenizer, c.max_length, c.max_prompt_length, self.sft) for pair in pairs]
        for example in examples:
            example["key"] = reference_cache.pair_key(example)
        return examples

    def model_batch(self, examples: list[dict]) -> ModelBatch:
        """The examples in this run's layout, on this rank's device."""
        return make_batch(self.layout, examples, self.tokenizer.pad_token_id).to(self.device)

    def sequence_logps(self, model: torch.nn.Module, batch: ModelBatch, compute: torch.dtype | None) -> torch.Tensor:
        """[R * B] float32 summed log-probs of each sequence's response tokens (all first responses, then all
        second ones), in one forward pass; compute: the model's compute dtype, or None for its weights'."""
        autocast = compute if self.autocast else None
        mask_dtype = compute or next(model.parameters()).dtype
        return sequence_logps(model, batch, autocast, mask_dtype, scored_head=self.scored_logits_only)

    def micro_batches(self, examples: list[dict], batch_size: int) -> tuple[list[list[dict]], int]:
        """This rank's share of `examples` (a batch of batch_size) in gradient_accumulation_steps micro-batches, and
        how many of the share are real (see local_shard)."""
        local, n_real = self.local_shard(examples)
        size = batch_size // (self.config.gradient_accumulation_steps * self.data_world_size)
        return [local[i : i + size] for i in range(0, len(local), size)], n_real

    def batch_metrics(self, examples: list[dict], split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the examples, and per-example metrics ([B] tensors) named as in the reference."""
        batch = self.model_batch(examples)  # built once: policy and a live reference share it
        policy_logps = self.sequence_logps(self.policy, batch, self.policy_compute)
        if self.sft:
            losses = -policy_logps
            return losses.mean(), {f"logps_{split}/chosen": policy_logps.detach(), f"loss/{split}": losses.detach()}

        policy_chosen, policy_rejected = policy_logps.chunk(2)
        if self.reference_logps is not None:
            reference = torch.tensor([self.reference_logps[ex["key"]] for ex in examples], device=self.device)
            reference_chosen, reference_rejected = reference.T
        elif self.reference is not None:
            with torch.no_grad():
                reference_logps = self.sequence_logps(self.reference, batch, self.reference_compute)
            reference_chosen, reference_rejected = reference_logps.chunk(2)
        else:  # reference-free: a uniform reference contributes zeros
            reference_chosen = reference_rejected = torch.zeros_like(policy_chosen)
        loss_config = self.config.loss
        losses, chosen_rewards, rejected_rewards = preference_loss(
            policy_chosen,
            policy_rejected,
            reference_chosen,
            reference_rejected,
            beta=loss_config.beta,
            label_smoothing=loss_config.get("label_smoothing", 0.0),
            ipo=loss_config.name == "ipo",
        )
        metrics = {
            f"rewards_{split}/chosen": chosen_rewards,
            f"rewards_{split}/rejected": rejected_rewards,
            f"rewards_{split}/accuracies": (chosen_rewards > rejected_rewards).float(),
            f"rewards_{split}/margins": chosen_rewards - rejected_rewards,
            f"logps_{split}/chosen": policy_chosen.detach(),
            f"logps_{split}/rejected": policy_rejected.detach(),
            f"loss/{split}": losses.detach(),
        }
        return losses.mean(), metrics

    # ---------------------------------------------------------------------------------------------------
    # Reference log-probs, computed once

    def cached_reference_logps(self, weights: str, load: Callable[[], torch.nn.Module], reference_dtype) -> dict:
        """Reference log-probs of every pair that training and eval will use, by pair key, from the cache where it
        has them; the others are computed now and added to it. With model.reference_dtype=auto the initial policy
        itself computes them, through its own precision path and on the same micro-batches as the first epoch's
        steps and the evals, so that at step 0 policy and reference agree to the last bit; no reference is loaded."""
        c = self.config
        weights_dtype = c.model.policy_dtype if reference_dtype == "auto" else c.model.reference_dtype
        micro = [size // c.gradient_accumulation_steps for size in (c.batch_size, c.eval_batch_size)]
        how = "autocast" if self.autocast else "FSDP"
        computation = (
            f"{weights_dtype} weights, {self.reference_compute or 'no'} {how} compute, "
            f"{self.layout} layout, {'scored' if self.scored_logits_only else 'all'} logits, "
            f"{type(self).__name__} x{self.world_size}, micro-batches of {micro[0]} and {micro[1]}, seed {c.seed}"
        )
        path = reference_cache.cache_path(self.cache_dir, weights, computation)
        entries, why = run_on_main(lambda: reference_cache.load(path, weights, computation)) or ({}, None)
        entries = broadcast_object(entries)
        if why:
            print(f"reference log-probs: recomputing, since {why}")
        first_use = list(dict.fromkeys(i for indices in self.schedule for i in indices))
        train = [self.train_examples[i] for i in first_use if self.train_examples[i]["key"] not in entries]
        evals = [[ex for ex in batch if ex["key"] not in entries] for batch in self.eval_batches]
        evals = [batch for batch in evals if batch]
        eval_keys = {ex["key"] for batch in self.eval_batches for ex in batch}
        needed = len({self.train_examples[i]["key"] for i in first_use} | eval_keys)
        missing = len({ex["key"] for ex in train} | {ex["key"] for batch in evals for ex in batch})
        if not missing:
            print(f"reference log-probs: all {needed} pairs from {path}")
            return entries
        print(f"reference log-probs: computing {missing} of {needed} pairs, then caching them in {path}")
        model = self.policy if reference_dtype == "auto" else self.load_reference(load)
        mode = model.training
        model.eval()
        batch_size = self.config.batch_size
        groups = [(train[i : i + batch_size], batch_size) for i in range(0, len(train), batch_size)]
        groups += [(batch, self.config.eval_batch_size) for batch in evals]
        total = len(train) + sum(map(len, evals))
        progress = tqdm.tqdm(total=total, desc="reference log-probs", unit="pair", disable=not self.is_main)
        with torch.no_grad():
            for examples, size in groups:
                micro, n_real = self.micro_batches(examples, size)
                # [R * b] per micro-batch -> [b, R]: the responses of each pair
                logps = [self.reference_pass(model, mb) for mb in micro]
                local = torch.cat(logps).cpu().tolist()[:n_real]
                keys = [ex["key"] for ex in self.local_shard(examples)[0][:n_real]]
                gathered = self.gather({"keys": keys, "logps": local})
                entries.update(zip(gathered["keys"], gathered["logps"]))
                progress.update(len(examples))
        progress.close()
        model.train(mode)
        if self.is_main:
            reference_cache.save(path, weights, computation, entries)
        return entries

    def reference_pass(self, model: torch.nn.Module, examples: list[dict]) -> torch.Tensor:
        """[B, R] reference log-probs of each example's responses."""
        return self.sequence_logps(model, self.model_batch(examples), self.reference_compute).view(-1, len(examples)).T

    # ---------------------------------------------------------------------------------------------------
    # Training

    def train_step(self, examples: list[dict]) -> dict[str, list[float]]:
        """One optimizer step over a global batch, in gradient_accumulation_steps equal micro-batches."""
        self.policy.train()
        accumulation = self.config.gradient_accumulation_steps
        metrics = defaultdict(list)
        micro_batches = self.micro_batches(examples, self.config.batch_size)[0]
        for i, micro_batch in enumerate(micro_batches):
            self.set_gradient_sync(i == len(micro_batches) - 1)  # reduce once per step, not per micro-batch
            loss, batch_metrics = self.batch_metrics(micro_batch, "train")
            # Each rank's loss is the mean over its share; averaging gradients over ranks gives the batch mean.
            (loss / accumulation).backward()
            for name, values in batch_metrics.items():
                metrics[name].extend(values.float().cpu().tolist())
        metrics = self.gather(metrics)
        metrics["grad_norm"] = [clip_grad_norm(self.policy.parameters(), self.config.max_grad_norm)]
        metrics["lr"] = [self.scheduler.get_last_lr()[0]]  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def train(self) -> None:
        c = self.config
        progress = tqdm.tqdm(total=len(self.schedule), initial=self.batch_counter, desc="train", unit="step", dynamic_ncols=True, disable=not self.is_main)
        interval = defaultdict(list)
        interval_time = interval_tokens = interval_examples = 0
        last_log = time.time()
        for indices in self.schedule[self.batch_counter :]:
            if self.example_counter % c.eval_every == 0 and (self.example_counter > 0 or c.do_first_eval):
                self.evaluate_and_save(final=False)
            start = time.time()
            examples = [self.train_examples[i] for i in indices]
            for name, values in self.train_step(examples).items():
                interval[name].extend(values)
            interval_time += time.time() - start
            interval_tokens += sum(len(ex["prompt"]) * len(ex["responses"]) + sum(map(len, ex["responses"])) for ex in examples)
            interval_examples += len(examples)
            self.example_counter += len(examples)
            self.batch_counter += 1
            progress.update()
            progress.set_postfix(loss=f"{sum(interval['loss/train']) / len(interval['loss/train']):.4f}")
            # Metrics of every step count: they are averaged over the interval, not sampled at its end.
            if time.time() - last_log >= c.minimum_log_interval_secs or self.batch_counter == len(self.schedule):
                record = {name: sum(values) / len(values) for name, values in interval.items()}
                record.update(examples_per_second=interval_examples / interval_time, tokens_per_second=interval_tokens / interval_time)
                self.log(record)
                interval = defaultdict(list)
                interval_time = interval_tokens = interval_examples = 0
                last_log = time.time()
        progress.close()
        self.evaluate_and_save(final=True)

    # ---------------------------------------------------------------------------------------------------
    # Evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean of each metric over all eval examples."""
        self.policy.eval()
        values = defaultdict(list)
        for batch in tqdm.tqdm(self.eval_batches, desc="eval", leave=False, dynamic_ncols=True, disable=not self.is_main):
            # The training micro-batch budget: a rank's share goes through in gradient_accumulation_steps parts.
            micro_batches, n_real = self.micro_batches(batch, self.config.eval_batch_size)
            local_values = defaultdict(list)
            for micro_batch in micro_batches:
                for name, metric in self.batch_metrics(micro_batch, "eval")[1].items():
                    local_values[name].extend(metric.float().cpu().tolist())
            for name, v in self.gather({name: v[:n_real] for name, v in local_values.items()}).items():
                values[name].extend(v)
        return {name: sum(v) / len(v) for name, v in values.items()}

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, examples: list[dict]) -> list[str]:
        """Sampled continuations of the examples' prompts, without the prompt text."""
        g = self.config.generation
        prompt_ids, attention_mask = left_padded_prompts(examples, self.tokenizer.pad_token_id)
        prompt_ids = prompt_ids.to(self.device)
        output = model.generate(
            prompt_ids,
            attention_mask=attention_mask.to(self.device),
            max_new_tokens=g.max_new_tokens,
            do_sample=g.do_sample,
            temperature=g.temperature,
            top_p=g.top_p,
            pad_token_id=self.tokenizer.pad_token_id,
            synced_gpus=self.world_size > 1,  # ranks done early keep joining the sharded forward passes of the others
        )
        return self.tokenizer.batch_decode(output[:, prompt_ids.shape[1] :], skip_special_tokens=True)

    def sample(self) -> list[dict]:
        examples = [ex for batch in self.eval_batches for ex in batch][: self.config.n_eval_model_samples]
        local, n_real = self.local_shard(examples)
        # The same seed on every rank: tensor-parallel ranks must draw the same tokens.
        torch.manual_seed(self.config.seed + self.example_counter)
        policy_texts = self.generate(self.policy, local)
        reference_texts = self.generate(self.reference, local) if self.reference is not None else [None] * len(local)
        samples = [{"step": self.example_counter, "prompt": ex["pair"].prompt, "policy": p, "reference": r} for ex, p, r in zip(local, policy_texts, reference_texts)]
        return self.gather({"samples": samples[:n_real]})["samples"]

    def evaluate_and_save(self, final: bool) -> None:
        if self.last_eval_at == self.example_counter and not final:
            return
        metrics = self.evaluate()
        self.log(metrics)
        print(f"eval at {self.example_counter} examples: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.config.sample_during_eval:
            samples = self.sample()
            for sample in samples if self.is_main else []:
                append_jsonl(self.run_dir / "samples.jsonl", sample)
            if self.wandb_run is not None:
                import wandb

                columns = ["step", "prompt", "policy", "reference"]
                self.wandb_run.log({"samples": wandb.Table(columns=columns, data=[[s[k] for k in columns] for s in samples])}, step=self.example_counter)
        self.last_eval_at = self.example_counter
        if final:
            self.save(self.run_dir / "LATEST", metrics, export_hf=True)
        elif self.example_counter > 0:
            self.save(self.run_dir / f"step-{self.example_counter}", metrics, export_hf=False)

    def log(self, metrics: dict[str, float]) -> None:
        if not self.is_main:
            return
        metrics = {**metrics, "counters/examples": self.example_counter, "counters/updates": self.batch_counter}
        append_jsonl(self.run_dir / "metrics.jsonl", {"step": self.example_counter, **metrics})
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=self.example_counter)

    # ---------------------------------------------------------------------------------------------------
    # Checkpoints, in the reference's format: {"step_idx": examples seen, "state": state_dict, "metrics": ...}.
    # States are full (unsharded) and keyed by parameter name, whatever the trainer, so that any trainer
    # resumes from any other's checkpoint.

    def save(self, output_dir: Path, metrics: dict[str, float], export_hf: bool) -> None:
        """Write policy.pt, optimizer.pt and scheduler.pt (and, if export_hf, a from_pretrained-ready copy
        of the policy and tokenizer) to a temporary directory, then swap it in whole. Every rank takes part
        in gathering the states; rank 0 writes."""
        if self.config.debug:
            return
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # the full states land on rank 0's CPU
        policy_state = get_model_state_dict(self.policy, options=options)
        optimizer_state = get_optimizer_state_dict(self.policy, self.optimizer, options=options)
        if not self.is_main:
            return
        tmp_dir = output_dir.with_name(output_dir.name + ".tmp")
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed save: none of it may leak into this one
        tmp_dir.mkdir(parents=True)
        for name, state in (("policy", policy_state), ("optimizer", optimizer_state), ("scheduler", self.scheduler.state_dict())):
            torch.save({"step_idx": self.example_counter, "state": state, "metrics": metrics}, tmp_dir / f"{name}.pt")
        if export_hf:
            self.policy.save_pretrained(tmp_dir, state_dict=policy_state)
            self.tokenizer.save_pretrained(tmp_dir)
        replace_dir(tmp_dir, output_dir)
        print(f"saved {output_dir}")

    def load_checkpoint(self, checkpoint_dir: Path) -> None:
        """Continue from a checkpoint: weights, optimizer and schedule state, and the position in the data.
        Rank 0 reads and checks the files; the states reach the other ranks by broadcast."""
        setting = f"resume_from={checkpoint_dir}"
        states = run_on_main(lambda: self.read_checkpoint(checkpoint_dir, setting))
        step_idx, scheduler_state = broadcast_object((states["policy"]["step_idx"], states["scheduler"]["state"]) if self.is_main else None)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1)
        set_model_state_dict(self.policy, states["policy"]["state"] if self.is_main else {}, options=options)
        set_optimizer_state_dict(self.policy, self.optimizer, states["optimizer"]["state"] if self.is_main else {}, options=options)
        load_state(self.scheduler, scheduler_state, setting, checkpoint_dir / "scheduler.pt")
        self.example_counter = step_idx
        self.batch_counter = step_idx // self.config.batch_size
        self.last_eval_at = step_idx
        print(f"resumed from {checkpoint_dir} at {step_idx} examples")

    def read_checkpoint(self, checkpoint_dir: Path, setting: str) -> dict[str, dict]:
        """The three checkpoint files, checked to fit this run, so that loading them cannot fail half-way
        through a broadcast."""
        states = {name: load_checkpoint_file(checkpoint_dir / f"{name}.pt", setting) for name in ("policy", "optimizer", "scheduler")}
        step_idx = states["policy"]["step_idx"]
        if step_idx % self.config.batch_size:
            raise UserError(f"{setting}: {step_idx} examples seen is not a multiple of batch_size={self.config.batch_size}")
        # DTensor shapes are global, so these are the full shapes whatever the sharding.
        expected = {name: tuple(value.shape) for name, value in self.policy.state_dict().items()}
        found = {name: tuple(value.shape) for name, value in states["policy"]["state"].items()}
        mismatches = [f"{name} is missing" for name in expected.keys() - found.keys()] + [f"{name} is unexpected" for name in found.keys() - expected.keys()]
        mismatches += [f"{name} has shape {list(found[name])}, expected {list(expected[name])}" for name in expected.keys() & found.keys() if found[name] != expected[name]]
        if mismatches:
            raise UserError(f"{setting}: {checkpoint_dir / 'policy.pt'} does not fit this {type(self.policy).__name__} ({sorted(mismatches)[0]})")
        optimizer_state = states["optimizer"]["state"]
        groups = optimizer_state.get("param_groups", [])
        unknown = [p for p in [p for group in groups for p in group.get("params", [])] + list(optimizer_state.get("state", {})) if p not in expected]
        if unknown:
            raise UserError(f"{setting}: {checkpoint_dir / 'optimizer.pt'} does not fit this {type(self.optimizer).__name__} (state for unknown parameter {unknown[0]!r})")
        if len(groups) != len(self.optimizer.param_groups):
            raise UserError(f"{setting}: {checkpoint_dir / 'optimizer.pt'} does not fit this {type(self.optimizer).__name__} ({len(groups)} parameter groups, expected {len(self.optimizer.param_groups)})")
        return states


class FSDPTrainer(BasicTrainer):
    """Shards parameters, gradients and optimizer state of the policy, and the reference's parameters, over all
    ranks with PyTorch FSDP2 (`fully_shard`, per transformer block); each rank trains on its slice of every
    batch (Zhao et al. 2023, "PyTorch FSDP")."""

    data_parallel = True
    autocast = False  # FSDP's MixedPrecisionPolicy casts the parameters instead

    def prepare_model(self, model: torch.nn.Module, is_policy: bool, compute_dtype: torch.dtype | None) -> nn.Module:
        config = self.config
        if is_policy and config.activation_checkpointing:
            checkpoint_blocks(model, config.model.block_name)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Parameters are gathered and gradients reduced in the compute dtype (buffers, e.g. Llama's rotary
        # frequencies, keep theirs).
        mixed_precision = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=compute_dtype)
        for block in find_blocks(model, config.model.block_name):
            fully_shard(block, mesh=mesh, mp_policy=mixed_precision)
        # The root (embeddings, final norm, head) reshards after each forward too, unlike FSDP2's default: evals,
        # sampling and the reference run forwards without a backward, which would leave it gathered.
        return fully_shard(model, mesh=mesh, mp_policy=mixed_precision, reshard_after_forward=True)

    def set_gradient_sync(self, enabled: bool) -> None:
        self.policy.set_requires_gradient_sync(enabled)


class TensorParallelTrainer(BasicTrainer):
    """Splits every attention and MLP projection of policy and reference over all ranks (DTensor tensor
    parallelism, Megatron-LM's column/row split: Shoeybi et al. 2019); every rank sees the whole batch."""

    def prepare_model(self, model: torch.nn.Module, is_policy: bool, compute_dtype: torch.dtype | None) -> nn.Module:
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # Split first: each split weight goes to the device as its shard, never whole.
        parallelize_module(model.base_model, mesh, tensor_parallel_plan(model, self.world_size))
        return super().prepare_model(model, is_policy, compute_dtype)
