"""The training loop: optimizer steps over the batch schedule, evals and checkpoints at their cadence, logging.

One Trainer serves every `trainer=` name: what differs between BasicTrainer, FSDPTrainer and TensorParallelTrainer
is how models are placed and which ranks share a batch, which the Topology (distributed.py) decides. The rest is
composed: the objective (objective.py), the scorer that turns examples into log-probs (scoring.py), the reference
(reference_cache.py), the optimizer (optim.py), evaluation and sampling (evaluation.py) and checkpoints
(checkpoint.py)."""

import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import math
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import tqdm
from omegaconf import DictConfig, OmegaConf

import checkpoint
import reference_cache
from adapters import AdaptersDisabled, is_adapted
from distributed import Topology, parallelize
from evaluation import Evaluator
from layouts import ModelBatch
from models import find_blocks
from objective import build_objective
from optim import build_optimizer, build_scheduler, clip_grad_norm
from plots import write_plots
from precision import parse_dtype, resolve_compute_dtype
from preference_datasets import PreferencePair, prepare_examples
from report import data_report
from scoring import Scorer
from telemetry import ModelFlops, Throughput, peak_flops, step_amounts
from utils import Interrupted, UserError, append_jsonl, get_local_dir, truncate_jsonl

LOGS = ("metrics.jsonl", "samples.jsonl", "plots.png")  # what a run writes besides checkpoints


