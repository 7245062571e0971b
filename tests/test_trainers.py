"""The training loop (trainers.py): steps, accumulation, logging cadence, resume, precision paths."""

import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import train
from conftest import (
    PADDED_BASELINE,
    assert_resume_matches_uninterrupted,
    assert_same_metrics,
    assert_same_weights,
    build_trainer,
    planned_training_peaks,
    read_jsonl,
    records,
    wrapped_batch_loss,
)
from core.step import Data
from persistence import checkpoint
from trainers import Trainer
from training.stop_signals import StopSignals
from utils import UserError


def test_first_step_loss_is_ln2_with_zero_rewards(make_config):
    trainer = build_trainer(make_config())
    examples = [trainer.data.train_examples[i] for i in trainer.data.schedule[0]]
    metrics = trainer.train_step(examples)
    assert metrics["loss/train"] == pytest.approx([math.log(2)] * 8, abs=1e-6)
    assert max(map(abs, metrics["rewards_train/chosen"] + metrics["rewards_train/rejected"])) < 1e-6
    assert metrics["grad_norm"][0] > 0
    assert metrics["lr"] == [trainer.config.lr]  # warmup_steps=0: the full rate from the first step


def test_warmup_is_linear_in_optimizer_steps(make_config):
    trainer = build_trainer(make_config("warmup_steps=3"))
    rates = [
        trainer.train_step([trainer.data.train_examples[i] for i in indices])["lr"][0]
        for indices in trainer.data.schedule[:5]
    ]
    assert rates == pytest.approx([c * trainer.config.lr for c in (1 / 4, 2 / 4, 3 / 4, 1, 1)])


