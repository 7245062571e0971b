"""Benchmarks behind the README's performance statements; run `python bench.py` and compare side by side.

1. Matmul throughput by dtype on this device (decides the dtype advice for CPUs).
2. Float32 sequence log-probs from bf16 logits: the chunked implementation vs the naive full upcast,
   forward + backward at a SmolLM2-sized vocabulary.
3. `python bench.py --levers`: the speed levers of the training step, each alone and all together, against the
   padded float32 path: SmolLM2-135M-Instruct on the first 48 pairs of ../shared's HH harmless-base file, DPO with
   beta 0.1 and AdamW, at max_length 256 x 4 pairs and 512 x 8 pairs per step. Each configuration runs in a fresh
   process (so its peak RSS is its own), configurations alternate, and each prints pairs/s, real tokens/s (prompt
   counted once), MFU and peak memory. Then the peak memory of the log-prob computation at a 32k and a 128k
   vocabulary.
4. `python bench.py --compile`: torch.compile of each transformer block against eager, on the default configuration
   at 256 x 4, first step (compilation) and steady state.
5. `python bench.py --fsdp`: FSDP1 (`FullyShardedDataParallel`) vs FSDP2 (`fully_shard`) on 2 processes (gloo on
   the CPU, NCCL with 2+ GPUs), both sharding per Llama block: training step time, and the largest parameter
   difference from one process training on the same batches (decides which FSDP FSDPTrainer uses).
6. `python bench.py --lora`: LoRA (the preset, rank 16 on every linear layer) against full fine-tuning on the
   default configuration at 256 x 4: seconds per step and peak RSS, alternating, each in a fresh process.
7. `python bench.py --attention`: the packed layout's attention bookkeeping per micro-batch, dense mask against block
   mask, at T = 1k, 4k, 16k and 32k; and the CPU's no-grad forward with each.
8. `python bench.py --fsdp-reduce`: FSDP2's gradient error reducing in bfloat16 against float32, 2 and 4 processes.
9. `python bench.py --gpu`: the GPU campaign (the cuda tests; padded, packed dense-mask and packed block-mask
   layouts and TRL's DPOTrainer on a random ~1B Llama at max_length 1024 and 4096: pairs/s, tokens/s, MFU, peak
   memory); `--gpu --smoke` runs it at tiny sizes on any device, as the test suite does.
10. `python bench.py --data`: prepared pairs/s on a first run and a rerun, and resident bytes per token, at about 5k,
   50k and 500k synthetic pairs, for 1 and 2 processes; the dry run on HH rows; the reference cache at a million
   pairs (`--data --smoke`: small sizes, as the test suite runs it).
11. `python bench.py --profile [OVERRIDES ...]`: where a training step's CPU time goes (operations by self time, parts
   of the step by their whole time) for any configuration, the default's by default.
12. `python bench.py --versus GIT_REF [--rounds N]`: this tree's training step against another version's,
   alternating fresh processes (2 rounds unless told): pairs/s, MFU, the share of the machine's fastest matmul rate,
   peak RSS.
13. `python bench.py --scale [--versus GIT_REF]`: each rank's peak resident memory while it reads the model, trains,
   saves (checkpoint and export) and resumes, and the load, save and resume times, on 1, 2 and 4 processes, for a
   random 286M Llama (hidden 1024, 20 layers, float32, AdamW; 2 steps of 4 HH pairs) and the same twice as deep;
   with --versus, another version's code on each configuration too, in turn.
14. `python bench.py --window`: a sliding-window model (a narrow Gemma 3: five 128-token-window layers to one
   global, and Gemma 2's final soft cap of 30) at max_length 512 x 8 HH pairs, the default configuration (packed
   rows with a windowed mask per layer type, the scored head soft-capping itself) against what such a model took
   before (padded rows, all logits) and packed with all logits: pairs/s, alternating fresh processes, 2 rounds.
"""

import argparse
import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers

from core import logprobs
from core.logprobs import token_logps_from_hidden, token_logps_from_logits
from modeling.distributed import free_port, leave_process_group, rank_environment
from utils import REPO_ROOT

IGNORE_INDEX = -100  # labels that are not scored (the reference implementation's convention)


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    labels = labels[:, 1:].clone()
    mask = labels != IGNORE_INDEX
    labels[~mask] = 0
    token_logps = logits[:, :-1].float().log_softmax(-1).gather(2, labels.unsqueeze(2)).squeeze(2)
    return (token_logps * mask).sum(-1)


def chunked_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    rows = (targets.flatten() != IGNORE_INDEX).nonzero().squeeze(-1)
    token_logps = token_logps_from_logits(logits.flatten(0, 1), rows, targets.flatten()[rows])
    return torch.zeros(labels.shape[0], device=logits.device).index_add_(0, rows // labels.shape[1], token_logps)


# ---------------------------------------------------------------------------------------------------------
# The training step's levers

HH_FILE = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base" / "test.jsonl.gz"
BASELINE = ["layout=padded", "scored_logits_only=false", "reference_cache=false", "model.fsdp_policy_mp=null"]
LEVERS = {  # each lever alone: the baseline with one setting changed
    "padded float32 (baseline)": BASELINE,
    "packed layout": ["layout=packed", *BASELINE[1:]],
    "scored logits only": [BASELINE[0], "scored_logits_only=true", *BASELINE[2:]],
    "reference cache": [*BASELINE[:2], "reference_cache=true", BASELINE[3]],
    "auto precision": [*BASELINE[:3], "model.fsdp_policy_mp=auto"],
    "all (the default)": [],
}
WORKLOADS = ((256, 4), (512, 8))


def bench_trainer(overrides: list[str], data_file: str = str(HH_FILE), n_rows: int | None = 48):
    """(trainer, setup seconds): a Trainer built as train.py builds it, on the first n_rows pairs of data_file
    (None: all). Called first in a fresh process (a worker): it maps the process's memory as train.py does."""
    from itertools import islice

    import config as configuration
    from build import build
    from modeling.distributed import Topology
    from modeling.models import load_tokenizer
    from preference_datasets import parse_rows, read_file_rows
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


def lever_worker(
    overrides: list[str],
    warmup: int,
    steps: int,
    result_file: str,
    compile_blocks: bool = False,
    data_file: str = str(HH_FILE),
    n_rows: int | None = 48,
) -> None:
    """One configuration in this fresh process: build the trainer (bench_trainer), time `steps` training steps after
    `warmup`, and write pairs/s, tokens/s (real: prompt once; computed: padding included), MFU, peak memory, what
    precision was chosen and the first step's seconds. compile_blocks: torch.compile each transformer block
    (dynamic shapes) before the first step."""

    from modeling.placement import find_blocks
    from reporting.telemetry import Throughput, step_amounts

    trainer, setup_seconds = bench_trainer(overrides, data_file, n_rows)
    config = trainer.config
    if compile_blocks:
        for block in find_blocks(trainer.policy, config.model.block_name):
            block.compile(dynamic=True)
    speed, first_step = Throughput(trainer.peak_flops, 1, trainer.topology.device), 0.0
    live_reference = trainer.live_reference
    step_rss = [0.0]  # the largest RSS seen while training steps run, sampled every 5 ms

    def sample_rss(stop: threading.Event) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not stop.wait(0.005):
            step_rss[0] = max(step_rss[0], int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**30)

    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(stop,), daemon=True)
    sampler.start()
    for step, indices in enumerate(trainer.data.schedule[: warmup + steps]):
        examples = trainer.data.train_examples.take(indices)
        start = time.perf_counter()
        metrics = trainer.train_step(examples)  # ends with the step's one transfer from the device: synchronised
        seconds = time.perf_counter() - start
        first_step = first_step or seconds
        if step >= warmup:
            computed = sum(metrics["perf/computed_tokens"])
            speed.add(**step_amounts(examples, seconds, computed, trainer.flops, live_reference))
    stop.set()
    sampler.join()
    cuda = trainer.topology.device.type == "cuda"
    rates = speed.rates()
    Path(result_file).write_text(
        json.dumps(
            {
                "pairs_per_second": rates["perf/pairs_per_second"],
                "real_tokens_per_second": rates["perf/real_tokens_per_second"],
                "computed_tokens_per_second": rates["perf/computed_tokens_per_second"],
                "mfu": rates["perf/mfu"],
                "peak_memory_gib": (
                    torch.cuda.max_memory_allocated() / 2**30
                    if cuda
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
                ),
                "training_rss_gib": step_rss[0],
                "precision": "bfloat16" if trainer.precision.policy_compute == torch.bfloat16 else "float32",
                "layout": trainer.scorer.describe(),
                "setup_seconds": setup_seconds,
                "first_step_seconds": first_step,
            }
        )
    )