class Trainer:
    """Trains the policy against a frozen reference on this process's share of the topology."""

    def __init__(
        self,
        config: DictConfig,
        topology: Topology,
        policy: torch.nn.Module,
        load_reference: Callable[[], torch.nn.Module],
        tokenizer,
        data: dict[str, list[PreferencePair]],
        run_dir: Path,
        wandb_run=None,
    ):
        """load_reference: loads the frozen reference; called only if the run needs one."""
        c = self.config = config
        self.topology, self.tokenizer, self.run_dir, self.wandb_run = topology, tokenizer, run_dir, wandb_run
        if c.resume_from is not None:  # fail now rather than after tokenizing and the reference pass
            topology.run_on_main(lambda: checkpoint.preflight(Path(c.resume_from), policy, c.batch_size))
        self.cache_dir = get_local_dir(c.local_dirs)
        self.objective = build_objective(c.loss)
        autocast = not topology.fsdp  # FSDP's MixedPrecisionPolicy casts the parameters instead
        self.policy_compute = resolve_compute_dtype(c.model.fsdp_policy_mp, topology, self.cache_dir, autocast)
        self.train_examples, self.eval_batches, self.schedule = self.tokenize(data)

        # The reference computes like the policy (same weights dtype, same compute dtype) unless a dtype is given:
        # at step 0, policy == reference then holds to the last bit, so rewards are 0 and the loss ln 2.
        reference_dtype = parse_dtype(c.model.reference_dtype, "model.reference_dtype", allow_auto=True)
        self.reference_compute = self.policy_compute if reference_dtype == "auto" else None
        cached = self.objective.needs_reference and c.reference_cache
        initial_weights = reference_cache.weights_digest(policy) if cached else None  # before sharding: whole
        self.flops = ModelFlops.of(policy, find_blocks(policy, c.model.block_name))
        weights_dtype = next(policy.parameters()).dtype
        self.policy = self.place(policy, self.policy_compute, is_policy=True)
        # The layout, attention and head checks run on the placed model: on its device, once, decided by rank 0.
        self.scorer = Scorer.create(self.policy, c, tokenizer.pad_token_id, topology, autocast, self.policy_compute)
        self.reference, self.reference_model = self.build_reference(initial_weights, load_reference, reference_dtype)
        self.peak_flops, source = topology.broadcast(
            topology.run_on_main(
                lambda: peak_flops(topology.device, self.policy_compute or weights_dtype, self.cache_dir)
            )
        )
        print(f"MFU is measured against {self.peak_flops / 1e12:.3g} TFLOP/s per device ({source})")

        # Built after sharding and before any forward pass: FSDP then hands it the sharded parameters each rank owns.
        knobs = OmegaConf.to_container(c.optimizer_kwargs)
        trainable = [p for p in self.policy.parameters() if p.requires_grad]  # with LoRA, the adapters only
        self.optimizer = build_optimizer(c.optimizer, trainable, c.lr, knobs)
        self.scheduler = build_scheduler(self.optimizer, c.warmup_steps)
        self.evaluator = Evaluator(c, topology, tokenizer, self.eval_batches, self.batch_metrics)
        self.example_counter = self.batch_counter = self.nonfinite_in_a_row = 0
        self.last_eval_at = self.last_saved_at = self.last_checkpoint = None
        self.finished = False  # resumed from the checkpoint that ends this run
        if c.resume_from is not None:
            self.resume(Path(c.resume_from))

    def resume(self, checkpoint_dir: Path) -> None:
        """Continue where a checkpoint left off: weights, optimizer, scheduler and the objective's state, the data
        position and the loop's counters, and the logs cut back to it (later steps are redone and logged again).
        Every random draw (dropout, sampling) is seeded by (seed, step): there is no random state to restore."""
        c = self.config
        step, objective_state, marker = checkpoint.load(
            checkpoint_dir, self.policy, self.optimizer, self.scheduler, c.batch_size, self.topology
        )
        self.objective.state.update(objective_state)
        loop = marker.get("loop", {})
        self.example_counter, self.batch_counter = step, step // c.batch_size
        self.last_eval_at = loop.get("last_eval_at", step)  # older checkpoints were all written right after an eval
        self.nonfinite_in_a_row = loop.get("nonfinite_in_a_row", 0)
        self.last_saved_at, self.last_checkpoint = step, checkpoint_dir
        self.finished = marker.get("final", False) and self.batch_counter >= len(self.schedule)
        if self.topology.is_main:  # at the checkpoint's own step, the eval only if it came before the checkpoint
            evaluated = self.last_eval_at == step
            kept = lambda r: r["step"] < step or r["step"] == step and (evaluated or "loss/eval" not in r)  # noqa: E731
            truncate_jsonl(self.run_dir / "metrics.jsonl", kept)
            truncate_jsonl(
                self.run_dir / "samples.jsonl", lambda r: r["step"] < step or evaluated and r["step"] == step
            )

    def tokenize(self, data: dict[str, list[PreferencePair]]) -> tuple[list[dict], list[list[dict]], list[list[int]]]:
        """Token ids of every example, once per run: (training examples, eval batches, the training schedule); the
        data report says what they are."""
        c = self.config
        train_examples, eval_examples, schedule = prepare_examples(data, self.objective, self.tokenizer, c)
        if self.topology.is_main:
            print(data_report(train_examples, eval_examples, self.tokenizer, c.max_length, c.max_prompt_length))
        print(f"{len(schedule)} steps of {c.batch_size} examples")
        size = c.eval_batch_size
        return train_examples, [eval_examples[i : i + size] for i in range(0, len(eval_examples), size)], schedule

    def build_reference(self, initial_weights: str | None, load: Callable[[], torch.nn.Module], reference_dtype):
        """(the reference's log-probs: cached, live or None for a loss without one; the reference model, kept only
        to score live or to sample from)."""
        c = self.config
        if not self.objective.needs_reference:
            return None, None
        model = reference = None
        if c.reference_cache:
            entries = self.cached_reference_logps(initial_weights, load, reference_dtype)
            reference = reference_cache.CachedReference(entries, self.topology.device)
        if is_adapted(self.policy):  # LoRA: the base model, the policy with its adapters disabled
            model = AdaptersDisabled(self.policy)
        elif not c.reference_cache or c.sample_during_eval:
            model = self.place(load().requires_grad_(False), self.reference_compute)
        if not c.reference_cache:
            reference = reference_cache.LiveReference(model, self.scorer, self.reference_compute)
        return reference, model

    def place(self, model: torch.nn.Module, compute_dtype: torch.dtype | None, is_policy: bool = False):
        """The model placed on this run's topology; compute_dtype: the dtype it computes in (None: its weights')."""
        c = self.config
        checkpointing = is_policy and c.activation_checkpointing
        reduce_dtype = parse_dtype(c.model.fsdp_reduce_dtype, "model.fsdp_reduce_dtype")
        return parallelize(model, self.topology, compute_dtype, c.model.block_name, checkpointing, reduce_dtype)

    def cached_reference_logps(self, weights: str, load: Callable[[], torch.nn.Module], reference_dtype) -> dict:
        """Reference log-probs of every pair that training and eval will use, by pair key (reference_cache.fill).
        With model.reference_dtype=auto the initial policy itself computes them, through its own precision path
        and on the same micro-batches as the first epoch's steps and the evals, so that at step 0 policy and
        reference agree to the last bit; no reference is loaded."""
        c = self.config
        weights_dtype = c.model.policy_dtype if reference_dtype == "auto" else c.model.reference_dtype
        micro = [size // c.gradient_accumulation_steps for size in (c.batch_size, c.eval_batch_size)]
        how = "autocast" if self.scorer.autocast else "FSDP"
        computation = (
            f"{weights_dtype} weights, {self.reference_compute or 'no'} {how} compute, {self.scorer.describe()}, "
            f"{self.topology.describe()}, micro-batches of {micro[0]} and {micro[1]}, seed {c.seed}"
        )
        path = reference_cache.cache_path(self.cache_dir, weights, computation)
        first_use = [self.train_examples[i] for i in dict.fromkeys(i for indices in self.schedule for i in indices)]

        def model_and_compute():
            if reference_dtype == "auto":
                return self.policy, self.policy_compute
            return self.place(load().requires_grad_(False), self.reference_compute), self.reference_compute

        return reference_cache.fill(
            path,
            weights,
            computation,
            first_use,
            self.eval_batches,
            (c.batch_size, c.eval_batch_size),
            c.gradient_accumulation_steps,
            model_and_compute,
            self.scorer,
            self.topology,
        )

    def batch_metrics(
        self, examples: list[dict], split: str, batch: ModelBatch | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the examples, and per-example metrics ([B] tensors on the device) named as in the
        reference; batch: the examples already laid out, else they are laid out here."""
        batch = batch or self.scorer.batch(examples)  # built once: policy and a live reference share it
        policy_logps = self.scorer(self.policy, batch, self.policy_compute)
        reference_logps = self.reference(examples, batch) if self.reference is not None else None
        return self.objective(policy_logps, reference_logps, batch.sequence_lengths, split)

    def train_step(self, examples: list[dict]) -> dict[str, list[float]]:
        """One optimizer step over a global batch, in gradient_accumulation_steps equal micro-batches. The step
        waits for the device once, at its end: for its gathered metrics and gradient norm, in one transfer."""
        self.policy.train()
        # Randomness in a step (LoRA's adapter dropout) is drawn from the step's own seed: a resumed run draws what
        # the uninterrupted one did, and tensor-parallel ranks draw alike.
        torch.manual_seed(self.config.seed + self.batch_counter)
        accumulation = self.config.gradient_accumulation_steps
        columns = defaultdict(list)
        for micro_batch in self.topology.micro_batches(examples, self.config.batch_size, accumulation)[0]:
            batch = self.scorer.batch(micro_batch)
            loss, batch_metrics = self.batch_metrics(micro_batch, "train", batch)
            # Each rank's loss is the mean over its share; averaging gradients over ranks gives the batch mean.
            (loss / accumulation).backward()
            for name, values in batch_metrics.items():
                columns[name].append(values.detach().float())
            # the positions this micro-batch computed, shared out over its examples so that they add up over ranks
            columns["perf/computed_tokens"].append(
                torch.full_like(columns[name][-1], batch.n_tokens / len(micro_batch))
            )
        names = sorted(columns)
        gathered = self.topology.gather_columns(torch.stack([torch.cat(columns[n]) for n in names]), len(examples))
        grad_norm = clip_grad_norm(self.policy.parameters(), self.config.max_grad_norm)  # the same on every rank
        host = torch.cat([gathered.flatten(), grad_norm.reshape(1).to(gathered)]).cpu().tolist()
        metrics = {name: host[i * len(examples) : (i + 1) * len(examples)] for i, name in enumerate(names)}
        metrics["grad_norm"] = [host[-1]]
        metrics["lr"] = [self.scheduler.get_last_lr()[0]]  # the rate this step uses
        finite = math.isfinite(host[-1]) and all(map(math.isfinite, metrics["loss/train"]))
        metrics["nonfinite_steps"] = [0.0 if finite else 1.0]
        if finite:
            self.objective.observe(metrics)
            self.optimizer.step()
            self.scheduler.step()
            self.nonfinite_in_a_row = 0
        else:  # the update would spoil the weights: skip it, and stop if it keeps happening
            self.nonfinite_in_a_row += 1
            self.stop_if_diverged()
        self.optimizer.zero_grad(set_to_none=True)
        return metrics

    def stop_if_diverged(self) -> None:
        allowed = self.config.max_nonfinite_steps
        if self.nonfinite_in_a_row >= allowed:
            raise UserError(
                f"{self.nonfinite_in_a_row} optimizer steps in a row had a non-finite loss or gradient norm and were "
                f"skipped (max_nonfinite_steps={allowed}), the last at step {self.batch_counter + 1}; stopping. "
                f"The last checkpoint is {self.last_checkpoint or 'none (none was written yet)'}; lower lr or check "
                "the data"
            )

    def train(self) -> None:
        c = self.config
        if self.finished:
            print(f"{self.last_checkpoint} ends this run: nothing left to train")
            return
        progress = tqdm.tqdm(
            total=len(self.schedule),
            initial=self.batch_counter,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=not self.topology.is_main,
        )
        interval = defaultdict(list)
        interval_speed, run_speed = self.throughput(), self.throughput()
        last_log = start_time = time.time()
        start_examples = self.example_counter
        live_reference = isinstance(self.reference, reference_cache.LiveReference)
        with StopSignals() as stop, progress:
            for indices in self.schedule[self.batch_counter :]:
                self.evaluate_and_save_when_due()
                start = time.time()
                examples = [self.train_examples[i] for i in indices]
                step_metrics = self.train_step(examples)
                computed = sum(step_metrics.pop("perf/computed_tokens"))
                amounts = step_amounts(examples, time.time() - start, computed, self.flops, live_reference)
                interval_speed.add(**amounts)
                run_speed.add(**amounts)
                for name, values in step_metrics.items():
                    interval[name].extend(values)
                self.example_counter += len(examples)
                self.batch_counter += 1
                progress.update()
                progress.set_postfix(loss=f"{sum(interval['loss/train']) / len(interval['loss/train']):.4f}")
                stopping = self.topology.any(stop.received is not None)
                # Metrics of every step count: they are averaged over the interval, not sampled at its end. The
                # interval also closes where a checkpoint may follow, so the log holds every step up to it.
                if time.time() - last_log >= c.minimum_log_interval_secs or stopping or self.at_boundary():
                    record = {name: sum(values) / len(values) for name, values in interval.items()}
                    self.log({**record, **interval_speed.rates()})
                    interval, interval_speed = defaultdict(list), self.throughput()
                    last_log = time.time()
                if stopping:
                    self.stop(stop.received)
            final_metrics = self.evaluate()  # a signal from here on lets the run finish: little is left
            self.save(self.run_dir / "LATEST", final_metrics, final=True)
        self.summarize(final_metrics, start_examples, time.time() - start_time, run_speed)

    def throughput(self) -> Throughput:
        """An empty tally of training steps' time, pairs, tokens and useful FLOPs (telemetry.py)."""
        return Throughput(self.peak_flops, self.topology.world_size, self.topology.device)

    @property
    def save_interval(self) -> int:
        """Examples between step-N checkpoints: save_every, or eval_every by default."""
        return self.config.save_every or self.config.eval_every

    def at_boundary(self) -> bool:
        """Whether an eval or a checkpoint may fall here, or training ends here."""
        n = self.example_counter
        return (
            n % self.config.eval_every == 0 or n % self.save_interval == 0 or self.batch_counter == len(self.schedule)
        )

    def evaluate_and_save_when_due(self) -> None:
        """Evaluate every eval_every examples; checkpoint every save_every (default: at each eval). A point done
        before a resume is not done again."""
        c, n = self.config, self.example_counter
        metrics = {}
        if n % c.eval_every == 0 and (n > 0 or c.do_first_eval) and self.last_eval_at != n:
            metrics = self.evaluate()
        if n > 0 and n % self.save_interval == 0 and self.last_saved_at != n:
            self.save(self.run_dir / f"step-{n}", metrics)

    def stop(self, signum: int) -> None:
        """Stop on a signal, with a checkpoint of the last finished step."""
        name = signal.Signals(signum).name
        if self.last_saved_at != self.example_counter:
            self.save(self.run_dir / f"step-{self.example_counter}", {})
        where = f"the checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint (debug=true)"
        raise Interrupted(
            f"stopped by {name} after {self.example_counter} examples; {where}. To continue, run the same command "
            f"with resume_from=auto local_run_dir={self.run_dir}",
            signum,
        )

    def summarize(self, final_metrics: dict[str, float], start_examples: int, seconds: float, speed: Throughput):
        """The run in a few lines: what was trained, how fast, how it ended, and where it is."""
        trained = self.example_counter - start_examples
        where = self.last_checkpoint or "nowhere (debug=true)"
        evals = ", ".join(f"{name}={value:.4f}" for name, value in final_metrics.items())
        print(
            f"done: {trained} examples in {self.batch_counter} steps"
            + (f" (resumed at {start_examples})" if start_examples else "")
            + f", {seconds / 60:.1f} min, {trained / max(seconds, 1e-9):.2f} pairs/s with evals and checkpoints\n"
            f"training steps: {speed.describe()}\n"
            f"final eval: {evals}\ncheckpoint and from_pretrained export: {where}; metrics: "
            f"{self.run_dir / 'metrics.jsonl'}"
        )

    def evaluate(self) -> dict[str, float]:
        """Evaluate (and sample), log it and redraw the plots; the eval metrics."""
        metrics = self.evaluator.evaluate(self.policy)
        self.log(metrics)
        if self.config.plots and self.topology.is_main:
            write_plots(self.run_dir)
        print(f"eval at {self.example_counter} examples: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.config.sample_during_eval:
            self.log_samples(self.evaluator.sample(self.policy, self.reference_model, self.example_counter))
        self.last_eval_at = self.example_counter
        return metrics

    def save(self, output_dir: Path, metrics: dict[str, float], final: bool = False) -> None:
        """A checkpoint of policy, optimizer and scheduler (see checkpoint.py) and of the loop's counters; final: also
        a from_pretrained copy of policy and tokenizer. keep_last prunes older step-N ones. Nothing is written under
        debug=true."""
        c = self.config
        if c.debug:
            return
        loop = {"last_eval_at": self.last_eval_at, "nonfinite_in_a_row": self.nonfinite_in_a_row}
        try:
            checkpoint.save(
                output_dir,
                self.example_counter,
                metrics,
                self.policy,
                self.optimizer,
                self.scheduler,
                self.topology,
                self.objective.state,
                loop,
                self.tokenizer if final else None,
            )
        except UserError as error:
            last = self.last_checkpoint or "none yet"
            raise UserError(f"{error}; the last complete checkpoint, {last}, is intact") from None
        self.last_checkpoint, self.last_saved_at = output_dir, self.example_counter
        if c.keep_last is not None and not final:
            self.topology.run_on_main(lambda: checkpoint.prune(self.run_dir, c.keep_last))

    def log(self, metrics: dict[str, float]) -> None:
        if not self.topology.is_main:
            return
        metrics = {**metrics, "counters/examples": self.example_counter, "counters/updates": self.batch_counter}
        append_jsonl(self.run_dir / "metrics.jsonl", {"step": self.example_counter, **metrics})
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=self.example_counter)

    def log_samples(self, samples: list[dict]) -> None:
        if not self.topology.is_main:
            return
        for sample in samples:
            append_jsonl(self.run_dir / "samples.jsonl", sample)
        if self.wandb_run is not None:
            import wandb

            columns = ["step", "prompt", "policy", "reference"]
            table = wandb.Table(columns=columns, data=[[s[k] for k in columns] for s in samples])
            self.wandb_run.log({"samples": table}, step=self.example_counter)


class StopSignals:
    """SIGINT (Ctrl-C) and SIGTERM (a scheduler's preemption, torchrun's shutdown) ask the loop to stop after the
    current step, with a checkpoint; a second Ctrl-C interrupts at once. Handlers can only be set in the main thread;
    elsewhere (a test's thread) signals keep their usual effect."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.previous = {signum: signal.signal(signum, self.handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            print(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint", flush=True)
            self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exception) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
