"""float16 compute with dynamic loss scaling (core/loss_scale.py), on the CPU, where float16 autocast and torch's
GradScaler are real: gradients that underflow in float16 survive with the scale, an overflowing step is skipped
whole and halves the scale, the scale grows after its window, a resumed run scales as the uninterrupted one did,
and float16 trains as float32 does within float16's rounding. `auto`'s choice on each GPU generation."""

import math
from pathlib import Path

import pytest
import torch

from conftest import arithmetic_pairs, build_trainer, policy_state, records, write_jsonl
from core.loss_scale import LossScale, ScaleSettings
from modeling import precision

SETTINGS = ScaleSettings(init=2.0**16, growth_interval=1000, growth_factor=2.0, backoff_factor=0.5, min_scale=1.0)


def float16_gradients(scale: LossScale | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight gradient from a loss 1e-9 of its output's sum, computed in float16 under autocast
    (with the scale, unscaled as a step unscales it), and the same gradient in float32."""
    torch.manual_seed(0)
    layer, x = torch.nn.Linear(16, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = layer(x).float().sum() * 1e-9
    (scale.scale(loss) if scale else loss).backward()
    if scale:
        scale.unscale(torch.optim.SGD(layer.parameters(), lr=0.1))
    half = layer.weight.grad.clone()
    layer.weight.grad = None
    (layer(x).sum() * 1e-9).backward()
    return half, layer.weight.grad


def test_float16_gradients_that_underflow_to_zero_survive_with_the_loss_scaled():
    # d loss / d output = 1e-9 is below float16's smallest subnormal (6e-8): unscaled, every gradient is 0; scaled
    # by 2^16 it is 6.6e-5, and the unscaled float32 gradient equals float32's own to float16's rounding (1e-2).
    unscaled, exact = float16_gradients(None)
    assert exact.abs().min() > 0 and unscaled.abs().max() == 0
    scaled, exact = float16_gradients(LossScale(SETTINGS, torch.device("cpu"), distributed=False))
    torch.testing.assert_close(scaled, exact, rtol=1e-2, atol=0)  # x rounded to 11 bits; sums that cancel


@pytest.fixture
def float16_config(make_config):
    return lambda *overrides: make_config("model.fsdp_policy_mp=float16", *overrides)


def test_an_overflow_skips_exactly_that_step_and_halves_the_scale(float16_config):
    # An inf put into one gradient at step 3, before the scale comes off: step 3 leaves the weights, AdamW's moments
    # and step count and the learning-rate schedule bit-unchanged, the scale halves, the skip is counted, and the
    # run goes on (above the scale's floor an overflow is the scale's, not the run's failure).
    trainer = build_trainer(float16_config("loss_scale.init=1024"))
    scale, seen = trainer.loss_scale, {}
    unscale = scale.unscale

    def state():
        moments = {k: v.clone() for s in trainer.optimizer.state.values() for k, v in s.items() if torch.is_tensor(v)}
        weights = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
        return weights, moments, trainer.scheduler.last_epoch

    def injecting(optimizer):
        step = trainer.batch_counter + 1
        if step == 3:
            seen["before"] = state()
            next(p for p in trainer.policy.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        if step == 4:
            seen["after"] = state()
        unscale(optimizer)

    scale.unscale = injecting
    trainer.train()
    (weights, moments, epoch), (weights_after, moments_after, epoch_after) = seen["before"], seen["after"]
    assert epoch_after == epoch and moments_after.keys() == moments.keys()
    for name, value in {**weights, **moments}.items():
        assert torch.equal({**weights_after, **moments_after}[name], value), name
    train = records(trainer.run_dir, "train")
    assert [r["loss_scale"] for r in train] == [1024, 1024, 512, 512, 512]
    assert [r["counters/skipped_steps"] for r in train] == [0, 0, 1, 1, 1]
    assert [r["nonfinite_steps"] for r in train] == [0, 0, 1, 0, 0]


def test_the_scale_grows_after_its_window_of_finite_steps(float16_config, tmp_path):
    trainer = build_trainer(float16_config("loss_scale.init=256", "loss_scale.growth_interval=2"))
    trainer.train()
    assert [r["loss_scale"] for r in records(trainer.run_dir, "train")] == [256, 512, 512, 1024, 1024]


def test_accumulated_micro_batches_are_scaled_each_and_unscaled_once_a_step(float16_config, tmp_path):
    # 8 pairs a step in 4 micro-batches against one: the same scales, and every step's loss equal to float16's
    # rounding of the micro-batches' layouts (measured: under 2e-4); a scale taken off after each micro-batch, or
    # once per micro-batch, would leave the gradients 4x or 2^-16x off and the losses apart from step 2 on.
    import train

    runs = {}
    for accumulation in (1, 4):
        run_dir = tmp_path / f"ga{accumulation}"
        train.run(float16_config(f"local_run_dir={run_dir}", f"gradient_accumulation_steps={accumulation}"))
        runs[accumulation] = records(run_dir, "train")
    assert [r["loss_scale"] for r in runs[1]] == [r["loss_scale"] for r in runs[4]] == [65536.0] * 5
    differences = [abs(a["loss/train"] - b["loss/train"]) for a, b in zip(runs[1], runs[4])]
    assert max(differences) < 1e-3, differences


def test_a_scale_at_its_floor_that_keeps_overflowing_stops_the_run_naming_float16(float16_config):
    trainer = build_trainer(float16_config("loss_scale.init=2", "loss_scale.min_scale=2", "max_nonfinite_steps=2"))
    unscale = trainer.loss_scale.unscale

    def overflowing(optimizer):
        next(p for p in trainer.policy.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        unscale(optimizer)

    trainer.loss_scale.unscale = overflowing
    with pytest.raises(Exception, match=r"loss scale is at its floor \(2, loss_scale.min_scale\).*bfloat16 or float32"):
        trainer.train()


def test_a_resumed_float16_run_scales_and_trains_as_the_uninterrupted_one(float16_config, tmp_path):
    # The scale's state is a checkpoint part: resumed at step 4 of 10 (growth every 3 steps, so mid-window), every
    # later step's scale, loss and the final weights equal the uninterrupted run's. Scales are powers of 2, so a
    # restarted scale would round no gradient differently: the scales themselves tell a lost state.
    import train

    common = ("eval_every=16", "n_epochs=2", "loss_scale.init=64", "loss_scale.growth_interval=3")
    train.run(float16_config(f"local_run_dir={tmp_path / 'full'}", *common))
    resume = f"resume_from={tmp_path / 'full' / 'step-32'}"
    train.run(float16_config(f"local_run_dir={tmp_path / 'resumed'}", resume, *common))
    full = {r["step"]: r for r in records(tmp_path / "full", "train")}
    resumed = {r["step"]: r for r in records(tmp_path / "resumed", "train")}
    assert sorted(resumed) == [40, 48, 56, 64, 72, 80]
    assert [full[s]["loss_scale"] for s in sorted(full)] == [64, 64, 128, 128, 128, 256, 256, 256, 512, 512]
    for step, record in resumed.items():
        assert record["loss_scale"] == full[step]["loss_scale"] and record["loss/train"] == full[step]["loss/train"]
    before, after = (policy_state(tmp_path / d / "LATEST") for d in ("full", "resumed"))
    for name, value in before.items():
        assert torch.equal(after[name], value), name


def test_float16_trains_as_float32_does_within_its_rounding(make_config, tmp_path):
    # 20 steps of the tiny model, float16 compute (autocast, scaled) against float32: every step's loss within
    # 1e-3 of float32's (measured: 2.5e-5 at most, on an AVX512 EPYC), and the float16 run really rounded (a difference
    # above 1e-6, where float32's reorderings stay near 1e-7).
    import train

    pairs = write_jsonl(tmp_path / "many.jsonl", arithmetic_pairs(170))
    common = (f"datasets=[{pairs}]", "n_eval_examples=10", "eval_every=80")
    losses = {}
    for name, dtype in (("float32", "null"), ("float16", "float16")):
        train.run(make_config(f"local_run_dir={tmp_path / name}", f"model.fsdp_policy_mp={dtype}", *common))
        losses[name] = [r["loss/train"] for r in records(tmp_path / name, "train")]
    assert len(losses["float32"]) == 20
    differences = [abs(a - b) for a, b in zip(losses["float32"], losses["float16"])]
    assert 1e-6 < max(differences) < 1e-3, differences
    assert losses["float16"][-1] < losses["float16"][0] - 0.2


def test_lora_trains_in_float16_with_its_adapters_scaled(make_config):
    # The adapters' float32 gradients flow through float16 autocast like the full model's: scaled, unscaled, stepped.
    import train

    config = make_config("lora.enabled=true", "lora.rank=4", "model.fsdp_policy_mp=float16", "loss_scale.init=512")
    train.run(config)
    train = records(Path(config.local_run_dir), "train")
    assert train[0]["loss/train"] == pytest.approx(math.log(2), abs=1e-6) and train[-1]["loss/train"] < 0.6
    assert [r["loss_scale"] for r in train] == [512] * 5 and train[-1]["counters/skipped_steps"] == 0


@pytest.mark.parametrize(
    ("capability", "bf16", "chosen", "said"),
    [
        ((9, 0), True, torch.bfloat16, "(compute capability 9.0) runs bfloat16 natively"),
        ((8, 0), True, torch.bfloat16, "(compute capability 8.0) runs bfloat16 natively"),
        ((7, 5), False, torch.float16, "(compute capability 7.5) has float16 tensor cores but no native bfloat16"),
        ((7, 0), False, torch.float16, "(compute capability 7.0) has float16 tensor cores"),
        ((6, 1), False, None, "(compute capability 6.1) has neither native bfloat16 nor float16 tensor cores"),
    ],
)
def test_auto_chooses_by_the_gpus_generation(monkeypatch, tmp_path, capability, bf16, chosen, said):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: bf16)
    dtype, why = precision.choose_compute_dtype(torch.device("cuda"), tmp_path)
    assert dtype == chosen and why.startswith("NVIDIA Test GPU") and said in why


def test_loss_scale_settings_are_checked_in_one_line(make_config):
    from utils import UserError

    for overrides, line in [
        (["loss_scale.min_scale=0.5"], "loss_scale.min_scale=0.5 must be 1 or more"),
        (["loss_scale.backoff_factor=1"], "loss_scale.backoff_factor=1.0 must be between 0 and 1"),
        (["loss_scale.growth_factor=1"], "loss_scale.growth_factor=1.0 must be above 1"),
        (["loss_scale.init=2", "loss_scale.min_scale=4"], "loss_scale.min_scale=4 is above loss_scale.init=2"),
        (["model.policy_dtype=float16"], "model.policy_dtype=float16 would keep the trained weights in float16"),
    ]:
        with pytest.raises(UserError, match=line):
            make_config(*overrides)
