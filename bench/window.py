"""A sliding-window model (--window): a narrow Gemma 3 (five 128-token-window layers to one global, and Gemma 2's
final soft cap of 30) at max_length 512 x 8 HH pairs, the default configuration (packed rows with a windowed mask per
layer type, the scored head soft-capping itself) against what such a model took before (padded rows, all logits) and
packed with all logits: pairs/s, alternating fresh processes, 2 rounds."""

import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import HH_FILE, bench_tokenizer, with_machine_rates, workload_overrides
from bench.step import lever_subprocess
from modeling.precision import cpu_flags, cpu_name
from utils import REPO_ROOT

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
