"""The training loop: optimizer steps over the batch schedule, evals and checkpoints at their cadence, logging.

One Trainer serves every `trainer=` name: what differs between BasicTrainer, FSDPTrainer and TensorParallelTrainer
is how models are placed and which ranks share a batch, which the Topology (distributed.py) decides. The Trainer
runs parts built for it (build.py): the objective on a micro-batch and what a loss reads of the whole batch
(core/step.py: BatchLoss over the scorer, scoring.py, and the reference, reference_cache.py), the optimizer
(optim.py), evaluation and sampling (evaluation.py); checkpoints are checkpoint.py's, written through the
Checkpointer (its `parts`)."""

import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import math
import signal
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import tqdm

from build import RunParts
from core.evaluation import HeldOutWinRate
from core.optim import clip_grad_norm
from core.step import Data
from modeling.reference_sync import SyncedReference
from persistence import checkpoint, reference_cache
from reporting.plots import write_plots
from reporting.telemetry import Throughput, step_amounts
from storage import append_jsonl, truncate_jsonl
from utils import Interrupted, UserError, metric_mean

PROGRESS_BAR = {"desc": "train", "unit": "step", "dynamic_ncols": True}
LOGS = ("metrics.jsonl", "samples.jsonl", "plots.png")  # what a run writes besides checkpoints


