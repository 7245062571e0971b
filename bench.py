"""Benchmarks behind the README's performance statements; run `python bench.py` and compare side by side.

1. Matmul throughput by dtype on this device (decides the dtype advice for CPUs).
2. Float32 sequence log-probs from bf16 logits: the chunked implementation vs the naive full upcast,
   forward + backward at a SmolLM2-sized vocabulary.
3. `python bench.py --fsdp`: FSDP1 (`FullyShardedDataParallel`) vs FSDP2 (`fully_shard`) on 2 processes (gloo on
   the CPU, NCCL with 2+ GPUs), both sharding per Llama block: training step time, and the largest parameter
   difference from one process training on the same batches (decides which FSDP FSDPTrainer uses).
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from losses import DEFAULT_CHUNK_ROWS, IGNORE_INDEX, sequence_logps
from utils import free_port


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


FSDP_STEPS, FSDP_BATCH, FSDP_LENGTH = 6, 8, 128  # global batch of 8 sequences of 128 tokens


def llama(seed: int = 0) -> torch.nn.Module:
    """A 4-layer Llama of ~21M parameters, randomly initialised (the same weights for every seed user)."""
    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=4, vocab_size=8192, max_position_embeddings=FSDP_LENGTH)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def train_steps(model: torch.nn.Module, device: torch.device, rank: int, world_size: int) -> tuple[float, torch.nn.Module]:
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

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if cuda else "gloo")
    model = llama()
    if variant == "FSDP1":
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=device)
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
    print(f"{FSDP_STEPS} SGD steps, global batch {FSDP_BATCH} x {FSDP_LENGTH} tokens, 4-layer Llama of "
          f"{sum(p.numel() for p in llama().parameters()) / 1e6:.0f}M parameters, float32")
    seconds, single = train_steps(llama().to(device), device, 0, 1)
    print(f"one process ({torch.get_num_threads()} threads){'':8s} {seconds * 1e3:8.1f} ms/step")
    expected = {name: value.cpu() for name, value in single.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("FSDP1", "FSDP2"):
            result_file = str(Path(tmp) / f"{variant}.pt")
            torch.multiprocessing.spawn(fsdp_rank, args=(world_size, free_port(), variant, result_file), nprocs=world_size)
            result = torch.load(result_file, weights_only=True)
            difference = max((result["state"][name].float() - value).abs().max().item() for name, value in expected.items())
            print(f"{variant} {world_size} processes ({'nccl' if cuda else 'gloo'}){'':6s} {result['seconds'] * 1e3:8.1f} ms/step, "
                  f"max |parameter - one process| {difference:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="only benchmark FSDP1 against FSDP2 (2 processes)")
    args = parser.parse_args()
    if args.fsdp:
        return bench_fsdp()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device: {device}, threads: {torch.get_num_threads()}")

    n = args.size
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        seconds = best_of(lambda: (a @ a, sync()), args.repeats)
        print(f"matmul {n}x{n} {str(dtype):15s} {2 * n**3 / seconds / 1e9:8.1f} GFLOP/s")

    batch, length, vocab = 16, 256, 49152
    logits = torch.randn(batch, length, vocab, device=device, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (batch, length), device=device)
    labels[:, : length // 3] = IGNORE_INDEX
    for name, fn in (("chunked", sequence_logps), ("naive", naive_sequence_logps)):
        def step():
            x = logits.clone().requires_grad_()
            fn(x, labels).sum().backward()
            sync()

        seconds = best_of(step, args.repeats)
        print(f"logps fwd+bwd [{batch}, {length}, {vocab}] bf16 logits, {name:7s} {seconds * 1e3:8.1f} ms")
    print(f"float32 copies of the logits: naive {batch * length * vocab * 4 / 2**20:.0f} MiB (all positions), "
          f"chunked {DEFAULT_CHUNK_ROWS * vocab * 4 / 2**20:.0f} MiB (one chunk of {DEFAULT_CHUNK_ROWS} rows)")


if __name__ == "__main__":
    main()
