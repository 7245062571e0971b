"""The GPU campaign (--gpu [--out DIR] [--budget SECONDS]), sized for a 15-minute lease: stages in order of what a
lease must not miss, each in a process of its own with a time limit inside one budget (campaign.py), the results in
one folder (campaign.json, campaign.md, campaign.log, profile-trace.json.gz):

1. the cuda-marked tests (offload, the vision block mask's backward, QLoRA where bitsandbytes is installed, Liger's
   kernels where liger-kernel is, the layouts on the GPU, ...), each test's outcome;
2. background saves beside GPU steps: a 144M Llama's 8 steps with a checkpoint every 2, written synchronously and with
   save_async=true (async_save.py's worker): the stall at a save and a step's time with and without a write;
3. the profile: torch.profiler over the default configuration's steps at the first workload, the kernels that take
   the most time and the device's gaps between them (profile.py's device_timeline), the host's operations;
4. the table: a random ~1.1B Llama at 1024 tokens x 8 and x 64 pairs a step and 4096 x 16 (activation
   checkpointing), ours in the packed block-mask layout (the default), padded and packed with the dense mask, and
   TRL's DPOTrainer (trl.py) without and with use_liger_kernel: pairs/s, real and computed tokens/s, MFU, peak memory;
   between the 1024-token workloads and the 4096-token one, sampling (sampling.py): evaluate.py's Sampler against
   plain model.generate(do_sample=True) on the same model, 16 prompts x 4 temperatures (64 rows) x 64 new tokens in
   bfloat16, tokens/s; the precisions: float16 with loss scaling, FP8 tensorwise and rowwise against bfloat16 at each
   workload, TRL with fp16=True, and FP8 against bfloat16 on a random ~3B Llama at 2048 x 16, where FP8 pays.

--gpu --smoke runs it at tiny sizes on any device, as the test suite does (without CUDA: no cuda tests, background
saves, block mask or Liger, each stage saying so)."""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.async_save import MODES, async_save_overrides, async_save_worker, summarize
from bench.campaign import Campaign, outcomes_of_tests
from bench.common import hh_like_rows
from bench.profile import step_profile_worker
from bench.sampling import render_sampling, sampling_worker
from bench.scale import scale_model_dir
from bench.step import lever_worker
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
# (max_length, pairs a step, activation checkpointing, TRL's pairs a micro-batch, warm-up steps, timed steps, each
# configuration's limit in seconds). TRL takes 8 pairs (4 at 4096) a micro-batch: at 64 pairs without recomputation
# its activations would not fit an H100 (8 pairs at 1024 took 48.8 GiB on the H200); ours plans its micro-batches
# from the device's memory (micro_batch_memory=auto). At 4096 both recompute activations.
CAMPAIGN_WORKLOADS = {
    "gpu": ((1024, 8, False, 8, 2, 5, 75), (1024, 64, False, 8, 1, 3, 100), (4096, 16, True, 4, 1, 3, 110)),
    "smoke": ((64, 4, False, 2, 1, 1, 120),),
}
# Our configurations (train.py overrides on the campaign's own); run in the order of CONFIGURATIONS, TRL's included
# The default on CUDA: shape buckets, compiled blocks and sync-free steps (issue 73), each taken away in a row of
# its own; "as campaign v2" is the default before them.
OURS = {
    "packed, block mask (default)": [],
    "packed, block mask as campaign v2": ["shape_buckets=false", "compile_blocks=false", "sync_free_steps=false"],
    "packed, block mask, eager": ["compile_blocks=false"],
    "packed, block mask, compiled without buckets": ["shape_buckets=false"],
    "packed, block mask, a sync a step": ["sync_free_steps=false"],
    # the precision issue's rows: float16 with loss scaling (what a V100 or T4 gets) and FP8 against bfloat16
    "packed, block mask, float16 + loss scaling": ["model.fsdp_policy_mp=float16"],
    "packed, block mask, FP8 tensorwise": ["model.fp8=tensorwise"],
    "packed, block mask, FP8 rowwise": ["model.fp8=rowwise"],
    "padded": ["layout=padded"],
    "packed, dense mask": ["layout=packed", "packed_attention=dense"],
}
BLOCK_MASK_ROWS = tuple(name for name in OURS if name.startswith("packed, block mask"))
TRL_ROWS = ("TRL", "TRL + Liger", "TRL, fp16=True")
CONFIGURATIONS = (
    *BLOCK_MASK_ROWS[:2], *TRL_ROWS[:2], *BLOCK_MASK_ROWS[2:], TRL_ROWS[2], "padded", "packed, dense mask"
)  # fmt: skip
TABLE_ORDER = ("padded", "packed, dense mask", *BLOCK_MASK_ROWS, *TRL_ROWS)
# Where FP8 pays: a random ~3B Llama (Llama-3.2-3B's shape, a 32k vocabulary) at 2048 tokens x 16 pairs with
# activation checkpointing, bfloat16 against FP8 (the workload tuple as CAMPAIGN_WORKLOADS')
FP8_MODEL = dict(CAMPAIGN_MODELS["gpu"], hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                 num_attention_heads=24, num_key_value_heads=8)  # fmt: skip
FP8_WORKLOAD = (2048, 16, True, 4, 1, 3, 150)
FP8_ROWS = ("packed, block mask (default)", "packed, block mask, FP8 tensorwise", "packed, block mask, FP8 rowwise")
# (limit in seconds on a GPU, in --smoke) of the cuda tests, each background-save run and the profile
LIMITS = {"cuda tests": (200, 60), "background saves": (90, 60), "profile": (120, 60), "sampling": (60, 60)}
# The sampling stage's (prompts, temperatures, new tokens, the pairs' max_length its prompts are drawn for)
SAMPLING = {"gpu": (16, [0.25, 0.5, 0.75, 1.0], 64, 1024), "smoke": (2, [0.5, 1.0], 4, 64)}
# The campaign's default budget: a 15-minute lease less the machine's start, the wheels' install and the transfers
BUDGET = 540