class Trainer:
    """Trains the policy against a reference (frozen, or moving: reference_sync.py) on this process's share of the
    topology: the parts come built (build.py); train() runs a round of optimizer steps over a schedule and may run
    again on new data, with the counters going on; finish() ends the run with a final eval, checkpoint and summary."""

    def __init__(self, parts: RunParts, run_dir: Path, wandb_run=None):
        self.config, self.topology, self.run_dir = parts.config, parts.topology, run_dir
        self.tokenizer, self.objective, self.data = parts.tokenizer, parts.objective, parts.data
        self.policy, self.reference_model = parts.policy, parts.reference_model
        self.optimizer, self.scheduler = parts.optimizer, parts.scheduler
        self.scorer, self.batch_loss, self.evaluator = parts.scorer, parts.batch_loss, parts.evaluator
        self.flops, self.peak_flops, self.precision = parts.flops, parts.peak_flops, parts.precision
        self.synced = parts.reference if isinstance(parts.reference, SyncedReference) else None  # TR-DPO's
        self.log = RunLog(run_dir, wandb_run, self.topology.is_main, self.throughput)
        self.evals = Evals(self.config, self.topology, self.evaluator, self.tokenizer, run_dir, self.log)
        self.cadence = Cadence(
            self.config.eval_every, self.config.save_every or self.config.eval_every, self.config.do_first_eval
        )
        self.checkpoints = Checkpointer(checkpoint_parts(parts), self.config, self.topology, run_dir, self.tokenizer)
        self.example_counter = self.batch_counter = 0
        self.nonfinite = NonfiniteSteps(self.config.max_nonfinite_steps)
        self.round_start, self.round_state = 0, None  # where this round's schedule starts; rounds.py's round state
        self.last_eval_at = None
        self.finished = False  # resumed from the checkpoint that ends this run
        self.start_examples, self.speed = 0, self.throughput()
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
        self.nonfinite.in_a_row = loop.get("nonfinite_in_a_row", 0)
        self.round_state = loop.get("round")
        if self.synced is not None:  # its weights came with the checkpoint
            self.synced.resumed(self.batch_counter)
        # the run's end, unless it now asks for more steps (n_epochs, n_examples) or rounds (rounds.n)
        rounds = self.round_state
        left = rounds["round"] + 1 < c.rounds.n if rounds else self.batch_counter < len(self.data.schedule)
        self.finished = marker.get("final", False) and not left
        self.log.truncate(step, evaluated=self.last_eval_at == step)

    def train_step(self, examples: list[dict]) -> dict[str, list[float]]:
        """One optimizer step over a global batch, in gradient_accumulation_steps equal micro-batches. The step
        waits for the device once, at its end: for its gathered metrics and gradient norm, in one transfer."""
        self.policy.train()
        # Randomness in a step (LoRA's adapter dropout) is drawn from the step's own seed: a resumed run draws what
        # the uninterrupted one did, and tensor-parallel ranks draw alike.
        torch.manual_seed(self.config.seed + self.batch_counter)
        accumulation = self.config.gradient_accumulation_steps
        columns = defaultdict(list)
        micro_batches, _ = self.topology.micro_batches(examples, self.config.batch_size, accumulation)
        coupled = self.batch_loss.couple(examples, self.config.batch_size, accumulation)  # what it reads of the batch
        for index, micro_batch in enumerate(micro_batches):
            batch = self.scorer.batch(micro_batch)
            loss, batch_metrics = self.batch_loss(micro_batch, "train", batch, coupled and coupled.part(index))
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
        with torch.profiler.record_function("clip gradients"):  # named for python -m bench --profile
            grad_norm = clip_grad_norm(self.policy.parameters(), self.config.max_grad_norm)  # the same on every rank
        host = torch.cat([gathered.flatten(), grad_norm.reshape(1).to(gathered)]).cpu().tolist()
        metrics = {name: host[i * len(examples) : (i + 1) * len(examples)] for i, name in enumerate(names)}
        metrics["grad_norm"] = [host[-1]]
        metrics["lr"] = [self.scheduler.get_last_lr()[0]]  # the rate this step uses
        finite = math.isfinite(host[-1]) and all(map(math.isfinite, metrics["loss/train"]))
        metrics["nonfinite_steps"] = [0.0 if finite else 1.0]
        if finite:  # else the update would spoil the weights: it is skipped, and the run stops if that keeps happening
            self.objective.observe(metrics)
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite.count(finite, self.batch_counter + 1, self.checkpoints.last)
        return metrics

    def train(self, data: Data | None = None, round_start: int | None = None) -> None:
        """A round: the steps of data's schedule, from now or from round_start (resumed inside it); None: the run's,
        from where a resume left off. Evals and checkpoints at their cadence; a signal stops it with a checkpoint."""
        if data is not None:
            if isinstance(self.batch_loss.reference, reference_cache.CachedReference):
                self.batch_loss.reference.require(self.batch_loss.reference_keys(data))
            self.data, self.round_start = data, self.batch_counter if round_start is None else round_start
            self.evaluator.eval_batches = data.eval_batches
        if self.finished:
            print(f"{self.checkpoints.last} ends this run: nothing left to train")
            return
        c, schedule = self.config, self.data.schedule
        done, disable = self.batch_counter - self.round_start, not self.topology.is_main
        progress = tqdm.tqdm(total=len(schedule), initial=done, disable=disable, **PROGRESS_BAR)
        last_log = time.time()
        with StopSignals() as stop, progress:
            for indices in schedule[done:]:
                self.evaluate_and_save_when_due()
                start = time.time()
                examples = self.data.train_examples.take(indices)
                step_metrics = self.train_step(examples)
                computed = sum(step_metrics.pop("perf/computed_tokens"))
                amounts = step_amounts(examples, time.time() - start, computed, self.flops, self.live_reference)
                self.speed.add(**amounts)
                self.example_counter += len(examples)
                self.batch_counter += 1
                progress.update()
                progress.set_postfix(loss=f"{self.log.add_step(step_metrics, amounts):.4f}")
                stopping = self.topology.any(stop.asked or self.log.failure is not None or self.checkpoints.failed())
                # Metrics of every step count: they are averaged over the interval, not sampled at its end. The
                # interval also closes where a checkpoint may follow, so the log holds every step up to it.
                round_end = self.batch_counter == self.round_start + len(schedule)
                boundary = self.cadence.boundary(self.example_counter) or round_end
                if time.time() - last_log >= c.minimum_log_interval_secs or stopping or boundary:
                    self.log.close_interval(*self.counters())
                    last_log = time.time()
                if self.synced is not None and self.synced.due(self.batch_counter):
                    self.move_reference()  # before this step's checkpoint, which holds the moved reference
                if stopping:
                    self.log.check(self.topology, self.stopped)
                    self.checkpoint_now(wait=True)  # of the last finished step (an earlier one's failure stops here)
                    raise stop.interrupted(self.example_counter, self.checkpoints.last, self.run_dir)

    @property
    def live_reference(self) -> bool:
        """Whether a step runs the reference's forward pass (its FLOPs count in MFU)."""
        return self.batch_loss.reference is not None and self.batch_loss.reference.live

    def move_reference(self) -> None:
        """TR-DPO's update of the reference after this step (reference_sync.py), logged with the updates so far."""
        self.synced.update()
        self.log.metrics({"reference/updates": self.synced.updates}, *self.counters())
        print(f"reference: update {self.synced.updates} after step {self.batch_counter}, alpha {self.synced.alpha:g}")

    def finish(self) -> None:
        """The run's end: a final eval, checkpoint (LATEST, with the export) and summary; a signal now lets it end."""
        if self.finished:
            return
        with StopSignals():
            final_metrics = self.evaluate()
            self.save(self.run_dir / "LATEST", final_metrics, final=True)
        started = (self.start_examples, self.start_time)
        self.log.summary(final_metrics, *self.counters(), *started, self.speed, self.checkpoints.last)

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

    def evaluate(self) -> dict[str, float]:
        """An eval (Evals) here; its metrics."""
        metrics = self.evals(self.policy, self.reference_model, *self.counters())
        self.last_eval_at = self.example_counter
        return metrics

    def save(self, output_dir: Path, metrics: dict[str, float], final: bool = False, wait: bool = False) -> None:
        """A checkpoint of where training is with the loop's counters (final: and the export; wait: done on return)."""
        self.log.check(self.topology, self.stopped)
        loop = dict(last_eval_at=self.last_eval_at, nonfinite_in_a_row=self.nonfinite.in_a_row, round=self.round_state)
        try:
            self.checkpoints.save(output_dir, self.example_counter, metrics, loop, final, wait)
        except UserError as error:
            raise self.stopped(error) from None

    def stopped(self, error: UserError) -> UserError:
        """A write failure's line, with where the run stopped, what is safe and how to go on."""
        return self.checkpoints.stopped(error, self.example_counter)


