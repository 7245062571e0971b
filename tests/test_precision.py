import json

import pytest
import torch

from modeling import precision
from modeling.precision import choose_compute_dtype, machine_key, parse_dtype
from utils import REPO_ROOT, UserError


def probe_returning(speedup: float, calls: list):
    def probe() -> dict[str, float]:
        calls.append(speedup)
        return {"float32": 1e11, "bfloat16": speedup * 1e11}

    return probe


@pytest.mark.parametrize("speedup,expected", [(4.0, torch.bfloat16), (1.6, torch.bfloat16), (1.2, None), (0.01, None)])
def test_cpu_choice_follows_the_measured_speedup(monkeypatch, tmp_path, speedup, expected):
    calls = []
    monkeypatch.setattr(precision, "probe_cpu_matmul_flops", probe_returning(speedup, calls))
    dtype, why = choose_compute_dtype(torch.device("cpu"), tmp_path)
    assert dtype == expected and f"bfloat16 matmuls run {speedup:.2g}x as fast as float32" in why
    rates = {"float32": 1e11, "bfloat16": speedup * 1e11}
    assert json.loads((tmp_path / "precision_probe.json").read_text()) == {machine_key(): rates}
    # The answer is kept per machine: the next run does not probe again.
    monkeypatch.setattr(precision, "probe_cpu_matmul_flops", probe_returning(-1.0, calls))
    assert choose_compute_dtype(torch.device("cpu"), tmp_path)[0] == expected and calls == [speedup]


def test_a_damaged_or_foreign_probe_cache_is_measured_again(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(precision, "probe_cpu_matmul_flops", probe_returning(3.0, calls))
    (tmp_path / "precision_probe.json").write_text("{not json")
    assert choose_compute_dtype(torch.device("cpu"), tmp_path)[0] == torch.bfloat16
    (tmp_path / "precision_probe.json").write_text(json.dumps({"another machine": 0.01}))
    assert choose_compute_dtype(torch.device("cpu"), tmp_path)[0] == torch.bfloat16 and calls == [3.0, 3.0]
    rates = {"float32": 1e11, "bfloat16": 3e11}
    assert json.loads((tmp_path / "precision_probe.json").read_text()) == {
        "another machine": 0.01,
        machine_key(): rates,
    }
    (tmp_path / "precision_probe.json").write_text(json.dumps({machine_key(): 3.0}))  # an older file: a speedup only
    assert choose_compute_dtype(torch.device("cpu"), tmp_path)[0] == torch.bfloat16 and calls == [3.0, 3.0, 3.0]


def test_the_probe_measures_real_rates():
    rates = precision.probe_cpu_matmul_flops()
    assert 1e8 < rates["float32"] < 1e14 and 1e6 < rates["bfloat16"] < 1e14


def test_parse_dtype_allows_auto_only_where_asked():
    assert parse_dtype("auto", "model.fsdp_policy_mp", allow_auto=True) == "auto"
    assert parse_dtype("bfloat16", "model.fsdp_policy_mp", allow_auto=True) == torch.bfloat16
    with pytest.raises(
        UserError, match="model.policy_dtype=auto is not a dtype; expected one of float32, bfloat16, float16$"
    ):
        parse_dtype("auto", "model.policy_dtype")
    with pytest.raises(UserError, match="expected one of float32, bfloat16, float16, auto"):
        parse_dtype("fp8", "model.reference_dtype", allow_auto=True)


@pytest.mark.cuda
def test_cuda_choice_follows_bfloat16_support():
    dtype, why = choose_compute_dtype(torch.device("cuda", 0), precision.Path("/nonexistent"))
    native = torch.cuda.is_bf16_supported(including_emulation=False)  # a T4's or V100's emulated bf16 is slow
    assert (dtype == torch.bfloat16) == native and torch.cuda.get_device_name(0) in why


AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}  # an AVX512 CPU made to act AVX2-only


