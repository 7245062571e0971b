"""The bench package (`python -m bench`): the GPU campaign (--gpu), the scale campaign (--scale), reward modelling
against TRL (--reward), vision-language DPO against TRL (--vision), checkpoints written in the background
(--async-save) and long pairs over sequence-parallel ranks (--long) in their smoke modes, so that they cannot rot
between the sessions that run them; its command line; and the workers of --versus and --scale --versus found in
another version's code, whether it is laid out in packages or flat."""

import math
import os
import re
import subprocess
import sys

import pytest

from bench.common import worker_subprocess
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


@pytest.mark.slow  # three fresh processes (two layouts and TRL) and their imports: ~20 s
def test_gpu_campaign_smoke_runs_every_configuration(tmp_path):
    result = run_bench("--gpu", "--smoke", timeout=600, OMP_NUM_THREADS="2")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    rows = {line[:40].strip(): line[40:].split() for line in lines if line.startswith(("padded", "packed", "TRL"))}
    assert rows["packed, block mask"][0] == "skipped:"  # FlexAttention trains on CUDA only
    for name in ("padded (what TRL computes)", "packed, dense mask", "TRL DPOTrainer (padded, precomputed ref)"):
        pairs_per_second, real_tokens_per_second, _, mfu = rows[name][:4]
        assert float(pairs_per_second) > 0 and float(real_tokens_per_second) > 0, name
        assert 0 < float(mfu.rstrip("%")) < 100 and math.isfinite(float(pairs_per_second)), name
    # the same data: the padded layout computes more positions than the packed one for the same real tokens
    assert float(rows["padded (what TRL computes)"][2]) / float(rows["padded (what TRL computes)"][1]) > float(
        rows["packed, dense mask"][2]
    ) / float(rows["packed, dense mask"][1])
    assert "packed layout (dense attention)" in result.stdout


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
        assert stderr.splitlines()[-1].endswith("at least 1, and only with --versus, --vision or --async-save"), stderr


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
