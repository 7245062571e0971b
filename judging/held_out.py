"""Evaluation on the held-out examples, samples from policy and reference on their prompts (generation/sampling.py
samples them), and the policy's win rate against its reference (judging/judges.py judges it)."""

import numpy as np
import torch
import tqdm

from generation.sampling import Sampler, distinct_prompts, sample_seed
from judging.judges import load_judge
from judging.winrates import score
from modeling.distributed import Topology
from utils import get_local_dir, metric_mean


class Evaluator:
    """Evaluates on fixed eval batches, each rank on its share in the training micro-batch budget (accumulation: a
    training step's micro-batches); samples from policy and reference with the run's sampler.

    batch_metrics: step.BatchLoss, the objective on a micro-batch: (examples, split, batch, coupled part) ->
    (mean loss, {name: [B] metric}), and its `couple` for a loss whose pairs depend on each other."""

    def __init__(self, config, topology: Topology, tokenizer, eval_batches: list[list[dict]], batch_metrics,
                 accumulation: int, sampler: Sampler):  # fmt: skip
        self.config, self.topology, self.tokenizer, self.accumulation = config, topology, tokenizer, accumulation
        self.eval_batches, self.batch_metrics, self.sampler = eval_batches, batch_metrics, sampler

    @torch.no_grad()
    def evaluate(self, policy: torch.nn.Module) -> dict[str, float]:
        """Mean of each metric over all eval examples; the metrics stay on the device until one transfer at the end."""
        policy.eval()
        gathered, names = [], []
        batches = tqdm.tqdm(
            self.eval_batches, desc="eval", leave=False, dynamic_ncols=True, disable=not self.topology.is_main
        )
        # The training micro-batch budget: a rank's share goes through in as many parts as a training step's.
        sizes = (self.config.eval_batch_size, self.accumulation)
        for batch in batches:
            names, values = self.batch_metrics.over_micro_batches(batch, "eval", *sizes)
            gathered.append(values)  # without the padding copies
        values = torch.cat(gathered, dim=1).cpu().tolist()
        return {name: metric_mean(name, row) for name, row in zip(names, values)}

    @torch.no_grad()
    def sample_texts(self, model: torch.nn.Module, examples: list[dict]) -> list[str]:
        """Sampled continuations of the examples' prompts (as generation.* says), without the prompt text; a
        vision-language model sees each prompt's images."""
        g = self.config.generation
        settings = dict(do_sample=g.do_sample, temperature=g.temperature, top_p=g.top_p)
        prompts, images = [ex["prompt"] for ex in examples], [ex.get("images", b"") for ex in examples]
        keep_end = [ex["keep_end"] for ex in examples]  # a prompt cut as training cuts it
        completions = self.sampler.decode_generate(model, prompts, images, keep_end, **settings)
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True)

    def sample(self, policy: torch.nn.Module, reference: torch.nn.Module | None, step: int) -> list[dict]:
        """{"step", "prompt", "policy", "reference"} for the first n_eval_model_samples eval prompts."""
        examples = [ex for batch in self.eval_batches for ex in batch][: self.config.n_eval_model_samples]
        local, n_real = self.topology.shard(examples)
        # The same seed on every rank: tensor-parallel ranks must draw the same tokens.
        torch.manual_seed(self.config.seed + step)
        policy_texts = self.sample_texts(policy, local)
        reference_texts = self.sample_texts(reference, local) if reference is not None else [None] * len(local)
        samples = [
            {"step": step, "prompt": self.tokenizer.decode(ex["prompt"]), "policy": p, "reference": r}
            for ex, p, r in zip(local, policy_texts, reference_texts)
        ]
        return self.topology.gather({"samples": samples[:n_real]})["samples"]


class HeldOutWinRate:
    """The policy's win rate (ties half) against the reference on the first `eval_winrate_prompts` distinct held-out
    prompts, at each eval: both complete each prompt as generation.* says, from the same seed of (seed, prompt), the
    same at every eval (common random numbers: a policy still equal to its reference draws the same completions, a
    rate of exactly 0.5, and the rate follows the policy rather than the draw); the judge (judges.load_judge:
    judge=, judge_template=) compares them on rank 0, in both orders."""

    def __init__(self, config, topology: Topology, tokenizer, sampler: Sampler, eval_batches: list[list[dict]]):
        self.config, self.topology, self.tokenizer, self.sampler = config, topology, tokenizer, sampler
        examples = distinct_prompts(eval_batches, config.eval_winrate_prompts)
        self.prompts, self.images = [ex["prompt"] for ex in examples], [ex.get("images", b"") for ex in examples]
        self.keep_end = [ex["keep_end"] for ex in examples]  # a prompt cut as training cuts it
        self.seeds = [sample_seed(ex["key"], config.seed, "winrate") for ex in examples]
        c, cache_dir = config, get_local_dir(config.local_dirs)
        self.judge = topology.run_on_main(
            lambda: load_judge(c.judge, c.judge_template, topology.device, c.eval_batch_size, c.max_length, cache_dir)
        )

    def __call__(self, policy: torch.nn.Module, reference: torch.nn.Module) -> float:
        g = self.config.generation
        sampling = (g.temperature, g.top_p)
        completions = [
            self.sampler.sample(
                model, self.prompts, self.images, self.seeds if g.do_sample else None, *sampling, keep_end=self.keep_end
            )
            for model in (policy, reference)
        ]

        def judged() -> float:
            prompts = [self.tokenizer.decode(ids) for ids in self.prompts]  # as the policy read them
            texts = [self.tokenizer.batch_decode(side, skip_special_tokens=True) for side in completions]
            return score(np.array(self.judge.judge(prompts, *texts, self.images).outcomes))

        return self.topology.broadcast(self.topology.run_on_main(judged))