def auto_choice_in_a_fresh_process(cache_dir, env_extra: dict) -> str:
    """What `auto` picks in a new process with env_extra set, through the probe cache in cache_dir."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, pathlib, torch; from modeling import precision; "
        "print(precision.choose_compute_dtype(torch.device('cpu'), pathlib.Path(sys.argv[1]))[0])"
    )
    env = {**{k: v for k, v in os.environ.items() if k not in AVX2_ONLY}, **env_extra}
    result = subprocess.run(
        [sys.executable, "-c", code, str(cache_dir)], capture_output=True, text=True, env=env, cwd=REPO_ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_a_cache_written_with_bf16_kernels_is_not_read_where_they_are_limited_away(tmp_path):
    # The same CPU, the same cache directory: first with its own kernels, then with oneDNN and ATen limited to AVX2
    # (as on the AVX2-only machines of the same name). The second run probes again and its answer is its own.
    native = auto_choice_in_a_fresh_process(tmp_path, {})
    emulated = auto_choice_in_a_fresh_process(tmp_path, AVX2_ONLY)
    entries = json.loads((tmp_path / "precision_probe.json").read_text())
    assert len(entries) == 2, entries  # two keys: one per kernel set
    avx2 = next(rates for key, rates in entries.items() if "capability AVX2" in key and "oneDNN AVX2" in key)
    assert avx2["bfloat16"] < avx2["float32"] and emulated == "None"  # bf16 emulated through float32: slower
    if "avx512_bf16" in precision.cpu_flags() or "amx_bf16" in precision.cpu_flags():
        assert native == "torch.bfloat16"  # native bf16 dot products: several times float32


@pytest.mark.parametrize(
    "speedup, compute, expected",
    [
        (0.0077, torch.bfloat16, "bfloat16 compute, as configured, runs matmuls 130x slower than float32"),  # AVX2
        (0.0077, torch.float32, None),
        (3.0, torch.float32, None),  # bfloat16 merely faster: float32's exactness may be the point
        (3.0, torch.bfloat16, None),
        (20.0, torch.float32, "float32 compute, as configured, runs matmuls 20x slower than bfloat16"),
    ],
)
def test_an_explicit_precision_far_slower_than_autos_choice_gets_one_line(
    monkeypatch, tmp_path, speedup, compute, expected
):
    monkeypatch.setattr(precision, "probe_cpu_matmul_flops", probe_returning(speedup, []))
    chosen = precision.Precision(torch.float32, compute, torch.float32, compute, True, True)
    note = precision.slow_precision_note("bfloat16", chosen, torch.device("cpu"), tmp_path)
    if expected is None:
        assert note is None
    else:
        assert note.startswith(f"precision: {expected} on this CPU (") and "model.fsdp_policy_mp=auto computes" in note
    assert precision.slow_precision_note("auto", chosen, torch.device("cpu"), tmp_path) is None


def test_a_dry_run_in_bfloat16_on_an_avx2_cpu_says_how_slow(run_main, tmp_path, pairs_file):
    # The probe's cache as an AVX2-only CPU leaves it (bfloat16 0.00135 TFLOP/s, float32 0.176): the design card's
    # line model.fsdp_policy_mp=bfloat16 is told, in one line, before it starts a run 130x slower than it could be.
    rates = {"float32": 1.76e11, "bfloat16": 1.35e9}
    (tmp_path / "precision_probe.json").write_text(json.dumps({machine_key(): rates}))
    overrides = ("model=tiny", f"datasets=[{pairs_file}]", f"local_dirs=[{tmp_path}]", "n_eval_examples=8")
    result = run_main("dry_run=true", "model.fsdp_policy_mp=bfloat16", *overrides)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "as configured" in line]
    assert lines == [
        f"precision: bfloat16 compute, as configured, runs matmuls 130x slower than float32 on this CPU "
        f"({precision.cpu_name()}: 0.00135 against 0.176 TFLOP/s, {tmp_path / 'precision_probe.json'}); "
        "model.fsdp_policy_mp=auto computes in float32 here"
    ]