@pytest.mark.parametrize("loss", ["dpo", "aot", "aot_unpaired", "kto", "kto on labelled completions"])
def test_gradient_accumulation_matches_full_batch(make_config, labelled_file, loss):
    # aot's pairs depend on each other through the batch's sort, kto's through its KL estimate: accumulated, each
    # micro-batch reads them from the whole batch
    # With SGD at lr 1 and no clipping, the update equals the gradient, so equal parameters mean equal gradients.
    data = (f"datasets=[{labelled_file}]",) if "labelled" in loss else ()
    base = ("optimizer=SGD", "lr=1.0", "max_grad_norm=1e9", f"loss={loss.split()[0]}", *data)
    full = build_trainer(make_config(*base))
    accumulated = build_trainer(
        make_config(*base, "gradient_accumulation_steps=4", "local_run_dir=" + str(full.run_dir) + "_ga")
    )
    for step in range(2):
        indices = full.data.schedule[step]
        full_metrics = full.train_step([full.data.train_examples[i] for i in indices])
        accumulated_metrics = accumulated.train_step([accumulated.data.train_examples[i] for i in indices])
        assert accumulated_metrics["loss/train"] == pytest.approx(full_metrics["loss/train"], abs=1e-6)
        assert accumulated_metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=1e-5)
    for (name, a), b in zip(full.policy.named_parameters(), accumulated.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_micro_batch_memory_takes_the_fewest_micro_batches_that_fit_and_trains_as_fixed_ones(make_config, capsys):
    # A budget between the plan's peaks at 1 and 2 micro-batches a step: 2 micro-batches of 4 examples, batch_size
    # unchanged; trained like gradient_accumulation_steps=2 exactly, and like 1 to float rounding.
    base = ("optimizer=SGD", "lr=1.0", "max_grad_norm=1e9")
    peaks = planned_training_peaks(make_config(*base))
    assert peaks[1] > peaks[2] > peaks[4] > peaks[8]  # activations shrink with the micro-batch
    budget = f"{(peaks[1] + peaks[2]) / 2 / 2**30:.9f}"
    chosen = build_trainer(make_config(*base, f"micro_batch_memory={budget}"))
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("micro-batches:"))
    assert line.startswith("micro-batches: 2 a step of 4 examples a rank (gradient_accumulation_steps=2), at most ")
    assert line.endswith(
        f"{peaks[2] / 2**30:.3g} GiB of the {float(budget):.3g} GiB budget (micro_batch_memory={budget})"
    )
    assert chosen.accumulation == 2 and chosen.config.batch_size == 8
    assert chosen.config.gradient_accumulation_steps == 1  # the checked config keeps what was given
    run_dir = str(chosen.run_dir)
    fixed = build_trainer(make_config(*base, "gradient_accumulation_steps=2", f"local_run_dir={run_dir}_2"))
    whole = build_trainer(make_config(*base, f"local_run_dir={run_dir}_1"))
    for indices in chosen.data.schedule[:2]:
        metrics = [trainer.train_step(chosen.data.train_examples.take(indices)) for trainer in (chosen, fixed, whole)]
        assert (
            metrics[0]["loss/train"] == metrics[1]["loss/train"] and metrics[0]["grad_norm"] == metrics[1]["grad_norm"]
        )
        assert metrics[0]["loss/train"] == pytest.approx(metrics[2]["loss/train"], abs=1e-6)
        assert metrics[0]["grad_norm"] == pytest.approx(metrics[2]["grad_norm"], rel=1e-5)
    for (name, a), b, c in zip(chosen.policy.named_parameters(), fixed.policy.parameters(), whole.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("floor, budget, chosen", [(4, "100", 4), (1, "100", 1), (2, "between 8 and 4", 8)])
def test_micro_batch_memory_takes_gradient_accumulation_steps_as_its_floor(make_config, floor, budget, chosen):
    peaks = planned_training_peaks(make_config())
    budget = budget if budget == "100" else f"{(peaks[8] + peaks[4]) / 2 / 2**30:.9f}"
    config = make_config(f"gradient_accumulation_steps={floor}", f"micro_batch_memory={budget}")
    assert build_trainer(config).accumulation == chosen and config.gradient_accumulation_steps == floor


def test_micro_batch_memory_auto_leaves_a_cpu_run_s_micro_batches_as_given(make_config, capsys):
    config = make_config("gradient_accumulation_steps=2", "micro_batch_memory=auto")
    assert build_trainer(config).accumulation == 2
    assert "micro-batches:" not in capsys.readouterr().out


@pytest.mark.slow
def test_compile_blocks_trains_as_eager_and_tells_each_compiled_graph(make_config, capsys):
    # compile_blocks=true: the policy's blocks compiled (the probes' and the reference pass's shapes too), packed rows
    # in multiples of 128 tokens, the head's chunks through compiled kernels; three steps equal eager's to rounding
    base = ("optimizer=SGD", "lr=1.0", "max_grad_norm=1e9")
    eager = build_trainer(make_config(*base))
    compiled = build_trainer(make_config(*base, "compile_blocks=true", f"local_run_dir={eager.run_dir}_compiled"))
    rounded = "packed layout (dense attention; rows in multiples of 128 tokens)"
    assert compiled.scorer.describe() == f"{rounded}, scored logits (compiled chunks)"
    for indices in eager.data.schedule[:3]:
        expected, metrics = (
            trainer.train_step(eager.data.train_examples.take(indices)) for trainer in (eager, compiled)
        )
        assert metrics["loss/train"] == pytest.approx(expected["loss/train"], abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    for (name, a), b in zip(eager.policy.named_parameters(), compiled.policy.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)
    graphs = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile_blocks: graph")]
    # without shape buckets (off on a CPU) the blocks compile for dynamic shapes, and the line says so
    assert any(line.endswith(" s (inputs 8x128x64, 64x64, 32x64, 32x64, 8x128x16, 8x128x16, 8x1x128x128, "
                             "64x64, 128x64, 128x64, 64x128; dynamic shapes)") for line in graphs), graphs  # fmt: skip


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
    for name in (
        "rewards_train/chosen",
        "rewards_train/rejected",
        "rewards_train/accuracies",
        "rewards_train/margins",
        "logps_train/chosen",
        "logps_train/rejected",
        "grad_norm",
        "lr",
        "perf/pairs_per_second",
        "perf/computed_tokens_per_second",
        "perf/real_tokens_per_second",
        "perf/scored_tokens_per_second",
        "perf/mfu",
        "perf/peak_rss_gib",
        "counters/examples",
        "counters/updates",
    ):
        assert name in trains[0], name
    assert sorted(p.name for p in run_dir.iterdir() if p.is_dir()) == ["LATEST", "step-24"]
    saved = checkpoint.describe(run_dir / "step-24")
    assert saved["step"] == 24 and saved["metrics"]["loss/eval"] == evals[1]["loss/eval"]
    assert OmegaConf.load(run_dir / "config.yaml").local_run_dir == str(run_dir)


def test_metrics_are_averaged_over_the_log_interval(make_config, tmp_path):
    # The interval also closes where a checkpoint may follow (evals every 16 examples here), so that the log up to
    # a checkpoint is complete when a run resumes from it.
    every_step = make_config(f"local_run_dir={tmp_path / 'every'}")
    interval = make_config(f"local_run_dir={tmp_path / 'interval'}", "minimum_log_interval_secs=1e9")
    train.run(every_step)
    train.run(interval)
    per_step, aggregated = records(tmp_path / "every", "train"), records(tmp_path / "interval", "train")
    assert [r["counters/examples"] for r in aggregated] == [16, 32, 40]
    for record, steps in zip(aggregated, (per_step[:2], per_step[2:4], per_step[4:])):
        for name in ("loss/train", "rewards_train/margins", "grad_norm"):
            assert record[name] == pytest.approx(sum(r[name] for r in steps) / len(steps), rel=1e-5)


def test_resume_matches_uninterrupted(make_config, tmp_path):
    assert_resume_matches_uninterrupted(make_config, tmp_path)


def test_activation_checkpointing_recomputes_blocks_and_gives_same_step(make_config, tmp_path):
    plain = build_trainer(make_config(f"local_run_dir={tmp_path / 'a'}"))
    checkpointed = build_trainer(make_config(f"local_run_dir={tmp_path / 'b'}", "activation_checkpointing=true"))
    calls = {"plain": 0, "checkpointed": 0}
    plain.policy.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: calls.__setitem__("plain", calls["plain"] + 1)
    )
    checkpointed.policy.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: calls.__setitem__("checkpointed", calls["checkpointed"] + 1)
    )
    examples = [plain.data.train_examples[i] for i in plain.data.schedule[0]]
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
    trainer.policy.model.layers[0].mlp.down_proj.register_forward_hook(
        lambda module, inputs, output: seen.append(output.dtype)
    )
    metrics = trainer.train_step([trainer.data.train_examples[i] for i in trainer.data.schedule[0]])
    assert seen == [torch.bfloat16] and all(p.dtype == torch.float32 for p in trainer.policy.parameters())
    assert metrics["loss/train"][0] == pytest.approx(math.log(2), abs=0.05)


