"""Throughput telemetry, in the units users compare trainers by: pairs/s, tokens/s (computed, real, scored), MFU on
useful FLOPs, and peak memory, per logging interval and for the whole run.

Tokens: computed = the positions the model runs, padding included (what the layout costs); real = the data's tokens,
each prompt once plus its responses (what any layout must compute at least); scored = the response tokens the loss
reads.

Useful FLOPs of one example (prompt P, responses r_1..r_k), counting what the data needs with the prompt once, after
Kaplan et al. 2020 ("Scaling Laws for Neural Language Models", 2N per token forward) and Chowdhery et al. 2022 (PaLM,
appendix B: MFU, with attention):
- transformer blocks: 2 N per real token forward, 2 N backward to the activations and 2 N_trainable to the weights
  (6 N in all for full fine-tuning, ~4 N with LoRA), N = the blocks' parameters (attention, MLP, norms; not the
  input embedding, a lookup, nor the head, counted below);
- attention: 4 d per visible (query, key) pair and layer forward (QK^T and AV, d = heads x head dimension), 3x that
  trained; a prompt token sees the prompt up to itself, a response token the prompt and its own response so far;
- the LM head, on scored positions only: 2 H V forward, 2 H V backward to the hidden states, 2 H V to its weight
  when it trains;
- a live reference adds the forward terms (2 N per real token, 4 d per visible pair and layer, 2 H V per scored
  token); a cached reference adds nothing per step.
MFU = useful FLOPs / (seconds x devices x the device's peak rate in the compute dtype): a GPU's datasheet bfloat16
peak by name, else a measured matmul; on a CPU the precision probe's measured matmul rate (precision.py).
"""

import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from modeling.adapters import logical_numel
from modeling.precision import DTYPE_NAMES, cpu_matmul_flops, cpu_name
from modeling.reward_head import reward_head

# NVIDIA datasheet dense bfloat16 tensor-core peaks, TFLOP/s (sparsity excluded), matched on the device name in order;
# float16's are the same on these GPUs.
GPU_BFLOAT16_TFLOPS = (
    (r"H100.*PCIe", 756),
    (r"H100.*NVL", 835),
    (r"H100|H200|H800|GH200", 989),
    (r"B200", 2250),
    (r"A100|A800", 312),
    (r"L40S", 362),
    (r"L40\b", 181),
    (r"\bL4\b", 121),
    (r"A10\b", 125),
    (r"A30\b", 165),
)
# float16 tensor-core peaks of the GPUs without native bfloat16 (compute capability 7.x), from the same datasheets.
GPU_FLOAT16_ONLY_TFLOPS = ((r"V100.*PCIe", 112), (r"V100", 125), (r"\bT4\b", 65), (r"TITAN V", 110))