class Evals:
    """What an eval does, apart from the loop that asks for it: the held-out metrics (evaluation.Evaluator), the
    policy's win rate against the reference where eval_winrate_prompts asks for it (winrate/eval), samples where
    sample_during_eval does, all logged; and plots.png redrawn."""

    def __init__(self, config, topology, evaluator, tokenizer, run_dir: Path, log: "RunLog"):
        self.config, self.topology, self.evaluator, self.run_dir, self.log = config, topology, evaluator, run_dir, log
        self.winrate = None
        if config.eval_winrate_prompts:
            batches = evaluator.eval_batches
            self.winrate = HeldOutWinRate(config, topology, tokenizer, evaluator.sampler, batches)

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


def checkpoint_parts(parts: RunParts) -> dict:
    """What a checkpoint holds, by file name: a new stateful part is one entry here."""
    held = {
        "policy": checkpoint.ModelWeights(parts.policy),
        "optimizer": checkpoint.OptimizerState(parts.policy, parts.optimizer),
        "scheduler": parts.scheduler,
        "objective": parts.objective,
    }
    if isinstance(parts.reference, SyncedReference):  # the moved reference's weights
        held["reference"] = checkpoint.ChosenWeights(parts.reference.owner, parts.reference.state)
    return held


class Checkpointer:
    """The run's checkpoints, apart from the loop that asks for them: the parts a checkpoint holds (by file name),
    the last complete checkpoint, and keep_last's pruning. Nothing is written under debug=true. With save_async=true
    a step-N checkpoint is written in the background while training goes on (checkpoint.save_in_background), one
    at a time: a save waits for the one before, and so does the run's end (this is a context manager: the run ends
    with it, however it ends)."""

    def __init__(self, parts: dict, config, topology, run_dir: Path, tokenizer):
        self.parts, self.config, self.topology, self.run_dir, self.tokenizer = (
            parts,
            config,
            topology,
            run_dir,
            tokenizer,
        )
        self.last: Path | None = None  # the last complete checkpoint, written or resumed from
        self.saved_at: int | None = None  # the example count it was written (or is being written) at
        self.in_flight: checkpoint.BackgroundSave | None = None
        self.in_background = config.save_async and not config.debug
        if self.in_background:
            self.process_group = checkpoint.save_process_group(config.distributed_timeout_secs)

    def load(self, directory: Path) -> tuple[int, dict]:
        """Every part from the checkpoint in `directory` (checkpoint.load); (its step, its marker)."""
        step, marker = checkpoint.load(directory, self.parts, self.config.batch_size, self.topology)
        self.last, self.saved_at = directory, step
        return step, marker

    def save(self, directory: Path, step: int, metrics: dict[str, float], loop: dict, final: bool, wait=False) -> None:
        """A checkpoint of every part at `step` (checkpoint.save); keep_last prunes older step-N ones. With
        save_async=true a step-N one is written in the background, once the one before is complete (and complete
        when this returns, with `wait`)."""
        if self.config.debug:
            return
        self.wait()
        keep_last, previous = self.config.keep_last, self.last
        if self.in_background and not final:
            self.in_flight = checkpoint.save_in_background(
                directory,
                step,
                metrics,
                self.parts,
                self.topology,
                loop,
                self.tokenizer,
                previous,
                keep_last,
                self.process_group,
            )
            self.saved_at = step
            if wait:
                self.wait()
            return
        checkpoint.save(
            directory, step, metrics, self.parts, self.topology, loop, self.tokenizer, final, previous, keep_last
        )
        self.last, self.saved_at = directory, step
        if keep_last is not None and not final:
            self.topology.run_on_main(lambda: checkpoint.prune(self.run_dir, keep_last))

    def failed(self) -> bool:
        """Whether the checkpoint written in the background failed (this rank's view; the next save, or wait(),
        raises the failure, the same on every rank). One that completed is the last complete checkpoint from now
        on."""
        if self.in_flight is not None and self.in_flight.done() and not self.in_flight.failed():
            self.last, self.in_flight = self.in_flight.directory, None
        return self.in_flight is not None and self.in_flight.failed()

    def wait(self) -> None:
        """The checkpoint written in the background, if any, complete (the last complete checkpoint), or its failure
        raised on every rank."""
        if self.in_flight is not None:
            pending, self.in_flight = self.in_flight, None
            pending.wait()
            self.last = pending.directory

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        """The run ends: a checkpoint still written in the background is completed first, unless a second Ctrl-C
        asks to stop at once (the half-written directory is never taken for a checkpoint); its failure does not
        hide the error the run ends with."""
        if kind is KeyboardInterrupt:
            return
        try:
            self.wait()
        except UserError:
            if kind is None:
                raise

    def stopped(self, error: UserError, examples: int) -> UserError:
        """A write failure's line, with where the run stopped, what is safe and how to go on."""
        if self.last is None:
            kept = "no checkpoint was written yet"
        elif checkpoint.describe(self.last) is None:
            kept = f"no complete checkpoint is left ({self.last} is gone)"
        else:
            kept = f"the last complete checkpoint, {self.last}, is intact"
        return UserError(
            f"{error}; stopped after {examples} examples, {kept}. To continue once that is fixed, run the same "
            f"command with resume_from=auto local_run_dir={self.run_dir}"
        )


