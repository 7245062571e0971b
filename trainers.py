"""The training loop: optimizer steps over the batch schedule, evals and checkpoints at their cadence, logging.

One Trainer serves every `trainer=` name: what differs between BasicTrainer, FSDPTrainer and TensorParallelTrainer
is how models are placed and which ranks share a batch, which the Topology (distributed.py) decides. The Trainer
runs parts built for it (build.py): the objective on a micro-batch and what a loss reads of the whole batch
(core/step.py: BatchLoss over the scorer, scoring.py, and the reference, reference_cache.py), the optimizer
(optim.py), evaluation and sampling (evaluation.py). The loop's other parts are training/'s: the checkpoints it asks
for (training/checkpointer.py), its logs (training/run_log.py), what it counts of finished steps
(training/step_accounting.py) and the stop on a signal (training/stop_signals.py)."""

import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import math
import time
from dataclasses import dataclass
from pathlib import Path

import tqdm

from build import RunParts
from core.loss_scale import LossScale
from core.optim import clip_grad_norm
from core.step import Data
from judging.held_out import HeldOutWinRate
from modeling.reference_sync import SyncedReference
from persistence import reference_cache
from references import round_reference
from reporting.plots import write_plots
from reporting.telemetry import Throughput
from training.checkpointer import Checkpointer, checkpoint_parts
from training.device_steps import FinishedStep, device_steps
from training.run_log import RunLog
from training.step_accounting import StepAccounting
from training.stop_signals import StopSignals
from utils import UserError

PROGRESS_BAR = {"desc": "train", "unit": "step", "dynamic_ncols": True}


