"""Data at scale (--data): prepared pairs/s on a first run and a rerun, and resident bytes per token, at about 5k,
50k and 500k synthetic pairs, for 1 and 2 processes; train.py's dry run on HH rows; the reference log-prob cache at a
million pairs (--data --smoke: small sizes, as the test suite runs it)."""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from bench.common import HH_FILE, bench_tokenizer, hh_like_rows, worker_subprocess
from modeling.distributed import leave_process_group, rank_environment
from modeling.precision import cpu_flags, cpu_name
from utils import REPO_ROOT

DATA_SIZES = (5_000, 50_000, 500_000)


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
    """A `world_size`-process start (data_rank), spawned from a fresh process; what rank 0 wrote."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO_ROOT)!r}); import torch; from bench.data import data_rank; "
        "from modeling.distributed import free_port; "
        f"torch.multiprocessing.spawn(data_rank, args=({world_size}, free_port(), {str(data_file)!r}, "
        f"{str(cache_dir)!r}, {str(result_file)!r}), nprocs={world_size})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.loads(result_file.read_text())


def bench_data(smoke: bool) -> None:
    """Prepared pairs/s, first run and rerun, and resident bytes per token at about 5k, 50k and 500k synthetic
    HH-length pairs (every text distinct), one process and a 2-process FSDP start; the issue's 46k construction
    through train.py's dry run; the reference log-prob cache at a million pairs."""
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
                    r = worker_subprocess(data_worker, str(result_file), data_file=str(data_file),
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
    from modeling.model_dirs import SMOLLM2_HUB_ID, resolve_model_dir

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
