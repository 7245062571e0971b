"""The kernels under a training step (`python -m bench`, no flag): matmul throughput by dtype on this device (which
decides the dtype advice for CPUs), and float32 sequence log-probs from bf16 logits, the chunked implementation
against the naive full upcast, forward + backward at a SmolLM2-sized vocabulary. And (after --levers) the peak memory
of the log-prob computation at a 32k and a 128k vocabulary, all logits against the fused head."""

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from core import logprobs
from core.logprobs import token_logps_from_hidden, token_logps_from_logits
from utils import REPO_ROOT

IGNORE_INDEX = -100  # labels that are not scored (the reference implementation's convention)
HEAD_TOKENS, HEAD_HIDDEN = 2048, 576  # scored tokens of a large step; SmolLM2's hidden size


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


def bench_kernels(n: int, repeats: int) -> None:
    """Matmul GFLOP/s at n x n in float32 and bfloat16, then the log-probs' forward + backward, chunked and naive,
    each the best of `repeats` after a warm-up."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"device: {device}, threads: {torch.get_num_threads()}")

    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        seconds = best_of(lambda a=a: (a @ a, sync()), repeats)
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

        seconds = best_of(step, repeats)
        print(f"logps fwd+bwd [{batch}, {length}, {vocab}] bf16 logits, {name:7s} {seconds * 1e3:8.1f} ms")
    rows = logprobs.chunk_rows(vocab, device)
    print(
        f"float32 copies of the logits: naive {batch * length * vocab * 4 / 2**20:.0f} MiB (all positions), "
        f"chunked {rows * vocab * 4 / 2**20:.0f} MiB (one chunk of {rows} rows)"
    )


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
                f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); from bench.kernels import head_memory_worker; "
                f"head_memory_worker({vocab}, {'fused' if 'fused' in method else 'logits'!r})"
            )
            results[method] = json.loads(
                subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
            )
        print(f"vocabulary {vocab:6d}: " + ", ".join(f"{method} {mib:6.0f} MiB" for method, mib in results.items()))
