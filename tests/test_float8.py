"""FP8 matmuls (model.fp8, modeling/float8.py) on the CPU through torchao's emulation: which layers convert, ln 2 at
step one against the converted policy's own cached log-probs, close to bfloat16, a resumed run equal to the
uninterrupted one, exports that load without torchao, and every refusal in one line."""

import math
import sys

import pytest
import torch
from torch import nn

from conftest import assert_resume_matches_uninterrupted, records
from modeling.float8 import convert_float8, converts, float8_problem
from utils import UserError

pytest.importorskip("torchao.float8", reason="torchao (requirements-dev.txt) emulates float8 on a CPU")


def test_the_lm_head_routers_and_odd_sizes_stay_as_they_are():
    head = nn.Linear(64, 100)
    assert converts(nn.Linear(64, 128), "model.layers.0.self_attn.q_proj", head)
    assert not converts(head, "lm_head", head)
    assert not converts(nn.Linear(64, 8), "model.layers.0.mlp.gate", head)  # Qwen-MoE's router
    assert not converts(nn.Linear(64, 8), "model.layers.0.block_sparse_moe.gate", head)
    assert not converts(nn.Linear(64, 8), "model.layers.0.mlp.router", head)
    assert not converts(nn.Linear(60, 128), "model.layers.0.mlp.down_proj", head)  # 60 is no multiple of 16
    assert not converts(nn.Embedding(10, 64), "model.embed_tokens", head)


def test_step_one_is_ln_2_against_the_converted_policys_own_cache(make_config, tmp_path, capsys):
    # A float32 run fills the reference cache first; the rowwise run after it in the same cache directory must not
    # read those numbers (float8 is part of the computation's key): its cached reference is the converted initial
    # policy's, and rowwise scales (per token, per output) make a token's log-prob independent of its batch, so step
    # one is exactly ln 2. Every linear layer but the LM head computes in float8.
    import train

    train.run(make_config(f"local_run_dir={tmp_path / 'plain'}"))
    capsys.readouterr()
    train.run(make_config(f"local_run_dir={tmp_path / 'fp8'}", "model.fp8=rowwise"))
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("model.fp8")]
    steps = records(tmp_path / "fp8", "train")
    assert steps[0]["loss/train"] == pytest.approx(math.log(2), abs=1e-7)
    assert steps[-1]["loss/train"] < 0.35
    assert said == [
        "model.fp8=rowwise: 14 of 15 linear layers compute in float8 (emulated on the CPU (correctness, not speed)); "
        "the LM head and routers keep the compute dtype"
    ]


def test_float8_trains_close_to_bfloat16(make_config, tmp_path):
    # Float8's 3 mantissa bits (e4m3) against bfloat16's 7, each with float32 master weights: every step's loss
    # within 0.01 of bfloat16's over 5 steps (measured: under 2e-3); tensorwise, one scale per tensor.
    import train

    losses = {}
    for name, overrides in (("bf16", ()), ("fp8", ("model.fp8=tensorwise",))):
        run_dir = tmp_path / name
        train.run(make_config(f"local_run_dir={run_dir}", "model.fsdp_policy_mp=bfloat16", *overrides))
        losses[name] = [r["loss/train"] for r in records(run_dir, "train")]
    differences = [abs(a - b) for a, b in zip(losses["bf16"], losses["fp8"])]
    assert len(differences) == 5 and 1e-6 < max(differences) < 1e-2, differences


def test_a_resumed_float8_run_equals_the_uninterrupted_one(make_config, tmp_path):
    assert_resume_matches_uninterrupted(make_config, tmp_path, "model.fp8=tensorwise")


def test_a_float8_runs_export_is_plain_and_loads_without_torchao(make_config, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import train

    train.run(make_config("model.fp8=rowwise"))
    export = tmp_path / "run" / "LATEST"
    monkeypatch.setitem(sys.modules, "torchao", None)  # an import of torchao now fails
    model = AutoModelForCausalLM.from_pretrained(export)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["model.fp8=e4m3"], "model.fp8=e4m3 is not a float8 recipe; expected tensorwise, rowwise or null"),
        (["model.fp8=rowwise", "lora.enabled=true"], "model.fp8=rowwise with lora.enabled=true: float8 converts"),
        (["model.fp8=rowwise", "trainer=TensorParallelTrainer"], "model.fp8=rowwise with tensor parallelism"),
    ],
)
def test_float8_settings_it_cannot_take_are_one_line(make_config, overrides, line):
    with pytest.raises(UserError, match=line):
        make_config(*overrides)


def test_float8_without_torchao_is_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert float8_problem("tensorwise", False, False, False) == (
        "model.fp8=tensorwise needs torchao: pip install torchao (docs/configuration.md#optional-packages)"
    )


def test_a_gpu_without_float8_tensor_cores_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(UserError, match=r"NVIDIA A100-SXM4-80GB \(compute capability 8.0\) has no float8 tensor"):
        convert_float8(nn.Sequential(nn.Linear(16, 16)), "tensorwise", torch.device("cuda"), fsdp=False)
