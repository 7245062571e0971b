"""Where a decode step's CPU time goes (--generate --profile): evaluate.py's sampling (the static loop, the candidate's
side: drawn with its log-probs summed) of SmolLM2-135M-Instruct on --generate's workload, under torch.profiler, in
float32 and in bfloat16, each in a fresh process. Per dtype: tokens/s; the share of the sampling's wall time in the
transformer blocks' linear layers, the LM head, attention, the seeded draw, the other operations, and outside any
operation (the host's Python); and the rate each matmul group reaches against the precision probe's (a 512^3
matmul) and against the weights' bytes read per step. So the step's ceiling follows: what the whole step would take
were everything but the linear layers free."""

import json
import tempfile
import time
from pathlib import Path

import torch

from bench.common import worker_subprocess
from bench.generate import SIZES, workload
from modeling.precision import cpu_flags, cpu_matmul_flops, cpu_name
from utils import REPO_ROOT

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION = ("dpo_decode::attention", "aten::_scaled_dot_product", "aten::scaled_dot_product")
DRAW = "seeded draw"  # generation.seeded_draw.RowDraws' record_function


def decode_profile_worker(result_file: str, model_dir: str, prompts_file: str, batch: int, max_new_tokens: int,
                          temperatures: list[float], dtype: str, **_) -> None:  # fmt: skip
    """The candidate's sampling under the profiler, after a warm-up, into result_file: wall seconds, tokens, and
    seconds and FLOPs by group."""
    import transformers
    from torch.profiler import ProfilerActivity, profile

    from bench.generate_worker import seeds_of
    from generation.sampling import Sampler
    from modeling.distributed import Topology

    prompts = json.loads(Path(prompts_file).read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    sampler = Sampler(tokenizer, Topology.create("BasicTrainer"), max_new_tokens, batch)
    sampler.sample(model, prompts[:2], None, [1, 2], 1.0)  # warm-up
    order = [(t, i) for i in range(len(prompts)) for t in temperatures]
    rows = ([prompts[i] for _, i in order], None, [seeds_of(len(prompts), t)[i] for t, i in order])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as profiler:
        start = time.perf_counter()
        drawn, _ = sampler.sample_scored(model, *rows, [t for t, _ in order])
        seconds = time.perf_counter() - start
    # a matmul of a block's linear layer has its (in, out) features; the LM head's, whole or in vocabulary blocks
    # written out= (generation.decoding.blocked_head), has others
    head = model.get_output_embeddings()
    linears = {
        (m.in_features, m.out_features) for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head
    }
    groups = {name: {"seconds": 0.0, "flops": 0.0} for name in ("block linears", "LM head", "attention", "draw")}
    own, top = 0.0, {}
    for event in profiler.key_averages(group_by_input_shape=True):
        self_seconds = event.self_cpu_time_total / 1e6
        own += self_seconds
        if event.key.startswith(MATMULS):
            shapes = [s for s in event.input_shapes if len(s) == 2]  # addmm: the bias first; out=: the output last
            (m, k), n = next((a, b[1]) for a, b in zip(shapes, shapes[1:]) if a[1] == b[0])  # [M, K] @ [K, N]
            group = groups["block linears" if (k, n) in linears else "LM head"]
            group["seconds"] += self_seconds
            group["flops"] += 2 * m * k * n * event.count
        elif event.key.startswith(ATTENTION):
            groups["attention"]["seconds"] += self_seconds
        else:
            top[event.key] = top.get(event.key, 0.0) + self_seconds
    # the draw's own operations are counted above by name; its record_function's whole time is the draw's part
    groups["draw"]["seconds"] = sum(e.cpu_time_total for e in profiler.key_averages() if e.key == DRAW) / 1e6
    for name in (DRAW, "fused head forward"):
        top.pop(name, None)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {
        "seconds": seconds,
        "tokens": sum(map(len, drawn)),
        "groups": groups,
        "own": own,
        "top": sorted(top.items(), key=lambda item: -item[1])[:8],
        "weights_bytes": weights,
        "threads": torch.get_num_threads(),
    }
    Path(result_file).write_text(json.dumps(result))


def bench_decode_profile() -> None:
    """Each dtype's profile, one after the other, each in a fresh process."""
    n, batch, new_tokens, temperatures = SIZES["full"]
    with tempfile.TemporaryDirectory() as tmp:
        prompts, settings = workload(Path(tmp), smoke=False)
        print(
            f"CPU: {cpu_name()} [{' '.join(cpu_flags())}], torch {torch.__version__}; SmolLM2-135M-Instruct, the "
            f"static loop, {n} HH prompts (mean {sum(map(len, prompts)) / n:.0f} tokens) x {len(temperatures)} "
            f"temperatures, batch {batch}, {new_tokens} new tokens, drawn with log-probs (evaluate.py's candidate)"
        )
        for dtype in ("float32", "bfloat16"):
            result = worker_subprocess(decode_profile_worker, str(Path(tmp) / f"{dtype}.json"), **settings, dtype=dtype)
            report(dtype, result, cpu_matmul_flops(REPO_ROOT / ".cache")[dtype])


def report(dtype: str, result: dict, probe: float) -> None:
    """A dtype's lines: tokens/s, each group's share and rate, the rest's top operations, and the ceiling."""
    seconds, groups = result["seconds"], result["groups"]
    print(f"\n{dtype}: {result['tokens'] / seconds:.1f} tokens/s ({result['tokens']} tokens in {seconds:.1f} s); "
          f"the probe's matmul rate {probe / 1e9:.0f} GFLOP/s")  # fmt: skip
    matmul_ops = groups["block linears"]["seconds"] + groups["LM head"]["seconds"] + groups["attention"]["seconds"]
    draw = groups["draw"]["seconds"]
    for name, group in groups.items():
        rate = group["flops"] / max(group["seconds"], 1e-9)
        reached = f", {rate / 1e9:.0f} GFLOP/s ({rate / probe:.0%} of the probe)" if group["flops"] else ""
        print(f"  {name:14s} {group['seconds']:6.2f} s {group['seconds'] / seconds:6.1%}{reached}")
    rest = result["own"] - matmul_ops
    print(f"  {'other ops':14s} {rest:6.2f} s {rest / seconds:6.1%} (the draw's own operations included): "
          + ", ".join(f"{name} {s:.2f}" for name, s in result["top"][:6]))  # fmt: skip
    host = seconds - result["own"]
    print(f"  {'outside ops':14s} {host:6.2f} s {host / seconds:6.1%} (Python: the loop, the model, the draw's numpy)")
    linears = groups["block linears"]["seconds"] + groups["LM head"]["seconds"]
    print(
        f"  ceiling with only the linear layers left: {result['tokens'] / linears:.0f} tokens/s "
        f"({seconds / linears:.2f}x); the draw is {draw / seconds:.1%} of the time"
    )
