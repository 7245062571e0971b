"""Benchmarks behind the README's performance statements; run `python bench.py` and compare side by side.

1. Matmul throughput by dtype on this device (decides the dtype advice for CPUs).
2. Float32 sequence log-probs from bf16 logits: the chunked implementation vs the naive full upcast,
   forward + backward at a SmolLM2-sized vocabulary.
3. `python bench.py --levers`: the speed levers of the training step, each alone and all together, against the
   padded float32 path: SmolLM2-135M-Instruct on the first 48 pairs of ../shared's HH harmless-base file, DPO with
   beta 0.1 and AdamW, at max_length 256 x 4 pairs and 512 x 8 pairs per step. Each configuration runs in a fresh
   process (so its peak RSS is its own), configurations alternate, and each prints pairs/s, real tokens/s (prompt
   counted once per response, as the padded layout computes it, padding excluded) and peak RSS. Then the peak
   memory of the log-prob computation at a 32k and a 128k vocabulary.
4. `python bench.py --compile`: torch.compile of each transformer block against eager, on the default configuration
   at 256 x 4, first step (compilation) and steady state.
5. `python bench.py --fsdp`: FSDP1 (`FullyShardedDataParallel`) vs FSDP2 (`fully_shard`) on 2 processes (gloo on
   the CPU, NCCL with 2+ GPUs), both sharding per Llama block: training step time, and the largest parameter
   difference from one process training on the same batches (decides which FSDP FSDPTrainer uses).
6. `python bench.py --lora`: LoRA (the preset, rank 16 on every linear layer) against full fine-tuning on the
   default configuration at 256 x 4: seconds per step and peak RSS, alternating, each in a fresh process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

import logprobs
from distributed import free_port, rank_environment
from logprobs import token_logps_from_hidden, token_logps_from_logits
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


def lever_worker(overrides: list[str], warmup: int, steps: int, result_file: str, compile_blocks: bool = False) -> None:
    """One configuration in this fresh process: build the trainer as train.py does, time `steps` training steps
    after `warmup`, and write pairs/s, real tokens/s, peak RSS, what precision was chosen and the first step's
    seconds. compile_blocks: torch.compile each transformer block (dynamic shapes) before the first step."""
    import resource

    import config as configuration
    from adapters import apply_lora
    from distributed import Topology
    from models import find_blocks, load_model, load_tokenizer
    from preference_datasets import parse_rows, read_file_rows
    from trainers import Trainer

    config = configuration.load(overrides)
    cache_dir = Path(config.local_dirs[0])
    tokenizer = load_tokenizer(config.model, cache_dir)
    pairs = parse_rows([item for _, item in zip(range(48), read_file_rows(HH_FILE))], str(HH_FILE), tokenizer)
    data = {"train": pairs, "test": pairs[:1]}  # the eval pair plays no part in the timings
    start = time.perf_counter()
    policy = load_model(config.model, torch.float32, cache_dir, config.seed)
    trainer = Trainer(
        config,
        Topology(),
        apply_lora(policy, config.lora) if config.lora.enabled else policy,
        lambda: load_model(config.model, torch.float32, cache_dir, config.seed),
        tokenizer,
        data,
        cache_dir / "run",
    )
    setup_seconds = time.perf_counter() - start
    if compile_blocks:
        for block in find_blocks(trainer.policy, config.model.block_name):
            block.compile(dynamic=True)
    seconds = pairs_seen = tokens = first_step = 0
    step_rss = [0.0]  # the largest RSS seen while training steps run, sampled every 5 ms

    def sample_rss(stop: threading.Event) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not stop.wait(0.005):
            step_rss[0] = max(step_rss[0], int(Path("/proc/self/statm").read_text().split()[1]) * page / 2**30)

    stop = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(stop,), daemon=True)
    sampler.start()
    for step, indices in enumerate(trainer.schedule[: warmup + steps]):
        examples = [trainer.train_examples[i] for i in indices]
        start = time.perf_counter()
        trainer.train_step(examples)
        first_step = first_step or time.perf_counter() - start
        if step >= warmup:
            seconds += time.perf_counter() - start
            pairs_seen += len(examples)
            tokens += sum(len(ex["prompt"]) * 2 + sum(map(len, ex["responses"])) for ex in examples)
    stop.set()
    sampler.join()
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    precision = "bfloat16" if trainer.policy_compute == torch.bfloat16 else "float32"
    Path(result_file).write_text(
        json.dumps(
            {
                "pairs_per_second": pairs_seen / seconds,
                "tokens_per_second": tokens / seconds,
                "peak_rss_gib": peak_rss,
                "training_rss_gib": step_rss[0],
                "precision": precision,
                "setup_seconds": setup_seconds,
                "first_step_seconds": first_step,
            }
        )
    )


def bench_levers(warmup: int, steps: int) -> None:
    from models import SMOLLM2_HUB_ID, resolve_model_dir
    from precision import cpu_name

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
            f"{'configuration':28s} {'pairs/s':>8s} {'x base':>7s} {'tokens/s':>9s} {'peak RSS':>9s}  precision, setup "
            "(loading, probes, tokenizing, and the reference pass where cached)"
        )
        baseline = None
        for name, lever in LEVERS.items():
            with tempfile.TemporaryDirectory() as tmp:
                overrides = [*workload_overrides(model_dir, tmp, max_length, batch), *lever]
                result = lever_subprocess(overrides, warmup, steps, str(Path(tmp) / "result.json"))
            baseline = baseline or result["pairs_per_second"]
            print(
                f"{name:28s} {result['pairs_per_second']:8.3f} {result['pairs_per_second'] / baseline:6.2f}x "
                f"{result['tokens_per_second']:9.0f} {result['peak_rss_gib']:7.2f} GiB  {result['precision']}"
                + f", setup {result['setup_seconds']:.0f} s",
                flush=True,
            )
    print()
    bench_vocabulary_memory()


def lever_subprocess(
    overrides: list[str], warmup: int, steps: int, result_file: str, compile_blocks: bool = False
) -> dict:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import bench; "
        f"bench.lever_worker({overrides!r}, {warmup}, {steps}, {result_file!r}, {compile_blocks})"
    )
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


def bench_compile(warmup: int, steps: int) -> None:
    """The default configuration at 256 x 4, eager against torch.compile of each block, alternating."""
    from models import SMOLLM2_HUB_ID, resolve_model_dir
    from precision import cpu_name

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
    from models import SMOLLM2_HUB_ID, resolve_model_dir
    from precision import cpu_name

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
            f"RSS while training {result['training_rss_gib']:.2f} GiB (process peak {result['peak_rss_gib']:.2f}), "
            f"{result['precision']}",
            flush=True,
        )


HEAD_TOKENS, HEAD_HIDDEN = 2048, 576  # scored tokens of a large step; SmolLM2's hidden size


def head_memory_worker(vocab: int, method: str) -> None:
    """Peak RSS growth of one forward + backward of the log-probs of HEAD_TOKENS tokens under a [vocab, 576] head."""
    import resource

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
    dist.destroy_process_group()


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="only benchmark FSDP1 against FSDP2 (2 processes)")
    parser.add_argument("--levers", action="store_true", help="only benchmark the training step's speed levers")
    parser.add_argument(
        "--compile", action="store_true", help="only benchmark torch.compile on the default configuration"
    )
    parser.add_argument("--lora", action="store_true", help="only benchmark LoRA against full fine-tuning")
    parser.add_argument("--warmup", type=int, default=2, help="--levers, --compile, --lora: untimed steps")
    parser.add_argument("--steps", type=int, default=6, help="--levers, --compile, --lora: timed steps")
    args = parser.parse_args()
    if args.fsdp:
        return bench_fsdp()
    if args.levers:
        return bench_levers(args.warmup, args.steps)
    if args.compile:
        return bench_compile(args.warmup, args.steps)
    if args.lora:
        return bench_lora(args.warmup, args.steps)
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
    rows = logprobs.chunk_rows(vocab)
    print(
        f"float32 copies of the logits: naive {batch * length * vocab * 4 / 2**20:.0f} MiB (all positions), "
        f"chunked {rows * vocab * 4 / 2**20:.0f} MiB (one chunk of {rows} rows)"
    )


if __name__ == "__main__":
    main()
