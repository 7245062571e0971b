import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

import train
from conftest import arithmetic_pairs, read_jsonl, run_cli, tiny_run_overrides, write_jsonl
from models import load_model, load_tokenizer
from preference_datasets import get_dataset
from trainers import BasicTrainer, FSDPTrainer, build_optimizer
from utils import UserError, free_port, init_distributed


def build_trainer(config, run_dir=None, trainer_class=BasicTrainer):
    """A trainer as train.run builds it, without training."""
    run_dir = run_dir or train.prepare_run_dir(config)
    tokenizer = load_tokenizer(config.model, run_dir)
    data = get_dataset(config.datasets[0], tokenizer, config.seed, config.n_eval_examples, run_dir)
    policy = load_model(config.model, torch.float32, run_dir, config.seed)
    return trainer_class(config, policy, lambda: load_model(config.model, torch.float32, run_dir, config.seed), tokenizer, data, run_dir)


def records(run_dir, split):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if f"loss/{split}" in r]


def test_first_step_loss_is_ln2_with_zero_rewards(make_config):
    trainer = build_trainer(make_config())
    examples = [trainer.train_examples[i] for i in trainer.schedule[0]]
    metrics = trainer.train_step(examples)
    assert metrics["loss/train"] == pytest.approx([math.log(2)] * 8, abs=1e-6)
    assert max(map(abs, metrics["rewards_train/chosen"] + metrics["rewards_train/rejected"])) < 1e-6
    assert metrics["grad_norm"][0] > 0
    assert metrics["lr"] == [trainer.config.lr]  # warmup_steps=0: the full rate from the first step


def test_warmup_is_linear_in_optimizer_steps(make_config):
    trainer = build_trainer(make_config("warmup_steps=3"))
    rates = [trainer.train_step([trainer.train_examples[i] for i in indices])["lr"][0] for indices in trainer.schedule[:5]]
    assert rates == pytest.approx([c * trainer.config.lr for c in (1 / 4, 2 / 4, 3 / 4, 1, 1)])


