"""--precision [--rounds N] [--warmup N] [--steps N]: the compute precisions side by side on the training step of
SmolLM2-135M-Instruct on HH pairs at max_length 128 x 2 pairs (DPO, beta 0.1, AdamW, the default levers): float32,
bfloat16 autocast, float16 autocast with dynamic loss scaling, and FP8 matmuls (torchao's float8 layers; on a CPU
emulated, for correctness only). A small workload, and only the pairs the steps read (their reference pass is setup):
a CPU without float16 kernels runs it some 50x slower than float32. Each configuration in a fresh process, in turn,
`rounds` times: pairs/s, peak RSS, the loss scale's skipped steps, and how far each step's loss lies from float32's on
the same batches. The GPU rows are the GPU campaign's (gpu.py)."""

import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import (
    HH_FILE,
    peak_memory_gib,
    smollm2_dir,
    with_machine_rates,
    worker_subprocess,
    workload_overrides,
)
from modeling.precision import cpu_name

PRECISIONS = {
    "float32": ["model.fsdp_policy_mp=null"],
    "bfloat16": ["model.fsdp_policy_mp=bfloat16"],
    "float16 + loss scaling": ["model.fsdp_policy_mp=float16"],
    "FP8 rowwise (+ bfloat16)": ["model.fsdp_policy_mp=bfloat16", "model.fp8=rowwise"],
}


WORKLOAD = (128, 2)  # max_length, pairs a step


def precision_worker(overrides: list[str], warmup: int, steps: int, result_file: str) -> None:
    """One precision in this fresh process: every step's mean loss, the timed steps' pairs/s, peak memory, the
    loss scale at the end and the steps it skipped (float16)."""
    from bench.step import bench_trainer

    trainer, _ = bench_trainer(overrides, n_rows=WORKLOAD[1] * (warmup + steps) + 1)
    losses, seconds, pairs = [], 0.0, 0
    for step, indices in enumerate(trainer.data.schedule[: warmup + steps]):
        examples = trainer.data.train_examples.take(indices)
        start = time.perf_counter()
        metrics = trainer.train_step(examples)  # ends with the step's one transfer from the device: synchronised
        if metrics is None:  # sync_free_steps (bfloat16): read at once, as float16's loss scale reads each step
            metrics = trainer.deferred.resolve()[-1].metrics
        trainer.batch_counter += 1
        if step >= warmup:
            seconds, pairs = seconds + time.perf_counter() - start, pairs + len(examples)
        losses.append(sum(metrics["loss/train"]) / len(metrics["loss/train"]))
    scale = trainer.loss_scale
    result = {
        "losses": losses,
        "pairs_per_second": pairs / seconds,
        "peak_memory_gib": peak_memory_gib(trainer.topology.device.type == "cuda"),
        "loss_scale": scale.value if scale else None,
        "skipped_steps": scale.skipped if scale else 0,
    }
    Path(result_file).write_text(json.dumps(result))


def bench_precision(warmup: int, steps: int, rounds: int) -> None:
    model_dir = smollm2_dir()
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; SmolLM2-135M-Instruct, pairs of {HH_FILE.name}")
    print(f"max_length {WORKLOAD[0]} x {WORKLOAD[1]} pairs a step, {warmup} warm-up + {steps} timed steps, "
          f"{rounds} round(s), alternating")  # fmt: skip
    results = {name: [] for name in PRECISIONS}
    for _ in range(rounds):
        for name, precision in PRECISIONS.items():
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [*workload_overrides(model_dir, with_machine_rates(tmp), *WORKLOAD), *precision]
                results[name].append(worker_subprocess(precision_worker, str(Path(tmp) / "r.json"),
                                                       overrides=overrides, warmup=warmup, steps=steps))  # fmt: skip
    reference = results["float32"][0]["losses"]
    print(f"\n{'precision':26s} {'pairs/s':>8s} {'x f32':>6s} {'peak RSS':>9s} {'max |loss - f32|':>17s}  loss scale")
    base = sum(r["pairs_per_second"] for r in results["float32"]) / rounds
    for name, runs in results.items():
        rate = sum(r["pairs_per_second"] for r in runs) / rounds
        distance = max(abs(a - b) for a, b in zip(runs[0]["losses"], reference))
        scale = runs[0]["loss_scale"]
        scaled = f"{scale:g}, {runs[0]['skipped_steps']} skipped" if scale is not None else "-"
        print(f"{name:26s} {rate:8.3f} {rate / base:5.2f}x {runs[0]['peak_memory_gib']:6.2f} GiB "
              f"{distance:17.2e}  {scaled}")  # fmt: skip
    print("\nlosses by step:")
    for name, runs in results.items():
        print(f"{name:26s} " + " ".join(f"{loss:.4f}" for loss in runs[0]["losses"]))
