"""Evaluation on the held-out examples, and samples from policy and reference on their prompts; completions
sampled with a seed of their own (SeededSampling), for iterative rounds (rounds.py)."""

from collections import defaultdict

import torch
import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from core.layouts import left_padded_prompts, to_device
from modeling.distributed import Topology
from modeling.placement import root_gathered
from modeling.vision import unpack_images
from utils import metric_mean


class Evaluator:
    """Evaluates on fixed eval batches, each rank on its share in the training micro-batch budget.

    batch_metrics: step.BatchLoss, the objective on a micro-batch: (examples, split, batch, coupled part) ->
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
        """Sampled continuations of the examples' prompts (as generation.* says), without the prompt text; a
        vision-language model sees each prompt's images."""
        g = self.config.generation
        settings = dict(do_sample=g.do_sample, temperature=g.temperature, top_p=g.top_p)
        prompts, images = [ex["prompt"] for ex in examples], [ex.get("images", b"") for ex in examples]
        completions = self.complete(model, prompts, images, **settings)
        return self.tokenizer.batch_decode(completions, skip_special_tokens=True)

    @torch.no_grad()
    def complete(
        self, model: torch.nn.Module, prompts: list[list[int]], images: list[bytes] | None = None, **settings
    ) -> list[list[int]]:
        """The generated ids of each prompt, up to generation.max_new_tokens, ending with its EOS where it stopped;
        images: each prompt's (modeling.vision.pack_images; b"": none), which a vision-language model sees; settings:
        model.generate's (do_sample, temperature, top_p, logits_processor). Every rank calls it with as many prompts
        (synced_gpus: ranks done early join the sharded forward passes of the others)."""
        pad_token_id, eos_token_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompt_ids, attention_mask = left_padded_prompts([{"prompt": p} for p in prompts], pad_token_id)
        vision = getattr(self.tokenizer, "vision", None)  # modeling.models.load_tokenizer's
        if vision is not None:  # the prompts' images, and their tokens marked where the model reads marks
            vision = vision.for_model(model)
            settings |= vision.pixel_inputs([unpack_images(packed) for packed in images or ()])
            # images (Qwen-VL, Gemma 3) or the prefix (PaliGemma)
            settings |= vision.marks(prompt_ids, attention_mask.bool())
            # never an image's token in a completion: a round's pair holding one would ask for an image it lacks
            settings["suppress_tokens"] = [vision.image_token_id]
        device = self.topology.device
        settings = {name: to_device(v, device) if torch.is_tensor(v) else v for name, v in settings.items()}
        with root_gathered(model):
            output = model.generate(
                prompt_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=self.config.generation.max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
                synced_gpus=self.topology.world_size > 1,
                **settings,
            )
        completions = []
        for row in output[:, prompt_ids.shape[1] :].tolist():
            end = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
            completions.append(row[:end])
        return completions

    def complete_seeded(
        self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], images: list[bytes] | None = None
    ) -> list[list[int]]:
        """Completions sampled as generation.* says (temperature, top_p), row i from its own seeds[i] alone: the
        same whatever rows share its batch and however many ranks there are (see SeededSampling); images: as
        complete's."""
        g = self.config.generation
        uniforms = torch.stack(
            [torch.rand(g.max_new_tokens, generator=torch.Generator().manual_seed(seed)) for seed in seeds]
        )
        width = max(map(len, prompts))
        sampler = SeededSampling(uniforms.to(self.topology.device), width, g.temperature, g.top_p)
        return self.complete(model, prompts, images, do_sample=False, logits_processor=LogitsProcessorList([sampler]))

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


class SeededSampling(LogitsProcessor):
    """Sampling at a temperature from the nucleus (the most likely tokens whose mass reaches top_p; Holtzman et al.
    2020), each row driven by uniforms of its own: row i's token at step t is the nucleus distribution's inverse
    CDF at uniforms[i, t]. transformers' sampler draws every row from one generator, so that a row's tokens would
    depend on the rows batched with it; here they depend on its seed. It returns scores that leave the drawn token
    the only finite one, for greedy decoding (do_sample=False) to pick.

    uniforms: [B, max_new_tokens] in [0, 1); prompt_width: the padded prompts' length (where step 0 starts)."""

    def __init__(self, uniforms: torch.Tensor, prompt_width: int, temperature: float, top_p: float):
        self.uniforms, self.prompt_width, self.temperature, self.top_p = uniforms, prompt_width, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.prompt_width
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        # stable: equal probabilities in the order of their token ids, on every device
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # the mass before it reached top_p
        outside[:, 0] = False
        cdf = sorted_probs.masked_fill(outside, 0).cumsum(dim=-1)
        target = self.uniforms[:, step : step + 1] * cdf[:, -1:]
        index = torch.searchsorted(cdf, target, right=True).clamp(max=cdf.shape[-1] - 1)
        drawn = order.gather(-1, index)
        return torch.full_like(scores, -torch.inf).scatter_(-1, drawn, 0.0)