class Trainer:
    """Trains the policy against a reference (frozen, or moving: reference_sync.py) on this process's share of the
    topology: the parts come built (build.py); train() runs a round of optimizer steps over a schedule and may run
    again on new data, with the counters going on; finish() ends the run with a final eval, checkpoint and summary."""

    def __init__(self, parts: RunParts, run_dir: Path, wandb_run=None, more_parts: dict | None = None):
        """more_parts: stateful parts beyond the run's (a run of rounds' progress), by file name: saved with every
        checkpoint and resumed like the others."""
        self.config, self.topology, self.run_dir = parts.config, parts.topology, run_dir
        self.tokenizer, self.objective, self.data = parts.tokenizer, parts.objective, parts.data
        self.policy, self.reference_model = parts.policy, parts.reference_model
        self.optimizer, self.scheduler, self.loss_scale = parts.optimizer, parts.scheduler, parts.loss_scale
        self.deferred = device_steps(parts)  # None: each step waits for its verdict on the host
        self.scorer, self.batch_loss, self.evaluator = parts.scorer, parts.batch_loss, parts.evaluator
        self.sampler = parts.sampler  # the run's: its evals' win rate and samples, and a run of rounds, sample with it
        self.flops, self.peak_flops, self.precision = parts.flops, parts.peak_flops, parts.precision
        self.accumulation = parts.accumulation  # micro-batches a step (micro_batch_memory may choose more than given)
        self.synced = parts.reference if isinstance(parts.reference, SyncedReference) else None  # TR-DPO's
        self.log = RunLog(run_dir, wandb_run, self.topology.is_main, self.throughput)
        self.evals = Evals(self.config, self.topology, self.evaluator, self.sampler, self.tokenizer, run_dir, self.log)
        self.cadence = Cadence(
            self.config.eval_every, self.config.save_every or self.config.eval_every, self.config.do_first_eval
        )
        self.more_parts = dict(more_parts or {})
        held = {**checkpoint_parts(parts), **self.more_parts}
        self.checkpoints = Checkpointer(held, self.config, self.topology, run_dir, self.tokenizer)
        self.example_counter = self.batch_counter = 0
        limits = (self.config.max_nonfinite_steps, self.config.minimum_log_interval_secs)
        self.steps = StepAccounting(self.log, self.flops, self.throughput(), self.deferred, *limits)
        self.round_start = 0  # where the schedule being trained starts (a run of rounds': its round's)
        self.last_eval_at = None
        self.resumed_final, self.resumed_loop = False, {}  # resumed from the checkpoint that ended a run; its loop
        self.start_examples = 0
        if self.config.resume_from is not None:
            self.resume(Path(self.config.resume_from))
        self.start_time = time.time()

    def resume(self, checkpoint_dir: Path) -> None:
        """Continue where a checkpoint left off: every checkpoint part (weights, optimizer, scheduler, the
        objective's state), the data position and the loop's counters, and the logs cut back to it (later steps are
        redone and logged again). Every random draw (dropout, sampling) is seeded by (seed, step): there is no random
        state to restore."""
        c = self.config
        step, marker = self.checkpoints.load(checkpoint_dir)
        loop = marker.get("loop", {})
        self.example_counter, self.batch_counter = step, step // c.batch_size
        self.start_examples = step
        self.last_eval_at = loop.get("last_eval_at", step)  # older checkpoints were all written right after an eval
        self.steps.nonfinite.in_a_row = loop.get("nonfinite_in_a_row", 0)
        if self.synced is not None:  # its weights came with the checkpoint
            self.synced.resumed(self.batch_counter)
        # the run's end: nothing left, unless the run now asks for more steps (n_epochs, n_examples) or rounds
        self.resumed_final, self.resumed_loop = marker.get("final", False), loop
        self.log.truncate(step, evaluated=self.last_eval_at == step)

    def train_step(self, examples: list[dict]) -> dict[str, list[float]] | None:
        """One optimizer step over a global batch, in `accumulation` equal micro-batches. The step waits for the device
        once, at its end, for its metrics and gradient norm in one transfer; with sync_free_steps (self.deferred) not
        at all: the optimizer steps on the device, the metrics wait for the log interval's end (None here)."""
        self.policy.train()
        # Randomness in a step (LoRA's adapter dropout) is drawn from the step's own seed: a resumed run draws what
        # the uninterrupted one did, and tensor-parallel ranks draw alike.
        torch.manual_seed(self.config.seed + self.batch_counter)
        step, scaled = (examples, "train", self.config.batch_size, self.accumulation), self.loss_scale
        names, gathered = self.batch_loss.over_micro_batches(*step, backward=True, scale=scaled and scaled.scale)
        if scaled:  # once per step, whatever the micro-batches: clipping must see the true gradients
            scaled.unscale(self.optimizer)
        with torch.profiler.record_function("clip gradients"):  # named for python -m bench --profile
            grad_norm = clip_grad_norm(self.policy.parameters(), self.config.max_grad_norm)  # the same on every rank
        if self.deferred is not None:
            return self.deferred.step(names, gathered, grad_norm, examples, self.batch_counter + 1)
        metrics, finite = on_host(names, gathered, grad_norm, len(examples))
        metrics["lr"] = [self.scheduler.get_last_lr()[0]]  # the rate this step uses
        if finite:  # else the update would spoil the weights: it is skipped, and the run stops if that keeps happening
            self.objective.observe(metrics)
        failed = step_optimizer(self.optimizer, self.scheduler, scaled, finite, metrics)
        self.steps.nonfinite.count(not failed, self.batch_counter + 1, self.checkpoints.last, scaled)
        return metrics

    def train(self, data: Data | None = None, round_start: int | None = None) -> None:
        """A round: the steps of data's schedule, from now or from round_start (resumed inside it); None: the run's,
        from where a resume left off. Evals and checkpoints at their cadence; a signal stops it with a checkpoint."""
        if data is not None:
            if isinstance(self.batch_loss.reference, reference_cache.CachedReference):
                self.batch_loss.reference.require(self.batch_loss.reference_keys(data))
            self.data, self.round_start = data, self.batch_counter if round_start is None else round_start
        schedule = self.data.schedule
        done, disable = self.batch_counter - self.round_start, not self.topology.is_main
        if self.resumed_final and done >= len(schedule):
            print(f"{self.checkpoints.last} ends this run: nothing left to train")
            return
        progress = tqdm.tqdm(total=len(schedule), initial=done, disable=disable, **PROGRESS_BAR)
        self.steps.start_interval()
        with StopSignals() as stop, progress:
            for indices in schedule[done:]:
                self.evaluate_and_save_when_due()
                start = time.time()
                examples = self.data.train_examples.take(indices)
                step_metrics = self.train_step(examples)
                accounted = (self.batch_loss.live_reference, self.checkpoints.last, progress)
                if step_metrics is not None:
                    self.steps.add([FinishedStep(step_metrics, True, examples, 0, time.time() - start)], *accounted)
                self.example_counter += len(examples)
                self.batch_counter += 1
                progress.update()
                stopping = self.topology.any(stop.asked or self.log.failure is not None or self.checkpoints.failed())
                # The log interval also closes where a checkpoint may follow, so the log holds every step up to it.
                round_end = self.batch_counter == self.round_start + len(schedule)
                boundary = self.cadence.boundary(self.example_counter) or round_end
                self.steps.close_interval(stopping or boundary, self.counters(), *accounted)
                if self.synced is not None and self.synced.due(self.batch_counter):  # before the step's checkpoint
                    self.report({"reference/updates": self.synced.update(self.batch_counter)})
                if stopping:
                    self.log.check(self.topology, self.stopped)
                    self.checkpoint_now(wait=True)  # of the last finished step (an earlier one's failure stops here)
                    raise stop.interrupted(self.example_counter, self.checkpoints.last, self.run_dir)

    def finish(self) -> None:
        """The run's end: a final eval, checkpoint (LATEST, with the export) and summary; a signal now lets it end.
        Nothing where the run resumed from its final checkpoint and took no step since."""
        if self.resumed_final and self.example_counter == self.start_examples:
            return
        with StopSignals():
            final_metrics = self.evaluate()
            self.save(self.run_dir / "LATEST", final_metrics, final=True)
        started = (self.start_examples, self.start_time)
        self.log.summary(final_metrics, *self.counters(), *started, self.steps.speed, self.checkpoints.last)

    def counters(self) -> tuple[int, int]:
        """(examples seen, optimizer steps taken): the log's step and counters."""
        return self.example_counter, self.batch_counter

    def throughput(self) -> Throughput:
        """An empty tally of training steps' time, pairs, tokens and useful FLOPs (telemetry.py)."""
        return Throughput(self.peak_flops, self.topology.world_size, self.topology.device)

    def evaluate_and_save_when_due(self) -> None:
        """An eval and a checkpoint where the cadence puts them; a point done before a resume is not done again."""
        n, metrics = self.example_counter, {}
        if self.cadence.eval_due(n) and self.last_eval_at != n:
            metrics = self.evaluate()
        if self.cadence.save_due(n) and self.checkpoints.saved_at != n:
            self.save(self.run_dir / f"step-{n}", metrics)

    def checkpoint_now(self, wait: bool = False) -> None:
        """A step-N checkpoint of where training is, unless one was just written (wait: complete when this returns)."""
        if self.checkpoints.saved_at != self.example_counter:
            self.save(self.run_dir / f"step-{self.example_counter}", {}, wait=wait)

    def evaluate_unless_done(self) -> None:
        """An eval here, unless one was just made at this step."""
        if self.last_eval_at != self.example_counter:
            self.evaluate()

    def report(self, metrics: dict[str, float]) -> None:
        """A record of metrics (a round's) logged at the current step."""
        self.log.metrics(metrics, *self.counters())

    def sample(self, prompts: list[list[int]], images: list[bytes], seeds, keep_end=None) -> list[list[int]]:
        """The policy's completions of `prompts`, which sees their `images` (pack_images; b"": none), sampled as
        generation.* says from `seeds` (greedy where None), gathered in order on every rank (keep_end: Sampler's)."""
        g = self.config.generation
        return self.sampler.sample(self.policy, prompts, images, seeds, g.temperature, g.top_p, keep_end)

    def use_cached_reference(self, data: Data, directory: Path, digest: str | None = None) -> str | None:
        """The reference from here on: the cached log-probs of data's pairs and eval batches under the policy's
        weights now, or under the weights of `digest` (a resume inside a round: references.round_reference); the
        digest (None for a loss without a reference)."""
        if not self.objective.needs_reference:
            return None
        parts = (self.config, self.accumulation, self.topology, data, self.objective, self.scorer, self.precision)
        reference, digest = round_reference(*parts, self.policy, directory, digest)
        self.batch_loss.use_reference(reference)
        return digest

    def evaluate(self) -> dict[str, float]:
        """An eval (Evals) here; its metrics."""
        metrics = self.evals(self.policy, self.reference_model, *self.counters())
        self.last_eval_at = self.example_counter
        return metrics

    def save(self, output_dir: Path, metrics: dict[str, float], final: bool = False, wait: bool = False) -> None:
        """A checkpoint of where training is with the loop's counters (final: and the export; wait: done on return)."""
        self.log.check(self.topology, self.stopped)
        loop = dict(last_eval_at=self.last_eval_at, nonfinite_in_a_row=self.steps.nonfinite.in_a_row)
        try:
            self.checkpoints.save(output_dir, self.example_counter, metrics, loop, final, wait)
        except UserError as error:
            raise self.stopped(error) from None

    def stopped(self, error: UserError) -> UserError:
        """A write failure's line, with where the run stopped, what is safe and how to go on."""
        return self.checkpoints.stopped(error, self.example_counter)


