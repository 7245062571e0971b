"""The objectives (objective.py) through whole runs: closed forms at step 0, SFT, reference-free."""

import math

import pytest
import torch

import train
from configuration.composition import group_options
from conftest import assert_resume_matches_uninterrupted, build_trainer, records
from persistence import checkpoint
from utils import UserError


def test_ipo_first_eval_matches_closed_form(make_config):
    config = make_config("loss=ipo", "loss.beta=0.25", "n_examples=8")
    train.run(config)
    first = records(train.Path(config.local_run_dir), "eval")[0]
    assert first["loss/eval"] == pytest.approx(1 / (2 * 0.25) ** 2)  # (0 - 1/(2 beta))^2 when policy == reference


@pytest.mark.parametrize("cached", [True, False])
def test_kto_starts_at_its_closed_form_with_a_zero_kl_estimate(make_config, cached):
    # At step 0 the policy is the reference: z0 = 0 on the mismatched examples (exactly, their cached reference
    # log-probs computed as the policy computes them), and every response scores lambda / 2: (1 + 3) / 4 per pair.
    overrides = ("loss=kto", "loss.undesirable_weight=3.0", "n_examples=8", f"reference_cache={str(cached).lower()}")
    config = make_config(*overrides)
    train.run(config)
    evals = records(train.Path(config.local_run_dir), "eval")
    assert evals[0]["kl/eval"] == 0.0 and evals[0]["loss/eval"] == pytest.approx(1.0, abs=1e-7)
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"]


@pytest.mark.parametrize(
    "loss, reference", [("kto", "cached"), ("kto", "live"), ("kto", "LoRA's base"), ("apo_zero_unpaired", "cached")]
)
def test_unpaired_losses_on_labelled_completions_start_at_their_closed_form(
    make_config, labelled_file, loss, reference
):
    # Thumbs up or down on single answers: at step 0 (log-ratios 0; for kto, z0 = 0) each completion scores
    # lambda / 2: 1/2 for the desirable half of the held-out prompts' completions and 3/2 for the other half, 1 on
    # average; rewards 0.
    how = {"cached": (), "live": ("reference_cache=false",), "LoRA's base": ("lora.enabled=true", "lr=1e-2")}
    overrides = (f"loss={loss}", "loss.undesirable_weight=3.0", *how[reference])
    config = make_config(f"datasets=[{labelled_file}]", "n_examples=16", *overrides)
    train.run(config)
    evals = records(train.Path(config.local_run_dir), "eval")
    assert evals[0]["loss/eval"] == pytest.approx(1.0, abs=1e-7)
    assert evals[0].get("kl/eval") == (0.0 if loss == "kto" else None)
    assert evals[0]["rewards_eval/chosen"] == 0.0 and evals[0]["rewards_eval/rejected"] == 0.0
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"]
    # desirable answers end above undesirable ones: each column averaged over its own examples only (NaN elsewhere)
    assert evals[-1]["rewards_eval/chosen"] > evals[-1]["rewards_eval/rejected"]


def test_a_last_eval_batch_of_one_joins_the_one_before_for_kto(make_config):
    # one example alone has no mismatched partner for the KL estimate
    assert [len(b) for b in build_trainer(make_config("n_eval_examples=9")).data.eval_batches] == [8, 1]
    assert [len(b) for b in build_trainer(make_config("n_eval_examples=9", "loss=kto")).data.eval_batches] == [9]


def test_labelled_completions_train_only_unpaired_losses(make_config, labelled_file):
    expected = r"hold labelled completions \(prompt, completion, label\): only loss=kto and loss=apo_zero_unpaired "
    with pytest.raises(UserError, match=expected):
        train.run(make_config(f"datasets=[{labelled_file}]", "loss=dpo"))


def test_sft_trains_on_chosen_and_needs_no_reference(make_config):
    config = make_config("loss=sft", "n_examples=16")
    train.run(config)
    evals = records(train.Path(config.local_run_dir), "eval")
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"]
    assert evals[0]["loss/eval"] == pytest.approx(-evals[0]["logps_eval/chosen"])
    assert "rewards_eval/chosen" not in evals[0]


def test_reference_free_rewards_are_policy_logps(make_config):
    config = make_config("loss.reference_free=true", "n_examples=8")
    train.run(config)
    first = records(train.Path(config.local_run_dir), "eval")[0]
    assert first["rewards_eval/chosen"] == pytest.approx(0.1 * first["logps_eval/chosen"], rel=1e-5)


@pytest.mark.parametrize("loss", group_options()["loss"])
def test_every_loss_trains_from_the_command_line(tmp_path, pairs_file, run_main, loss):
    run_dir = tmp_path / "run"
    result = run_main(
        "model=tiny",
        f"loss={loss}",
        f"datasets={pairs_file}",
        f"local_run_dir={run_dir}",
        f"local_dirs=[{tmp_path}]",
        "wandb.enabled=false",
        "n_examples=16",
        "n_eval_examples=8",
        "eval_every=8",
        "lr=1e-3",
        "warmup_steps=0",
        "plots=false",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # A reference is scored (cached) exactly when the loss reads one.
    assert ("reference log-probs: computing" in result.stdout) == needs_reference(loss)
    evals = records(run_dir, "eval")
    assert [r["step"] for r in evals] == [0, 8, 16]
    assert all(math.isfinite(r["loss/eval"]) for r in evals)
    assert checkpoint.describe(run_dir / "LATEST") is not None


def needs_reference(loss: str) -> bool:
    import config
    from core.objective import build_objective

    return build_objective(config.load(["model=tiny", f"loss={loss}"]).loss).needs_reference


def test_bco_pair_resumes_with_its_running_reward_mean(make_config, tmp_path):
    # The reward mean is checkpointed (objective.pt): a resumed run continues with the same shift.
    assert_resume_matches_uninterrupted(make_config, tmp_path, "loss=bco_pair")
    state = torch.load(tmp_path / "full" / "step-32" / "objective.pt", weights_only=True)["state"]
    assert state["rewards_seen"] == 2 * 32 and state["reward_mean"] != 0