def test_gradient_accumulation_matches_full_batch(make_config):
    # With SGD at lr 1 and no clipping, the update equals the gradient, so equal parameters mean equal gradients.
    base = ("optimizer=SGD", "lr=1.0", "max_grad_norm=1e9")
    full = build_trainer(make_config(*base))
    accumulated = build_trainer(make_config(*base, "gradient_accumulation_steps=4", "local_run_dir=" + str(full.run_dir) + "_ga"))
    for step in range(2):
        indices = full.schedule[step]
        full_metrics = full.train_step([full.train_examples[i] for i in indices])
        accumulated_metrics = accumulated.train_step([accumulated.train_examples[i] for i in indices])
        assert accumulated_metrics["loss/train"] == pytest.approx(full_metrics["loss/train"], abs=1e-6)
        assert accumulated_metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=1e-5)
    for (name, a), b in zip(full.policy.named_parameters(), accumulated.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_run_logs_train_and_eval_with_final_eval(make_config):
    config = make_config("eval_every=24")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    evals, trains = records(run_dir, "eval"), records(run_dir, "train")
    # 48 pairs, 8 held out -> 40 train -> 5 steps of 8; evals at 0 and 24 examples, and a final one at 40
    assert [r["step"] for r in evals] == [0, 24, 40]
    assert [r["step"] for r in trains] == [8, 16, 24, 32, 40]
    assert evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"] and evals[-1]["rewards_eval/accuracies"] > 0.5
    for name in ("rewards_train/chosen", "rewards_train/rejected", "rewards_train/accuracies", "rewards_train/margins",
                 "logps_train/chosen", "logps_train/rejected", "grad_norm", "lr", "examples_per_second", "tokens_per_second",
                 "counters/examples", "counters/updates"):
        assert name in trains[0], name
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["LATEST", "step-24"]
    saved = torch.load(run_dir / "step-24" / "policy.pt", weights_only=True)
    assert saved["step_idx"] == 24 and saved["metrics"]["loss/eval"] == evals[1]["loss/eval"]
    assert OmegaConf.load(run_dir / "config.yaml").local_run_dir == str(run_dir)


def test_metrics_are_averaged_over_the_log_interval(make_config, tmp_path):
    every_step = make_config(f"local_run_dir={tmp_path / 'every'}")
    interval = make_config(f"local_run_dir={tmp_path / 'interval'}", "minimum_log_interval_secs=1e9")
    train.run(every_step)
    train.run(interval)
    per_step, [aggregated] = records(tmp_path / "every", "train"), records(tmp_path / "interval", "train")
    assert aggregated["counters/examples"] == 40
    for name in ("loss/train", "rewards_train/margins", "grad_norm"):
        assert aggregated[name] == pytest.approx(sum(r[name] for r in per_step) / len(per_step), rel=1e-5)


def test_resume_matches_uninterrupted(make_config, tmp_path):
    full = make_config(f"local_run_dir={tmp_path / 'full'}", "eval_every=16", "n_epochs=2")
    train.run(full)
    resumed = make_config(f"local_run_dir={tmp_path / 'resumed'}", "eval_every=16", "n_epochs=2", f"resume_from={tmp_path / 'full' / 'step-32'}")
    train.run(resumed)
    full_losses = {r["step"]: r["loss/train"] for r in records(tmp_path / "full", "train")}
    resumed_losses = {r["step"]: r["loss/train"] for r in records(tmp_path / "resumed", "train")}
    assert sorted(resumed_losses) == [40, 48, 56, 64, 72, 80]
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(full_losses[step], abs=1e-6)
    a = torch.load(tmp_path / "full" / "LATEST" / "policy.pt", weights_only=True)["state"]
    b = torch.load(tmp_path / "resumed" / "LATEST" / "policy.pt", weights_only=True)["state"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_ipo_first_eval_matches_closed_form(make_config):
    config = make_config("loss=ipo", "loss.beta=0.25", "n_examples=8")
    train.run(config)
    first = records(train.Path(config.local_run_dir), "eval")[0]
    assert first["loss/eval"] == pytest.approx(1 / (2 * 0.25) ** 2)  # (0 - 1/(2 beta))^2 when policy == reference


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


def test_sampling_during_eval_strips_prompt(make_config):
    config = make_config("sample_during_eval=true", "n_eval_model_samples=3", "generation.max_new_tokens=5", "n_examples=8")
    train.run(config)
    samples = read_jsonl(train.Path(config.local_run_dir) / "samples.jsonl")
    assert len(samples) == 6 and {s["step"] for s in samples} == {0, 8}
    for sample in samples:
        assert sample["prompt"].startswith("Q: ")
        assert not sample["policy"].startswith("Q: ") and len(sample["policy"]) <= 5 * 4  # <= 5 byte tokens


def test_activation_checkpointing_recomputes_blocks_and_gives_same_step(make_config, tmp_path):
    plain = build_trainer(make_config(f"local_run_dir={tmp_path / 'a'}"))
    checkpointed = build_trainer(make_config(f"local_run_dir={tmp_path / 'b'}", "activation_checkpointing=true"))
    calls = {"plain": 0, "checkpointed": 0}
    plain.policy.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("plain", calls["plain"] + 1))
    checkpointed.policy.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("checkpointed", calls["checkpointed"] + 1))
    examples = [plain.train_examples[i] for i in plain.schedule[0]]
    plain_metrics, checkpointed_metrics = plain.train_step(examples), checkpointed.train_step(examples)
    assert calls == {"plain": 1, "checkpointed": 2}  # the block's forward runs again in the backward pass
    assert checkpointed_metrics["loss/train"] == pytest.approx(plain_metrics["loss/train"], abs=1e-7)
    assert checkpointed_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=1e-6)
    for a, b in zip(plain.policy.parameters(), checkpointed.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    assert list(plain.policy.state_dict()) == list(checkpointed.policy.state_dict())


def test_mixed_precision_autocast_runs_in_bfloat16(make_config):
    trainer = build_trainer(make_config("model.fsdp_policy_mp=bfloat16"))
    seen = []
    trainer.policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    metrics = trainer.train_step([trainer.train_examples[i] for i in trainer.schedule[0]])
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    assert metrics["loss/train"][0] == pytest.approx(math.log(2), abs=0.05)


PADDED_BASELINE = ("layout=padded", "scored_logits_only=false", "reference_cache=false")


def test_default_levers_equal_the_padded_run_step_by_step(make_config, tmp_path, capsys):
    # Packed layout, scored-only logits and cached reference log-probs against today's padded path: every
    # per-step and eval metric and the final weights, over two epochs (the second reads the cache).
    # AdamW's eps at 1e-6, as in launch below: the weights then measure the layouts, not near-zero gradients.
    train.run(make_config(f"local_run_dir={tmp_path / 'padded'}", "n_epochs=2", "+optimizer_kwargs.eps=1e-6", *PADDED_BASELINE))
    train.run(make_config(f"local_run_dir={tmp_path / 'default'}", "n_epochs=2", "+optimizer_kwargs.eps=1e-6"))
    assert "reference log-probs: computing 35 of 35 pairs" in capsys.readouterr().out
    assert_same_metrics(read_jsonl(tmp_path / "padded" / "metrics.jsonl"), read_jsonl(tmp_path / "default" / "metrics.jsonl"))
    assert_same_weights(tmp_path / "padded", tmp_path / "default")


def test_cached_reference_equals_live_reference_and_is_reused(make_config, tmp_path, capsys):
    live = build_trainer(make_config(f"local_run_dir={tmp_path / 'live'}", "reference_cache=false"))
    cached = build_trainer(make_config(f"local_run_dir={tmp_path / 'cached'}"))
    assert live.reference is not None and cached.reference is None  # the cache needs no reference model
    examples = live.train_examples + [ex for batch in live.eval_batches for ex in batch]
    with torch.no_grad():
        expected = live.sequence_logps(live.reference, live.model_batch(examples), None).view(2, -1).T
    computed = torch.tensor([cached.reference_logps[ex["key"]] for ex in examples])
    torch.testing.assert_close(computed, expected, rtol=0, atol=1e-6)
    assert "computing 35 of 35 pairs" in capsys.readouterr().out

    def no_reference():
        raise AssertionError("the reference was loaded although the cache holds every pair")

    config = make_config(f"local_run_dir={tmp_path / 'again'}")
    tokenizer, policy = cached.tokenizer, load_model(config.model, torch.float32, tmp_path, config.seed)
    data = get_dataset(config.datasets[0], tokenizer, config.seed, config.n_eval_examples, tmp_path)
    again = BasicTrainer(config, policy, no_reference, tokenizer, data, tmp_path / "again")
    assert "reference log-probs: all 35 pairs from" in capsys.readouterr().out
    assert again.reference_logps == cached.reference_logps

    # A damaged file is recomputed, with a line that says why; another precision is another file.
    [path] = (tmp_path / "reference_logps").glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])
    rebuilt = build_trainer(make_config(f"local_run_dir={tmp_path / 'rebuilt'}"))
    assert f"reference log-probs: recomputing, since {path} is unreadable" in capsys.readouterr().out
    assert rebuilt.reference_logps == cached.reference_logps
    build_trainer(make_config(f"local_run_dir={tmp_path / 'bf16'}", "model.fsdp_policy_mp=bfloat16"))
    assert "computing 35 of 35 pairs" in capsys.readouterr().out
    assert len(list((tmp_path / "reference_logps").glob("*.pt"))) == 2