def on_host(names: list[str], gathered: torch.Tensor, grad_norm: torch.Tensor, n: int) -> tuple[dict, bool]:
    """A step's metrics ([names, n] gathered on the device) and gradient norm, brought to the host in one transfer;
    whether the loss and the norm are finite (nonfinite_steps counts a step that is not)."""
    host = torch.cat([gathered.flatten(), grad_norm.reshape(1).to(gathered)]).cpu().tolist()
    metrics = {name: host[i * n : (i + 1) * n] for i, name in enumerate(names)}
    metrics["grad_norm"] = [host[-1]]
    finite = math.isfinite(host[-1]) and all(map(math.isfinite, metrics["loss/train"]))
    metrics["nonfinite_steps"] = [0.0 if finite else 1.0]
    return metrics, finite


def step_optimizer(optimizer, scheduler, loss_scale: LossScale | None, finite: bool, metrics: dict) -> bool:
    """The optimizer's step and then the schedule's where the step was finite (so that it ran at the rate logged), a
    float16 run's through its loss scale, which updates after every step and logs itself into `metrics`; the
    gradients cleared. Whether the step failed the run's way (max_nonfinite_steps): not finite, unless it was a
    float16 gradient overflow above the scale's floor, which is the scale's to fix (it halves), not the run's."""
    failed = not finite
    if loss_scale is not None:
        failed = loss_scale.finish(optimizer, finite, metrics)
    elif finite:
        optimizer.step()
    if finite:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return failed


