"""Benchmarks behind the README's performance statements; run `python bench.py` and compare side by side.

1. Matmul throughput by dtype on this device (decides the dtype advice for CPUs).
2. Float32 sequence log-probs from bf16 logits: the chunked implementation vs the naive full upcast,
   forward + backward at a SmolLM2-sized vocabulary.
"""
import argparse
import time

import torch

from losses import DEFAULT_CHUNK_ROWS, IGNORE_INDEX, sequence_logps


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
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