def test_default_levers_equal_the_padded_run_step_by_step(make_config, tmp_path, capsys):
    # Packed layout, scored-only logits and cached reference log-probs against today's padded path: every
    # per-step and eval metric and the final weights, over two epochs (the second reads the cache).
    # AdamW's eps at 1e-6, as in launch below: the weights then measure the layouts, not near-zero gradients.
    train.run(
        make_config(
            f"local_run_dir={tmp_path / 'padded'}", "n_epochs=2", "+optimizer_kwargs.eps=1e-6", *PADDED_BASELINE
        )
    )
    train.run(make_config(f"local_run_dir={tmp_path / 'default'}", "n_epochs=2", "+optimizer_kwargs.eps=1e-6"))
    assert "reference log-probs: computing 35 of 35 pairs" in capsys.readouterr().out
    assert_same_metrics(
        read_jsonl(tmp_path / "padded" / "metrics.jsonl"), read_jsonl(tmp_path / "default" / "metrics.jsonl")
    )
    assert_same_weights(tmp_path / "padded", tmp_path / "default")


@pytest.mark.cuda
@pytest.mark.parametrize("checkpointing", [False, True])
def test_block_mask_training_on_cuda_equals_the_padded_run_step_by_step(make_config, tmp_path, capsys, checkpointing):
    # On the GPU, as a user runs it: packed_attention=auto picks FlexAttention with a block mask (compiled by
    # transformers), the batch goes over asynchronously and the step waits once. Float32 without TF32: every
    # per-step and eval metric and the final weights equal the padded, full-logits, live-reference run's. With
    # activation checkpointing the backward pass recomputes each block's forward with the BlockMask, outside the
    # scorer's forward (on the H200 that recomputation once reached sdpa and failed).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        common = ("n_epochs=2", "+optimizer_kwargs.eps=1e-6", f"activation_checkpointing={str(checkpointing).lower()}")
        train.run(make_config(f"local_run_dir={tmp_path / 'padded'}", *common, *PADDED_BASELINE))
        train.run(make_config(f"local_run_dir={tmp_path / 'block'}", *common))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert "scoring: packed layout (block attention), scored logits" in capsys.readouterr().out
    # At step 0 every margin is 0 in exact arithmetic (policy = reference), so its accuracy (margin > 0) is the sign
    # of float32 rounding, which the GPU's kernels leave to each layout: the margins themselves are compared.
    padded, block = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("padded", "block"))
    for record in (record for record in (*padded, *block) if record["step"] == 0):
        for name in ("rewards_eval/accuracies", "rewards_train/accuracies"):
            record.pop(name, None)
    assert_same_metrics(padded, block)
    assert_same_weights(tmp_path / "padded", tmp_path / "block")
    assert records(tmp_path / "block", "train")[-1]["perf/peak_allocated_gib"] > 0  # train records carry perf/*


