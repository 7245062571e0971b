"""The training loop: DPO / IPO / SFT updates, evaluation, sampling, logging and checkpoints."""
import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import contextlib
import inspect
import shutil
import time
from collections import defaultdict
from pathlib import Path

import tqdm
from omegaconf import DictConfig, OmegaConf

from losses import preference_loss, sequence_logps
from models import checkpoint_blocks, parse_dtype
from preference_datasets import PreferencePair, batch_schedule, collate, sft_examples, tokenize_pair
from utils import UserError, append_jsonl, get_device, load_checkpoint_file, load_state, replace_dir


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


def split_evenly(items: list, parts: int) -> list[list]:
    size = len(items) // parts
    return [items[i * size : (i + 1) * size] for i in range(parts)]


class BasicTrainer:
    """Trains the policy on one process (CUDA if present, else CPU); the reference model stays frozen."""

    def __init__(self, config: DictConfig, policy: torch.nn.Module, reference: torch.nn.Module | None, tokenizer, data: dict[str, list[PreferencePair]], run_dir: Path, wandb_run=None):
        self.config = config
        self.run_dir = run_dir
        self.wandb_run = wandb_run
        self.tokenizer = tokenizer
        self.device = get_device()
        self.sft = config.loss.name == "sft"
        self.policy = policy.to(self.device)
        self.reference = reference.to(self.device) if reference is not None else None
        # Mixed precision on one process: fp32 master weights, compute in this dtype (FSDP's param_dtype analogue).
        self.autocast_dtype = parse_dtype(config.model.fsdp_policy_mp, "model.fsdp_policy_mp")
        if config.activation_checkpointing:
            checkpoint_blocks(self.policy, config.model.block_name)

        self.train_examples = sft_examples(data["train"]) if self.sft else data["train"]
        eval_examples = sft_examples(data["test"]) if self.sft else data["test"]
        if config.n_eval_examples is not None:
            eval_examples = eval_examples[: config.n_eval_examples]
        self.eval_batches = [self.tokenize(eval_examples[i : i + config.eval_batch_size]) for i in range(0, len(eval_examples), config.eval_batch_size)]
        self.schedule = batch_schedule(len(self.train_examples), config.batch_size, config.seed, config.n_epochs, config.n_examples)
        print(f"{len(self.train_examples)} training and {len(eval_examples)} eval examples; {len(self.schedule)} steps of {config.batch_size}")

        self.optimizer = build_optimizer(config.optimizer, self.policy.parameters(), config.lr, OmegaConf.to_container(config.optimizer_kwargs))
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        self.example_counter = 0
        self.batch_counter = 0
        self.last_eval_at = None
        if config.resume_from is not None:
            self.load_checkpoint(Path(config.resume_from))

    # ---------------------------------------------------------------------------------------------------
    # Loss

    def tokenize(self, pairs: list[PreferencePair]) -> list[dict]:
        c = self.config
        return [tokenize_pair(pair, self.tokenizer, c.max_length, c.max_prompt_length, self.sft) for pair in pairs]

    def sequence_logps(self, model: torch.nn.Module, batch: dict, autocast_dtype: torch.dtype | None = None) -> torch.Tensor:
        """[R * B] float32 summed log-probs of each sequence's response tokens, in one forward pass."""
        autocast = torch.autocast(self.device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with autocast:
            logits = model(batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
        return sequence_logps(logits, batch["labels"])

    def batch_metrics(self, examples: list[dict], split: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean loss over the examples, and per-example metrics ([B] tensors) named as in the reference."""
        batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in collate(examples, self.tokenizer.pad_token_id).items()}
        policy_logps = self.sequence_logps(self.policy, batch, self.autocast_dtype)
        if self.sft:
            losses = -policy_logps
            return losses.mean(), {f"logps_{split}/chosen": policy_logps.detach(), f"loss/{split}": losses.detach()}

        policy_chosen, policy_rejected = policy_logps.chunk(2)
        if self.reference is None:  # reference-free: a uniform reference contributes zeros
            reference_chosen = reference_rejected = torch.zeros_like(policy_chosen)
        else:
            with torch.no_grad():
                reference_chosen, reference_rejected = self.sequence_logps(self.reference, batch).chunk(2)
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
    # Training

    def train_step(self, examples: list[dict]) -> dict[str, list[float]]:
        """One optimizer step over a global batch, in gradient_accumulation_steps equal micro-batches."""
        self.policy.train()
        accumulation = self.config.gradient_accumulation_steps
        metrics = defaultdict(list)
        for micro_batch in split_evenly(examples, accumulation):
            loss, batch_metrics = self.batch_metrics(micro_batch, "train")
            (loss / accumulation).backward()
            for name, values in batch_metrics.items():
                metrics[name].extend(values.float().cpu().tolist())
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        metrics["lr"].append(self.scheduler.get_last_lr()[0])  # the rate this step uses
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics["grad_norm"].append(grad_norm.item())
        return metrics

    def train(self) -> None:
        c = self.config
        progress = tqdm.tqdm(total=len(self.schedule), initial=self.batch_counter, desc="train", unit="step", dynamic_ncols=True)
        interval = defaultdict(list)
        interval_time = interval_tokens = interval_examples = 0
        last_log = time.time()
        for indices in self.schedule[self.batch_counter :]:
            if self.example_counter % c.eval_every == 0 and (self.example_counter > 0 or c.do_first_eval):
                self.evaluate_and_save(final=False)
            start = time.time()
            examples = self.tokenize([self.train_examples[i] for i in indices])
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
        size = self.config.eval_batch_size // self.config.gradient_accumulation_steps  # the training micro-batch budget
        for batch in tqdm.tqdm(self.eval_batches, desc="eval", leave=False, dynamic_ncols=True):
            for micro_batch in (batch[i : i + size] for i in range(0, len(batch), size)):
                for name, metric in self.batch_metrics(micro_batch, "eval")[1].items():
                    values[name].extend(metric.float().cpu().tolist())
        return {name: sum(v) / len(v) for name, v in values.items()}

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, batch: dict) -> list[str]:
        """Sampled continuations of the batch's prompts, without the prompt text."""
        g = self.config.generation
        prompt_ids = batch["prompt_input_ids"].to(self.device)
        output = model.generate(
            prompt_ids,
            attention_mask=batch["prompt_attention_mask"].to(self.device),
            max_new_tokens=g.max_new_tokens,
            do_sample=g.do_sample,
            temperature=g.temperature,
            top_p=g.top_p,
            pad_token_id=self.tokenizer.pad_token_id,
        )
        return self.tokenizer.batch_decode(output[:, prompt_ids.shape[1] :], skip_special_tokens=True)

    def sample(self) -> list[dict]:
        examples = [ex for batch in self.eval_batches for ex in batch][: self.config.n_eval_model_samples]
        batch = collate(examples, self.tokenizer.pad_token_id)
        policy_texts = self.generate(self.policy, batch)
        reference_texts = self.generate(self.reference, batch) if self.reference is not None else [None] * len(examples)
        return [{"step": self.example_counter, "prompt": ex["pair"].prompt, "policy": p, "reference": r} for ex, p, r in zip(examples, policy_texts, reference_texts)]

    def evaluate_and_save(self, final: bool) -> None:
        if self.last_eval_at == self.example_counter and not final:
            return
        metrics = self.evaluate()
        self.log(metrics)
        print(f"eval at {self.example_counter} examples: " + ", ".join(f"{k}={v:.4f}" for k, v in metrics.items()))
        if self.config.sample_during_eval:
            samples = self.sample()
            for sample in samples:
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
        metrics = {**metrics, "counters/examples": self.example_counter, "counters/updates": self.batch_counter}
        append_jsonl(self.run_dir / "metrics.jsonl", {"step": self.example_counter, **metrics})
        if self.wandb_run is not None:
            self.wandb_run.log(metrics, step=self.example_counter)

    # ---------------------------------------------------------------------------------------------------
    # Checkpoints, in the reference's format: {"step_idx": examples seen, "state": state_dict, "metrics": ...}

    def save(self, output_dir: Path, metrics: dict[str, float], export_hf: bool) -> None:
        """Write policy.pt, optimizer.pt and scheduler.pt (and, if export_hf, a from_pretrained-ready copy
        of the policy and tokenizer) to a temporary directory, then swap it in whole."""
        if self.config.debug:
            return
        tmp_dir = output_dir.with_name(output_dir.name + ".tmp")
        shutil.rmtree(tmp_dir, ignore_errors=True)  # left by a crashed save: none of it may leak into this one
        tmp_dir.mkdir(parents=True)
        for name, state in (("policy", self.policy.state_dict()), ("optimizer", self.optimizer.state_dict()), ("scheduler", self.scheduler.state_dict())):
            torch.save({"step_idx": self.example_counter, "state": state, "metrics": metrics}, tmp_dir / f"{name}.pt")
        if export_hf:
            self.policy.save_pretrained(tmp_dir)
            self.tokenizer.save_pretrained(tmp_dir)
        replace_dir(tmp_dir, output_dir)
        print(f"saved {output_dir}")

    def load_checkpoint(self, checkpoint_dir: Path) -> None:
        """Continue from a checkpoint: weights, optimizer and schedule state, and the position in the data."""
        setting = f"resume_from={checkpoint_dir}"
        states = {name: load_checkpoint_file(checkpoint_dir / f"{name}.pt", setting) for name in ("policy", "optimizer", "scheduler")}
        step_idx = states["policy"]["step_idx"]
        if step_idx % self.config.batch_size:
            raise UserError(f"{setting}: {step_idx} examples seen is not a multiple of batch_size={self.config.batch_size}")
        for name, target in (("policy", self.policy), ("optimizer", self.optimizer), ("scheduler", self.scheduler)):
            load_state(target, states[name]["state"], setting, checkpoint_dir / f"{name}.pt")
        self.example_counter = step_idx
        self.batch_counter = step_idx // self.config.batch_size
        self.last_eval_at = step_idx
        print(f"resumed from {checkpoint_dir} at {step_idx} examples")
