"""Attention for packed rows (--attention): the packed layout's attention bookkeeping per micro-batch, dense mask
against block mask, at T = 1k, 4k, 16k and 32k; and the CPU's no-grad forward (a reference-cache pass) with each."""

import json
import os
import tempfile
import time
from itertools import islice
from pathlib import Path

import torch
import transformers

from bench.common import HH_FILE, hh_like_rows, worker_subprocess
from modeling.precision import cpu_name
from utils import REPO_ROOT

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
    from core.attention import FLEX_BLOCK, additive_mask, block_mask
    from core.layouts import dense_mask, pack, segment_lengths
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
    from core.attention import FLEX_BLOCK
    from core.heads import sequence_logps
    from core.layouts import pack, segment_lengths
    from modeling.model_dirs import SMOLLM2_HUB_ID, resolve_model_dir
    from pairs.sources import read_file_rows
    from persistence.tokenized import Tokenization, tokenize_pairs
    from preference_datasets import parse_rows

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
                result = worker_subprocess(cpu_reference_pass_worker, str(Path(tmp) / "result.json"), **kwargs)
                outcome = f"{result['seconds']:.2f} s" if "seconds" in result else f"failed: {result['error']}"
                print(f"{dtype:9s} {attention:6s} mask: {outcome}", flush=True)
