"""What the campaigns share: the HH workload (its file, the overrides of a run on it, HH-like synthetic pairs), the
tokenizer and model they read, the machine's measured matmul rates, peak memory as the results report it, images
counted through vision towers, and a worker run in a fresh process, from this tree's code or another version's
(code_at)."""

import contextlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from utils import REPO_ROOT

HH_FILE = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base" / "test.jsonl.gz"
SMOLLM2_TOKENIZER = REPO_ROOT.parent / "shared" / "tokenizers" / "smollm2" / "tokenizer.json"
# Token lengths of the HH harmless-base test pairs under the SmolLM2 tokenizer (medians: prompt 94, chosen 27,
# rejected 37; log-normal spread ~1.0), scaled from HH's usual max_length of 512 to the workload's.
HH_MEDIANS, HH_LOG_SPREAD = {"prompt": 94, "chosen": 27, "rejected": 37}, 1.0


def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct's directory under ./.cache (converted there once), the Hub asked nothing."""
    from modeling.model_dirs import SMOLLM2_HUB_ID, resolve_model_dir

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return resolve_model_dir(SMOLLM2_HUB_ID, REPO_ROOT / ".cache")


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

    (REPO_ROOT / ".cache").mkdir(exist_ok=True)
    cpu_matmul_flops(REPO_ROOT / ".cache")
    shutil.copy(REPO_ROOT / ".cache" / "precision_probe.json", cache_dir)
    return cache_dir


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


def bench_tokenizer():
    """SmolLM2's original tokenizer (../shared), else the tiny byte-level one; and its name."""
    if SMOLLM2_TOKENIZER.exists():
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2_TOKENIZER), eos_token="<|im_end|>")
        return tokenizer, "SmolLM2"
    return transformers.AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tiny-llama"), "tiny byte-level"


def peak_memory_gib(cuda: bool) -> float:
    """This process's peak memory: the GPU's allocations on CUDA, else the resident set's high-water mark."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB


@contextlib.contextmanager
def images_encoded(*models: torch.nn.Module | None):
    """[images each model's vision tower encodes while the block runs]: a forward hook counts the images of each call
    (its pixel batch's rows); 0 for None or a text model, and a tower shared with an earlier model (LoRA's reference
    is the policy's base) counts in that one's."""
    from modeling.vision import vision_tower

    counts, hooks, seen = [0] * len(models), [], set()
    for index, model in enumerate(models):
        tower = vision_tower(model) if model is not None else None
        if tower is None or id(tower) in seen:
            continue
        seen.add(id(tower))

        def count(module, args, output, index=index):
            counts[index] += args[0].shape[0]

        hooks.append(tower.register_forward_hook(count))
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def worker_subprocess(worker: Callable, result_file: str, root: Path = REPO_ROOT, **kwargs) -> dict:
    """worker(result_file=result_file, **kwargs) in a fresh process, from the code in `root` (this tree, or another
    version's: code_at), the worker found by its name in that version: in its module of the bench package
    (bench.step.lever_worker), or in the one bench.py of versions from before the package; the JSON it writes there."""
    module = f"(importlib.import_module({worker.__module__!r}) if hasattr(bench, '__path__') else bench)"
    call = f"{module}.{worker.__name__}(result_file={result_file!r}, **{kwargs!r})"
    code = f"import importlib, sys; sys.path.insert(0, {str(root)!r}); import bench; {call}"
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return json.loads(Path(result_file).read_text())


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
