"""TR-DPO's moving reference (reference_sync.py): the update rule, a hard update each step (ln 2 at every step),
cached and live references alike, resume across an update, LoRA's reference adapter, the config's checks."""

import math
from pathlib import Path

import pytest
import torch

import train
from conftest import assert_same_metrics, assert_same_weights, build_trainer, read_jsonl, records
from modeling.adapters import REFERENCE_ADAPTER, ReferenceAdapter
from modeling.reference_sync import mix, weight_pairs
from utils import UserError

LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.dropout=0")
LN2 = torch.tensor(math.log(2)).item()  # float32's ln 2, as a loss is logged


def test_an_update_is_alpha_policy_plus_one_minus_alpha_reference():
    # Quarters, halves and their sums are exact in float32: the closed form holds to the bit.
    reference, policy = torch.tensor([1.0, -2.0, 0.5, 4.0]), torch.tensor([3.0, 2.0, -0.5, 0.0])
    mix({"w": (reference, policy)}, 0.25)
    assert reference.tolist() == [1.5, -1.0, 0.25, 3.0]  # 0.25 * policy + 0.75 * reference
    # alpha = 1 copies the policy exactly, whatever the values
    reference, policy = torch.randn(64, 32), torch.randn(64, 32)
    mix({"w": (reference, policy)}, 1.0)
    assert torch.equal(reference, policy)
    # a reference in another dtype (model.reference_dtype) is mixed in float32 and rounded once
    reference, policy = torch.randn(16).bfloat16(), torch.randn(16)
    expected = (reference.float() * 0.4 + policy * 0.6).bfloat16()
    mix({"w": (reference, policy)}, 0.6)
    assert torch.equal(reference, expected)
    with pytest.raises(RuntimeError, match="the reference's w is not placed like the policy's"):
        mix({"w": (torch.zeros(3), torch.zeros(4))}, 0.5)


@pytest.mark.parametrize("adapters", [(), LORA], ids=["full", "lora"])
def test_a_hard_update_after_every_step_starts_each_step_at_ln_2(make_config, adapters):
    # Right after a hard update (alpha = 1) the reference is the policy, so the next step's forward, before its
    # optimizer step, has every log-ratio at 0: each pair's loss is exactly ln 2, at every step and every eval, while
    # the policy trains. The first step reads the cached log-probs of the initial weights, the later ones the moved
    # reference live: a stale cached number would not give ln 2.
    sync = ("reference_sync_steps=1", "reference_mixup_alpha=1.0", "n_examples=24", "debug=true")  # no checkpoints
    trainer = build_trainer(make_config(*sync, *adapters))
    initial = {name: policy.detach().clone() for name, (_, policy) in weight_pairs(*owners(trainer)).items()}
    trainer.train()
    trainer.evaluate()
    losses = [r["loss/train"] for r in records(trainer.run_dir, "train")]
    evals = [r["loss/eval"] for r in records(trainer.run_dir, "eval")]
    assert losses == [LN2] * 3 and evals == [LN2] * 3  # at 0, 16 and 24 examples
    assert moves(trainer.run_dir) == [(8, 1), (16, 2), (24, 3)]
    pairs = weight_pairs(*owners(trainer))
    assert all(torch.equal(reference, policy) for reference, policy in pairs.values())  # a copy
    assert any(not torch.equal(policy, initial[name]) for name, (_, policy) in pairs.items())  # it trained


def moves(run_dir: Path) -> list[tuple[int, int]]:
    """(examples seen, updates so far) of each update the run logged."""
    log = read_jsonl(run_dir / "metrics.jsonl")
    return [(r["step"], r["reference/updates"]) for r in log if "reference/updates" in r]


def owners(trainer) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the policy, the model holding the reference's moving weights: the reference model, or the LoRA policy)."""
    lora = isinstance(trainer.reference_model, ReferenceAdapter)
    return trainer.policy, trainer.policy if lora else trainer.reference_model


def test_without_updates_the_loss_leaves_ln_2(make_config):
    # The control of the test above: with a fixed reference only the first step is at ln 2.
    trainer = build_trainer(make_config())
    losses = [
        trainer.train_step(trainer.data.train_examples.take(indices))["loss/train"]
        for indices in trainer.data.schedule[:2]
    ]
    assert losses[0] == [LN2] * 8 and all(loss != LN2 for loss in losses[1])


# LoRA's in the slow suite: its reference adapter is read from the cache, then live, in the ln 2 test above, and
# checkpointed and resumed in tests/test_distributed.py's moving-reference test
@pytest.mark.parametrize("adapters", [(), pytest.param(LORA, marks=pytest.mark.slow)], ids=["full", "lora"])
def test_cached_live_and_resumed_runs_are_one_run(make_config, tmp_path, capsys, adapters):
    # Soft updates after steps 2 and 4 of 5. Cached (the default): the initial weights' log-probs serve the two steps
    # and the eval before the first update (16 training pairs and the 8 held out: 20 distinct, where the whole run
    # has 35), and are never read after it: the same run as with the reference scored live throughout. Resumed from
    # the checkpoint after step 3, which holds the reference moved once, and on past the second update: the same run.
    sync = ("reference_sync_steps=2", "reference_mixup_alpha=0.6", "save_every=24", *adapters)
    train.run(make_config(f"local_run_dir={tmp_path / 'cached'}", *sync))
    assert "reference log-probs: computing 20 of 20 pairs" in capsys.readouterr().out
    train.run(make_config(f"local_run_dir={tmp_path / 'live'}", "reference_cache=false", *sync))
    step_24 = tmp_path / "cached" / "step-24"
    assert (step_24 / "reference").is_dir()
    train.run(make_config(f"local_run_dir={tmp_path / 'resumed'}", f"resume_from={step_24}", *sync))
    assert moves(tmp_path / "cached") == [(16, 1), (32, 2)] and moves(tmp_path / "resumed") == [(32, 2)]
    cached = read_jsonl(tmp_path / "cached" / "metrics.jsonl")
    assert_same_metrics(cached, read_jsonl(tmp_path / "live" / "metrics.jsonl"))
    assert_same_metrics([r for r in cached if r["step"] > 24], read_jsonl(tmp_path / "resumed" / "metrics.jsonl"))
    for name in ("live", "resumed"):
        assert_same_weights(tmp_path / "cached", tmp_path / name)


