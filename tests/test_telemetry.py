"""Throughput telemetry (telemetry.py): useful FLOPs written out by hand, device peaks, and the rates a run logs."""

import json

import pytest
import torch
import transformers

from reporting import telemetry
from reporting.telemetry import ModelFlops, PeakRate, Throughput, peak_flops, real_tokens, scored_tokens, visible_pairs

# prompt 3, chosen 2, rejected 1 tokens
EXAMPLE = {"prompt": [1, 2, 3], "responses": [[4, 5], [6]]}


def test_an_examples_tokens_and_visible_pairs():
    assert real_tokens(EXAMPLE) == 6 and scored_tokens(EXAMPLE) == 3
    # prompt: 1 + 2 + 3; chosen: (3 + 1) + (3 + 2); rejected: 3 + 1
    assert visible_pairs(EXAMPLE) == 6 + 9 + 4
    no_prompt = {"prompt": [], "responses": [[4, 5], [6]]}
    assert scored_tokens(no_prompt) == 1 and visible_pairs(no_prompt) == 3 + 1  # nothing predicts a first token


def test_useful_flops_of_an_example():
    n, trainable, layers, width, hidden, vocab = 1000, 10, 2, 8, 16, 50
    flops = ModelFlops(n, trainable, layers, width, hidden, vocab, head_trains=False)
    attention = 4 * width * layers * 19  # QK^T and AV over the 19 visible pairs, each layer
    head = 2 * hidden * vocab * 3
    trained = (2 * n + 2 * n + 2 * trainable) * 6 + 3 * attention + 2 * head  # a frozen head: no weight gradient
    assert flops.example(EXAMPLE, live_reference=False) == trained
    assert flops.example(EXAMPLE, live_reference=True) == trained + 2 * n * 6 + attention + head
    full = ModelFlops(n, n, layers, width, hidden, vocab, head_trains=True)
    assert full.example(EXAMPLE, False) == 6 * n * 6 + 3 * attention + 3 * head  # 6N per token when all trains


def test_model_flops_of_a_llama_with_and_without_lora():
    from modeling.adapters import LoraSettings, apply_lora

    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=259,
        head_dim=16,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    flops = ModelFlops.of(model, list(model.model.layers))
    blocks = sum(p.numel() for p in model.model.layers.parameters())
    assert (flops.block_parameters, flops.trainable_block_parameters, flops.layers) == (blocks, blocks, 2)
    assert (flops.attention_width, flops.hidden, flops.vocab, flops.head_trains) == (4 * 16, 32, 259, True)
    lora = apply_lora(model, LoraSettings(True, 4, 8, 0.0, None, None))
    adapted = ModelFlops.of(lora, list(lora.base_model.model.model.layers))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert adapted.trainable_block_parameters == adapters and adapted.block_parameters == blocks + adapters
    assert not adapted.head_trains


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
        ("NVIDIA L40S", 362),
        ("NVIDIA L40", 181),
        ("NVIDIA L4", 121),
        ("NVIDIA A10", 125),
    ],
)
def test_gpu_peaks_by_name(monkeypatch, name, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(telemetry, "measured_matmul_flops", lambda device, dtype: pytest.fail("not measured"))
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16, None) == PeakRate(
        tflops * 1e12, f"{name}'s datasheet bfloat16 peak"
    )


def test_unknown_gpus_and_other_dtypes_are_measured(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    monkeypatch.setattr(telemetry, "measured_matmul_flops", lambda device, dtype: 1.5e14)
    assert peak_flops(torch.device("cuda", 0), torch.bfloat16, None).flops == 1.5e14
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert peak_flops(torch.device("cuda", 0), torch.float32, None).flops == 1.5e14  # TF32, not in the table


def test_a_cpus_peak_is_the_precision_probes_rate(tmp_path):
    from modeling.precision import machine_key

    (tmp_path / "precision_probe.json").write_text(json.dumps({machine_key(): {"float32": 1e11, "bfloat16": 4e11}}))
    assert peak_flops(torch.device("cpu"), torch.bfloat16, tmp_path).flops == 4e11
    assert peak_flops(torch.device("cpu"), torch.float32, tmp_path).flops == 1e11


def test_throughput_rates():
    speed = Throughput(peak=PeakRate(1e12, "given"), devices=2, device=torch.device("cpu"))
    speed.add(seconds=1.5, pairs=3, computed_tokens=90, real_tokens=60, scored_tokens=30, flops=6e11)
    speed.add(seconds=0.5, pairs=1, computed_tokens=10, real_tokens=20, scored_tokens=10, flops=4e11)
    rates = speed.rates()
    assert rates["perf/pairs_per_second"] == 2 and rates["perf/computed_tokens_per_second"] == 50
    assert rates["perf/real_tokens_per_second"] == 40 and rates["perf/scored_tokens_per_second"] == 20
    assert rates["perf/mfu"] == 1e12 / (2 * 2 * 1e12)
    assert 0 < rates["perf/peak_rss_gib"] < 64


def test_a_measured_peak_that_training_beats_is_measured_again_and_mfu_never_exceeds_one(tmp_path, monkeypatch):
    # The probe ran while the machine was loaded: 1e9 FLOP/s cached. Training then does 4e9 useful FLOP/s: the
    # probe runs again (once), the faster rate is kept and cached, and MFU is against it. Where even that is beaten,
    # no MFU is reported rather than one above 100%.
    from modeling import precision

    (tmp_path / "precision_probe.json").write_text(
        json.dumps({precision.machine_key(): {"float32": 1e9, "bfloat16": 1e7}})
    )
    probes = []
    monkeypatch.setattr(
        precision, "probe_cpu_matmul_flops", lambda: probes.append(1) or {"float32": 8e9, "bfloat16": 2e6}
    )
    peak = peak_flops(torch.device("cpu"), torch.float32, tmp_path)
    assert peak.flops == 1e9 and not probes
    speed = Throughput(peak, devices=1, device=torch.device("cpu"))
    speed.add(seconds=1.0, pairs=1, computed_tokens=1, real_tokens=1, scored_tokens=1, flops=4e9)
    assert speed.rates()["perf/mfu"] == 0.5 and len(probes) == 1
    assert json.loads((tmp_path / "precision_probe.json").read_text())[precision.machine_key()] == {
        "float32": 8e9, "bfloat16": 1e7,
    }  # fmt: skip
    assert "MFU 50.00% of 0.008 TFLOP/s per device x 1" in speed.describe()
    speed.add(seconds=0.0, pairs=0, computed_tokens=0, real_tokens=0, scored_tokens=0, flops=8e9)  # 12e9 FLOP/s
    assert "perf/mfu" not in speed.rates() and len(probes) == 1  # measured again once per run, not per interval
    assert "MFU not reported: training ran faster than the peak of 0.008 TFLOP/s per device" in speed.describe()
