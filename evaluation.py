"""Evaluation on the held-out examples, and samples from policy and reference on their prompts."""

from collections import defaultdict

import torch
import tqdm

from distributed import Topology
from layouts import left_padded_prompts
from utils import metric_mean


class Evaluator:
    """Evaluates on fixed eval batches, each rank on its share in the training micro-batch budget.

    batch_metrics: build.BatchLoss, the objective on a micro-batch: (examples, split, batch, coupled part) ->
    (mean loss, {name: [B] metric}), and its `couple` for a loss whose pairs depend on each other."""

    def __init__(self, config, topology: Topology, tokenizer, eval_batches: list[list[dict]], batch_metrics):
        self.config, self.topology, self.tokenizer = config, topology, tokenizer
        self.eval_batches, self.batch_metrics = eval_batches, batch_metrics

    @torch.no_grad()
    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """Mean of each metric over all eval examples; the metrics stay on the device until one transfer at the end."""
        policy.eval()
        gathered, names = [], []
        batches = tqdm.tqdm(
            self.eval_batches, desc="eval", leave=False, dynamic_ncols=True, disable=not self.topology.is_main
        )
        for batch in batches:
            # The training micro-batch budget: a rank's share goes through in gradient_accumulation_steps parts.
            sizes = (self.config.eval_batch_size, self.config.gradient_accumulation_steps)
            micro_batches, _ = self.topology.micro_batches(batch, *sizes)
            coupled = self.batch_metrics.couple(batch, *sizes)  # what the loss reads of the whole batch
            columns = defaultdict(list)
            for index, micro_batch in enumerate(micro_batches):
                for name, metric in self.batch_metrics(micro_batch, "eval", None, coupled and coupled.part(index))[
                    1
                ].items():
                    columns[name].append(metric.detach().float())
            names = sorted(columns)
            local = torch.stack([torch.cat(columns[name]) for name in names])
            gathered.append(self.topology.gather_columns(local, len(batch)))  # without the padding copies
        values = torch.cat(gathered, dim=1).cpu().tolist()
        return {name: metric_mean(name, row) for name, row in zip(names, values)}

    @torch.no_grad()
    def generate(self, model: torch.nn.Module, examples: list[dict]) -> list[str]:
        """Sampled continuations of the examples' prompts, without the prompt text."""
        g = self.config.generation
        pad_token_id = self.tokenizer.pad_token_id
        prompt_ids, attention_mask = left_padded_prompts(examples, pad_token_id)
        device = self.topology.device
        output = model.generate(
            prompt_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=g.max_new_tokens,
            do_sample=g.do_sample,
            temperature=g.temperature,
            top_p=g.top_p,
            pad_token_id=pad_token_id,
            # ranks done early keep joining the sharded forward passes of the others
            synced_gpus=self.topology.world_size > 1,
        )
        return self.tokenizer.batch_decode(output[:, prompt_ids.shape[1] :], skip_special_tokens=True)

    def sample(self, policy: torch.nn.Module, reference: torch.nn.Module | None, step: int) -> list[dict]:
        """{"step", "prompt", "policy", "reference"} for the first n_eval_model_samples eval prompts."""
        examples = [ex for batch in self.eval_batches for ex in batch][: self.config.n_eval_model_samples]
        local, n_real = self.topology.shard(examples)
        # The same seed on every rank: tensor-parallel ranks must draw the same tokens.
        torch.manual_seed(self.config.seed + step)
        policy_texts = self.generate(policy, local)
        reference_texts = self.generate(reference, local) if reference is not None else [None] * len(local)
        samples = [
            {"step": step, "prompt": self.tokenizer.decode(ex["prompt"]), "policy": p, "reference": r}
            for ex, p, r in zip(local, policy_texts, reference_texts)
        ]
        return self.topology.gather({"samples": samples[:n_real]})["samples"]
