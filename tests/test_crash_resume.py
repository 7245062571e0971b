"""Crash-exact resume: a real CLI run killed at seeded random moments (mid-step, mid-eval, mid-save, between the
renames that swap a checkpoint in) and stopped by Ctrl-C, each time re-run with the same command
(resume_from=auto), ends with the uninterrupted run's training and eval records and bit-identical weights."""

import random
import signal
from pathlib import Path

import pytest
import torch

from conftest import MEASURED, optimizer_state, policy_state, read_jsonl, tiny_run_overrides
from persistence import checkpoint

pytestmark = pytest.mark.xdist_group("processes")  # see pyproject.toml

FAULTS_DIR = Path(__file__).parent / "faults"  # sitecustomize.py: the FAULT=KIND:N hooks
# The most events of each kind an attempt is sure to reach (see faults/sitecustomize.py), so each one is killed.
REACHABLE = {"step": 4, "eval": 2, "save": 4, "shards": 3, "swap": 3, "interrupt": 4}


def command(run_dir: Path, pairs_file: Path, *overrides: str) -> list[str]:
    """15 steps of 8, evals every 2 steps, a checkpoint every step of which the last 3 are kept."""
    return [
        *tiny_run_overrides(run_dir.parent, pairs_file),
        f"local_run_dir={run_dir}",
        "resume_from=auto",
        "n_epochs=3",
        "save_every=8",
        "keep_last=3",
        "max_grad_norm=1.5",
        *overrides,
    ]


def faults(seed: int, ranks: int) -> list[tuple[str, int, int]]:
    """(kind, N, rank): first Ctrl-C at step 2, whose checkpoint comes before the eval at its step, then a kill
    before the next checkpoint, after the resumed run evaluated at that step (which must then be logged once);
    then one fault of each kind, in a seeded order, at a seeded event count and rank (every rank writes its shards,
    so any can be killed mid-save; rank 0 alone swaps the directory in)."""
    rng = random.Random(seed)
    kinds = list(REACHABLE)
    rng.shuffle(kinds)
    seeded = [(kind, rng.randint(1, REACHABLE[kind]), 0 if kind == "swap" else rng.randrange(ranks)) for kind in kinds]
    return [("interrupt", 2, 0), ("step", 1, 0), *seeded]


def assert_crashes_do_not_change_the_run(cli, tmp_path, pairs_file, seed: int, ranks: int, *overrides: str):
    env = {"OMP_NUM_THREADS": "1"} if ranks > 1 else {}
    whole = tmp_path / "whole"
    result = cli(*command(whole, pairs_file, *overrides), env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]

    crashed = tmp_path / "crashed"
    for kind, n, rank in faults(seed, ranks):
        fault = {"PYTHONPATH": str(FAULTS_DIR), "FAULT": f"{kind}:{n}", "FAULT_RANK": str(rank), **env}
        result = cli(*command(crashed, pairs_file, *overrides), env_extra=fault)
        if kind == "interrupt":  # a clean stop: a checkpoint of the last step, one line, no traceback
            assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
            assert "Traceback" not in result.stderr
            assert result.stderr.splitlines()[-1].startswith("stopped by SIGINT after ")
            assert result.stderr.splitlines()[-1].endswith(f"with resume_from=auto local_run_dir={crashed}")
        else:
            killed = -signal.SIGKILL if ranks == 1 else 1  # spawn reports a killed rank with exit code 1
            assert result.returncode == killed, (kind, n, rank, result.returncode, result.stderr[-3000:])
        for directory in crashed.iterdir():  # every checkpoint directory resume could pick is complete
            if checkpoint.STEP_DIR.fullmatch(directory.name) or directory.name == "LATEST":
                assert checkpoint.describe(directory) is not None, (kind, n, directory)
                assert {"policy", "optimizer", "scheduler.pt"} <= {p.name for p in directory.iterdir()}
    result = cli(*command(crashed, pairs_file, *overrides), env_extra=env)
    assert result.returncode == 0, result.stderr[-3000:]

    expected, actual = read_jsonl(whole / "metrics.jsonl"), read_jsonl(crashed / "metrics.jsonl")
    assert [r["step"] for r in expected if "loss/train" in r] == list(range(8, 121, 8))
    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in records]  # noqa: E731
    assert strip(actual) == strip(expected)  # every train and eval record, once, with the same values
    assert_equal_checkpoints(whole / "LATEST", crashed / "LATEST", tmp_path)
    assert sorted(p.name for p in crashed.iterdir() if p.is_dir()) == sorted(
        p.name for p in whole.iterdir() if p.is_dir()
    )