def campaign_model_dir(directory: Path, sizes: dict) -> Path:
    """A model directory of a Llama config of these sizes and the tiny byte-level tokenizer (assets/tiny-llama)."""
    directory.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(**sizes, tie_word_embeddings=False).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REPO_ROOT / "assets" / "tiny-llama" / name, directory / name)
    return directory


def pairs_file(tmp: Path, n: int, max_length: int) -> Path:
    """n HH-like pairs at max_length written to a JSONL file (the same for every configuration of a workload)."""
    path = tmp / f"pairs-{max_length}-{n}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in hh_like_rows(n, max_length, seed=max_length)))
    return path


def versions() -> dict:
    """The device and the versions of what the campaign runs on (None: not installed)."""
    cuda = torch.cuda.is_available()
    found = {name: importlib.util.find_spec(module) is not None for name, module in
             (("trl", "trl"), ("liger-kernel", "liger_kernel"), ("bitsandbytes", "bitsandbytes"))}  # fmt: skip
    from importlib.metadata import version

    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "cuda": cuda,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        **{name: version(name) if present else None for name, present in found.items()},
    }


def bench_gpu(smoke: bool, out: Path, budget: float, only: tuple[str, ...] = ()) -> None:
    """The campaign (the module's docstring), its results in `out`, its stages inside `budget` seconds; with `only`,
    just the stages whose names contain one of its texts."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the stages' processes inherit it: a GPU lease reaches no Hub
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    size = "smoke" if smoke else "gpu"
    header = {**versions(), "smoke": smoke, "model": CAMPAIGN_MODELS[size]}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = campaign_model_dir(Path(tmp) / "model", CAMPAIGN_MODELS[size])
        with torch.device("meta"):
            meta = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
        header["parameters"] = sum(p.numel() for p in meta.parameters())
        campaign = Campaign(out, budget, header, render_campaign, only)
        print(f"--gpu: {header}; results in {out}", flush=True)
        run_cuda_tests(campaign, smoke)
        run_background_saves(campaign, Path(tmp), smoke)
        run_profile(campaign, Path(tmp), model_dir, CAMPAIGN_WORKLOADS[size][0], smoke)
        workloads = CAMPAIGN_WORKLOADS[size]
        # 1024 x 64 carries the speed targets: its rows first; 1024 x 8 (the first lease's workload) after sampling
        for workload in workloads[1:2]:
            run_workload(campaign, Path(tmp), model_dir, workload)
        run_sampling(campaign, Path(tmp), model_dir, smoke)  # one stage, before the remaining rows
        for workload in (*workloads[:1], *workloads[2:]):
            run_workload(campaign, Path(tmp), model_dir, workload)
        if not smoke:  # FP8 at the shape where it pays: after every row of the 1.1B model
            fp8_model = campaign_model_dir(Path(tmp) / "model-3b", FP8_MODEL)
            run_workload(campaign, Path(tmp), fp8_model, FP8_WORKLOAD, FP8_ROWS, "3B")
    print(f"\n{render_campaign(campaign.report)}", flush=True)


def run_cuda_tests(campaign: Campaign, smoke: bool) -> None:
    """The cuda-marked tests (pytest -v, so that a run stopped at its limit still says which ended how)."""
    if not torch.cuda.is_available() or smoke:
        campaign.record("cuda tests", "skipped: no CUDA" if not torch.cuda.is_available() else "skipped: --smoke")
        return
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-v", "-rfEs", "-p", "no:cacheprovider", "tests"]
    status, seconds, output = campaign.run("cuda tests", argv, LIMITS["cuda tests"][smoke])
    outcomes = outcomes_of_tests(output)
    counts = {}
    for outcome in outcomes["tests"].values():
        counts[outcome.split(":")[0]] = counts.get(outcome.split(":")[0], 0) + 1
    campaign.record("cuda tests", status, seconds, counts=counts, **outcomes)


def run_background_saves(campaign: Campaign, tmp: Path, smoke: bool) -> None:
    """async_save.py's run, synchronous and in the background, on a Llama of --scale's shape with 8 blocks (2 and
    --scale's tiny shape with --smoke) and the campaign's HH-like pairs at 256 tokens: each mode's summary; skipped
    without CUDA."""
    if not torch.cuda.is_available():
        for mode in MODES:  # on CPUs --async-save measures them
            campaign.record(f"background saves: {mode}", "skipped: no CUDA")
        return
    model_dir = scale_model_dir(2 if smoke else 8, smoke)
    data = pairs_file(tmp, 48, 256)
    for mode in MODES:
        overrides = [f"datasets=[{data}]" if setting.startswith("datasets=") else setting
                     for setting in async_save_overrides(model_dir, tmp / f"saves-{mode}", mode)]  # fmt: skip
        limit = LIMITS["background saves"][smoke]
        name = f"background saves: {mode}"
        campaign.worker(name, async_save_worker, tmp / "saves.json", limit, summarize, overrides=overrides)


def campaign_overrides(tmp: Path, model_dir: Path, data_file: Path, workload: tuple) -> list[str]:
    """Our trainer on the campaign's random model and a workload's pairs, bfloat16 autocast on a GPU (TRL's recipe),
    float32 on a CPU."""
    max_length, pairs, checkpointing = workload[:3]
    return [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        "model.random_init=true",
        "model.block_name=LlamaDecoderLayer",
        f"model.fsdp_policy_mp={'bfloat16' if torch.cuda.is_available() else 'null'}",
        f"datasets=[{data_file}]",
        f"local_dirs=[{tmp}]",
        "loss.beta=0.1",
        "lr=1e-6",
        f"max_length={max_length}",
        f"max_prompt_length={max_length // 2}",
        f"batch_size={pairs}",
        f"eval_batch_size={pairs}",
        f"eval_every={pairs * 20}",  # a multiple of every workload's batch (the default, 160, is not of 64)
        f"activation_checkpointing={str(checkpointing).lower()}",
        "wandb.enabled=false",
        "debug=true",
    ]


def run_profile(campaign: Campaign, tmp: Path, model_dir: Path, workload: tuple, smoke: bool) -> None:
    """The default configuration's steps at `workload` under torch.profiler (profile.py's step_profile_worker)."""
    max_length, pairs, _, _, warmup, steps, _ = workload
    data = pairs_file(tmp, pairs * (warmup + 3), max_length)
    overrides = campaign_overrides(tmp, model_dir, data, workload)
    campaign.worker(f"profile: {max_length} x {pairs}, the default configuration", step_profile_worker,
                    tmp / "profile.json", LIMITS["profile"][smoke], overrides=overrides, warmup=warmup, steps=3,
                    data_file=str(data), trace_file=str(campaign.out / "profile-trace.json.gz"))  # fmt: skip


def run_sampling(campaign: Campaign, tmp: Path, model_dir: Path, smoke: bool) -> None:
    """evaluate.py's sampling against plain generate (sampling.py's worker)."""
    n_prompts, temperatures, max_new_tokens, max_length = SAMPLING["smoke" if smoke else "gpu"]
    name = f"sampling: {n_prompts * len(temperatures)} rows x {max_new_tokens} new tokens"
    campaign.worker(name, sampling_worker, tmp / "sampling.json", LIMITS["sampling"][smoke], model_dir=str(model_dir),
                    n_prompts=n_prompts, temperatures=temperatures, max_new_tokens=max_new_tokens,
                    max_length=max_length)  # fmt: skip


def configuration_skip(name: str) -> str | None:
    """Why a configuration cannot run here, or None."""
    cuda = torch.cuda.is_available()
    if name in BLOCK_MASK_ROWS and not cuda:
        return "skipped: FlexAttention has no backward pass on a CPU"
    if name.startswith("TRL") and importlib.util.find_spec("trl") is None:
        return "skipped: trl is not installed"
    if name == "TRL + Liger" and not cuda:
        return "skipped: no CUDA (Liger's kernels are Triton's)"
    if name == "TRL + Liger" and importlib.util.find_spec("liger_kernel") is None:
        return "skipped: liger-kernel is not installed"
    return None


def run_workload(campaign: Campaign, tmp: Path, model_dir: Path, workload: tuple, names=CONFIGURATIONS,
                 model: str = "") -> None:  # fmt: skip
    """One workload's table: its pairs written to a file, then each configuration (`names`) on them in a fresh
    process; `model` names a model other than the campaign's 1.1B in the stages' names."""
    max_length, pairs, checkpointing, trl_pairs, warmup, steps, limit = workload
    data_file = pairs_file(tmp, pairs * (warmup + steps), max_length)
    overrides = campaign_overrides(tmp, model_dir, data_file, workload)
    for name in names:
        stage = f"{f'{model} ' if model else ''}{max_length} x {pairs}: {name}"
        if skip := configuration_skip(name):
            campaign.record(stage, skip)
        elif name in OURS:
            campaign.worker(stage, lever_worker, tmp / "result.json", limit, overrides=[*overrides, *OURS[name]],
                            warmup=warmup, steps=steps, data_file=str(data_file), n_rows=None)  # fmt: skip
        else:
            trl = dict(
                model_dir=str(model_dir),
                data_file=str(data_file),
                max_length=max_length,
                pairs=pairs,
                checkpointing=checkpointing,
                warmup=warmup,
                steps=steps,
                accumulation=pairs // trl_pairs,
            )
            campaign.worker(stage, trl_worker, tmp / "trl.json", limit, **trl, liger=name == "TRL + Liger",
                            fp16=name == "TRL, fp16=True")  # fmt: skip


def render_campaign(report: dict) -> str:
    """campaign.md: the device and versions, every stage's status and seconds, then each kind of stage's results."""
    head = report["campaign"]
    stages = report["stages"]
    lines = [
        f"# GPU campaign{' (--smoke)' if head['smoke'] else ''}",
        "",
        f"{head['device']}; Python {head['python']}, torch {head['torch']}, transformers {head['transformers']}, trl "
        f"{head['trl']}, liger-kernel {head['liger-kernel']}, bitsandbytes {head['bitsandbytes']}; random Llama of "
        f"{head['parameters'] / 1e6:,.1f}M parameters {head['model']}; budget {head['budget_s']:.0f} s",
        "",
        "| stage | status | seconds |",
        "| --- | --- | ---: |",
        *(f"| {s['name']} | {s['status'].replace('|', '/')} | {s['seconds']:.0f} |" for s in stages),
    ]
    for stage in stages:
        if stage["name"] == "cuda tests" and stage.get("tests"):
            lines += render_tests(stage)
        elif stage["name"].startswith("profile") and stage.get("result"):
            lines += render_profile(stage)
        elif stage["name"].startswith("sampling") and stage.get("result"):
            lines += render_sampling(stage)
    lines += render_saves([s for s in stages if s["name"].startswith("background saves")])
    workloads = dict.fromkeys(s["name"].split(": ")[0] for s in stages if " x " in s["name"].split(": ")[0])
    for workload in workloads:
        lines += render_table(workload, {s["name"].split(": ", 1)[1]: s for s in stages if
                                         s["name"].startswith(f"{workload}: ")})  # fmt: skip
    return "\n".join(lines) + "\n"


def render_tests(stage: dict) -> list[str]:
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(stage["counts"].items()))
    lines = ["", f"## cuda tests: {counts}", "", "| test | outcome |", "| --- | --- |"]
    lines += [f"| {test} | {outcome.replace('|', '/')} |" for test, outcome in stage["tests"].items()]
    return lines + ([""] + [f"- skipped: {reason}" for reason in stage["skips"]] if stage["skips"] else [])


def render_saves(stages: list[dict]) -> list[str]:
    """Seconds of each background-save run: the loop, the stall at a save, a save's write, a step."""
    measured = [s for s in stages if s.get("result")]
    if not measured:
        return []
    lines = ["", "## Background saves (seconds)", "", "| mode | loop | stall at a save | write | step | step while "
             "writing | saves |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for stage in measured:
        r = stage["result"]
        lines.append(f"| {stage['name'].split(': ')[1]} | {r['loop']:.2f} | {r['stall']:.3f} | {r['write']:.2f} | "
                     f"{r['step']:.3f} | {r['step_writing']:.3f} | {r['saves']} |")  # fmt: skip
    return lines


def render_profile(stage: dict) -> list[str]:
    """The step under the profiler: the device's top kernels and gaps (on a GPU), the host's top operations."""
    r = stage["result"]
    lines = ["", f"## {stage['name']}", "", f"{r['layout']}; {r['seconds_per_step'] * 1000:.1f} ms a step under the "
             f"profiler, the host's operators {r['host_ms_per_step']:.1f} ms of it (self time)"]  # fmt: skip
    if "top_kernels" in r:
        gaps = ", ".join(f"{size}: {n:.0f} a step, {ms:.2f} ms" for size, (n, ms) in r["gaps_by_size"].items())
        lines[-1] += (
            f"; the device busy {r['device_busy_share']:.1%} of the steps' time, {r['kernels_per_step']:.0f} kernels "
            "a step."
        )
        lines += ["", "| kernel | ms a step | share of the step | launches a step |", "| --- | ---: | ---: | ---: |"]
        lines += [f"| `{name[:100]}` | {ms:.2f} | {share:.1%} | {n:.0f} |" for name, ms, share, n in r["top_kernels"]]
        lines += ["", f"Gaps (the device idle) by size: {gaps}", "", "| largest gaps, ms | after | before | "
                  "the host in |", "| ---: | --- | --- | --- |"]  # fmt: skip
        lines += [f"| {ms:.3f} | `{after}` | `{before}` | `{host}` |" for ms, after, before, host in r["largest_gaps"]]
    else:
        lines[-1] += "; no device timeline (no CUDA)."
    lines += ["", "| host operator | ms a step (self) | share | calls a step |", "| --- | ---: | ---: | ---: |"]
    return lines + [f"| `{name}` | {ms:.2f} | {share:.1%} | {n} |" for name, ms, share, n in r["top_host_ops"]]


def render_table(workload: str, stages: dict) -> list[str]:
    """A workload's configurations: pairs/s, tokens/s (real: the prompt once; computed: padding included), MFU, peak
    memory, and what our trainer chose (or why a configuration has no numbers)."""
    columns = "configuration | pairs/s | real tokens/s | computed tokens/s | MFU | peak memory GiB | layout, or status"
    lines = [
        "",
        f"## {workload} pairs a step",
        "",
        f"| {columns} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name in (name for name in TABLE_ORDER if name in stages):
        stage, r = stages[name], stages[name].get("result")
        if not r:
            lines.append(f"| {name} | | | | | | {stage['status'].replace('|', '/')} |")
            continue
        computed = r.get("computed_tokens_per_second")
        chosen = "; ".join([r.get("layout", "TRL's padded rows"), *r.get("fallbacks", [])]).replace("|", "/")
        chosen += f"; first step {r['first_step_seconds']:.1f} s" if "first_step_seconds" in r else ""
        computed = f"{computed:.0f}" if computed else "-"
        lines.append(
            f"| {name} | {r['pairs_per_second']:.2f} | {r['real_tokens_per_second']:.0f} | {computed} | "
            f"{r['mfu'] * 100:.3g}% | {r['peak_memory_gib']:.2f} | {chosen} |"
        )  # 3 digits of MFU: the smoke run's tiny model is far below 0.1% and must not read 0
    return lines
