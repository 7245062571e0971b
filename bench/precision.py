"""--precision [--rounds N]: the compute precisions side by side on the training step of SmolLM2-135M-Instruct on the
first 48 HH pairs at max_length 256 x 4 pairs (DPO, beta 0.1, AdamW, the default levers): float32, bfloat16
autocast, float16 autocast with dynamic loss scaling, and FP8 matmuls (torchao's float8 layers; on a CPU emulated,
for correctness only). Each configuration in a fresh process, in turn, `rounds` times: pairs/s, peak RSS, the loss
scale's skipped steps, and how far each step's loss lies from float32's on the same batches."""

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


def precision_worker(overrides: list[str], warmup: int, steps: int, result_file: str) -> None:
    """One precision in this fresh process: every step's mean loss, the timed steps' pairs/s, peak memory, the
    loss scale at the end and the steps it skipped (float16)."""
    from bench.step import bench_trainer

    trainer, _ = bench_trainer(overrides)
    losses, seconds, pairs = [], 0.0, 0
    for step, indices in enumerate(trainer.data.schedule[: warmup + steps]):
        examples = trainer.data.train_examples.take(indices)
        start = time.perf_counter()
        metrics = trainer.train_step(examples)  # ends with the step's one transfer from the device: synchronised
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
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; SmolLM2-135M-Instruct, first 48 pairs of {HH_FILE.name}")
    print(f"max_length 256 x 4 pairs a step, {warmup} warm-up + {steps} timed steps, {rounds} round(s), alternating")
    results = {name: [] for name in PRECISIONS}
    for _ in range(rounds):
        for name, precision in PRECISIONS.items():
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [*workload_overrides(model_dir, with_machine_rates(tmp), 256, 4), *precision]
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