def bench_levers(warmup: int, steps: int) -> None:
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from modeling.precision import cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    flags = sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(flags)}; torch {torch.__version__}, "
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


# Where a step's CPU time goes (--profile): operations by their self time, parts of the step by their whole time
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
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from modeling.precision import cpu_flags, cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    with tempfile.TemporaryDirectory() as tmp:
        base = [*workload_overrides(model_dir, with_machine_rates(tmp), 256, 4), *overrides]
        result = worker_subprocess("profile_worker", str(Path(tmp) / "result.json"), overrides=base, warmup=warmup,
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


def lever_subprocess(overrides: list[str], warmup: int, steps: int, result_file: str, compile_blocks=False, **data):
    """lever_worker in a fresh process (whose peak memory is then its own); data: its data_file and n_rows."""
    kwargs = dict(overrides=overrides, warmup=warmup, steps=steps, compile_blocks=compile_blocks, **data)
    return worker_subprocess("lever_worker", result_file, **kwargs)


def worker_subprocess(worker: str, result_file: str, root: Path = REPO_ROOT, **kwargs) -> dict:
    """bench.<worker>(result_file=result_file, **kwargs) in a fresh process, from the code in `root` (this tree, or
    another version's: code_at); the JSON it writes there."""
    call = f"bench.{worker}(result_file={result_file!r}, **{kwargs!r})"
    code = f"import sys; sys.path.insert(0, {str(root)!r}); import bench; {call}"
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(result_file).read_text())


def workload_overrides(model_dir: str, cache_dir: str, max_length: int, batch: int) -> list[str]:
    return [
        f"model.name_or_path={model_dir}",
        f"datasets=[{HH_FILE}]",
        f"local_dirs=[{cache_dir}]",
        "loss.beta=0.1",
        f"max_length={max_length}",
        f"max_prompt_length={max_length // 2}",
        f"batch_size={batch}",
        f"eval_batch_size={batch}",
        "n_epochs=4",
        "wandb.enabled=false",
        "debug=true",
    ]


def with_machine_rates(cache_dir: str) -> str:
    """cache_dir holding this machine's measured matmul rates (precision_probe.json, measured once in ./.cache), so
    that every run's MFU, and `auto`'s choice, rest on the same numbers rather than on a fresh, noisy probe each."""
    from modeling.precision import cpu_matmul_flops

    cpu_matmul_flops(REPO_ROOT / ".cache")
    shutil.copy(REPO_ROOT / ".cache" / "precision_probe.json", cache_dir)
    return cache_dir


