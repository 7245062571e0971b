"""Scale (--scale [--versus GIT_REF]): each rank's peak resident memory while it reads the model, trains, saves
(checkpoint and export) and resumes, and the load, save and resume times, on 1, 2 and 4 processes, for a random
286M Llama (hidden 1024, 20 layers, float32, AdamW; 2 steps of 4 HH pairs) and the same twice as deep; with --versus,
another version's code on each configuration too, in turn (the ranks' work: scale_ranks.py)."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench import scale_ranks
from bench.common import HH_FILE, bench_tokenizer, code_at
from modeling.precision import cpu_name
from utils import REPO_ROOT

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


def scale_overrides(model_dir: Path, run_dir: Path, world: int) -> list[str]:
    return [
        "model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null",
        f"trainer={'BasicTrainer' if world == 1 else 'FSDPTrainer'}", f"datasets=[{HH_FILE}]",
        f"local_dirs=[{REPO_ROOT / '.cache' / 'bench'}]", f"local_run_dir={run_dir}", "n_examples=8",
        "batch_size=4", "eval_batch_size=4", "n_eval_examples=4", "eval_every=8", "do_first_eval=false",
        "max_length=256", "max_prompt_length=128", "wandb.enabled=false", "plots=false",
    ]  # fmt: skip


def scale_subprocess(root: Path, result_file: str, **kwargs) -> list[dict]:
    """scale_ranks.scale_launch over the project's code in `root` (this tree, or another version's: code_at), in a
    fresh process; each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        # a name of its own: root's modules come first, and root's bench (a package, or bench.py) is not this one
        shutil.copy(Path(scale_ranks.__file__), Path(tmp) / "scale_bench.py")
        call = f"scale_bench.scale_launch(result_file={result_file!r}, tree={str(root)!r}, **{kwargs!r})"
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
        f"{os.cpu_count()} cores ({cpu_name()})"
    )
    with code_at(versus) if versus else contextlib.nullcontext() as other:
        trees = {"this": REPO_ROOT, **({versus[:7]: other} if versus else {})}
        whole = {}  # (code, layers, world) -> each rank's whole-process peak
        depths = (2, 4) if smoke else (20, 40)
        for layers in depths:
            whole.update(scale_depth(trees, layers, smoke))
    for code in trees:
        grown = [max(whole[code, layers, 4]) for layers in depths]
        one = [whole[code, layers, 1][0] for layers in depths]
        print(
            f"{code}, twice as deep: the highest 4-rank peak grew {(grown[1] - grown[0]) / 2**30:+.2f} GiB, while "
            f"one process's grew {(one[1] - one[0]) / 2**30:+.2f} GiB"
        )


def scale_depth(trees: dict[str, Path], layers: int, smoke: bool) -> dict[tuple, list[int]]:
    """One depth's table: every rank of 1, 2 and 4 processes, each version's code in turn, and how far each version's
    4 ranks are from the targets; (code, layers, world) -> each rank's whole-process peak."""
    model_dir = scale_model_dir(layers, smoke)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    n_parameters = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    del model
    print(f"\nrandom Llama, {layers} layers: {n_parameters / 1e6:.0f}M parameters ({model_dir})")
    print("code     ranks rank    load   train    save  resume   whole | load s  save s  resume s")
    whole = {}
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
    return whole
