"""Checkpoints (checkpoint.py): atomic directories, one-line errors, and the format of earlier versions."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import build
import train
from conftest import assert_same_metrics, build_trainer, policy_state, read_jsonl
from modeling import weights
from persistence import checkpoint
from utils import UserError


def test_save_ignores_leftovers_of_a_crashed_save(make_config):
    trainer = build_trainer(make_config())
    stale = trainer.run_dir / "step-8.tmp"
    stale.mkdir()
    (stale / "stale.bin").write_text("from a crashed save")
    trainer.save(trainer.run_dir / "step-8", {"loss/eval": 0.5})
    names = sorted(p.name for p in (trainer.run_dir / "step-8").iterdir())
    parts = ["checkpoint.json", "config.json", "generation_config.json", "optimizer", "policy", "scheduler.pt"]
    assert [name for name in names if not name.startswith("tokenizer") and name != "chat_template.jinja"] == parts
    assert not stale.exists()


def fake_checkpoint(run_dir: Path, name: str, step: int, eval_loss: float | None = None, complete: bool = True):
    directory = run_dir / name
    directory.mkdir(parents=True)
    (directory / "policy.pt").write_text("weights")
    if complete:
        metrics = {} if eval_loss is None else {"loss/eval": eval_loss}
        (directory / "checkpoint.json").write_text(json.dumps({"step": step, "metrics": metrics}))
    return directory


def test_newest_picks_the_complete_checkpoint_with_most_examples(tmp_path):
    assert checkpoint.newest(tmp_path) is None
    fake_checkpoint(tmp_path, "step-8", 8)
    fake_checkpoint(tmp_path, "step-24", 24, complete=False)  # no checkpoint.json: not written by save()
    fake_checkpoint(tmp_path, "step-16.tmp", 16)  # a save in progress
    fake_checkpoint(tmp_path, "step-100.deleted", 100)  # pruning in progress
    (tmp_path / "step-9").mkdir()
    (tmp_path / "step-9" / "checkpoint.json").write_text('{"step": 9')  # cut short
    assert checkpoint.newest(tmp_path) == tmp_path / "step-8"
    fake_checkpoint(tmp_path, "step-16", 16)
    assert checkpoint.newest(tmp_path) == tmp_path / "step-16"
    fake_checkpoint(tmp_path, "LATEST", 16)
    assert checkpoint.newest(tmp_path) == tmp_path / "LATEST"


def test_prune_keeps_the_newest_and_the_best_by_eval_loss(tmp_path):
    for step, loss in ((8, 0.6), (16, 0.4), (24, None), (32, 0.5), (40, 0.7)):
        fake_checkpoint(tmp_path, f"step-{step}", step, loss)
    fake_checkpoint(tmp_path, "LATEST", 40)
    fake_checkpoint(tmp_path, "step-4", 4, complete=False)  # not ours to judge: kept
    (tmp_path / "step-2.deleted").mkdir()  # a deletion a kill interrupted
    checkpoint.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-16", "step-32", "step-4", "step-40"]
    checkpoint.prune(tmp_path, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "step-16", "step-4", "step-40"]


def test_keep_last_and_save_every_in_a_run(make_config):
    # 5 steps of 8; a checkpoint every step, evals every 2 steps; the best eval so far is kept beside the last two.
    config = make_config("save_every=8", "eval_every=16", "keep_last=2", "n_epochs=2", "lr=1e-2")
    train.run(config)
    run_dir = Path(config.local_run_dir)
    evals = {r["step"]: r["loss/eval"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss/eval" in r}
    best = min((loss, step) for step, loss in evals.items() if 0 < step < 80)[1]
    kept = sorted(p.name for p in run_dir.iterdir() if p.is_dir())
    assert kept == sorted({"LATEST", "step-64", "step-72", f"step-{best}"})
    marker = json.loads((run_dir / "step-72" / "checkpoint.json").read_text())
    assert marker["step"] == 72 and marker["metrics"] == {} and not marker["final"]


def test_resume_from_a_bad_checkpoint_is_one_clear_line(make_config, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"resume_from=.*nowhere: .*nowhere does not exist"):
        build_trainer(make_config(f"resume_from={tmp_path / 'nowhere'}"))
    config = make_config(f"local_run_dir={tmp_path / 'first'}", "n_examples=8")
    train.run(config)
    latest = tmp_path / "first" / "LATEST"
    with pytest.raises(UserError, match=r"examples seen is not a multiple of batch_size=16"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'second'}", "batch_size=16", f"resume_from={latest}"))
    # An optimizer with a parameter group per weight cannot take the state of one group.
    grouped = lambda name, parameters, lr, knobs: torch.optim.AdamW([{"params": [p]} for p in parameters], lr=lr)  # noqa: E731
    monkeypatch.setattr(build, "build_optimizer", grouped)
    with pytest.raises(UserError, match=r"optimizer does not fit this AdamW \(1 parameter groups, expected 21\)"):
        build_trainer(make_config(f"local_run_dir={tmp_path / 'third'}", f"resume_from={latest}"))


def test_a_resumed_optimizer_steps_as_this_run_chose_not_as_the_checkpoints_writer(make_config, tmp_path):
    # The writer's AdamW was fused (optim.fused_default); this run's is foreach: it stays so (tensor parallelism's
    # unfused AdamW, made fused by a BasicTrainer or FSDP checkpoint, stopped at its first step). The state is loaded.
    train.run(make_config(f"local_run_dir={tmp_path / 'fused'}", "n_examples=8"))
    latest = tmp_path / "fused" / "LATEST"
    resumed = build_trainer(make_config(f"local_run_dir={tmp_path / 'foreach'}", "+optimizer_kwargs.foreach=true"))
    resumed.resume(latest)
    group = resumed.optimizer.param_groups[0]
    assert group["foreach"] is True and not group.get("fused")
    assert json.loads((latest / "checkpoint.json").read_text())["step"] == 8
    assert all(torch.count_nonzero(state["exp_avg"]) for state in resumed.optimizer.state.values())


CHECKPOINT_419E2F5 = Path(__file__).parent / "assets" / "checkpoint-419e2f5"


def test_a_checkpoint_written_before_the_refactor_resumes_exactly(make_config):
    # Written by commit 419e2f5 (before checkpoint.py existed) on conftest's tiny run with eval_every=16: its
    # step-16 checkpoint, and beside it that run's metrics and final weights. Resumed by today's code, the run ends
    # where it did.
    config = make_config("eval_every=16", f"resume_from={CHECKPOINT_419E2F5 / 'step-16'}")
    train.run(config)
    expected = [r for r in read_jsonl(CHECKPOINT_419E2F5 / "metrics.jsonl") if r["step"] > 16]
    assert [r["step"] for r in expected] == [24, 32, 32, 40, 40]
    for record in expected:  # the timings of then, measured, not computed: perf/* today
        record.pop("examples_per_second", None), record.pop("tokens_per_second", None)
    resumed = read_jsonl(Path(config.local_run_dir) / "metrics.jsonl")
    # nonfinite_steps came later: none here, and the records are otherwise the old ones
    assert [r.pop("nonfinite_steps") for r in resumed if "loss/train" in r] == [0.0, 0.0, 0.0]
    assert_same_metrics(expected, resumed)
    expected_weights = torch.load(CHECKPOINT_419E2F5 / "final-policy.pt", weights_only=True)["state"]
    weights = policy_state(Path(config.local_run_dir) / "LATEST")
    assert weights.keys() == expected_weights.keys()
    for name, value in expected_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-6, msg=name)


class Tally:
    """A stateful part a later feature might add (a data sampler's position, a KL controller): state_dict() and
    load_state_dict() are all a checkpoint asks of it."""

    def __init__(self, count: int = 0):
        self.count = count

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_a_new_stateful_part_is_one_entry_and_resumes(make_config, tmp_path):
    trainer = build_trainer(make_config())
    trainer.checkpoints.parts["tally"] = Tally(7)
    trainer.train()
    trainer.finish()
    step_16 = trainer.run_dir / "step-16"
    assert torch.load(step_16 / "tally.pt", weights_only=True)["state"] == {"count": 7}
    assert sorted(p.name for p in step_16.glob("*.pt")) == ["scheduler.pt", "tally.pt"]
    resumed = build_trainer(make_config(f"local_run_dir={tmp_path / 'resumed'}", f"resume_from={step_16}"))
    tally = resumed.checkpoints.parts["tally"] = Tally()
    resumed.resume(step_16)
    assert tally.count == 7
    # A checkpoint without the part's file (written before it existed) leaves the part as it was built.
    fresh = Tally(3)
    resumed.checkpoints.parts["tally"] = fresh
    (step_16 / "tally.pt").unlink()
    resumed.resume(step_16)
    assert fresh.count == 3


def test_shards_that_do_not_add_up_are_never_a_checkpoint(make_config, tmp_path, monkeypatch):
    # One rank's shards without the other's, as in a run directory the machines do not share: each file knows its
    # offsets, not what is missing, so the check compares with the whole shapes the run knows.
    whole = torch.arange(12.0).view(4, 3)
    weights.write_shards({"w": whole}, tmp_path / "whole", world_size=1)
    assert weights.missing_shards(tmp_path / "whole", {"w": whole.shape}) is None
    half = tmp_path / "half"
    half.mkdir()
    metadata = {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0, 0]}}), "DCP_VERSION": "1.0", "format": "pt"}
    save_file({"w": whole[:2]}, half / "shard-00001-model-00001-of-00001.safetensors", metadata)  # rows 0-1 only
    assert weights.missing_shards(half, {"w": whole.shape}) == "its files hold 6 of the 12 values of w"
    # In a run: the save stops in one line, with nothing half-written left and the last checkpoint whole.
    trainer = build_trainer(make_config())
    trainer.example_counter = 8
    trainer.save(trainer.run_dir / "step-8", {})
    monkeypatch.setattr(weights, "missing_shards", lambda directory, shapes: "its files hold 6 of the 12 values of w")
    trainer.example_counter = 16
    with pytest.raises(UserError) as error:
        trainer.save(trainer.run_dir / "step-16", {})
    assert str(error.value).startswith(
        f"could not write the checkpoint {trainer.run_dir / 'step-16'}: the checkpoint's policy/ is incomplete (its "
        "files hold 6 of the 12 values of w): with several machines, local_run_dir must be on a filesystem they all "
        "share; stopped after 16 examples, the last complete checkpoint"
    )
    assert sorted(p.name for p in trainer.run_dir.iterdir() if p.is_dir()) == ["step-8"]


@pytest.mark.parametrize("keep_last", [1, 2, 3, None])
def test_short_of_space_a_save_first_prunes_what_keep_last_would_never_the_newest(tmp_path, monkeypatch, keep_last):
    """make_room: with too little free, the older checkpoints keep_last would prune after the save go first; the
    newest complete one stays whatever keep_last says (a failed save must leave it), and nothing goes with room."""
    for step in (8, 16, 24):
        fake_checkpoint(tmp_path, f"step-{step}", step)
    checkpoint.make_room(tmp_path, 1 << 20, keep_last)  # room enough: nothing pruned
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-16", "step-24", "step-8"]
    monkeypatch.setattr(checkpoint.storage, "free_bytes", lambda path: 1000)
    checkpoint.make_room(tmp_path, 1 << 20, keep_last)
    kept = {1: ["step-24"], 2: ["step-24"], 3: ["step-16", "step-24"], None: ["step-16", "step-24", "step-8"]}
    assert sorted(p.name for p in tmp_path.iterdir()) == kept[keep_last]
