"""The training step's speed levers (--levers): each alone and all together against the padded float32 path, on
SmolLM2-135M-Instruct and the first 48 HH pairs, then the log-prob computation's memory by vocabulary; and two more
levers against the default, each its own flag: torch.compile per block (--compile) and LoRA (--lora). The levers
that are on by default on CUDA only (shape buckets, compiled blocks, sync-free steps) get a row each on top of the
default, so that the CPU's default follows what they measure here."""

import os
import tempfile
from pathlib import Path

import torch

from bench.common import HH_FILE, smollm2_dir, with_machine_rates, workload_overrides
from bench.kernels import bench_vocabulary_memory
from bench.step import lever_subprocess
from modeling.precision import cpu_name

BASELINE = ["layout=padded", "scored_logits_only=false", "reference_cache=false", "model.fsdp_policy_mp=null"]
LEVERS = {  # each lever alone: the baseline with one setting changed
    "padded float32 (baseline)": BASELINE,
    "packed layout": ["layout=packed", *BASELINE[1:]],
    "scored logits only": [BASELINE[0], "scored_logits_only=true", *BASELINE[2:]],
    "reference cache": [*BASELINE[:2], "reference_cache=true", BASELINE[3]],
    "auto precision": [*BASELINE[:3], "model.fsdp_policy_mp=auto"],
    "all (the default)": [],
    # issue 73's levers, off on a CPU by default (auto: CUDA), each on top of the default: keep what pays here
    "default + shape buckets": ["shape_buckets=true"],
    "default + compiled blocks": ["compile_blocks=true"],
    "default + both": ["shape_buckets=true", "compile_blocks=true"],
    "default + sync-free steps": ["sync_free_steps=true"],
}
WORKLOADS = ((256, 4), (512, 8))


def cpuinfo_flags() -> list[str]:
    """Which of the vector and matrix extensions that decide a CPU's bfloat16 speed /proc/cpuinfo lists."""
    return sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def bench_levers(warmup: int, steps: int) -> None:
    """At 256 x 4 and 512 x 8 pairs per step: each lever in a fresh process (so its peak RSS is its own), in turn,
    with pairs/s, its ratio to the baseline's, real tokens/s (prompt counted once), MFU and peak memory."""
    model_dir = smollm2_dir()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpuinfo_flags())}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    print(
        f"SmolLM2-135M-Instruct, first 48 pairs of {HH_FILE.name}, DPO beta 0.1, AdamW; "
        f"{warmup} warm-up + {steps} timed steps"
    )
    for max_length, batch in WORKLOADS:
        print(f"\nmax_length {max_length} x {batch} pairs per step")
        print(
            f"{'configuration':28s} {'pairs/s':>8s} {'x base':>7s} {'tokens/s':>9s} {'MFU':>6s} {'peak RSS':>9s}  "
            "precision, setup (loading, probes, tokenizing, and the reference pass where cached)"
        )
        baseline = None
        for name, lever in LEVERS.items():
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [*workload_overrides(model_dir, with_machine_rates(tmp), max_length, batch), *lever]
                result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"))
            baseline = baseline or result["pairs_per_second"]
            print(
                f"{name:28s} {result['pairs_per_second']:8.3f} {result['pairs_per_second'] / baseline:6.2f}x "
                f"{result['real_tokens_per_second']:9.0f} {result['mfu']:6.1%} {result['peak_memory_gib']:7.2f} GiB  "
                f"{result['precision']}, setup {result['setup_seconds']:.0f} s",
                flush=True,
            )
    print()
    bench_vocabulary_memory()


def bench_compile(warmup: int, steps: int) -> None:
    """The default configuration at 256 x 4, eager against compile_blocks=true, alternating: the first step
    (compilation) and the steady state."""
    model_dir = smollm2_dir()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; the default configuration at max_length 256 x 4 pairs; "
        f"{warmup} warm-up + {steps} timed steps"
    )
    for compile_blocks in (False, True, False, True):
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [*workload_overrides(model_dir, tmp, 256, 4), f"compile_blocks={str(compile_blocks).lower()}"]
            result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"))
        name = "compile_blocks=true" if compile_blocks else "eager"
        print(
            f"{name:24s} first step {result['first_step_seconds']:5.1f} s, "
            f"then {4 / result['pairs_per_second']:.2f} s/step "
            f"({result['pairs_per_second']:.3f} pairs/s)",
            flush=True,
        )


def bench_lora(warmup: int, steps: int) -> None:
    """Full fine-tuning against LoRA (the preset: rank 16 on every linear layer) at 256 x 4, alternating: seconds per
    step and the RSS while training, each in a fresh process."""
    model_dir = smollm2_dir()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpuinfo_flags())}; SmolLM2-135M-Instruct, "
        f"default levers, max_length 256 x 4 pairs; {warmup} warm-up + {steps} timed steps"
    )
    for name, lever in (("full fine-tuning", []), ("LoRA r=16", ["lora.enabled=true"])) * 2:
        with tempfile.TemporaryDirectory() as tmp:
            overrides = [*workload_overrides(model_dir, tmp, 256, 4), *lever]
            result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"))
        print(
            f"{name:18s} {4 / result['pairs_per_second']:6.2f} s/step ({result['pairs_per_second']:.3f} pairs/s), "
            f"RSS while training {result['training_rss_gib']:.2f} GiB (process peak {result['peak_memory_gib']:.2f}), "
            f"{result['precision']}",
            flush=True,
        )