def assert_equal_checkpoints(expected: Path, actual: Path, scratch: Path) -> None:
    """The two checkpoints' weights and optimizer states, bit for bit."""
    assert_equal_states(policy_state(expected), policy_state(actual), "policy")
    (scratch / "a").mkdir()
    (scratch / "b").mkdir()
    assert_equal_states(optimizer_state(expected, scratch / "a"), optimizer_state(actual, scratch / "b"), "optimizer")


def assert_equal_states(a, b, where: str):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal_states(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):  # a loaded optimizer holds its betas as a list
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_states(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_crashes_and_ctrl_c_resume_bit_identically(warm_cli, tmp_path, pairs_file):
    assert_crashes_do_not_change_the_run(warm_cli, tmp_path, pairs_file, 0, 1)


@pytest.mark.slow
def test_crashes_and_ctrl_c_resume_bit_identically_with_fsdp_on_2_processes(warm_cli, tmp_path, pairs_file):
    assert_crashes_do_not_change_the_run(warm_cli, tmp_path, pairs_file, 1, 2, "trainer=FSDPTrainer", "nproc=2")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_crashes_and_ctrl_c_resume_bit_identically_with_checkpoints_written_in_the_background(
    warm_cli, tmp_path, pairs_file, ranks
):
    """save_async=true: the kinds save, shards and swap kill in the thread that writes, while training goes on;
    step, eval and interrupt in training, a checkpoint perhaps in flight. The resumed run is the uninterrupted one
    all the same."""
    fsdp = ("trainer=FSDPTrainer", "nproc=2") if ranks > 1 else ()
    assert_crashes_do_not_change_the_run(warm_cli, tmp_path, pairs_file, 2, ranks, *fsdp, "save_async=true")


def test_rounds_resume_bit_identically_after_crashes(warm_cli, tmp_path, pairs_file):
    # Three rounds of iterative DPO (rounds.py), killed mid-generation, mid-reference pass, mid-step, mid-eval and
    # mid-save, and stopped by Ctrl-C, each attempt re-run with the same command: the rounds' pairs, every record and
    # the final weights are the uninterrupted run's.
    rounds = (
        "rounds.n=3",
        "rounds.reward=tests.round_rewards:lowercase_letters",
        "generation.max_new_tokens=8",
        "generation.temperature=1.0",
        "n_epochs=2",
    )
    whole = tmp_path / "whole"
    result = warm_cli(*command(whole, pairs_file, *rounds))
    assert result.returncode == 0, result.stderr[-3000:]
    crashed = tmp_path / "crashed"
    for kind, n in [("interrupt", 3), ("generate", 40), ("step", 4), ("reference", 2), ("eval", 2), ("save", 3)]:
        fault = {"PYTHONPATH": str(FAULTS_DIR), "FAULT": f"{kind}:{n}"}
        result = warm_cli(*command(crashed, pairs_file, *rounds), env_extra=fault)
        expected_code = 128 + signal.SIGINT if kind == "interrupt" else -signal.SIGKILL
        assert result.returncode == expected_code, (kind, n, result.returncode, result.stderr[-3000:])
    result = warm_cli(*command(crashed, pairs_file, *rounds))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resume_from=auto: continuing from" in result.stdout

    strip = lambda records: [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in records]  # noqa: E731
    expected = read_jsonl(whole / "metrics.jsonl")
    assert [r["rounds/round"] for r in expected if "rounds/round" in r] == [0, 1, 2, 3]
    assert strip(read_jsonl(crashed / "metrics.jsonl")) == strip(expected)
    for index in range(3):
        name = f"rounds/round-{index}.jsonl"
        assert (crashed / name).read_text() == (whole / name).read_text(), name
    assert_equal_checkpoints(whole / "LATEST", crashed / "LATEST", tmp_path)