@contextlib.contextmanager
def code_at(ref: str):
    """The project's code at git `ref`, checked out beside this tree (a detached worktree, removed afterwards), with
    ../shared reachable from it as from here."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), ref], cwd=REPO_ROOT, check=True,
                       capture_output=True)  # fmt: skip
        (Path(tmp) / "shared").symlink_to(REPO_ROOT.parent / "shared")
        try:
            yield tree
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO_ROOT, capture_output=True)


def bench_versus(ref: str, warmup: int, steps: int, rounds: int) -> None:
    """This tree's training step against the code at `ref`, on the default configuration at 256 x 4 and 512 x 8 and
    in float32 (what `auto` picks on a CPU without fast bfloat16; measured separately only where the default is
    bfloat16) at 256 x 4: each run in a fresh process, the two versions alternating, `rounds` rounds (runs of one
    version vary by ~10% on a shared machine, so more rounds give a steadier ratio)."""
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from modeling.precision import REQUIRED_SPEEDUP, cpu_flags, cpu_matmul_flops, cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    rates = cpu_matmul_flops(REPO_ROOT / ".cache")
    peak_dtype = max(rates, key=rates.get)
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
        f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; matmul {rates['float32'] / 1e9:.0f} GFLOP/s float32, "
        f"{rates['bfloat16'] / 1e9:.0f} bfloat16; torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        f"SmolLM2-135M-Instruct, first 48 pairs of {HH_FILE.name}, DPO beta 0.1, AdamW; {warmup} warm-up + {steps} "
        f"timed steps; {ref} against this tree, alternating, {rounds} rounds, each run in a fresh process; "
        f"'of peak': useful FLOP/s as a share of the faster matmul rate here ({peak_dtype})"
    )
    workloads = [("default", 256, 4, []), ("default", 512, 8, [])]
    if rates["bfloat16"] >= REQUIRED_SPEEDUP * rates["float32"]:  # else the default is the float32 path already
        workloads.append(("float32", 256, 4, ["model.fsdp_policy_mp=null"]))
    with code_at(ref) as old:
        for name, max_length, batch, extra in workloads:
            print(f"\n{name} at max_length {max_length} x {batch} pairs per step")
            print(f"{'code':12s} {'pairs/s':>8s} {'MFU':>6s} {'of peak':>8s} {'peak RSS':>9s}  precision")
            speeds = {ref: [], "this tree": []}
            for _ in range(rounds):
                for label, root in ((ref, old), ("this tree", REPO_ROOT)):
                    with tempfile.TemporaryDirectory() as tmp:
                        overrides = [*workload_overrides(model_dir, with_machine_rates(tmp), max_length, batch), *extra]
                        result = worker_subprocess("lever_worker", str(Path(tmp) / "result.json"), root,
                                                   overrides=overrides, warmup=warmup, steps=steps)  # fmt: skip
                    speeds[label].append(result["pairs_per_second"])
                    # MFU is against the compute dtype's rate; "of peak" against the machine's fastest one
                    of_peak = result["mfu"] * rates[result["precision"]] / rates[peak_dtype]
                    print(
                        f"{label:12s} {result['pairs_per_second']:8.3f} {result['mfu']:6.1%} {of_peak:8.1%} "
                        f"{result['peak_memory_gib']:7.2f} GiB  {result['precision']}",
                        flush=True,
                    )
            ratio = sum(speeds["this tree"]) / sum(speeds[ref])
            print(f"this tree / {ref}: {ratio:.2f}x pairs/s")


def bench_compile(warmup: int, steps: int) -> None:
    """The default configuration at 256 x 4, eager against torch.compile of each block, alternating."""
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from modeling.precision import cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores; the default configuration at max_length 256 x 4 pairs; "
        f"{warmup} warm-up + {steps} timed steps"
    )
    for compile_blocks in (False, True, False, True):
        with tempfile.TemporaryDirectory() as tmp:
            overrides = workload_overrides(model_dir, tmp, 256, 4)
            result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"), compile_blocks)
        name = "torch.compile per block" if compile_blocks else "eager"
        print(
            f"{name:24s} first step {result['first_step_seconds']:5.1f} s, "
            f"then {4 / result['pairs_per_second']:.2f} s/step "
            f"({result['pairs_per_second']:.3f} pairs/s)",
            flush=True,
        )


def bench_lora(warmup: int, steps: int) -> None:
    """Full fine-tuning against LoRA (the preset: rank 16 on every linear layer) at 256 x 4, alternating."""
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from modeling.precision import cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    flags = sorted(set(Path("/proc/cpuinfo").read_text().split()) & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(flags)}; SmolLM2-135M-Instruct, default levers, "
        f"max_length 256 x 4 pairs; {warmup} warm-up + {steps} timed steps"
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


# ---------------------------------------------------------------------------------------------------------
# The GPU campaign: python bench.py --gpu (and --gpu --smoke: tiny sizes on any device, as the test suite runs it)

# A randomly initialised ~1.1B Llama (Llama-3.2-1B's shape with a 32k vocabulary): config only, nothing downloaded.
CAMPAIGN_MODELS = {
    "gpu": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}
# --smoke: the tiny preset's shape (assets/tiny-llama, the tests' model)
CAMPAIGN_MODELS["smoke"] = {
    key: value
    for key, value in json.loads((REPO_ROOT / "assets" / "tiny-llama" / "config.json").read_text()).items()
    if key in CAMPAIGN_MODELS["gpu"]
}
# (max_length, pairs per step, activation checkpointing): at 4096 the padded layout's 8 rows x 4096 tokens would
# not fit an H100's 80 GB without recomputation, for TRL as for us.
CAMPAIGN_WORKLOADS = {"gpu": ((1024, 8, False), (4096, 4, True)), "smoke": ((64, 4, False),)}
CAMPAIGN_LAYOUTS = {
    "padded (what TRL computes)": ["layout=padded"],
    "packed, dense mask": ["layout=packed", "packed_attention=dense"],
    "packed, block mask": ["layout=packed", "packed_attention=block"],
    # the block mask's row budget: the whole micro-batch in one row (the default) against rows of max_length
    "packed, block mask, rows of max_length": [
        "layout=packed",
        "packed_attention=block",
        "pack_row_tokens={max_length}",
    ],
}
# Token lengths of the HH harmless-base test pairs under the SmolLM2 tokenizer (medians: prompt 94, chosen 27,
# rejected 37; log-normal spread ~1.0), scaled from HH's usual max_length of 512 to the workload's.
HH_MEDIANS, HH_LOG_SPREAD = {"prompt": 94, "chosen": 27, "rejected": 37}, 1.0


def hh_like_rows(n: int, max_length: int, seed: int) -> list[dict]:
    """n pairs of random lowercase text (one token per character under the byte-level tiny tokenizer) whose lengths
    follow HH's mix scaled to max_length, kept within the trainers' limits (prompt <= max_length / 2, prompt +
    longer response + EOS <= max_length) so that neither trainer truncates."""
    import random

    rng = random.Random(seed)
    scale = max_length / 512

    def text(median: float, limit: int) -> str:
        length = min(limit, max(1, round(rng.lognormvariate(math.log(median * scale), HH_LOG_SPREAD))))
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))

    rows = []
    for _ in range(n):
        prompt = text(HH_MEDIANS["prompt"], max_length // 2)
        room = max_length - len(prompt) - 1  # the EOS that ends each response
        rows.append({name: text(HH_MEDIANS[name], room) for name in ("chosen", "rejected")} | {"prompt": prompt})
    return rows


def campaign_model_dir(directory: Path, sizes: dict) -> Path:
    """A model directory of a Llama config of these sizes and the tiny byte-level tokenizer (assets/tiny-llama)."""
    import shutil

    directory.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(**sizes, tie_word_embeddings=False).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO_ROOT / "assets" / "tiny-llama" / name, directory / name)
    return directory


def trl_worker(
    result_file: str,
    model_dir: str,
    data_file: str,
    max_length: int,
    pairs: int,
    checkpointing: bool,
    warmup: int,
    steps: int,
) -> None:
    """TRL's DPOTrainer on the same model, data and precision recipe as ours (float32 weights, bfloat16 autocast on
    a GPU; float32 on a CPU), its reference log-probs precomputed as our cache does, timed per step."""

    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from reporting.telemetry import ModelFlops, peak_flops

    cuda = torch.cuda.is_available()
    rows = [json.loads(line) for line in Path(data_file).read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    times = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            torch.cuda.synchronize() if cuda else None
            times.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            torch.cuda.synchronize() if cuda else None
            times[-1] = time.perf_counter() - times[-1]

    with tempfile.TemporaryDirectory() as output_dir:
        args = DPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=pairs,
            max_length=max_length,
            beta=0.1,
            learning_rate=1e-6,
            max_steps=warmup + steps,
            bf16=cuda,
            use_cpu=not cuda,
            precompute_ref_log_probs=True,
            gradient_checkpointing=checkpointing,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[StepTimer()],
        )
        trainer.train()
    seconds = sum(times[warmup:])
    # TRL draws its own batches: per-pair tokens and FLOPs are the data's means
    examples = [
        {"prompt": [0] * len(r["prompt"]), "responses": [[0] * (len(r[k]) + 1) for k in ("chosen", "rejected")]}
        for r in rows
    ]
    flops_model = ModelFlops.of(model, list(model.model.layers))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    pairs_per_second = pairs * steps / seconds
    peak, _ = peak_flops(
        torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, Path(tempfile.gettempdir())
    )
    Path(result_file).write_text(
        json.dumps(
            {
                "pairs_per_second": pairs_per_second,
                "real_tokens_per_second": pairs_per_second
                * mean([len(e["prompt"]) + sum(map(len, e["responses"])) for e in examples]),
                "mfu": pairs_per_second * mean([flops_model.example(e, False) for e in examples]) / peak,
                "peak_memory_gib": (
                    torch.cuda.max_memory_allocated() / 2**30
                    if cuda
                    else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
                ),
            }
        )
    )


def bench_gpu(smoke: bool, warmup: int, steps: int) -> None:
    """The campaign: the cuda-marked tests, then each layout (and TRL's DPOTrainer when importable) on a random ~1B
    Llama at max_length 1024 and 4096, each configuration in a fresh process; --smoke: tiny sizes, no test run."""
    import importlib.util

    size = "smoke" if smoke else "gpu"
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device}; torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if not smoke:
        tests = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", str(REPO_ROOT / "tests")],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
        )
        print(f"cuda tests: {(tests.stdout.strip().splitlines() or ['no output'])[-1]}", flush=True)
        if tests.returncode:
            print(tests.stdout[-6000:], flush=True)
    trl = importlib.util.find_spec("trl") is not None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = campaign_model_dir(Path(tmp) / "model", CAMPAIGN_MODELS[size])
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
        parameters = sum(p.numel() for p in meta.parameters())
        print(
            f"model: random Llama of {parameters / 1e6:,.1f}M parameters {CAMPAIGN_MODELS[size]}; HH-like length mix; "
            f"{warmup} warm-up + {steps} timed steps",
            flush=True,
        )
        for max_length, pairs, checkpointing in CAMPAIGN_WORKLOADS[size]:
            data_file = Path(tmp) / f"pairs-{max_length}.jsonl"
            rows = hh_like_rows(pairs * (warmup + steps), max_length, seed=max_length)
            data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
            print(f"\nmax_length {max_length} x {pairs} pairs per step, activation checkpointing {checkpointing}")
            print(
                f"{'configuration':40s} {'pairs/s':>8s} {'real tok/s':>11s} {'computed':>9s} {'MFU':>6s} "
                f"{'peak mem':>9s}  (tokens/s: real = prompt once, computed = padding included)"
            )
            overrides = [
                "model=blank_model",
                f"model.name_or_path={model_dir}",
                "model.random_init=true",
                "model.block_name=LlamaDecoderLayer",
                f"model.fsdp_policy_mp={'bfloat16' if cuda else 'null'}",
                f"datasets=[{data_file}]",
                f"local_dirs=[{tmp}]",
                "loss.beta=0.1",
                "lr=1e-6",
                f"max_length={max_length}",
                f"max_prompt_length={max_length // 2}",
                f"batch_size={pairs}",
                f"eval_batch_size={pairs}",
                f"activation_checkpointing={str(checkpointing).lower()}",
                "wandb.enabled=false",
                "debug=true",
            ]
            for name, layout in CAMPAIGN_LAYOUTS.items():
                if "block" in name and not cuda:
                    print(f"{name:40s} skipped: FlexAttention has no backward pass on a CPU", flush=True)
                    continue
                layout = [setting.format(max_length=max_length) for setting in layout]
                result = lever_subprocess(
                    [*overrides, *layout],
                    warmup,
                    steps,
                    str(Path(tmp) / "result.json"),
                    data_file=str(data_file),
                    n_rows=None,
                )
                print(campaign_row(name, result) + f"  {result['layout']}", flush=True)
            if trl:
                kwargs = dict(
                    model_dir=str(model_dir),
                    data_file=str(data_file),
                    max_length=max_length,
                    pairs=pairs,
                    checkpointing=checkpointing,
                    warmup=warmup,
                    steps=steps,
                )
                result = worker_subprocess("trl_worker", str(Path(tmp) / "trl.json"), **kwargs)
                print(campaign_row("TRL DPOTrainer (padded, precomputed ref)", result), flush=True)
            else:
                print("TRL: not importable here (pip install trl to compare)", flush=True)


def campaign_row(name: str, result: dict) -> str:
    computed = result.get("computed_tokens_per_second")
    mfu = f"{result['mfu'] * 100:.3g}%"  # 3 digits: the smoke run's tiny model is far below 0.1% and must not read 0
    return (
        f"{name:40s} {result['pairs_per_second']:8.3f} {result['real_tokens_per_second']:11.0f} "
        f"{(f'{computed:9.0f}' if computed else '        -')} {mfu:>6s} {result['peak_memory_gib']:6.2f} GiB"
    )


# ---------------------------------------------------------------------------------------------------------
# Attention for packed rows: python bench.py --attention

ATTENTION_LENGTHS = (1024, 4096, 16384, 32768)


def packed_micro_batch(tokens: int, seed: int = 0) -> list[dict]:
    """Tokenized HH-like pairs (lengths of hh_like_rows at max_length 1024) filling about `tokens`: each pair that
    still fits is taken, until less than 64 tokens are left."""
    examples, room = [], tokens
    for row in hh_like_rows(10_000, 1024, seed):
        example = {
            "prompt": [1] * len(row["prompt"]),
            "responses": [[2] * (len(row[k]) + 1) for k in ("chosen", "rejected")],
        }
        length = len(example["prompt"]) + sum(map(len, example["responses"]))
        if length <= room:
            examples.append(example)
            room -= length
        if room < 64:
            break
    return examples


def bench_attention_bookkeeping() -> None:
    """Per micro-batch of about T tokens: the memory and CPU build time of the dense mask (rows of the longest
    segment, and one row of T) and of the block mask (one row of T), and the attention scores each path computes as
    a share of T^2 (SDPA with an arbitrary mask computes every score of its rows; FlexAttention the 128 x 128 blocks
    not fully masked), against the scores the data needs (visible query-key pairs)."""
    from core.layouts import dense_mask, pack, segment_lengths
    from core.scoring import FLEX_BLOCK, additive_mask, block_mask
    from reporting.telemetry import visible_pairs

    def timed(build):
        """The result and seconds of the second of two builds (the first allocates, or compiles for a new shape)."""
        build()
        start = time.perf_counter()
        result = build()
        return result, time.perf_counter() - start

    print(
        f"{'T':>6s} {'pairs':>5s}  {'dense rows':>11s} {'mask':>9s} {'build':>7s} {'scores':>7s}  "
        f"{'dense, 1 row':>12s} {'build':>7s}  {'block mask':>10s} {'build':>7s} {'scores':>7s}  {'needed':>7s}"
    )
    for tokens in ATTENTION_LENGTHS:
        examples = packed_micro_batch(tokens)
        rows = pack(examples, 0)
        (_, dense_seconds) = timed(lambda rows=rows: additive_mask(dense_mask(rows), torch.bfloat16))
        dense_scores = rows.input_ids.shape[0] * rows.input_ids.shape[1] ** 2
        dense_bytes = dense_scores * 3  # bool + bfloat16
        one_row = pack(examples, 0, row_tokens=sum(segment_lengths(examples)), multiple=FLEX_BLOCK)
        length = one_row.input_ids.shape[1]
        _, one_row_seconds = timed(lambda one_row=one_row: additive_mask(dense_mask(one_row), torch.bfloat16))
        blocks, block_seconds = timed(lambda one_row=one_row: block_mask(one_row))
        block_bytes = sum(t.numel() * t.element_size() for t in blocks.as_tuple() if torch.is_tensor(t))
        run = (blocks.kv_num_blocks.sum() + blocks.full_kv_num_blocks.sum()).item() / blocks.kv_num_blocks.shape[
            -1
        ] ** 2
        visible = sum(map(visible_pairs, examples)) / length**2
        print(
            f"{length:6d} {len(examples):5d}  {str(tuple(rows.input_ids.shape)):>11s} {dense_bytes / 2**20:7.1f} MiB "
            f"{dense_seconds:6.2f}s {dense_scores / length**2:7.2%}  {length**2 * 3 / 2**20:8.0f} MiB "
            f"{one_row_seconds:6.2f}s  {block_bytes / 2**10:6.0f} KiB {block_seconds:6.2f}s {run:7.2%}  {visible:7.2%}",
            flush=True,
        )


def cpu_reference_pass_worker(result_file: str, attention: str, dtype: str, max_length: int) -> None:
    """Seconds per no-grad forward (a reference-cache pass) of 8 HH pairs on SmolLM2, float32 or bfloat16 autocast,
    dense mask (rows of the longest segment) or block mask (one row), after a warm-up micro-batch."""
    from itertools import islice

    from core.layouts import pack, segment_lengths
    from core.scoring import FLEX_BLOCK, sequence_logps
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir
    from persistence.tokenized import Tokenization, tokenize_pairs
    from preference_datasets import parse_rows, read_file_rows

    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pairs = parse_rows(list(islice(read_file_rows(HH_FILE), 40)), str(HH_FILE), tokenizer)
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(max_length, max_length // 2, sft=False)).take(range(40))
    autocast = getattr(torch, dtype) if dtype != "float32" else None
    times = []
    try:
        for start in range(0, 40, 8):
            micro = examples[start : start + 8]
            if attention == "block":
                batch = pack(micro, 0, row_tokens=sum(segment_lengths(micro)), multiple=FLEX_BLOCK)
            else:
                batch = pack(micro, 0)
            begin = time.perf_counter()
            with torch.no_grad():
                sequence_logps(model, batch, autocast, getattr(torch, dtype), True, attention)
            times.append(time.perf_counter() - begin)
        result = {"seconds": sum(times[1:]) / len(times[1:])}
    except Exception as error:  # the CPU FlexAttention kernel does not compile in every case
        result = {"error": f"{type(error).__name__}: {str(error).strip().splitlines()[0][:100]}"}
    Path(result_file).write_text(json.dumps(result))


def bench_attention() -> None:
    from modeling.precision import cpu_name

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(
        f"attention bookkeeping per packed micro-batch (HH-like pairs), on {cpu_name()}, {os.cpu_count()} cores; "
        "dense masks: bool + bfloat16 additive"
    )
    bench_attention_bookkeeping()
    print(
        "\nno-grad forward (the reference-cache pass) of 8 HH pairs on SmolLM2-135M-Instruct, max_length 512, on this "
        "CPU: seconds per micro-batch (mean of 4 after a warm-up), each configuration in a fresh process"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in ("float32", "bfloat16"):
            for attention in ("dense", "block", "dense", "block"):
                kwargs = dict(attention=attention, dtype=dtype, max_length=512)
                result = worker_subprocess("cpu_reference_pass_worker", str(Path(tmp) / "result.json"), **kwargs)
                outcome = f"{result['seconds']:.2f} s" if "seconds" in result else f"failed: {result['error']}"
                print(f"{dtype:9s} {attention:6s} mask: {outcome}", flush=True)


HEAD_TOKENS, HEAD_HIDDEN = 2048, 576  # scored tokens of a large step; SmolLM2's hidden size


def head_memory_worker(vocab: int, method: str) -> None:
    """Peak RSS growth of one forward + backward of the log-probs of HEAD_TOKENS tokens under a [vocab, 576] head."""

    torch.manual_seed(0)
    hidden = torch.randn(HEAD_TOKENS, HEAD_HIDDEN, requires_grad=True)
    weight = (torch.randn(vocab, HEAD_HIDDEN) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (HEAD_TOKENS,))
    rows = torch.arange(HEAD_TOKENS)
    before = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    if method == "fused":
        token_logps = token_logps_from_hidden(hidden, weight, None, rows, targets)
    else:
        token_logps = token_logps_from_logits(hidden @ weight.T, rows, targets)
    token_logps.sum().backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    weight_gradient = weight.numel() * 4 / 2**20  # the parameter's own gradient, which every method must produce
    print(json.dumps(peak - before - weight_gradient))


def bench_vocabulary_memory() -> None:
    """Each method and vocabulary in a fresh process, whose peak RSS is then its own."""
    print(
        f"log-prob computation, forward + backward, {HEAD_TOKENS} scored tokens, hidden {HEAD_HIDDEN}, float32: "
        "peak memory beyond inputs and the weight gradient"
    )
    for vocab in (32768, 131072):
        results = {}
        for method in ("all logits, chunked log-softmax", "fused head (scored logits only)"):
            code = (
                f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import bench; "
                f"bench.head_memory_worker({vocab}, {'fused' if 'fused' in method else 'logits'!r})"
            )
            results[method] = json.loads(
                subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
            )
        print(f"vocabulary {vocab:6d}: " + ", ".join(f"{method} {mib:6.0f} MiB" for method, mib in results.items()))


FSDP_STEPS, FSDP_BATCH, FSDP_LENGTH = 6, 8, 128  # global batch of 8 sequences of 128 tokens


def llama(seed: int = 0) -> torch.nn.Module:
    """A 4-layer Llama of ~21M parameters, randomly initialised (the same weights for every seed user)."""
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=FSDP_LENGTH,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def train_steps(
    model: torch.nn.Module, device: torch.device, rank: int, world_size: int
) -> tuple[float, torch.nn.Module]:
    """Seconds per step (the mean after the first) and the model after FSDP_STEPS SGD steps. SGD, because AdamW
    would turn float rounding in near-zero gradient entries into lr-sized weight differences."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(FSDP_STEPS):
        ids = torch.randint(0, 8192, (FSDP_BATCH, FSDP_LENGTH), generator=torch.Generator().manual_seed(step))
        ids = ids.chunk(world_size)[rank].to(device)
        start = time.perf_counter()
        model(ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / len(times[1:]), model


def fsdp_rank(rank: int, world_size: int, port: int, variant: str, result_file: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    os.environ.update(rank_environment(rank, world_size, port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if cuda else "gloo")
    model = llama()
    if variant == "FSDP1":
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=device
        )
    else:
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    seconds, model = train_steps(model, device, rank, world_size)
    # Without cpu_offload: FSDP1's CPU-offloaded full state dict fails on CPU ranks (torch 2.13).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"seconds": seconds, "state": {name: value.cpu() for name, value in state.items()}}, result_file)
    del model, state
    leave_process_group()


def bench_fsdp() -> None:
    world_size = 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(
        f"{FSDP_STEPS} SGD steps, global batch {FSDP_BATCH} x {FSDP_LENGTH} tokens, 4-layer Llama of "
        f"{sum(p.numel() for p in llama().parameters()) / 1e6:.0f}M parameters, float32"
    )
    seconds, single = train_steps(llama().to(device), device, 0, 1)
    print(f"one process ({torch.get_num_threads()} threads){'':8s} {seconds * 1e3:8.1f} ms/step")
    expected = {name: value.cpu() for name, value in single.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("FSDP1", "FSDP2"):
            result_file = str(Path(tmp) / f"{variant}.pt")
            torch.multiprocessing.spawn(
                fsdp_rank, args=(world_size, free_port(), variant, result_file), nprocs=world_size
            )
            result = torch.load(result_file, weights_only=True)
            difference = max(
                (result["state"][name].float() - value).abs().max().item() for name, value in expected.items()
            )
            print(
                f"{variant} {world_size} processes ({'nccl' if cuda else 'gloo'}){'':6s} "
                f"{result['seconds'] * 1e3:8.1f} ms/step, "
                f"max |parameter - one process| {difference:.1e}"
            )


REDUCE_BATCH, REDUCE_STEPS = 16, 4  # global sequences of FSDP_LENGTH tokens per step; steps whose gradients count


def reduce_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 8192, (REDUCE_BATCH, FSDP_LENGTH), generator=torch.Generator().manual_seed(100 + step))


def reduce_rank(rank: int, world_size: int, port: int, reduce_dtype: str, result_file: str) -> None:
    """One FSDP2 rank computing in bfloat16 and reducing gradients in reduce_dtype: the full gradient of each of
    REDUCE_STEPS batches (each rank its share, SGD steps in between), written by rank 0."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = []
    for step in range(REDUCE_STEPS):
        ids = reduce_batch(step).chunk(world_size)[rank]
        model(ids, labels=ids, use_cache=False).loss.backward()
        gradients.append({name: p.grad.full_tensor().float() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save(gradients, result_file)
    del model, optimizer
    leave_process_group()


def bench_fsdp_reduce() -> None:
    """The gradient error of FSDP2's reduction in bfloat16 and in float32, both computing in bfloat16, against one
    float32 process on the same batches (each step's gradient, after the same SGD updates), on 2 and 4 processes."""
    reference, model = [], llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(REDUCE_STEPS):
        ids = reduce_batch(step)
        model(ids, labels=ids, use_cache=False).loss.backward()
        reference.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()

    def relative_error(gradients: list[dict]) -> float:
        """The mean over steps of |g - g_float32| / |g_float32| over all parameters."""
        errors = []
        for got, want in zip(gradients, reference):
            difference = sum(((got[n] - want[n]) ** 2).sum() for n in want).sqrt()
            errors.append((difference / sum((want[n] ** 2).sum() for n in want).sqrt()).item())
        return sum(errors) / len(errors)

    print(
        f"FSDP2 over a 4-layer Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), bfloat16 "
        f"compute, gloo on {os.cpu_count()} CPU cores; {REDUCE_STEPS} steps of {REDUCE_BATCH} x {FSDP_LENGTH} tokens; "
        "gradient error relative to one float32 process"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in (2, 4):
            errors = {}
            for reduce_dtype in ("bfloat16", "float32"):
                result_file = str(Path(tmp) / f"{reduce_dtype}.pt")
                torch.multiprocessing.spawn(
                    reduce_rank, args=(world_size, free_port(), reduce_dtype, result_file), nprocs=world_size
                )
                errors[reduce_dtype] = relative_error(torch.load(result_file, weights_only=True))
            print(
                f"{world_size} processes: reduce in bfloat16 {errors['bfloat16']:.3e}, "
                f"in float32 {errors['float32']:.3e} ({errors['bfloat16'] / errors['float32']:.2f}x)",
                flush=True,
            )


# ---------------------------------------------------------------------------------------------------------
# Data at scale: tokenizing, caching and mapping the examples

SMOLLM2_TOKENIZER = REPO_ROOT.parent / "shared" / "tokenizers" / "smollm2" / "tokenizer.json"
DATA_SIZES = (5_000, 50_000, 500_000)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_tokenizer():
    """SmolLM2's original tokenizer (../shared), else the tiny byte-level one; and its name."""
    if SMOLLM2_TOKENIZER.exists():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2_TOKENIZER), eos_token="<|im_end|>")
        return tokenizer, "SmolLM2"
    return transformers.AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tiny-llama"), "tiny byte-level"


def synthetic_hh_file(path: Path, n_rows: int, distinct: bool) -> Path:
    """n_rows HH-format rows from HH harmless-base's 2,312 (../shared; random text of HH's lengths without it): row i
    is row i mod 2312 with a variant number, in its first human turn only (distinct=False: the responses repeat
    every 2,312 rows) or in every text (distinct=True: every prompt and response new, as in real data, so that
    nothing is tokenized once for several rows)."""
    import gzip

    if HH_FILE.exists():
        base = [json.loads(line) for line in gzip.open(HH_FILE, "rt")]
    else:
        base = [
            {"chosen": f"\n\nHuman: {r['prompt']}\n\nAssistant:{r['chosen']}", "rejected": r["rejected"]}
            for r in hh_like_rows(2312, 512, seed=0)
        ]
        base = [{**r, "rejected": r["chosen"][: r["chosen"].rfind(":") + 1] + r["rejected"]} for r in base]
    with open(path, "w") as f:
        for i in range(n_rows):
            row, k = base[i % len(base)], i // len(base)
            cut = row["chosen"].find("\n\nAssistant:")
            marked = {name: text[:cut] + f" (variant {k})" + text[cut:] for name, text in row.items()}
            if distinct:
                marked = {name: text + f" ({i})" for name, text in marked.items()}
            f.write(json.dumps(marked) + "\n")
    return path


def data_worker(result_file: str, data_file: str, cache_dir: str) -> None:
    """The data of one run, in this fresh process: examples from the cache (tokenized into it first if it has none),
    timed; the resident memory it adds per token, mapped, and after every token was read once (as an epoch reads
    them)."""

    from persistence import tokenized
    from persistence.tokenized import Tokenization, load_examples

    tokenizer, _ = bench_tokenizer()
    builds = []
    build_cache = tokenized.build_cache
    tokenized.build_cache = lambda *args: builds.append(1) or build_cache(*args)
    before = rss_bytes()
    start = time.perf_counter()
    splits = load_examples([data_file], tokenizer, Tokenization(512, 256, False), 0, 256, Path(cache_dir))
    seconds = time.perf_counter() - start
    mapped, peak = rss_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    n_tokens = sum(split.n_tokens for split in splits.values())
    checksum = sum(int(part.sum(dtype=np.int64)) for split in splits.values() for part in split.token_parts)
    result = {
        "seconds": seconds,
        "pairs": sum(map(len, splits.values())),
        "tokens": n_tokens,
        "built": bool(builds),
        "peak_per_token": (peak - before) / n_tokens,
        "mapped_per_token": (mapped - before) / n_tokens,
        "read_per_token": (rss_bytes() - before) / n_tokens,
        "checksum": checksum,
    }
    Path(result_file).write_text(json.dumps(result))


def data_rank(rank: int, world_size: int, port: int, data_file: str, cache_dir: str, result_file: str) -> None:
    """One rank of a multi-process start: the run's data as build.py prepares it (local rank 0 first, into the
    cache; the others map it); rank 0 writes the seconds until every rank has it and how many ranks tokenized."""
    from modeling.distributed import Topology
    from persistence import tokenized
    from persistence.tokenized import Tokenization, load_examples

    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topology = Topology.create("FSDPTrainer")
    tokenizer, _ = bench_tokenizer()
    built = []
    build_cache = tokenized.build_cache
    tokenized.build_cache = lambda *args: built.append(1) or build_cache(*args)
    dist.barrier()
    start = time.perf_counter()
    with topology.main_first():
        load_examples([data_file], tokenizer, Tokenization(512, 256, False), 0, 256, Path(cache_dir))
    dist.barrier()
    seconds = time.perf_counter() - start
    builds = torch.tensor([float(bool(built))])
    dist.all_reduce(builds)
    if rank == 0:
        Path(result_file).write_text(json.dumps({"seconds": seconds, "ranks_tokenizing": int(builds.item())}))
    leave_process_group()


def data_start(world_size: int, data_file: Path, cache_dir: Path, result_file: Path) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import bench, torch; "
        "from modeling.distributed import free_port; "
        f"torch.multiprocessing.spawn(bench.data_rank, args=({world_size}, free_port(), {str(data_file)!r}, "
        f"{str(cache_dir)!r}, {str(result_file)!r}), nprocs={world_size})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.loads(result_file.read_text())


def bench_data(smoke: bool) -> None:
    """Prepared pairs/s, first run and rerun, and resident bytes per token at about 5k, 50k and 500k synthetic
    HH-length pairs (every text distinct), one process and a 2-process FSDP start; the issue's 46k construction
    through train.py's dry run; the reference log-prob cache at a million pairs."""
    from modeling.precision import cpu_flags, cpu_name

    sizes = (500, 2_000) if smoke else DATA_SIZES
    _, tokenizer_name = bench_tokenizer()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}; "
        f"{tokenizer_name} tokenizer, max_length 512; each run in a fresh process"
    )
    print(f"{'pairs':>8} {'tokens':>11}  {'run':28} {'seconds':>8} {'pairs/s':>9}  bytes/token: peak  mapped  all read")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for n in sizes:
            data_file = synthetic_hh_file(tmp / f"pairs-{n}.jsonl", n, distinct=True)
            runs = [("1 process, first run", "one", 1), ("1 process, rerun", "one", 1)]
            runs += [("2 processes, first run", "two", 2), ("2 processes, rerun", "two", 2)]
            for name, cache, world in runs:
                result_file = tmp / "result.json"
                if world == 1:
                    r = worker_subprocess("data_worker", str(result_file), data_file=str(data_file),
                                          cache_dir=str(tmp / f"cache-{cache}-{n}"))  # fmt: skip
                    n_pairs, n_tokens = r["pairs"], r["tokens"]
                    memory = f"{r['peak_per_token']:10.2f} {r['mapped_per_token']:7.2f} {r['read_per_token']:9.2f}"
                else:
                    r = data_start(world, data_file, tmp / f"cache-{cache}-{n}", result_file)
                    memory = f"  ranks tokenizing: {r['ranks_tokenizing']} of {world}"
                print(f"{n_pairs:8d} {n_tokens:11d}  {name:28} {r['seconds']:8.2f} {n_pairs / r['seconds']:9.0f}  "
                      f"{memory}", flush=True)  # fmt: skip
            data_file.unlink()
            shutil.rmtree(tmp / f"cache-one-{n}"), shutil.rmtree(tmp / f"cache-two-{n}")
        issue_construction(tmp, 600 if smoke else 46_240)
        reference_cache_at_a_million(tmp, 10_000 if smoke else 1_000_000)


def issue_construction(tmp: Path, n_rows: int) -> None:
    """The issue's measurement: HH rows repeated with a variant suffix in the prompt (responses repeat every 2,312
    rows), through `train.py dry_run=true` with the default model's tokenizer, first run and rerun."""
    from modeling.models import SMOLLM2_HUB_ID, resolve_model_dir

    data_file = synthetic_hh_file(tmp / "issue.jsonl", n_rows, distinct=False)
    model_dir = resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")  # converted once, beforehand: not timed
    overrides = ["dry_run=true", f"model.name_or_path={model_dir}", f"datasets=[{data_file}]", "max_length=512"]
    for run in ("first run", "rerun"):
        start = time.perf_counter()
        result = subprocess.run(
            [sys.executable, str(REPO_ROOT / "train.py"), *overrides, f"local_dirs=[{tmp / 'issue-cache'}]"],
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        seconds = time.perf_counter() - start
        assert result.returncode == 0, result.stderr[-2000:]
        line = next(line for line in result.stdout.splitlines() if line.startswith("data report:"))
        print(f"train.py dry_run=true on {n_rows} HH rows with a variant suffix ({run}): {seconds:.1f} s, {line}")


def reference_cache_at_a_million(tmp: Path, n: int) -> None:
    """The reference log-prob cache: save, load (memory-mapped) and look up every key of n synthetic entries."""

    from persistence import reference_cache

    rng = np.random.default_rng(0)
    keys = rng.integers(0, 256, size=(n, 16), dtype=np.uint8).view("S16").reshape(-1)
    table = reference_cache.ReferenceTable.of(keys, -rng.random((n, 2), dtype=np.float32))
    path = tmp / "reference.pt"
    start = time.perf_counter()
    reference_cache.save(path, "w", "c", table)
    saved = time.perf_counter() - start
    before, start = rss_bytes(), time.perf_counter()
    loaded, _ = reference_cache.load(path, "w", "c")
    loading = time.perf_counter() - start
    added = rss_bytes() - before
    start = time.perf_counter()
    found = loaded.lookup(keys)
    looked_up = time.perf_counter() - start
    assert np.array_equal(found, table.logps[np.searchsorted(table.keys, keys)])
    print(
        f"reference log-prob cache, {n} pairs: file {path.stat().st_size / 2**20:.1f} MiB, saved in {saved:.2f} s, "
        f"loaded in {loading * 1e3:.0f} ms adding {added / 2**20:.1f} MiB resident, every key looked up in "
        f"{looked_up:.2f} s; process peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
    )


# ---------------------------------------------------------------------------------------------------------
# Scale: what each rank holds while it reads the model, trains, saves and resumes

# A 286M-parameter Llama: SmolLM2's vocabulary and tied embeddings, hidden 1024, 8 of 16 heads for keys and values.
SCALE_MODEL = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8,
                   vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)  # fmt: skip
SCALE_SMOKE = dict(SCALE_MODEL, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
SCALE_PHASES = ("load", "train", "save", "resume")


def scale_model_dir(layers: int, smoke: bool) -> Path:
    """A random Llama of SCALE_MODEL's shape (SCALE_SMOKE's) with `layers` blocks, float32, with SmolLM2's tokenizer:
    written once under .cache/bench/ (not timed) and read by every run from there, as a pretrained model would be."""
    directory = REPO_ROOT / ".cache" / "bench" / f"scale-llama-{layers}{'-smoke' if smoke else ''}"
    if not (directory / "config.json").exists():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(**(SCALE_SMOKE if smoke else SCALE_MODEL), num_hidden_layers=layers)
        model = transformers.AutoModelForCausalLM.from_config(config)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        bench_tokenizer()[0].save_pretrained(tmp)
        tmp.rename(directory)
    return directory


class PhasePeaks:
    """This process's peak resident memory in each named phase: the kernel's high-water mark (VmHWM), reset as each
    phase starts (/proc/self/clear_refs), and the phase's seconds. What peaks between phases counts as "other"."""

    def __init__(self):
        self.peaks, self.seconds = {"other": 0}, {}

    @staticmethod
    def high_water_mark() -> int:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        return int(line.split()[1]) * 1024

    @contextlib.contextmanager
    def phase(self, name: str):
        self.peaks["other"] = max(self.peaks["other"], self.high_water_mark())
        Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.peaks[name] = max(self.peaks.get(name, 0), self.high_water_mark())
        Path("/proc/self/clear_refs").write_text("5")

    def result(self) -> dict:
        self.peaks["other"] = max(self.peaks["other"], self.high_water_mark())
        return {"peaks": self.peaks, "seconds": self.seconds}


def scale_rank(rank: int, world: int, port: int, overrides: list[str], resume: str | None, result_file: str) -> None:
    """One rank of a --scale run: build (its policy's placement and reading timed as "load"), train, save the final
    checkpoint and export ("save"); or, with `resume`, build and read that checkpoint ("resume")."""
    import build
    import config as configuration
    from modeling.distributed import Topology, init_process_group
    from trainers import Trainer

    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(1)
    if world > 1:
        init_process_group(timeout_secs=1800)
    peaks = PhasePeaks()
    place = build.place

    def timed_place(*args, is_policy: bool = False, **kwargs):
        if not is_policy:
            return place(*args, is_policy=is_policy, **kwargs)
        with peaks.phase("load"):
            return place(*args, is_policy=is_policy, **kwargs)

    build.place = timed_place
    config = configuration.load(overrides + ([f"resume_from={resume}"] if resume else []))
    topology = Topology.create(config.trainer)
    run_dir = Path(config.local_run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = build.build(config, topology)
    if resume:
        config.resume_from = None
        trainer = Trainer(parts, run_dir)
        with peaks.phase("resume"):
            trainer.resume(Path(resume))
    else:
        trainer = Trainer(parts, run_dir)
        with peaks.phase("train"):
            trainer.train()
        with peaks.phase("save"):
            trainer.save(run_dir / "LATEST", {}, final=True)
    Path(f"{result_file}.{rank}").write_text(json.dumps(peaks.result()))
    if world > 1:
        leave_process_group()


def scale_launch(result_file: str, world: int, overrides: list[str], resume: str | None) -> None:
    """A --scale run of `world` ranks (spawned here, a fresh process group)."""
    args = (world, free_port(), overrides, resume, result_file)
    if world == 1:
        scale_rank(0, *args)
    else:
        torch.multiprocessing.spawn(scale_rank, args=args, nprocs=world)
    ranks = [json.loads(Path(f"{result_file}.{rank}").read_text()) for rank in range(world)]
    Path(result_file).write_text(json.dumps(ranks))


def scale_overrides(model_dir: Path, run_dir: Path, world: int) -> list[str]:
    return [
        "model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null",
        f"trainer={'BasicTrainer' if world == 1 else 'FSDPTrainer'}", f"datasets=[{HH_FILE}]",
        f"local_dirs=[{REPO_ROOT / '.cache' / 'bench'}]", f"local_run_dir={run_dir}", "n_examples=8",
        "batch_size=4", "eval_batch_size=4", "n_eval_examples=4", "eval_every=8", "do_first_eval=false",
        "max_length=256", "max_prompt_length=128", "wandb.enabled=false", "plots=false",
    ]  # fmt: skip


def scale_subprocess(root: Path, result_file: str, **kwargs) -> list[dict]:
    """scale_launch of this bench.py over the project's code in `root` (this tree, or another version's: code_at), in
    a fresh process; each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(__file__), Path(tmp) / "scale_bench.py")  # a name of its own: root's modules come first
        call = f"scale_bench.scale_launch(result_file={result_file!r}, **{kwargs!r})"
        code = f"import sys; sys.path[:0] = [{str(root)!r}, {tmp!r}]; import scale_bench; {call}"
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(result_file).read_text())


def scale_run(root: Path, model_dir: Path, world: int) -> list[dict]:
    """Per rank: the peaks and seconds of a run (load, train, save) and of a new run resuming its checkpoint."""
    with tempfile.TemporaryDirectory(dir=REPO_ROOT / ".cache") as tmp:
        run_dir, result = Path(tmp) / "run", str(Path(tmp) / "result.json")
        first = scale_subprocess(
            root, result, world=world, overrides=scale_overrides(model_dir, run_dir, world), resume=None
        )
        resumed = scale_overrides(model_dir, Path(tmp) / "resumed", world)
        second = scale_subprocess(root, result, world=world, overrides=resumed, resume=str(run_dir / "LATEST"))
    return [
        {
            "peaks": {**a["peaks"], "resume": b["peaks"]["resume"]},
            "whole": max(*a["peaks"].values(), *b["peaks"].values()),
            "seconds": {**a["seconds"], "resume": b["seconds"]["resume"]},
        }
        for a, b in zip(first, second)
    ]


def bench_scale(smoke: bool, versus: str | None) -> None:
    """smoke: hidden 64, 2 and 4 layers (the test suite's). versus: another version's code beside this tree's, each
    configuration run by both in turn."""
    if not HH_FILE.exists():
        sys.exit(f"--scale trains on HH harmless-base pairs: {HH_FILE} is missing")
    print(
        f"--scale: peak RSS (GiB) of each rank while it reads the model (load), trains 2 steps of 4 pairs (train), "
        f"writes the final checkpoint and export (save) and reads that checkpoint in a new run (resume); the whole "
        f"process's peak; and the times (s). float32, AdamW, max_length 256; {torch.__version__}, "
        f"{os.cpu_count()} cores ({cpu_model()})"
    )
    with code_at(versus) if versus else contextlib.nullcontext() as other:
        trees = {"this": REPO_ROOT, **({versus[:7]: other} if versus else {})}
        whole = {}  # (code, layers, world) -> each rank's whole-process peak
        depths = (2, 4) if smoke else (20, 40)
        for layers in depths:
            model_dir = scale_model_dir(layers, smoke)
            model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
            n_parameters = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
            del model
            print(f"\nrandom Llama, {layers} layers: {n_parameters / 1e6:.0f}M parameters ({model_dir})")
            print("code     ranks rank    load   train    save  resume   whole | load s  save s  resume s")
            for world in (1, 2, 4):
                for code, root in trees.items():
                    ranks = scale_run(root, model_dir, world)
                    whole[code, layers, world] = [rank["whole"] for rank in ranks]
                    for index, rank in enumerate(ranks):
                        cells = " ".join(f"{rank['peaks'].get(phase, 0) / 2**30:7.2f}" for phase in SCALE_PHASES)
                        seconds = rank["seconds"]
                        times = f"{seconds['load']:6.1f} {seconds['save']:7.1f} {seconds['resume']:9.1f}"
                        print(f"{code:8} {world:5d} {index:4d} {cells} {rank['whole'] / 2**30:7.2f} | {times}")
            for code in trees:
                four, one = whole[code, layers, 4], whole[code, layers, 1][0]
                print(
                    f"{code}, at 4 ranks: the highest rank peak is {max(four) / one:.2f}x the one-process peak "
                    f"(target 0.5x); rank 0 is {(four[0] - min(four[1:])) / 2**30:+.2f} GiB from the lowest other "
                    f"rank (target within 0.5 GiB)"
                )
    for code in trees:
        grown = [max(whole[code, layers, 4]) for layers in depths]
        one = [whole[code, layers, 1][0] for layers in depths]
        print(
            f"{code}, twice as deep: the highest 4-rank peak grew {(grown[1] - grown[0]) / 2**30:+.2f} GiB, while "
            f"one process's grew {(one[1] - one[0]) / 2**30:+.2f} GiB"
        )


# A narrow Gemma 3 (hidden 256, 6 layers: five local layers with a 128-token window, then a global one) with Gemma
# 2's final logit soft cap, over SmolLM2's vocabulary: both of the fast path's new cases in one model.
WINDOW_MODEL = dict(
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=64,
    sliding_window=128,
    final_logit_softcapping=30.0,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    max_position_embeddings=2048,
)
WINDOW_CONFIGURATIONS = {
    "padded, all logits (before)": ["layout=padded", "scored_logits_only=false"],
    "packed, all logits": ["scored_logits_only=false"],
    "packed, scored head (default)": [],
}


def window_model_dir() -> Path:
    """WINDOW_MODEL, random, float32, with SmolLM2's tokenizer: written once under .cache/bench/ (not timed)."""
    directory = REPO_ROOT / ".cache" / "bench" / "window-gemma3"
    if not (directory / "config.json").exists():
        tokenizer, _ = bench_tokenizer()
        torch.manual_seed(0)
        config = transformers.Gemma3TextConfig(**WINDOW_MODEL, vocab_size=len(tokenizer))
        model = transformers.AutoModelForCausalLM.from_config(config)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(directory)
    return directory


def bench_window(warmup: int, steps: int, rounds: int = 2) -> None:
    from modeling.precision import cpu_flags, cpu_name

    model_dir = window_model_dir()
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
        f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
        f"Gemma 3 shape, hidden 256, 6 layers (5 with a 128-token window, 1 global), final soft cap 30, random; "
        f"first 48 pairs of {HH_FILE.name} at max_length 512 x 8 pairs, DPO beta 0.1, AdamW, the default precision; "
        f"{warmup} warm-up + {steps} timed steps; alternating, {rounds} rounds, each run in a fresh process"
    )
    print(f"{'configuration':30s} {'pairs/s':>8s} {'tokens/s':>9s} {'peak RSS':>9s}  scoring")
    speeds = {name: [] for name in WINDOW_CONFIGURATIONS}
    for _ in range(rounds):
        for name, extra in WINDOW_CONFIGURATIONS.items():
            with tempfile.TemporaryDirectory() as tmp:
                workload = workload_overrides(str(model_dir), with_machine_rates(tmp), 512, 8)
                overrides = ["model=blank_model", *workload, *extra]
                result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"))
            speeds[name].append(result["pairs_per_second"])
            print(
                f"{name:30s} {result['pairs_per_second']:8.3f} {result['real_tokens_per_second']:9.0f} "
                f"{result['peak_memory_gib']:7.2f} GiB  {result['precision']}, {result['layout']}",
                flush=True,
            )
    before = sum(speeds["padded, all logits (before)"])
    for name, values in speeds.items():
        print(f"{name}: {sum(values) / before:.2f}x the padded path's pairs/s")


def cpu_model() -> str:
    from modeling.precision import cpu_name

    return cpu_name()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="only benchmark FSDP1 against FSDP2 (2 processes)")
    parser.add_argument(
        "--fsdp-reduce", action="store_true", help="FSDP2's gradient error reducing in bfloat16 vs float32"
    )
    parser.add_argument("--levers", action="store_true", help="only benchmark the training step's speed levers")
    parser.add_argument(
        "--compile", action="store_true", help="only benchmark torch.compile on the default configuration"
    )
    parser.add_argument("--lora", action="store_true", help="only benchmark LoRA against full fine-tuning")
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU campaign: cuda tests, layouts and TRL on a ~1B Llama"
    )
    parser.add_argument("--attention", action="store_true", help="dense vs block-mask attention bookkeeping")
    parser.add_argument("--data", action="store_true", help="data at scale: tokenizing, caching, mapping")
    parser.add_argument(
        "--versus", metavar="GIT_REF", help="the training step (or with --scale, the memory) against another version's"
    )
    parser.add_argument("--rounds", type=int, help="--versus: rounds of the two versions alternating (default 2)")
    parser.add_argument(
        "--profile", nargs="*", metavar="KEY=VALUE", help="where a training step's time goes (train.py overrides)"
    )
    parser.add_argument("--scale", action="store_true", help="each rank's memory at load, train, save, resume")
    parser.add_argument("--window", action="store_true", help="a sliding-window, soft-capped model: packed vs padded")
    parser.add_argument("--smoke", action="store_true", help="--gpu, --data or --scale at tiny sizes (the tests')")
    parser.add_argument("--warmup", type=int, default=2, help="--levers, --compile, --lora, --window: untimed steps")
    parser.add_argument("--steps", type=int, default=6, help="--levers, --compile, --lora, --window: timed steps")
    args = parser.parse_args()
    if args.rounds is not None and (not args.versus or args.rounds < 1):
        parser.error(f"--rounds {args.rounds}: a number of rounds of at least 1, and only with --versus")
    if args.fsdp:
        return bench_fsdp()
    if args.fsdp_reduce:
        return bench_fsdp_reduce()
    if args.levers:
        return bench_levers(args.warmup, args.steps)
    if args.compile:
        return bench_compile(args.warmup, args.steps)
    if args.lora:
        return bench_lora(args.warmup, args.steps)
    if args.attention:
        return bench_attention()
    if args.data:
        return bench_data(args.smoke)
    if args.scale:
        return bench_scale(args.smoke, args.versus)
    if args.window:
        return bench_window(args.warmup, args.steps)
    if args.versus:
        return bench_versus(args.versus, args.warmup, args.steps, args.rounds or 2)
    if args.profile is not None:
        return bench_profile(args.profile, args.warmup, args.steps)
    if args.gpu:
        return bench_gpu(args.smoke, *((1, 1) if args.smoke else (args.warmup, args.steps)))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device: {device}, threads: {torch.get_num_threads()}")

    n = args.size
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        seconds = best_of(lambda a=a: (a @ a, sync()), args.repeats)
        print(f"matmul {n}x{n} {str(dtype):15s} {2 * n**3 / seconds / 1e9:8.1f} GFLOP/s")

    batch, length, vocab = 16, 256, 49152
    logits = torch.randn(batch, length, vocab, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, length), device=device)
    labels[:, : length // 3] = IGNORE_INDEX
    for name, fn in (("chunked", chunked_sequence_logps), ("naive", naive_sequence_logps)):

        def step(fn=fn):
            x = logits.clone().requires_grad_()
            fn(x, labels).sum().backward()
            sync()

        seconds = best_of(step, args.repeats)
        print(f"logps fwd+bwd [{batch}, {length}, {vocab}] bf16 logits, {name:7s} {seconds * 1e3:8.1f} ms")
    rows = logprobs.chunk_rows(vocab, device)
    print(
        f"float32 copies of the logits: naive {batch * length * vocab * 4 / 2**20:.0f} MiB (all positions), "
        f"chunked {rows * vocab * 4 / 2**20:.0f} MiB (one chunk of {rows} rows)"
    )


if __name__ == "__main__":
    main()