@dataclass(frozen=True)
class ModelFlops:
    """A model's sizes for the FLOP count: blocks' parameters (all, trainable), layers, attention width, hidden
    size, vocabulary, whether the head trains."""

    block_parameters: int
    trainable_block_parameters: int
    layers: int
    attention_width: int
    hidden: int
    vocab: int
    head_trains: bool

    @classmethod
    def of(cls, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> "ModelFlops":
        """From the model before placement (whole tensors) and its language model's transformer blocks
        (placement.language_blocks: a vision-language model's vision tower is not counted)."""
        config = model.config.get_text_config()  # a vision-language model's: its language model's
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        head = model.get_output_embeddings() or reward_head(model)  # a reward model's: its scalar head
        return cls(
            block_parameters=sum(logical_numel(p) for block in blocks for p in block.parameters()),
            trainable_block_parameters=sum(
                p.numel() for block in blocks for p in block.parameters() if p.requires_grad
            ),
            layers=len(blocks),
            attention_width=heads * head_dim,
            hidden=head.weight.shape[1],
            vocab=head.weight.shape[0],
            head_trains=head.weight.requires_grad,
        )

    def example(self, example: dict, live_reference: bool) -> float:
        """Useful FLOPs of training on one tokenized example (see the module's docstring)."""
        real = real_tokens(example)
        attention = 4 * self.attention_width * self.layers * visible_pairs(example)
        head = 2 * self.hidden * self.vocab * scored_tokens(example)
        trained = (4 * self.block_parameters + 2 * self.trainable_block_parameters) * real
        trained += 3 * attention + (3 if self.head_trains else 2) * head
        reference = 2 * self.block_parameters * real + attention + head if live_reference else 0
        return float(trained + reference)


def visible_pairs(example: dict) -> int:
    """(query, key) pairs of an example that attention must compute: a prompt token sees the prompt up to itself, a
    response token the prompt and its own response so far."""
    prompt = len(example["prompt"])
    return prompt * (prompt + 1) // 2 + sum(n * prompt + n * (n + 1) // 2 for n in map(len, example["responses"]))


def real_tokens(example: dict) -> int:
    return len(example["prompt"]) + sum(map(len, example["responses"]))


def scored_tokens(example: dict) -> int:
    """With no prompt nothing predicts a response's first token: it is not scored."""
    return sum(map(len, example["responses"])) - (0 if example["prompt"] else len(example["responses"]))


def measured_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 8192, repeats: int = 5) -> float:
    """FLOP/s of the best of `repeats` square matmuls of `size` in `dtype` on a GPU."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    a @ a
    torch.cuda.synchronize(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


@dataclass
class PeakRate:
    """The peak FLOP/s of one device that MFU divides by, and where it comes from. A CPU's is the precision probe's
    measured matmul rate in the compute dtype (cache_dir: where it is cached); since a probe that ran while other
    processes loaded the machine measured too little, it is measured again, once, when training achieves more than
    it, keeping the faster rate. An MFU that would still exceed 1 is not reported (mfu: None)."""

    flops: float
    source: str
    cache_dir: Path | None = None  # a CPU's probe cache, while it may still be measured again
    dtype_name: str = "float32"

    def mfu(self, achieved: float) -> float | None:
        """achieved: useful FLOP/s per device."""
        if achieved > self.flops and self.cache_dir is not None:
            self.flops = cpu_matmul_flops(self.cache_dir, again=True)[self.dtype_name]
            self.source += "; measured again when training ran faster than it"
            self.cache_dir = None
            print(f"MFU is measured against {self.describe()}")
        return achieved / self.flops if achieved <= self.flops else None

    def describe(self) -> str:
        return f"{self.flops / 1e12:.3g} TFLOP/s per device ({self.source})"


def peak_flops(device: torch.device, dtype: torch.dtype, cache_dir: Path) -> PeakRate:
    """The peak FLOP/s of one device computing in `dtype`, and where the number comes from."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        half = {torch.bfloat16: GPU_BFLOAT16_TFLOPS, torch.float16: GPU_BFLOAT16_TFLOPS + GPU_FLOAT16_ONLY_TFLOPS}
        for pattern, tflops in half.get(dtype, ()):
            if re.search(pattern, name):
                return PeakRate(tflops * 1e12, f"{name}'s datasheet {str(dtype).removeprefix('torch.')} peak")
        return PeakRate(measured_matmul_flops(device, dtype), f"a measured {dtype} matmul on {name}")
    rates = cpu_matmul_flops(cache_dir)
    name = DTYPE_NAMES.get(dtype)
    name = name if name in rates else "float32"  # float16 in a probe file written before it was measured
    rate = rates[name]
    return PeakRate(rate, f"the precision probe's {name} matmul on {cpu_name()}", cache_dir, name)


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak memory of this process so far, GiB: CUDA allocated and reserved, or the CPU's resident set."""
    if device.type == "cuda":
        return {
            "perf/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"perf/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # KiB on Linux


def mfu_text(mfu: float | None, peak: PeakRate) -> str:
    if mfu is None:
        return f"MFU not reported: training ran faster than the peak of {peak.flops / 1e12:.3g} TFLOP/s per device"
    return f"MFU {mfu:.2%} of {peak.flops / 1e12:.3g} TFLOP/s per device"


def step_amounts(
    examples: list[dict], seconds: float, computed_tokens: float, flops: ModelFlops, live_reference: bool
) -> dict[str, float]:
    """What one training step over `examples` adds to a Throughput."""
    return dict(
        seconds=seconds,
        pairs=len(examples),
        computed_tokens=computed_tokens,
        real_tokens=sum(map(real_tokens, examples)),
        scored_tokens=sum(map(scored_tokens, examples)),
        flops=sum(flops.example(example, live_reference) for example in examples),
    )


class Throughput:
    """Sums of one period (a logging interval, or the run) and their rates."""

    FIELDS = ("seconds", "pairs", "computed_tokens", "real_tokens", "scored_tokens", "flops")

    def __init__(self, peak: PeakRate, devices: int, device: torch.device):
        self.peak, self.devices, self.device = peak, devices, device
        self.totals = dict.fromkeys(self.FIELDS, 0.0)

    def add(self, **amounts: float) -> None:
        for name, amount in amounts.items():
            self.totals[name] += amount

    def rates(self) -> dict[str, float]:
        """The period's rates; perf/mfu only where it is at most 1 (PeakRate.mfu)."""
        t = self.totals
        seconds = max(t["seconds"], 1e-9)
        mfu = self.peak.mfu(t["flops"] / (seconds * self.devices))
        return {
            "perf/pairs_per_second": t["pairs"] / seconds,
            "perf/computed_tokens_per_second": t["computed_tokens"] / seconds,
            "perf/real_tokens_per_second": t["real_tokens"] / seconds,
            "perf/scored_tokens_per_second": t["scored_tokens"] / seconds,
            **({"perf/mfu": mfu} if mfu is not None else {}),
            **peak_memory(self.device),
        }

    def describe(self) -> str:
        """The rates in one line, for the end-of-run summary."""
        r = self.rates()
        memory = ", ".join(f"{name.removeprefix('perf/')} {value:.2f}" for name, value in r.items() if "gib" in name)
        return (
            f"{r['perf/pairs_per_second']:.3g} pairs/s; tokens/s {r['perf/real_tokens_per_second']:.4g} real, "
            f"{r['perf/computed_tokens_per_second']:.4g} computed, {r['perf/scored_tokens_per_second']:.4g} scored; "
            f"{mfu_text(r.get('perf/mfu'), self.peak)} x {self.devices}; {memory}"
        )