class Evals:
    """What an eval does, apart from the loop that asks for it: the held-out metrics (evaluation.Evaluator), the
    policy's win rate against the reference where eval_winrate_prompts asks for it (winrate/eval), samples where
    sample_during_eval does, all logged; and plots.png redrawn."""

    def __init__(self, config, topology, evaluator, sampler, tokenizer, run_dir: Path, log: "RunLog"):
        self.config, self.topology, self.evaluator, self.run_dir, self.log = config, topology, evaluator, run_dir, log
        self.winrate = None
        if config.eval_winrate_prompts:
            self.winrate = HeldOutWinRate(config, topology, tokenizer, sampler, evaluator.eval_batches)

    def __call__(self, policy, reference_model, examples: int, updates: int) -> dict[str, float]:
        metrics = self.evaluator.evaluate(policy)
        if self.winrate is not None:
            metrics["winrate/eval"] = self.winrate(policy, reference_model)
        self.log.metrics(metrics, examples, updates)
        if self.config.plots and self.topology.is_main:
            self.log.write(lambda: write_plots(self.run_dir))
        print(f"eval at {examples} examples: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.config.sample_during_eval:
            self.log.samples(self.evaluator.sample(policy, reference_model, examples), examples, updates)
        return metrics


@dataclass(frozen=True)
class Cadence:
    """When evals and step-N checkpoints fall, by examples seen: an eval every eval_every (and at 0 with
    do_first_eval), a checkpoint every save_every (save_every=null: at each eval)."""

    eval_every: int
    save_every: int
    first_eval: bool

    def eval_due(self, examples: int) -> bool:
        return examples % self.eval_every == 0 and (examples > 0 or self.first_eval)

    def save_due(self, examples: int) -> bool:
        return examples > 0 and examples % self.save_every == 0

    def boundary(self, examples: int) -> bool:
        """Whether an eval or a checkpoint may fall here: a log interval closes here."""
        return examples % self.eval_every == 0 or examples % self.save_every == 0
