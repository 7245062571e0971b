"""The bench package (`python -m bench`): the GPU campaign (--gpu), the scale campaign (--scale), reward modelling
against TRL (--reward), vision-language DPO against TRL (--vision), checkpoints written in the background
(--async-save) and long pairs over sequence-parallel ranks (--long) in their smoke modes, so that they cannot rot
between the sessions that run them; its command line; and the workers of --versus and --scale --versus found in
another version's code, whether it is laid out in packages or flat."""

import json
import os
import re
import subprocess
import sys

import pytest

from bench import gpu
from bench.campaign import Campaign, outcomes_of_tests
from bench.common import worker_subprocess
from bench.profile import device_timeline
from bench.reward import PRECISIONS
from bench.scale_ranks import module_name
from bench.step import lever_worker
from bench.vision import CONFIGURATIONS
from conftest import REPO_ROOT


def run_bench(*flags: str, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """`python -m bench FLAGS` from the repository's root, offline, its output captured."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env}
    return subprocess.run(
        [sys.executable, "-m", "bench", *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.slow  # five fresh processes (the profile, two layouts, TRL, sampling) and their imports: ~75 s
def test_gpu_campaign_smoke_writes_every_stage_and_the_profile_to_its_folder(tmp_path):
    result = run_bench("--gpu", "--smoke", "--out", str(tmp_path / "out"), timeout=600, OMP_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "campaign.json").read_text())
    stages = {stage["name"]: stage for stage in report["stages"]}
    table = [f"64 x 4: {name}" for name in gpu.CONFIGURATIONS]
    profile = "profile: 64 x 4, the default configuration"
    sampling = "sampling: 4 rows x 4 new tokens"
    saves = ["background saves: sync", "background saves: async"]
    # --smoke's one workload is the first of the GPU's three, which run after sampling (the second one before it)
    assert list(stages) == ["cuda tests", *saves, profile, sampling, *table]
    for name in ("cuda tests", "background saves: sync", "background saves: async", "64 x 4: TRL + Liger"):
        assert stages[name]["status"].startswith("skipped: no CUDA"), stages[name]
    for name in gpu.BLOCK_MASK_ROWS:  # the default, its levers taken away one by one, the precisions
        assert stages[f"64 x 4: {name}"]["status"].startswith("skipped: FlexAttention"), name
    ran = [f"64 x 4: {name}" for name in ("padded", "packed, dense mask", "TRL", "TRL, fp16=True")]
    for name in (profile, *ran, sampling):
        assert stages[name]["status"] == "ok" and stages[name]["result"], stages[name]
    for name in ran:
        r = stages[name]["result"]
        assert r["pairs_per_second"] > 0 and r["real_tokens_per_second"] > 0 and 0 < r["mfu"] < 1, name
    # the same data: the padded layout computes more positions than the packed one for the same real tokens
    padded, packed = (stages[name]["result"] for name in ran[:2])
    ratio = lambda r: r["computed_tokens_per_second"] / r["real_tokens_per_second"]  # noqa: E731
    assert ratio(padded) > ratio(packed) and "packed layout (dense attention)" in packed["layout"]
    # the profile on a CPU: the host's operators, matmuls among the largest, and no device timeline
    top = stages[profile]["result"]["top_host_ops"]
    assert len(top) == 15 and "aten::mm" in [name for name, *_ in top[:5]] and sum(s for _, _, s, _ in top) <= 1
    assert "top_kernels" not in stages[profile]["result"] and (tmp_path / "out" / "profile-trace.json.gz").exists()
    # sampling: the Sampler's and generate's rows each drew tokens, up to each row's EOS, at most max_new_tokens a row
    r = stages[sampling]["result"]
    assert r["rows"] == 4 and r["dtype"] == "float32" and r["speedup"] > 0
    assert all(0 < r[side]["tokens"] <= 16 and r[side]["tokens_per_second"] > 0 for side in ("ours", "generate"))
    markdown = (tmp_path / "out" / "campaign.md").read_text()
    for name, stage in stages.items():
        assert f"| {name} | {stage['status']} | " in markdown
    assert "| `aten::mm` | " in markdown and "| padded | " in markdown and "## 64 x 4 pairs a step" in markdown
    assert f"## {sampling}" in markdown and "| ours: the static loop, graphed (evaluate.py's Sampler) | " in markdown
    assert "===== 64 x 4: TRL: ok" in (tmp_path / "out" / "campaign.log").read_text()


def test_a_campaign_stage_that_fails_or_runs_past_its_limit_is_recorded_and_the_next_runs(tmp_path):
    # Each stage a process group of its own: the one that hangs (and its child) is stopped at its limit, the one that
    # fails gives its last line, the budget's end skips the rest; the JSON and the markdown say so after each.
    campaign = Campaign(tmp_path, 30, {"device": "test"}, lambda report: f"{len(report['stages'])} stages\n")
    hang = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "print('started', flush=True); time.sleep(60)"  # fmt: skip
    status, seconds, output = campaign.run("hangs", [sys.executable, "-c", hang], limit=2, least=1)
    assert status == "timed out after 2 s" and seconds < 10 and output.strip() == "started"
    campaign.record("hangs", status, seconds)
    fail = "print('first'); raise SystemExit('second: what went wrong')"
    stage = campaign.record("fails", *campaign.run("fails", [sys.executable, "-c", fail], limit=20, least=1)[:2])
    assert stage["status"] == "failed: exit 1: second: what went wrong"
    assert campaign.run("late", [sys.executable, "-c", "pass"], limit=20, least=60)[0].startswith("skipped: out of")
    report = json.loads((tmp_path / "campaign.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["hangs", "fails"] and report["campaign"]["budget_s"] == 30
    assert (tmp_path / "campaign.md").read_text() == "2 stages\n"
    assert "===== hangs: timed out after 2 s\nstarted" in (tmp_path / "campaign.log").read_text()


def test_only_runs_the_stages_it_names_and_goes_with_gpu_alone(tmp_path, capsys):
    # A lease's second call: only the named stages start; the others are recorded as not selected, never started
    from bench.__main__ import main

    campaign = Campaign(tmp_path, 30, {"device": "test"}, lambda report: "", only=("1024 x 64: padded",))
    write = [sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'a').write('x')"]
    assert campaign.run("1024 x 64: TRL", write, limit=20, least=1)[0] == "skipped: not selected (--only)"
    assert not (tmp_path / "ran").exists()
    assert campaign.run("1024 x 64: padded", write, limit=20, least=1)[0] == "ok"
    assert (tmp_path / "ran").read_text() == "x"
    with pytest.raises(SystemExit) as exit:
        main(["--only", "padded", "--fsdp"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith("--only TEXT chooses among the stages of --gpu's campaign")


def test_every_configuration_of_every_gpu_workload_passes_the_single_runs_checks(tmp_path):
    # The H200 found 1024 x 64 refused by the campaign's own config (eval_every=160 is no multiple of 64 pairs): a
    # lease cannot afford a configuration the CPU could have checked
    import config as configuration

    data = tmp_path / "pairs.jsonl"
    for workload in gpu.CAMPAIGN_WORKLOADS["gpu"]:
        for extra in gpu.OURS.values():
            configuration.load([*gpu.campaign_overrides(tmp_path, tmp_path / "model", data, workload), *extra])


def test_test_outcomes_read_pytest_verbose_lines_with_and_without_xdist_and_the_summary():
    output = """[gw0] [ 33%] PASSED tests/test_liger.py::test_kernels
tests/test_adapters.py::test_qlora SKIPPED (needs bitsandbytes)     [ 66%]
[gw1] [100%] FAILED tests/test_vision.py::test_block[gemma3]
=========================== short test summary info ============================
FAILED tests/test_vision.py::test_block[gemma3] - AssertionError: 0.5 != 0.25
SKIPPED [1] tests/test_adapters.py:140: could not import 'bitsandbytes'"""
    assert outcomes_of_tests(output) == {
        "tests": {
            "tests/test_liger.py::test_kernels": "passed",
            "tests/test_adapters.py::test_qlora": "skipped",
            "tests/test_vision.py::test_block[gemma3]": "failed: AssertionError: 0.5 != 0.25",
        },
        "skips": ["tests/test_adapters.py:140: could not import 'bitsandbytes'"],
    }


def test_the_device_timeline_finds_kernels_and_the_gaps_between_them():
    # Two steps traced: a host op over 0-100 us; kernels a (10-30 and 40-50, overlapping b at 25-35) and a copy at
    # 90-95. Busy: 10-35, 40-50, 90-95 = 40 us of 100; gaps 0-10 (before a), 35-40, 50-90 (the host in "step"), 95-100:
    # two of 5 us, one of 10 and one of 40, over two steps.
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "step", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 10, "dur": 20},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 25, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 40, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 90, "dur": 5},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 60},
    ]
    timeline = device_timeline(events, steps=2)
    assert timeline["device_busy_share"] == pytest.approx(0.4) and timeline["kernels_per_step"] == 2
    assert timeline["top_kernels"][0] == ["a", 0.015, 0.3, 1] and [k[0] for k in timeline["top_kernels"]] == [
        "a", "b", "copy"]  # fmt: skip
    assert timeline["gaps_by_size"] == {"under 10 us": [1.0, 0.005], "10-100 us": [1.0, 0.025], "0.1-1 ms": [0, 0],
                                        "over 1 ms": [0, 0]}  # fmt: skip
    assert timeline["largest_gaps"][0] == [0.04, "a", "copy", "step"]
    assert timeline["largest_gaps"][-1][1:] == ["b", "a", "step"] and device_timeline(events[:2], 1) == {}


@pytest.mark.slow  # two fresh processes, each loading torch, transformers and a model: ~25 s
def test_async_save_smoke_times_training_around_synchronous_and_background_saves():
    result = run_bench("--async-save", "--smoke", timeout=900, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {cells[0]: cells[2:] for cells in map(str.split, result.stdout.splitlines()) if cells[1:2] == ["1"]}
    assert rows.keys() == {"sync", "async"}  # one round of each
    for mode in ("sync", "async"):
        loop, stall, write, step, _, saves = rows[mode]
        assert int(saves) == 3 and 0 < float(stall) <= float(write) < float(loop) and float(step) > 0, (mode, rows)
    assert result.stdout.splitlines()[-1].startswith("async against sync: the loop ")


def test_rounds_is_refused_without_versus_or_below_one(capsys):
    # --rounds only steers --versus: anywhere else, or at 0, it is one line of error, not a flag silently ignored
    # (or a division by zero after minutes of loading).
    from bench.__main__ import main

    for flags in (["--fsdp", "--rounds", "3"], ["--versus", "HEAD", "--rounds", "0"]):
        with pytest.raises(SystemExit) as exit:
            main(flags)
        assert exit.value.code == 2, flags
        stderr = capsys.readouterr().err
        assert stderr.splitlines()[-1].endswith(
            "at least 1, and only with --versus, --vllm, --vision, --async-save or --precision"
        ), stderr


@pytest.mark.slow
def test_reward_smoke_times_both_trainers_in_both_precisions():
    # --reward at its smallest: our reward model and TRL's RewardTrainer on the same HH pairs, float32 and bfloat16
    result = run_bench("--reward", "--smoke", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {
        line[:28].strip(): line[28:].split() for line in result.stdout.splitlines() if line.startswith(("ours", "TRL"))
    }
    assert sorted(rows) == sorted(f"{who}, {dtype}" for who in ("ours", "TRL RewardTrainer") for dtype in PRECISIONS)
    for name, (pairs_per_second, tokens_per_second, peak, _) in rows.items():
        assert float(pairs_per_second) > 0 and float(tokens_per_second) > 0 and float(peak) > 0.3, name
    assert [line.split(":")[0] for line in result.stdout.splitlines()[-2:]] == list(PRECISIONS)


@pytest.mark.slow  # three fresh processes, each loading torch, transformers and a model: ~35 s
def test_vision_smoke_encodes_each_image_once_per_pair_where_trl_encodes_it_twice():
    # --vision at its smallest: our packed layout holds each pair's prompt and image once, so the policy's vision
    # tower encodes 1 image per pair (and a live reference 1 more); TRL's collator repeats the image for the chosen
    # and the rejected row, in its policy and in its live reference (it precomputes none for images).
    result = run_bench("--vision", "--smoke", timeout=900, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line[:42].strip(): line[42:].split() for line in lines if line.startswith(("ours", "TRL"))}
    rows = {name: row for name, row in rows.items() if name in CONFIGURATIONS}  # the ratio lines aside
    images = {name: " ".join(row[3:]) for name, row in rows.items()}
    assert images == {
        "ours (packed, cached reference)": "1 + 0",
        "ours (packed, live reference)": "1 + 1",
        "TRL DPOTrainer (padded, live reference)": "2 + 2",
    }, result.stdout
    for name, (pairs_per_second, peak, unit, *_) in rows.items():
        assert float(pairs_per_second) > 0 and float(peak) > 0.1 and unit == "GiB", name
    assert lines[1].startswith("model: random LLaVA of ") and "M parameters: vision CLIP ViT-like {" in lines[1]
    ratios = [line.split(": ") for line in lines[-2:]]
    assert [name for name, _ in ratios] == list(CONFIGURATIONS)[:2], lines[-2:]
    assert all(ratio.endswith("x TRL DPOTrainer's pairs/s") and float(ratio[:-26]) > 0 for _, ratio in ratios)


@pytest.mark.slow
def test_scale_smoke_measures_every_rank_in_every_phase():
    # --scale at tiny sizes: each of 1, 2 and 4 ranks reports its peaks while loading, training, saving and resuming.
    result = run_bench("--scale", "--smoke", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("this ")]
    assert [(int(row[1]), int(row[2])) for row in rows] == [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)] * 2
    for row in rows:  # load, train, save, resume, whole: GiB; the whole process's peak is the highest
        peaks = [float(value) for value in row[3:8]]
        assert all(0 < peak for peak in peaks) and peaks[4] == max(peaks)
    assert result.stdout.count("at 4 ranks: the highest rank peak is ") == 2 and "twice as deep" in result.stdout


@pytest.mark.slow  # 7 fresh processes over 3 launches and a dry run's: ~1 min
def test_long_smoke_measures_every_rank_beside_the_dry_runs_halved_activations():
    # --long at tiny sizes: each rank of sp = 1, 2 and 4 reports its resident memory as training starts and its peak
    # while training, beside the dry run's training estimate; the plan gives a rank 1 / sp of the activations,
    # exactly, as the byte counts of the ratio lines show.
    result = run_bench("--long", "--smoke", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and " flags " in lines[0] and "torch " in lines[0], lines[0]
    rows = [line.replace("|", " ").split() for line in lines if re.match(r" *\d+ +\d+ ", line)]
    assert [(int(row[0]), int(row[1])) for row in rows] == [(1, 0), (2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)]
    for row in rows:  # GiB: start, peak, growth | estimate, activations, mask | seconds (0.0 at tiny sizes)
        start, peak, _, estimate, *_ = map(float, row[2:])
        assert 0.1 < start <= peak and estimate > 0, row
    ratios = {
        int(sp): (float(ratio), int(one), int(many))
        for sp, ratio, one, many in re.findall(r"sp 1 / sp (\d), per rank: the dry run's activations ([\d.]+)x "
                                               r"\((\d+) / (\d+) bytes\)", result.stdout)
    }  # fmt: skip
    assert ratios.keys() == {2, 4}, result.stdout
    assert ratios[2][1] == 2 * ratios[2][2] and ratios[4][1] == 4 * ratios[4][2] and ratios[2][0] == 2.0, ratios


# A version's worker standing in for lever_worker: it writes what it was given and the file it lives in.
STAND_IN_WORKER = """import json, pathlib


def lever_worker(result_file, **kwargs):
    pathlib.Path(result_file).write_text(json.dumps({**kwargs, "file": __file__}))
"""


def test_versus_runs_the_worker_of_the_version_it_is_given_in_either_layout(tmp_path):
    # --versus runs another version's own lever_worker: in bench.py before the package, in bench/step.py since.
    flat, packaged = tmp_path / "flat", tmp_path / "packaged"
    (packaged / "bench").mkdir(parents=True)
    flat.mkdir()
    (flat / "bench.py").write_text(STAND_IN_WORKER)
    (packaged / "bench" / "__init__.py").write_text("")
    (packaged / "bench" / "step.py").write_text(STAND_IN_WORKER)
    for root, worker_file in ((flat, flat / "bench.py"), (packaged, packaged / "bench" / "step.py")):
        result_file = str(tmp_path / f"{root.name}.json")
        result = worker_subprocess(lever_worker, result_file, root, overrides=["n_epochs=1"], warmup=1, steps=2)
        assert result == {"overrides": ["n_epochs=1"], "warmup": 1, "steps": 2, "file": str(worker_file)}


def test_scale_ranks_take_the_project_modules_of_either_layout(tmp_path):
    # --scale --versus runs this version's ranks over another version's modules: modeling/distributed.py since the
    # packages, distributed.py before them; the top-level modules keep their names in both.
    (tmp_path / "modeling").mkdir()
    assert module_name(str(tmp_path), "modeling.distributed") == "modeling.distributed"
    assert module_name(str(tmp_path / "flat"), "modeling.distributed") == "distributed"
    assert module_name(str(tmp_path / "flat"), "build") == "build"


@pytest.mark.slow  # two fresh processes (the tiny model's maker and the worker) and their imports: ~40 s
def test_generate_smoke_times_the_sampler_plain_generate_and_every_part_of_an_evaluation():
    result = run_bench("--generate", "--smoke", timeout=900, OMP_NUM_THREADS="1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    sampler = next(line for line in lines if line.startswith("this tree    sampler"))
    assert float(sampler.split()[3]) > 0 and "tokens/s" in sampler and "of bound" in sampler, sampler
    split = next(line.strip() for line in lines if line.strip().startswith("evaluation "))
    shares = [int(share) for share in re.findall(r"\((\d+)%\)", split)]
    # prefill, decode, the rest, the baseline's sampling, log-probs, judging
    assert len(shares) == 6 and abs(sum(shares) - 100) <= 3, split
    plain = next(line for line in lines if "plain generate(do_sample=True)" in line)
    assert float(plain.split()[2]) > 0, plain


def test_vllm_is_refused_without_generate_or_with_smoke(capsys):
    # vLLM's CPU attention takes no tiny model's head size (16): --vllm measures SmolLM2 with --generate only
    from bench.__main__ import main

    for flags in (["--vllm", "python3", "--generate", "--smoke"], ["--vllm", "python3", "--fsdp"]):
        with pytest.raises(SystemExit) as exit:
            main(flags)
        assert exit.value.code == 2, flags
        assert capsys.readouterr().err.splitlines()[-1].endswith("vLLM's CPU attention takes no tiny model's heads")


def test_the_decode_profile_puts_every_lm_head_matmul_in_its_group_and_reports_the_ceiling(tmp_path, capsys):
    """--generate --profile's worker on a random tiny Llama, in-process: every matmul of the LM head ([m, H] @ [H, V])
    is counted in its group and none in the blocks', the groups fit in the sampling's time, and the report's ceiling
    is the tokens over the linear layers' seconds."""
    import transformers

    from bench.decode_profile import decode_profile_worker, report
    from bench.reward import tiny_model_dir

    model_dir = tiny_model_dir(tmp_path / "model")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    (tmp_path / "prompts.json").write_text(json.dumps([[5, 6, 7], [8, 9], [10, 11, 12, 13]]))
    settings = dict(model_dir=model_dir, prompts_file=str(tmp_path / "prompts.json"), batch=4, max_new_tokens=5)
    decode_profile_worker(str(tmp_path / "result.json"), **settings, temperatures=[0.5, 1.0], dtype="float32")
    result = json.loads((tmp_path / "result.json").read_text())
    groups, head_flops = result["groups"], 2 * config.hidden_size * config.vocab_size
    assert 0 < result["tokens"] <= 3 * 2 * 5
    assert groups["LM head"]["flops"] > 0 and groups["LM head"]["flops"] % head_flops == 0
    assert groups["block linears"]["flops"] > 0 and groups["attention"]["seconds"] > 0
    assert sum(group["seconds"] for group in groups.values()) <= result["seconds"]
    report("float32", result, probe=1e11)
    linears = groups["LM head"]["seconds"] + groups["block linears"]["seconds"]
    assert (
        f"ceiling with only the linear layers left: {result['tokens'] / linears:.0f} tokens/s"
        in capsys.readouterr().out
    )