@dataclass
class NonfiniteSteps:
    """Optimizer steps skipped for a non-finite loss or gradient norm, counted in a row: the run stops with one line
    once `allowed` were."""

    allowed: int
    in_a_row: int = 0

    def count(self, finite: bool, step: int, last_checkpoint: Path | None) -> None:
        self.in_a_row = 0 if finite else self.in_a_row + 1
        if self.in_a_row >= self.allowed:
            raise UserError(
                f"{self.in_a_row} optimizer steps in a row had a non-finite loss or gradient norm and were skipped "
                f"(max_nonfinite_steps={self.allowed}), the last at step {step}; stopping. The last checkpoint is "
                f"{last_checkpoint or 'none (none was written yet)'}; lower lr or check the data"
            )


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


class RunLog:
    """What a run writes besides checkpoints: metrics.jsonl, samples.jsonl and wandb (rank 0 only), by example
    count. Training metrics of every step count: they are averaged over a log interval, not sampled at its end."""

    def __init__(self, run_dir: Path, wandb_run, is_main: bool, throughput: Callable[[], Throughput]):
        self.run_dir, self.wandb_run, self.is_main, self.throughput = run_dir, wandb_run, is_main, throughput
        self.interval, self.interval_speed = defaultdict(list), throughput()
        self.failure: str | None = None  # a write that failed (rank 0): the loop stops every rank at its next check

    def write(self, write: Callable[[], None]) -> None:
        """write() (rank 0), or nothing after a failure to write: that is kept for check(), which stops every rank
        (this one alone cannot: the others would wait for it in their next collective)."""
        if self.failure is None:
            try:
                write()
            except UserError as error:
                self.failure = str(error)

    def check(self, topology, stop_line: Callable[[UserError], UserError]) -> None:
        """Stop every rank with stop_line(rank 0's failure to write a log), if there was one. Collective."""
        failure = topology.broadcast(self.failure)
        if failure is not None:
            raise stop_line(UserError(failure))

    def add_step(self, step_metrics: dict[str, list[float]], amounts: dict[str, float]) -> float:
        """Add a training step to the interval; the interval's mean training loss so far."""
        self.interval_speed.add(**amounts)
        for name, values in step_metrics.items():
            self.interval[name].extend(values)
        return sum(self.interval["loss/train"]) / len(self.interval["loss/train"])

    def close_interval(self, examples: int, updates: int) -> None:
        record = {name: metric_mean(name, values) for name, values in self.interval.items()}
        self.metrics({**record, **self.interval_speed.rates()}, examples, updates)
        self.interval, self.interval_speed = defaultdict(list), self.throughput()

    def metrics(self, metrics: dict[str, float], examples: int, updates: int) -> None:
        if not self.is_main:
            return
        metrics = {**metrics, "counters/examples": examples, "counters/updates": updates}
        self.write(lambda: append_jsonl(self.run_dir / "metrics.jsonl", {"step": examples, **metrics}))
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=examples)

    def samples(self, samples: list[dict], examples: int, updates: int) -> None:
        if not self.is_main:
            return
        self.write(lambda: append_jsonl(self.run_dir / "samples.jsonl", *samples))
        if self.wandb_run is not None:
            import wandb

            columns = ["step", "prompt", "policy", "reference"]
            table = wandb.Table(columns=columns, data=[[s[k] for k in columns] for s in samples])
            self.wandb_run.log({"samples": table}, step=examples)

    def summary(self, final_metrics, examples: int, steps: int, resumed_at: int, start_time: float, speed, where):
        """The run in a few lines: what was trained, how fast, how it ended, and where it is (None: debug=true)."""
        trained, where = examples - resumed_at, where or "nowhere (debug=true)"
        seconds = time.time() - start_time
        evals = ", ".join(f"{name}={value:.4f}" for name, value in final_metrics.items())
        print(
            f"done: {trained} examples in {steps} steps"
            + (f" (resumed at {resumed_at})" if resumed_at else "")
            + f", {seconds / 60:.1f} min, {trained / max(seconds, 1e-9):.2f} pairs/s with evals and checkpoints\n"
            f"training steps: {speed.describe()}\n"
            f"final eval: {evals}\ncheckpoint and from_pretrained export: {where}; metrics: "
            f"{self.run_dir / 'metrics.jsonl'}"
        )

    def truncate(self, step: int, evaluated: bool) -> None:
        """Cut the logs back to a checkpoint at `step`: its own step's eval stays only if it came before the
        checkpoint (evaluated); a round's record there came after it (rounds.py: a round starts after the checkpoint
        that ends the one before)."""
        if not self.is_main:
            return

        def kept(record: dict) -> bool:
            at_step = (evaluated or "loss/eval" not in record) and "rounds/round" not in record
            return record["step"] < step or record["step"] == step and at_step

        self.write(lambda: truncate_jsonl(self.run_dir / "metrics.jsonl", kept))
        samples_kept = lambda r: r["step"] < step or evaluated and r["step"] == step  # noqa: E731
        self.write(lambda: truncate_jsonl(self.run_dir / "samples.jsonl", samples_kept))


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

    @property
    def asked(self) -> bool:
        """Whether a signal asked the run to stop."""
        return self.received is not None

    def handle(self, signum: int, frame) -> None:
        if self.received is None:
            print(f"\n{signal.Signals(signum).name}: stopping after this step, with a checkpoint", flush=True)
            self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted(self, examples: int, last_checkpoint: Path | None, run_dir: Path) -> Interrupted:
        """The line a run stopped by the received signal ends with: where it stopped and how to go on."""
        where = f"the checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint (debug=true)"
        return Interrupted(
            f"stopped by {signal.Signals(self.received).name} after {examples} examples; {where}. To continue, run "
            f"the same command with resume_from=auto local_run_dir={run_dir}",
            self.received,
        )

    def __exit__(self, *exception) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
