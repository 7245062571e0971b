"""One configuration's training steps, timed in a fresh process (whose peak memory is then its own): the worker
behind --levers, --compile, --lora, --window, --gpu's layouts, --reward's and --vision's own side, and --versus
(where another version runs its own)."""

import contextlib
import json
import os
import threading
import time
from pathlib import Path

import torch

from bench.common import HH_FILE, images_encoded, peak_memory_gib, worker_subprocess
from modeling.precision import DTYPE_NAMES


def bench_trainer(overrides: list[str], data_file: str = str(HH_FILE), n_rows: int | None = 48):
    """(trainer, setup seconds): a Trainer built as train.py builds it, on the first n_rows pairs of data_file
    (None: all). Called first in a fresh process (a worker): it maps the process's memory as train.py does."""
    from itertools import islice

    import config as configuration
    from build import build
    from modeling.distributed import Topology
    from modeling.tokenizers import load_tokenizer
    from pairs.sources import read_file_rows
    from preference_datasets import parse_rows
    from reporting.host_memory import use_huge_pages
    from trainers import Trainer

    use_huge_pages()  # before torch allocates anything
    config = configuration.load(overrides)
    cache_dir = Path(config.local_dirs[0])
    tokenizer = load_tokenizer(config.model, cache_dir)
    pairs = parse_rows(list(islice(read_file_rows(Path(data_file)), n_rows)), data_file, tokenizer)
    data = {"train": pairs, "test": pairs[:1]}  # the eval pair plays no part in the timings
    start = time.perf_counter()
    trainer = Trainer(build(config, Topology.create(config.trainer), data), cache_dir / "run")
    return trainer, time.perf_counter() - start


@contextlib.contextmanager
def sampled_rss():
    """[the largest RSS (GiB) seen while the block runs], sampled every 5 ms by a thread of its own."""
    peak = [0.0]

    def sample(stop: threading.Event) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not stop.wait(0.005):
            peak[0] = max(peak[0], int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**30)

    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop,), daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()


def timed_steps(trainer, warmup: int, steps: int) -> tuple[dict, float]:
    """The throughput rates (perf/*) of `steps` training steps after `warmup`, and the first step's seconds. With
    sync_free_steps the warm-up steps are resolved one by one (the first one's time includes the device's) and the
    timed ones together at the end, as one log interval resolves them."""
    from reporting.telemetry import Throughput, step_amounts

    speed, first_step = Throughput(trainer.peak_flops, 1, trainer.topology.device), 0.0
    timed, finished, seconds = [], [], 0.0
    for step, indices in enumerate(trainer.data.schedule[: warmup + steps]):
        examples = trainer.data.train_examples.take(indices)
        start = time.perf_counter()
        metrics = trainer.train_step(examples)  # synchronised: ends with the step's one transfer from the device
        done = [metrics] if metrics is not None else []
        if trainer.deferred is not None and (step < warmup or step == warmup + steps - 1):
            done = [finished_step.metrics for finished_step in trainer.deferred.resolve()]
        elapsed = time.perf_counter() - start
        first_step = first_step or elapsed
        if step >= warmup:
            seconds, timed, finished = seconds + elapsed, timed + examples, finished + done
    computed = sum(sum(metrics["perf/computed_tokens"]) for metrics in finished)
    speed.add(**step_amounts(timed, seconds, computed, trainer.flops, trainer.batch_loss.live_reference))
    return speed.rates(), first_step


def lever_worker(
    overrides: list[str],
    warmup: int,
    steps: int,
    result_file: str,
    data_file: str = str(HH_FILE),
    n_rows: int | None = 48,
) -> None:
    """One configuration in this fresh process: build the trainer (bench_trainer), time `steps` training steps after
    `warmup`, and write pairs/s, tokens/s (real: prompt once; computed: padding included), MFU, peak memory, what
    precision was chosen, the first step's seconds, and the images the policy's and a live reference's vision towers
    encode per pair in the steps (0 for a text model; the reference cache's pass before training is setup)."""
    trainer, setup_seconds = bench_trainer(overrides, data_file, n_rows)
    # the largest RSS seen while training steps run, and the images encoded in them
    with sampled_rss() as step_rss, images_encoded(trainer.policy, trainer.reference_model) as encoded:
        rates, first_step = timed_steps(trainer, warmup, steps)
    pairs = sum(len(indices) for indices in trainer.data.schedule[: warmup + steps])
    result = {
        "pairs_per_second": rates["perf/pairs_per_second"],
        "real_tokens_per_second": rates["perf/real_tokens_per_second"],
        "computed_tokens_per_second": rates["perf/computed_tokens_per_second"],
        "mfu": rates.get("perf/mfu", float("nan")),  # absent where the peak was exceeded (PeakRate.mfu)
        "peak_memory_gib": peak_memory_gib(trainer.topology.device.type == "cuda"),
        "training_rss_gib": step_rss[0],
        "precision": DTYPE_NAMES[trainer.precision.policy_compute or torch.float32],
        "layout": trainer.scorer.describe(),
        "fallbacks": list(trainer.scorer.fallbacks),
        "setup_seconds": setup_seconds,
        "first_step_seconds": first_step,
        "images_per_pair": {"policy": encoded[0] / pairs, "reference": encoded[1] / pairs},
    }
    Path(result_file).write_text(json.dumps(result))


def lever_subprocess(overrides: list[str], warmup: int, steps: int, result_file: str, **data):
    """lever_worker in a fresh process (whose peak memory is then its own); data: its data_file and n_rows."""
    kwargs = dict(overrides=overrides, warmup=warmup, steps=steps, **data)
    return worker_subprocess(lever_worker, result_file, **kwargs)