@pytest.mark.cuda
def test_the_default_cli_run_on_cuda_takes_block_masks_in_bfloat16(tmp_path, pairs_file):
    # The command line, TF32 and bfloat16 autocast on: the block mask is chosen, step 0 is ln 2 (the cached reference
    # is the policy's own computation) to bfloat16 rounding, not to the bit as on a CPU: the file repeats pairs, and an
    # eval pair's cached value then comes from a training batch, whose other shapes take other GPU kernels.
    from conftest import run_cli, tiny_run_overrides

    run_dir = tmp_path / "run"
    result = run_cli(*tiny_run_overrides(tmp_path, pairs_file), "model.fsdp_policy_mp=bfloat16", "n_epochs=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scoring: packed layout (block attention), scored logits" in result.stdout
    evals = records(run_dir, "eval")
    assert evals[0]["loss/eval"] == pytest.approx(math.log(2), abs=1e-4)
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"]


@pytest.mark.parametrize("reference_cache", ["true", "false"])
def test_bfloat16_compute_starts_at_exactly_ln2(make_config, reference_cache):
    # The reference computes like the policy (autocast over float32 weights), so at step 0 they agree to the bit.
    config = make_config("model.fsdp_policy_mp=bfloat16", f"reference_cache={reference_cache}", "n_examples=16")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    first_eval, first_step = records(run_dir, "eval")[0], records(run_dir, "train")[0]
    ln2 = torch.tensor(math.log(2)).item()  # float32 ln 2
    assert first_eval["loss/eval"] == ln2 and first_step["loss/train"] == ln2
    for name in (
        "rewards_eval/chosen",
        "rewards_eval/rejected",
        "rewards_eval/margins",
        "rewards_train/chosen",
        "rewards_train/rejected",
    ):
        assert (first_eval | first_step)[name] == 0.0, name


def test_automatic_precision_follows_the_probe(make_config, tmp_path, capsys):
    from modeling.precision import machine_key

    for speedup, expected in (
        (4.0, "precision: bfloat16 compute (float32 weights under autocast)"),
        (0.01, "precision: float32"),
    ):
        rates = {"float32": 1e11, "bfloat16": speedup * 1e11}
        (tmp_path / "precision_probe.json").write_text(json.dumps({machine_key(): rates}))
        config = make_config(f"local_run_dir={tmp_path / str(speedup)}", "model.fsdp_policy_mp=auto", "n_examples=8")
        train.run(config)
        assert expected in capsys.readouterr().out
        seen = []
        trainer = build_trainer(
            make_config(f"local_run_dir={tmp_path / f'{speedup}-step'}", "model.fsdp_policy_mp=auto")
        )
        trainer.policy.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda module, inputs, output, seen=seen: seen.append(output.dtype)
        )
        trainer.train_step([trainer.data.train_examples[i] for i in trainer.data.schedule[0]])
        assert seen == [torch.bfloat16 if speedup > 1 else torch.float32]
        assert records(train.Path(config.local_run_dir), "eval")[0]["loss/eval"] == torch.tensor(math.log(2)).item()


