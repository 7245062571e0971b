import json

import pytest
import torch

import precision
from precision import choose_compute_dtype, machine_key, parse_dtype
from utils import UserError


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
