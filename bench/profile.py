"""Where a training step's CPU time goes (--profile [OVERRIDES ...]): operations by their self time, parts of the
step by their whole time, user and kernel time and page faults, for any configuration, the default's by default."""

import json
import os
import resource
import tempfile
import time
from pathlib import Path

import torch

from bench.common import smollm2_dir, with_machine_rates, worker_subprocess, workload_overrides
from bench.step import bench_trainer
from modeling.precision import cpu_flags, cpu_name

OPERATIONS = {
    "matmul (mm, addmm, bmm)": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "dtype casts and copies": ("aten::copy_", "aten::_to_copy"),
    "attention (SDPA)": ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention"),
}
PARTS = {
    "fused head, forward": "fused head forward",
    "fused head, backward": "fused head backward",
    "optimizer step": "Optimizer.step#",
    "gradient clipping": "clip gradients",
}


def profile_worker(overrides: list[str], warmup: int, steps: int, result_file: str) -> None:
    """torch.profiler over `steps` training steps of a configuration after `warmup` (bench_trainer): each
    operation's self time, each part of the step's whole time, and the seconds per step."""
    from torch.profiler import ProfilerActivity, profile

    trainer, _ = bench_trainer(overrides)
    batches = [trainer.data.train_examples.take(indices) for indices in trainer.data.schedule[: warmup + steps]]
    for examples in batches[:warmup]:
        trainer.train_step(examples)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start, usage_before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    with profile(activities=activities) as profiler:
        for examples in batches[warmup:]:
            trainer.train_step(examples)
    seconds, usage = (time.perf_counter() - start) / steps, resource.getrusage(resource.RUSAGE_SELF)
    compute_dtype = trainer.precision.policy_compute or trainer.precision.policy_weights
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    operations = {name: sum(e.self_cpu_time_total for e in events if e.key.startswith(prefixes)) / total
                  for name, prefixes in OPERATIONS.items()}  # fmt: skip
    parts = {name: sum(e.cpu_time_total for e in events if e.key.startswith(prefix)) / total
             for name, prefix in PARTS.items()}  # fmt: skip
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    result = {
        "seconds_per_step": seconds,
        # the kernel's share: page faults (memory touched for the first time) and threads waking one another
        "kernel_seconds_per_step": (usage.ru_stime - usage_before.ru_stime) / steps,
        "user_seconds_per_step": (usage.ru_utime - usage_before.ru_utime) / steps,
        "page_faults_per_step": (usage.ru_minflt - usage_before.ru_minflt) // steps,
        "operations": operations,
        "parts": parts,
        "top": [(e.key, e.self_cpu_time_total / total, e.count // steps) for e in top],
        "precision": f"{str(compute_dtype).removeprefix('torch.')} compute",
        "layout": trainer.scorer.describe(),
    }
    Path(result_file).write_text(json.dumps(result))


def bench_profile(overrides: list[str], warmup: int, steps: int) -> None:
    """The breakdown of a training step's CPU time for a configuration: the default's, or the one the overrides
    make, at 256 x 4 on SmolLM2 and the HH pairs (max_length=... and batch_size=... override those too)."""
    model_dir = smollm2_dir()
    with tempfile.TemporaryDirectory() as tmp:
        base = [*workload_overrides(model_dir, with_machine_rates(tmp), 256, 4), *overrides]
        result = worker_subprocess(profile_worker, str(Path(tmp) / "result.json"), overrides=base, warmup=warmup,
                                   steps=steps)  # fmt: skip
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}; torch {torch.__version__}"
        f"\nSmolLM2-135M-Instruct on HH pairs, {' '.join(overrides) or 'the default configuration'} (max_length 256 x "
        f"4 pairs unless set); {result['precision']}, {result['layout']}; {warmup} warm-up + {steps} profiled steps: "
        f"{result['seconds_per_step']:.2f} s/step under the profiler\nCPU time per step (both cores): "
        f"{result['user_seconds_per_step']:.2f} s user, {result['kernel_seconds_per_step']:.2f} s kernel (system), "
        f"{result['page_faults_per_step']} page faults\n\nshare of the operators' time"
    )
    for name, share in result["operations"].items():
        print(f"  {name:32s} {share:6.1%}")
    print(f"  {'everything else':32s} {1 - sum(result['operations'].values()):6.1%}\nparts of the step (all they run)")
    for name, share in result["parts"].items():
        print(f"  {name:32s} {share:6.1%}")
    print("the 12 operators that take the most time (self), and their calls per step")
    for name, share, calls in result["top"]:
        print(f"  {name:44s} {share:6.1%} {calls:6d}")