@pytest.mark.parametrize("reference_cache", ["true", "false"])
def test_bfloat16_compute_starts_at_exactly_ln2(make_config, reference_cache):
    # The reference computes like the policy (autocast over float32 weights), so at step 0 they agree to the bit.
    config = make_config("model.fsdp_policy_mp=bfloat16", f"reference_cache={reference_cache}", "n_examples=16")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    first_eval, first_step = records(run_dir, "eval")[0], records(run_dir, "train")[0]
    ln2 = torch.tensor(math.log(2)).item()  # float32 ln 2
    assert first_eval["loss/eval"] == ln2 and first_step["loss/train"] == ln2
    for name in ("rewards_eval/chosen", "rewards_eval/rejected", "rewards_eval/margins", "rewards_train/chosen", "rewards_train/rejected"):
        assert (first_eval | first_step)[name] == 0.0, name


def test_automatic_precision_follows_the_probe(make_config, tmp_path, capsys):
    from precision import machine_key

    for speedup, expected in ((4.0, "precision: bfloat16 compute (float32 weights under autocast)"), (0.01, "precision: float32")):
        (tmp_path / "precision_probe.json").write_text(json.dumps({machine_key(): speedup}))
        config = make_config(f"local_run_dir={tmp_path / str(speedup)}", "model.fsdp_policy_mp=auto", "n_examples=8")
        train.run(config)
        assert expected in capsys.readouterr().out
        seen = []
        trainer = build_trainer(make_config(f"local_run_dir={tmp_path / f'{speedup}-step'}", "model.fsdp_policy_mp=auto"))
        trainer.policy.model.layers[0].mlp.down_proj.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        trainer.train_step([trainer.train_examples[i] for i in trainer.schedule[0]])
        assert seen == [torch.bfloat16 if speedup > 1 else torch.float32]
        assert records(train.Path(config.local_run_dir), "eval")[0]["loss/eval"] == torch.tensor(math.log(2)).item()


