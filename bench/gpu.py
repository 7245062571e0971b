"""The GPU campaign (--gpu): the cuda-marked tests, then the padded, packed dense-mask and packed block-mask layouts
and TRL's DPOTrainer (trl.py) on a random ~1B Llama at max_length 1024 and 4096: pairs/s, tokens/s, MFU, peak
memory, each configuration in a fresh process; --gpu --smoke runs it at tiny sizes on any device, as the test suite
does."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import hh_like_rows, worker_subprocess
from bench.step import lever_subprocess
from bench.trl import trl_worker
from utils import REPO_ROOT

# A randomly initialised ~1.1B Llama (Llama-3.2-1B's shape with a 32k vocabulary): config only, nothing downloaded.
CAMPAIGN_MODELS = {
    "gpu": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
}
# --smoke: the tiny preset's shape (assets/tiny-llama, the tests' model)
CAMPAIGN_MODELS["smoke"] = {
    key: value
    for key, value in json.loads((REPO_ROOT / "assets" / "tiny-llama" / "config.json").read_text()).items()
    if key in CAMPAIGN_MODELS["gpu"]
}
# (max_length, pairs per step, activation checkpointing): at 4096 the padded layout's 8 rows x 4096 tokens would
# not fit an H100's 80 GB without recomputation, for TRL as for us.
CAMPAIGN_WORKLOADS = {"gpu": ((1024, 8, False), (4096, 4, True)), "smoke": ((64, 4, False),)}
CAMPAIGN_LAYOUTS = {
    "padded (what TRL computes)": ["layout=padded"],
    "packed, dense mask": ["layout=packed", "packed_attention=dense"],
    "packed, block mask": ["layout=packed", "packed_attention=block"],
    # the block mask's row budget: the whole micro-batch in one row (the default) against rows of max_length
    "packed, block mask, rows of max_length": [
        "layout=packed",
        "packed_attention=block",
        "pack_row_tokens={max_length}",
    ],
}


def campaign_model_dir(directory: Path, sizes: dict) -> Path:
    """A model directory of a Llama config of these sizes and the tiny byte-level tokenizer (assets/tiny-llama)."""
    directory.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(**sizes, tie_word_embeddings=False).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO_ROOT / "assets" / "tiny-llama" / name, directory / name)
    return directory


def run_cuda_tests() -> None:
    """The cuda-marked tests, their output streamed as they run: a campaign cut short still shows how far it got."""
    print("cuda tests:", flush=True)
    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider", str(REPO_ROOT / "tests")],
        cwd=REPO_ROOT,
    )
    print(f"cuda tests: {'passed' if tests.returncode == 0 else f'exit {tests.returncode}'}", flush=True)


def bench_gpu(smoke: bool, warmup: int, steps: int) -> None:
    """The campaign: the cuda-marked tests, then each layout (and TRL's DPOTrainer when importable) on a random ~1B
    Llama at max_length 1024 and 4096, each configuration in a fresh process; --smoke: tiny sizes, no test run."""
    size = "smoke" if smoke else "gpu"
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)"
    print(f"device: {device}; torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    if not smoke:
        run_cuda_tests()
    trl = importlib.util.find_spec("trl") is not None
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = campaign_model_dir(Path(tmp) / "model", CAMPAIGN_MODELS[size])
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
        parameters = sum(p.numel() for p in meta.parameters())
        print(
            f"model: random Llama of {parameters / 1e6:,.1f}M parameters {CAMPAIGN_MODELS[size]}; HH-like length mix; "
            f"{warmup} warm-up + {steps} timed steps",
            flush=True,
        )
        for workload in CAMPAIGN_WORKLOADS[size]:
            bench_workload(Path(tmp), model_dir, workload, warmup, steps, trl)


def bench_workload(tmp: Path, model_dir: Path, workload: tuple, warmup: int, steps: int, trl: bool) -> None:
    """One workload's table: HH-like pairs for every step written to a file, then each layout and TRL on them."""
    max_length, pairs, checkpointing = workload
    cuda = torch.cuda.is_available()
    data_file = tmp / f"pairs-{max_length}.jsonl"
    rows = hh_like_rows(pairs * (warmup + steps), max_length, seed=max_length)
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"\nmax_length {max_length} x {pairs} pairs per step, activation checkpointing {checkpointing}")
    print(
        f"{'configuration':40s} {'pairs/s':>8s} {'real tok/s':>11s} {'computed':>9s} {'MFU':>6s} "
        f"{'peak mem':>9s}  (tokens/s: real = prompt once, computed = padding included)"
    )
    overrides = campaign_overrides(tmp, model_dir, data_file, workload, cuda)
    for name, layout in CAMPAIGN_LAYOUTS.items():
        if "block" in name and not cuda:
            print(f"{name:40s} skipped: FlexAttention has no backward pass on a CPU", flush=True)
            continue
        layout = [setting.format(max_length=max_length) for setting in layout]
        result = lever_subprocess(
            [*overrides, *layout], warmup, steps, str(tmp / "result.json"), data_file=str(data_file), n_rows=None
        )
        print(campaign_row(name, result) + f"  {result['layout']}", flush=True)
        for fallback in result["fallbacks"]:
            print(f"{'':42s}{fallback}", flush=True)
    if trl:
        kwargs = dict(
            model_dir=str(model_dir),
            data_file=str(data_file),
            max_length=max_length,
            pairs=pairs,
            checkpointing=checkpointing,
            warmup=warmup,
            steps=steps,
        )
        result = worker_subprocess(trl_worker, str(tmp / "trl.json"), **kwargs)
        print(campaign_row("TRL DPOTrainer (padded, precomputed ref)", result), flush=True)
    else:
        print("TRL: not importable here (pip install trl to compare)", flush=True)


def campaign_overrides(tmp: Path, model_dir: Path, data_file: Path, workload: tuple, cuda: bool) -> list[str]:
    """Our trainer on the campaign's random model and a workload's pairs, bfloat16 autocast on a GPU (TRL's recipe),
    float32 on a CPU."""
    max_length, pairs, checkpointing = workload
    return [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        "model.random_init=true",
        "model.block_name=LlamaDecoderLayer",
        f"model.fsdp_policy_mp={'bfloat16' if cuda else 'null'}",
        f"datasets=[{data_file}]",
        f"local_dirs=[{tmp}]",
        "loss.beta=0.1",
        "lr=1e-6",
        f"max_length={max_length}",
        f"max_prompt_length={max_length // 2}",
        f"batch_size={pairs}",
        f"eval_batch_size={pairs}",
        f"activation_checkpointing={str(checkpointing).lower()}",
        "wandb.enabled=false",
        "debug=true",
    ]


def campaign_row(name: str, result: dict) -> str:
    computed = result.get("computed_tokens_per_second")
    mfu = f"{result['mfu'] * 100:.3g}%"  # 3 digits: the smoke run's tiny model is far below 0.1% and must not read 0
    return (
        f"{name:40s} {result['pairs_per_second']:8.3f} {result['real_tokens_per_second']:11.0f} "
        f"{(f'{computed:9.0f}' if computed else '        -')} {mfu:>6s} {result['peak_memory_gib']:6.2f} GiB"
    )