def test_a_checkpoint_without_a_reference_leaves_it_as_built(make_config, tmp_path, capsys):
    # A run without reference_sync_steps writes no reference/: resumed with updates, its reference is the one built
    # (the initial weights, which is what it had), and a line says so.
    fixed = build_trainer(make_config(f"local_run_dir={tmp_path / 'fixed'}"))
    fixed.example_counter = 8
    fixed.save(fixed.run_dir / "step-8", {})
    step_8 = fixed.run_dir / "step-8"
    assert not (step_8 / "reference").exists()
    resumed = build_trainer(make_config("reference_sync_steps=2", f"resume_from={step_8}"))
    assert f"resume: {step_8} holds no reference/ (written by a run without it): the reference is as built" in (
        capsys.readouterr().out
    )
    assert resumed.synced.updates == 0 and resumed.example_counter == 8


def test_lora_reference_is_the_base_with_the_reference_adapter(make_config):
    trainer = build_trainer(make_config("reference_sync_steps=2", "reference_mixup_alpha=0.6", *LORA))
    policy, reference = trainer.policy, trainer.reference_model
    pairs = weight_pairs(policy, policy)
    assert pairs and all(f".{REFERENCE_ADAPTER}." in name for name in pairs)
    # it starts as a frozen copy of the policy's adapters (B = 0: the base), outside the optimizer
    assert all(torch.equal(r, p) and not r.requires_grad and p.requires_grad for r, p in pairs.values())
    trained = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not trained & {id(r) for r, _ in pairs.values()}
    for indices in trainer.data.schedule[:2]:
        trainer.train_step(trainer.data.train_examples.take(indices))
    before = {name: r.detach().clone() for name, (r, _) in pairs.items()}
    trainer.synced.update(1)
    for name, (r, p) in pairs.items():  # each factor: 0.6 A + 0.4 A_ref, 0.6 B + 0.4 B_ref
        torch.testing.assert_close(r, 0.4 * before[name] + 0.6 * p, rtol=1e-6, atol=0, msg=name)
    # The reference computes as the policy would with the reference's factors in its own adapter.
    batch = trainer.scorer.batch(trainer.data.train_examples.take(range(8)))
    policy.eval()
    with torch.no_grad():
        scored = trainer.scorer(reference, batch, None)
        own = trainer.scorer(policy, batch, None)
        for r, p in pairs.values():
            r_value = r.detach().clone()
            r.copy_(p), p.copy_(r_value)
        swapped = trainer.scorer(policy, batch, None)
    assert torch.equal(scored, swapped) and (scored - own).abs().max() > 1e-4


def test_the_dry_run_and_the_run_say_how_the_reference_moves(make_config, run_main, tmp_path, pairs_file):
    result = run_main(
        "model=tiny", f"datasets=[{pairs_file}]", f"local_dirs=[{tmp_path}]", "wandb.enabled=false",
        "n_eval_examples=8", "batch_size=8", "dry_run=true", "reference_sync_steps=2",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    line = (
        "reference: TR-DPO, the reference's weights <- 0.6 x policy + 0.4 x reference after every 2 optimizer steps: "
        "2 updates in 5 steps, the reference scored live after the first (cached log-probs of the initial weights "
        "before it)"
    )
    assert line in result.stdout


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["loss=simpo"], "reference_sync_steps=2 moves the reference towards the policy, but loss=simpo reads no"),
        (["loss.reference_free=true"], "reference_sync_steps=2 moves the reference towards the policy, but loss=dpo"),
        (
            ["rounds.n=2", "rounds.reward=tests.round_rewards:lowercase_letters"],
            "reference_sync_steps=2 with rounds.n=2: each round's reference is the policy that starts it",
        ),
        (["reference_mixup_alpha=0"], r"reference_mixup_alpha=0.0 must be in \(0, 1\]"),
        (["reference_mixup_alpha=1.5"], r"reference_mixup_alpha=1.5 must be in \(0, 1\]"),
    ],
)
def test_reference_sync_config_errors(make_config, overrides, message):
    with pytest.raises(UserError, match=message):
        make_config("reference_sync_steps=2", *overrides)


def test_reference_sync_steps_must_be_positive_or_null(make_config):
    with pytest.raises(UserError, match=r"reference_sync_steps=0 must be positive, or null to keep the reference"):
        make_config("reference_sync_steps=0")
    assert make_config("reference_sync_steps=null").reference_sync_steps is None