def test_optimizer_errors_list_valid_choices():
    params = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(UserError, match=r"unknown optimizer 'Adamm'; torch.optim has: .*AdamW.*RMSprop"):
        build_optimizer("Adamm", params, 1e-3, {})
    with pytest.raises(UserError, match=r"optimizer RMSprop has no setting betas; its settings: alpha, eps, weight_decay, momentum"):
        build_optimizer("RMSprop", params, 1e-3, {"betas": [0.9, 0.99]})
    assert build_optimizer("AdamW", params, 1e-3, {"betas": [0.8, 0.9], "weight_decay": 0.0}).defaults["betas"] == (0.8, 0.9)


def test_existing_run_dir_is_not_overwritten(make_config):
    config = make_config("n_examples=8")
    train.run(config)
    before = (train.Path(config.local_run_dir) / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run"):
        train.run(make_config("n_examples=8"))
    assert (train.Path(config.local_run_dir) / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize("overrides,message", [
    (["batch_size=6", "gradient_accumulation_steps=4"], "batch_size=6 must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = 4"),
    (["eval_batch_size=6", "gradient_accumulation_steps=4"], "eval_batch_size=6 must be a positive multiple"),
    (["eval_every=12"], "eval_every=12 must be a positive multiple of batch_size=8"),
    (["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be positive"),
    (["batch_size=abc"], "batch_size=abc must be an integer"),
    (["loss.beta=abc"], "loss.beta=abc must be a number"),
    (["trainer=Foo"], "unknown trainer 'Foo'; valid: BasicTrainer, FSDPTrainer, TensorParallelTrainer"),
    (["nproc=2"], "BasicTrainer runs on one process; for 2 use trainer=FSDPTrainer or trainer=TensorParallelTrainer"),
    (["n_epochs=null"], "set n_epochs or n_examples"),
    (["n_eval_examples=0"], "n_eval_examples=0 must be positive"),
    (["optimizer=Adamm"], "unknown optimizer 'Adamm'; torch.optim has: "),
    (["model.policy_dtype=float64"], "model.policy_dtype=float64 is not a dtype; expected one of float32, bfloat16, float16"),
    (["model.policy_dtype=auto"], "model.policy_dtype=auto is not a dtype; expected one of float32, bfloat16, float16$"),
    (["model.fsdp_policy_mp=fp8"], "model.fsdp_policy_mp=fp8 is not a dtype; expected one of float32, bfloat16, float16, auto"),
    (["layout=ragged"], "layout=ragged is not a layout; expected one of packed, padded"),
    (["reference_cache=maybe"], "reference_cache=maybe must be true or false"),
    (["scored_logits_only=1"], "scored_logits_only=1 must be true or false"),
    (["model=blank_model"], "model.name_or_path must be set"),
    (["activation_checkpointing=true", "model.block_name=GPT2Block"], "model.block_name=GPT2Block matches no module of LlamaForCausalLM; its blocks: LlamaDecoderLayer"),
])
def test_config_errors(make_config, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train.run(make_config(*overrides))


def test_save_ignores_leftovers_of_a_crashed_save(make_config):
    trainer = build_trainer(make_config())
    stale = trainer.run_dir / "step-8.tmp"
    stale.mkdir()
    (stale / "stale.bin").write_text("from a crashed save")
    trainer.save(trainer.run_dir / "step-8", {"loss/eval": 0.5}, export_hf=False)
    assert sorted(p.name for p in (trainer.run_dir / "step-8").iterdir()) == ["optimizer.pt", "policy.pt", "scheduler.pt"]
    assert not stale.exists()


def test_resume_from_a_bad_checkpoint_is_one_clear_line(make_config, tmp_path):
    with pytest.raises(UserError, match=r"resume_from=.*: .*nowhere/policy.pt does not exist"):
        build_trainer(make_config(f"resume_from={tmp_path / 'nowhere'}"))
    config = make_config(f"local_run_dir={tmp_path / 'first'}", "n_examples=8")
    train.run(config)
    latest = tmp_path / "first" / "LATEST"
    with pytest.raises(UserError, match=r"examples seen is not a multiple of batch_size=16"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'second'}", "batch_size=16", f"resume_from={latest}"))
    optimizer = torch.load(latest / "optimizer.pt", weights_only=True)
    optimizer["state"]["param_groups"].append(optimizer["state"]["param_groups"][0])
    torch.save(optimizer, latest / "optimizer.pt")
    with pytest.raises(UserError, match=r"optimizer.pt does not fit this AdamW"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'third'}", f"resume_from={latest}"))


def test_eval_micro_batches_give_the_same_metrics(make_config, tmp_path):
    # 6 held-out pairs: with eval_batch_size=8 and 4 accumulation steps they go through in micro-batches of 2.
    whole = build_trainer(make_config(f"local_run_dir={tmp_path / 'a'}", "n_eval_examples=6"))
    micro = build_trainer(make_config(f"local_run_dir={tmp_path / 'b'}", "n_eval_examples=6", "gradient_accumulation_steps=4", "layout=padded"))
    calls = []
    micro.policy.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[0]), with_kwargs=True)
    metrics, micro_metrics = whole.evaluate(), micro.evaluate()
    assert calls == [4, 4, 4]  # 3 micro-batches of 2 pairs (chosen + rejected)
    assert micro_metrics.keys() == metrics.keys()
    for name, value in metrics.items():
        assert micro_metrics[name] == pytest.approx(value, abs=1e-5), name


# -------------------------------------------------------------------------------------------------------
# FSDPTrainer and TensorParallelTrainer: 2 CPU processes (gloo), compared with BasicTrainer on the same data.

TIMINGS = ("examples_per_second", "tokens_per_second")


def launch(run_dir, pairs_file, *overrides: str, launcher: str = "spawn"):
    """A tiny-model run of train.py; "spawn": train.py starts 2 workers, "torchrun": torchrun starts 2 ranks."""
    # Gradient norms here run from 2.6 down to 1.2: max_grad_norm=1.5 clips most steps but not all.
    # AdamW's eps at 1e-6: with the default 1e-8, a gradient entry of ~1e-10 moves its weight by ~lr whatever its
    # rounding, so summation order alone could move a weight by a fraction of lr = 1e-3.
    args = [*tiny_run_overrides(run_dir.parent, pairs_file), f"local_run_dir={run_dir}", "distributed_timeout_secs=120", "max_grad_norm=1.5",
            "+optimizer_kwargs.eps=1e-6", *overrides]
    torchrun = (str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2")
    if launcher == "spawn" and not any(arg.startswith("trainer=BasicTrainer") for arg in overrides):
        args.append("nproc=2")
    result = run_cli(*args, launcher=torchrun if launcher == "torchrun" else (sys.executable,), env_extra={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory):
    """BasicTrainer's run of the tiny fixture in the padded layout, with full logits and a live reference: the run
    every distributed one must reproduce with the default levers."""
    root = tmp_path_factory.mktemp("basic")
    pairs_file = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    launch(root / "run", pairs_file, "trainer=BasicTrainer", *PADDED_BASELINE)
    return root / "run", pairs_file


# Summation order differs between layouts and ranks; with AdamW's eps at 1e-6 (see launch) the final weights of
# these runs agree to ~7e-7.
PARAMETER_ATOL = 5e-6


def assert_same_weights(expected_dir, actual_dir):
    expected = torch.load(expected_dir / "LATEST" / "policy.pt", weights_only=True)["state"]
    actual = torch.load(actual_dir / "LATEST" / "policy.pt", weights_only=True)["state"]
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=PARAMETER_ATOL, msg=f"{actual_dir}: {name}")


def assert_same_metrics(expected: list[dict], actual: list[dict]):
    assert [sorted(r) for r in actual] == [sorted(r) for r in expected]
    for e, a in zip(expected, actual):
        for name, value in e.items():
            if name not in TIMINGS:
                assert a[name] == pytest.approx(value, rel=1e-5, abs=1e-5), (e["step"], name)


@pytest.mark.parametrize("trainer,overrides,launcher", [
    ("FSDPTrainer", ["sample_during_eval=true", "n_eval_model_samples=3", "generation.max_new_tokens=4"], "spawn"),
    ("FSDPTrainer", ["gradient_accumulation_steps=2", "activation_checkpointing=true"], "torchrun"),
    ("TensorParallelTrainer", ["sample_during_eval=true", "n_eval_model_samples=3", "generation.max_new_tokens=4"], "spawn"),
    ("TensorParallelTrainer", ["gradient_accumulation_steps=2", "activation_checkpointing=true"], "torchrun"),
])
def test_distributed_trainer_matches_basic_trainer(basic_run, tmp_path, trainer, overrides, launcher):
    # Per-step losses, rewards and gradient norms, every eval, and the final weights, all to ~1e-5.
    basic_dir, pairs_file = basic_run
    run_dir = tmp_path / "run"
    result = launch(run_dir, pairs_file, f"trainer={trainer}", *overrides, launcher=launcher)
    assert result.stdout.count("run directory:") == 1  # rank 0 reports for all
    assert_same_metrics(read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(basic_dir, run_dir)
    if "sample_during_eval=true" in overrides:
        samples = read_jsonl(run_dir / "samples.jsonl")
        assert [s["step"] for s in samples] == [0] * 3 + [16] * 3 + [32] * 3 + [40] * 3
        assert all(isinstance(s["policy"], str) and isinstance(s["reference"], str) for s in samples)
    # The export is a from_pretrained directory, whatever the trainer.
    assert AutoModelForCausalLM.from_pretrained(run_dir / "LATEST").config.architectures == ["LlamaForCausalLM"]


def test_fsdp_bfloat16_trains_close_to_float32(basic_run, tmp_path):
    basic_dir, pairs_file = basic_run
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", "model.fsdp_policy_mp=bfloat16")
    float32, bfloat16 = read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    differences = [abs(b[name] - f[name]) for f, b in zip(float32, bfloat16) for name in ("loss/train", "loss/eval") if name in f]
    assert all(map(math.isfinite, differences)) and max(differences) < 5e-3
    assert max(differences) > 1e-5  # beyond float32 rounding: the policy really computed in bfloat16
    evals = [r for r in bfloat16 if "loss/eval" in r]
    assert evals[-1]["rewards_eval/accuracies"] > evals[0]["rewards_eval/accuracies"] and evals[-1]["rewards_eval/accuracies"] >= 0.75


def test_checkpoints_resume_across_trainers(basic_run, tmp_path):
    # FSDPTrainer continues BasicTrainer's step-16 checkpoint, then BasicTrainer continues FSDPTrainer's step-32:
    # both end where the uninterrupted run did.
    basic_dir, pairs_file = basic_run
    launch(tmp_path / "fsdp", pairs_file, "trainer=FSDPTrainer", f"resume_from={basic_dir / 'step-16'}")
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", f"resume_from={tmp_path / 'fsdp' / 'step-32'}")
    uninterrupted = read_jsonl(basic_dir / "metrics.jsonl")
    assert_same_metrics([r for r in uninterrupted if r["step"] > 16], read_jsonl(tmp_path / "fsdp" / "metrics.jsonl"))
    assert_same_metrics([r for r in uninterrupted if r["step"] > 32], read_jsonl(tmp_path / "basic" / "metrics.jsonl"))
    assert_same_weights(basic_dir, tmp_path / "fsdp")
    assert_same_weights(basic_dir, tmp_path / "basic")


def fsdp_rank(local_rank: int, port: int, config, check, out_file: Path) -> None:
    """One of 2 FSDPTrainer ranks, built in-process: runs check(trainer, rank) and writes rank 0's result."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    init_distributed(timeout_secs=60)  # a rank left waiting fails the test within a minute instead of hanging it
    try:
        result = check(build_trainer(config, run_dir=Path(config.local_run_dir), trainer_class=FSDPTrainer), local_rank)
        if local_rank == 0:
            out_file.write_text(json.dumps(result))
        torch.distributed.barrier()
    finally:
        torch.distributed.destroy_process_group()


def run_fsdp_ranks(config, check, tmp_path):
    Path(config.local_run_dir).mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(fsdp_rank, args=(free_port(), config, check, tmp_path / "result.json"), nprocs=2)
    return json.loads((tmp_path / "result.json").read_text())


def sample_unevenly(trainer, rank: int) -> list[dict]:
    trainer.config.generation.max_new_tokens = 8 if rank == 0 else 1
    return trainer.sample()


def test_fsdp_sampling_with_uneven_lengths_completes(make_config, tmp_path):
    # Rank 0 generates 8 tokens and rank 1 one: rank 1 must keep joining rank 0's sharded forward passes.
    config = make_config("sample_during_eval=true", "n_eval_model_samples=4", "generation.do_sample=false")
    samples = run_fsdp_ranks(config, sample_unevenly, tmp_path)
    single = build_trainer(config, run_dir=tmp_path / "run")
    examples = [ex for batch in single.eval_batches for ex in batch][:4]
    single.config.generation.max_new_tokens = 8
    long = single.generate(single.policy, examples)
    single.config.generation.max_new_tokens = 1
    short = single.generate(single.policy, examples)
    # Greedy decoding from the same weights: rank 0 had pairs 0-1, rank 1 pairs 2-3.
    assert [s["policy"] for s in samples] == long[:2] + short[2:]
    assert [s["reference"] for s in samples] == long[:2] + short[2:]


def record_micro_batches(trainer, rank: int) -> list[tuple[int, bool]]:
    """(pairs in the micro-batch, whether any sharded gradient exists yet) for each micro-batch of one step."""
    seen = []
    batch_metrics = trainer.batch_metrics

    def recording(examples, split):
        seen.append((len(examples), any(p.grad is not None for p in trainer.policy.parameters())))
        return batch_metrics(examples, split)

    trainer.batch_metrics = recording
    metrics = trainer.train_step([trainer.train_examples[i] for i in trainer.schedule[0]])
    assert len(metrics["loss/train"]) == 8  # gathered from both ranks
    return seen


def test_fsdp_ranks_split_batches_and_reduce_once_per_step(make_config, tmp_path):
    # 8 pairs, 2 ranks, 4 accumulation steps: each rank runs 4 micro-batches of 1 pair, and sharded gradients
    # appear only when the last micro-batch's backward reduces them across ranks.
    config = make_config("gradient_accumulation_steps=4")
    assert run_fsdp_ranks(config, record_micro_batches, tmp_path) == [[1, False]] * 4