def poison_training_from(step: int):
    """A Trainer.train_step whose training loss is NaN from optimizer step `step` (1-based) on."""
    train_step = Trainer.train_step

    def poisoned(self, examples):
        if self.batch_counter + 1 < step:
            return train_step(self, examples)
        batch_loss = self.batch_loss
        self.batch_loss = wrapped_batch_loss(batch_loss, lambda examples, loss, metrics: (loss * float("nan"), metrics))
        try:
            return train_step(self, examples)
        finally:
            self.batch_loss = batch_loss

    return poisoned


def test_a_nonfinite_step_is_skipped_and_counted(make_config, monkeypatch):
    trainer = build_trainer(make_config())
    steps = [[trainer.data.train_examples[i] for i in indices] for indices in trainer.data.schedule[:3]]
    assert trainer.train_step(steps[0])["nonfinite_steps"] == [0.0]
    trainer.batch_counter = 1
    before = {name: p.detach().clone() for name, p in trainer.policy.named_parameters()}
    monkeypatch.setattr(Trainer, "train_step", poison_training_from(2))
    metrics = trainer.train_step(steps[1])
    assert metrics["nonfinite_steps"] == [1.0] and math.isnan(metrics["grad_norm"][0])
    for name, parameter in trainer.policy.named_parameters():  # no update: the weights, optimizer and schedule
        assert torch.equal(parameter, before[name]), name
    assert trainer.scheduler.last_epoch == 1 and trainer.steps.nonfinite.in_a_row == 1
    monkeypatch.undo()
    assert trainer.train_step(steps[2])["nonfinite_steps"] == [0.0] and trainer.steps.nonfinite.in_a_row == 0
    assert any(not torch.equal(p, before[name]) for name, p in trainer.policy.named_parameters())


def test_nonfinite_steps_in_a_row_stop_the_run_and_keep_the_last_checkpoint(make_config, monkeypatch):
    # Steps 3 on are poisoned; with max_nonfinite_steps=2 the run stops after step 4, the step-16 checkpoint intact.
    monkeypatch.setattr(Trainer, "train_step", poison_training_from(3))
    config = make_config("max_nonfinite_steps=2", "eval_every=16", "minimum_log_interval_secs=0")
    run_dir = train.Path(config.local_run_dir)
    message = (
        rf"^2 optimizer steps in a row had a non-finite loss or gradient norm and were skipped "
        rf"\(max_nonfinite_steps=2\), the last at step 4; stopping. The last checkpoint is {run_dir / 'step-16'};"
    )
    with pytest.raises(UserError, match=message):
        train.run(config)
    assert [r["nonfinite_steps"] for r in records(run_dir, "train")] == [0.0, 0.0, 1.0]  # step 4 stopped first
    assert checkpoint.describe(run_dir / "step-16")["step"] == 16
    assert not (run_dir / "LATEST").exists()


def test_the_run_ends_with_a_summary(make_config, capsys):
    config = make_config("n_examples=16")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    out = capsys.readouterr().out
    final = records(run_dir, "eval")[-1]
    assert "done: 16 examples in 2 steps, " in out and " pairs/s with evals and checkpoints" in out
    assert "training steps: " in out and " real, " in out and "MFU " in out and "peak_rss_gib" in out
    assert f"rewards_eval/accuracies={final['rewards_eval/accuracies']:.4f}" in out.split("final eval: ")[1]
    assert f"loss/eval={final['loss/eval']:.4f}" in out.split("final eval: ")[1]
    assert f"checkpoint and from_pretrained export: {run_dir / 'LATEST'}; metrics: {run_dir / 'metrics.jsonl'}" in out


def test_sigterm_asks_for_a_stop_and_the_handlers_come_back():
    before = signal.getsignal(signal.SIGINT)
    with StopSignals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM  # noted, not fatal: the loop stops after its step
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == signal.SIGTERM  # the first signal is the reason
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # a second Ctrl-C stops at once
    assert signal.getsignal(signal.SIGINT) is before


def test_auto_resume_of_a_finished_run_changes_nothing(make_config, capsys):
    config = make_config("resume_from=auto")
    train.run(config)
    run_dir = Path(config.local_run_dir)
    log = (run_dir / "metrics.jsonl").read_text()
    train.run(make_config("resume_from=auto"))
    assert f"{run_dir / 'LATEST'} ends this run: nothing left to train" in capsys.readouterr().out
    assert (run_dir / "metrics.jsonl").read_text() == log


