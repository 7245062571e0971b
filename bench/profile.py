"""Where a training step's CPU time goes (--profile [OVERRIDES ...]): operations by their self time, parts of the
step by their whole time, user and kernel time and page faults, for any configuration, the default's by default; and
the GPU campaign's profile stage (step_profile_worker): the device's top kernels and idle gaps from the trace."""

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
        if trainer.deferred is not None:  # sync_free_steps: the steps' results, as a log interval's end reads them
            trainer.deferred.resolve()
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


# The device's side of a chrome trace (torch.profiler's export_chrome_trace): kernels, copies and fills
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "user_annotation")
GAP_SIZES = {"under 10 us": 10, "10-100 us": 100, "0.1-1 ms": 1000, "over 1 ms": float("inf")}  # upper bounds, us


def device_timeline(events: list[dict], steps: int) -> dict:
    """Where the profiled steps' wall time went on the device, from a chrome trace's events: the kernels that took
    the most of it (name, ms per step, share, launches per step), the device's busy share, and its gaps (the device
    idle while the host prepares, launches or waits) by size, the largest with the kernels around them and the
    innermost host operation running at their middle. Empty where no device event was traced (a CPU run)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    device = sorted((e for e in spans if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not device:
        return {}
    window = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    wall = window[1] - window[0]
    kernels: dict[str, list[float]] = {}
    for event in device:
        kernels.setdefault(event["name"], []).append(event["dur"])
    top = sorted(kernels.items(), key=lambda item: -sum(item[1]))[:15]
    gaps, busy, end, before = [], 0.0, window[0], "(start of the profiled steps)"
    for event in device + [{"ts": window[1], "dur": 0.0, "name": "(end of the profiled steps)"}]:
        if event["ts"] > end:
            gaps.append((event["ts"] - end, end, before, event["name"]))
        busy += max(0.0, event["ts"] + event["dur"] - max(end, event["ts"]))
        if event["ts"] + event["dur"] >= end:
            end, before = event["ts"] + event["dur"], event["name"]
    host = [e for e in spans if e.get("cat") in HOST_CATEGORIES]

    def host_at(moment: float) -> str:
        running = [e for e in host if e["ts"] <= moment <= e["ts"] + e["dur"]]
        return min(running, key=lambda e: e["dur"])["name"] if running else "(no host operation)"

    sizes = {name: [g[0] for g in gaps if bound > g[0] >= lower] for (name, bound), lower in
             zip(GAP_SIZES.items(), (0, 10, 100, 1000))}  # fmt: skip
    return {
        "device_busy_share": busy / wall,
        "kernels_per_step": len(device) / steps,
        "top_kernels": [[name, sum(d) / steps / 1000, sum(d) / wall, len(d) / steps] for name, d in top],
        "gaps_by_size": {name: [len(g) / steps, sum(g) / steps / 1000] for name, g in sizes.items()},
        "largest_gaps": [
            [length / 1000, before[:80], after[:80], host_at(start + length / 2)[:80]]
            for length, start, before, after in sorted(gaps, reverse=True)[:10]
        ],  # fmt: skip
    }


def step_profile_worker(result_file: str, overrides: list[str], warmup: int, steps: int, data_file: str,
                        trace_file: str) -> None:  # fmt: skip
    """torch.profiler (CPU, and CUDA where there is one) over `steps` training steps of a configuration after
    `warmup`: the host's operations by self time, the device's timeline (device_timeline), seconds per step; the
    trace written gzipped to trace_file."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    trainer, _ = bench_trainer(overrides, data_file, None)
    batches = [trainer.data.train_examples.take(indices) for indices in trainer.data.schedule[: warmup + steps]]
    for examples in batches[:warmup]:
        trainer.train_step(examples)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    start = time.perf_counter()
    with profile(activities=activities) as profiler:
        for examples in batches[warmup:]:
            trainer.train_step(examples)  # ends with the step's one transfer from the device, unless sync-free
        if trainer.deferred is not None:  # sync_free_steps: the steps' results, as a log interval's end reads them
            trainer.deferred.resolve()
    seconds = (time.perf_counter() - start) / steps
    with tempfile.TemporaryDirectory() as tmp:
        profiler.export_chrome_trace(str(Path(tmp) / "trace.json"))
        trace = (Path(tmp) / "trace.json").read_bytes()
    Path(trace_file).write_bytes(gzip.compress(trace))
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]
    result = {
        "seconds_per_step": seconds,
        "layout": trainer.scorer.describe(),
        "host_ms_per_step": total / steps / 1000,
        "top_host_ops": [
            [e.key, e.self_cpu_time_total / steps / 1000, e.self_cpu_time_total / total, e.count // steps] for e in top
        ],  # fmt: skip
        **device_timeline(json.loads(trace)["traceEvents"], steps),
    }
    Path(result_file).write_text(json.dumps(result))