def test_each_record_carries_the_steps_throughput(make_config):
    # One step per record (minimum_log_interval_secs=0): per pair, the record's real and scored tokens are the step's
    # examples', its computed tokens the packed rows' positions, and its MFU the useful FLOPs over the peak.
    from core.layouts import pack
    from reporting.telemetry import real_tokens, scored_tokens

    config = make_config("n_examples=24")
    train.run(config)
    trainer = build_trainer(make_config("n_examples=24", f"local_run_dir={config.local_run_dir}-again"))
    for record, indices in zip(records(train.Path(config.local_run_dir), "train"), trainer.data.schedule):
        examples = [trainer.data.train_examples[i] for i in indices]
        pairs = record["perf/pairs_per_second"]
        assert record["perf/real_tokens_per_second"] / pairs == pytest.approx(sum(map(real_tokens, examples)) / 8)
        assert record["perf/scored_tokens_per_second"] / pairs == pytest.approx(sum(map(scored_tokens, examples)) / 8)
        assert record["perf/computed_tokens_per_second"] / pairs == pytest.approx(pack(examples, 0).n_tokens / 8)
        flops = sum(trainer.flops.example(ex, live_reference=False) for ex in examples) / 8
        assert record["perf/mfu"] / pairs == pytest.approx(flops / trainer.peak_flops.flops)


def test_training_in_two_rounds_equals_one_round(make_config, tmp_path):
    # A round trains on a given schedule and may run again (iterative DPO gives each round new data): the schedule
    # cut in two rounds of 3 and 2 steps trains, evaluates, checkpoints and logs exactly as one round of 5.
    whole = build_trainer(make_config(f"local_run_dir={tmp_path / 'whole'}"))
    whole.train()
    whole.finish()
    rounds = build_trainer(make_config(f"local_run_dir={tmp_path / 'rounds'}"))
    data = rounds.data
    for schedule in (data.schedule[:3], data.schedule[3:]):
        rounds.train(Data(data.train_examples, data.eval_batches, schedule))
    rounds.finish()
    assert len(data.schedule) == 5 and rounds.batch_counter == 5
    assert_same_metrics(
        read_jsonl(tmp_path / "whole" / "metrics.jsonl"), read_jsonl(tmp_path / "rounds" / "metrics.jsonl")
    )
    assert sorted(p.name for p in (tmp_path / "rounds").glob("step-*")) == ["step-16", "step-32"]
    assert_same_weights(tmp_path / "whole", tmp_path / "rounds")


def test_the_runs_end_holds_signals_until_it_is_written(make_config, monkeypatch):
    # A SIGTERM or a first Ctrl-C during the final eval and save is noted, not obeyed: LATEST gets written.
    trainer = build_trainer(make_config("n_examples=8"))
    trainer.train()
    handlers, evaluate = [], Trainer.evaluate

    def noting_the_handler(self):
        handlers.append(signal.getsignal(signal.SIGTERM))
        return evaluate(self)

    monkeypatch.setattr(Trainer, "evaluate", noting_the_handler)
    trainer.finish()
    assert len(handlers) == 1 and isinstance(getattr(handlers[0], "__self__", None), StopSignals)
    assert (trainer.run_dir / "LATEST" / "checkpoint.json").exists()


def test_a_round_on_pairs_the_reference_cache_lacks_is_one_line(make_config):
    trainer = build_trainer(make_config())
    data = trainer.data
    new_keys = np.array([f"new-{i}".encode() for i in range(len(data.train_examples))], dtype="S16")
    new = dataclasses.replace(data.train_examples, keys=new_keys)
    evals = len({example["key"] for batch in data.eval_batches for example in batch})  # the eval pairs: cached
    message = rf"^40 of these {40 + evals} pairs have no cached reference log-probs: .*reference_cache=false$"
    with pytest.raises(UserError, match=message):
        trainer.train(Data(new, data.eval_batches, data.schedule))
    assert trainer.batch_counter == 0 and trainer.data is data  # nothing ran, nothing changed
