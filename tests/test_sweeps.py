"""Sweeps (`python train.py -m ...`, sweeps.py), in this process on the tiny model: each job equals the single run
of its keys, a grid's jobs, one line before any job for a bad value or a missing plugin, a stopped sweep resumed
as a whole, and the objective an optimizing sweeper gets back."""

import json
import signal
import traceback
from pathlib import Path

import matplotlib
import pytest
from torch.optim.optimizer import register_optimizer_step_pre_hook

from conftest import MEASURED, read_jsonl, tiny_run_overrides
from reporting import frontier
from reporting.sweep_report import SUMMARY_JSON, Job, jobs

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def sweep_args(tmp_path: Path, pairs_file: Path, directory: Path, *overrides: str) -> list[str]:
    """A tiny sweep in `directory`: two steps of 8 per job, evals at 0 and 16."""
    common = [arg for arg in tiny_run_overrides(tmp_path, pairs_file) if not arg.startswith("local_run_dir=")]
    return ["-m", *common, f"local_run_dir={directory}", "n_examples=16", *overrides]


def computed(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl without what is measured (throughput, memory)."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_each_job_of_a_beta_sweep_equals_the_single_run_of_its_keys(tmp_path, pairs_file, run_main):
    sweep = tmp_path / "sweep"
    result = run_main(*sweep_args(tmp_path, pairs_file, sweep, "loss.beta=0.1,0.3", "n_examples=8"))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((sweep / SUMMARY_JSON).read_text())
    assert [(job["keys"], job["status"]) for job in summary["jobs"]] == [
        ({"loss.beta": 0.1}, "finished"),
        ({"loss.beta": 0.3}, "finished"),
    ]
    for number, beta in enumerate((0.1, 0.3)):
        single = tmp_path / f"single-{beta}"
        args = sweep_args(tmp_path, pairs_file, single, f"loss.beta={beta}", "n_examples=8")[1:]  # the keys, no -m
        assert run_main(*args).returncode == 0
        assert computed(sweep / str(number)) == computed(single)  # every record, bit for bit
        assert summary["jobs"][number]["objective"]["value"] == computed(single)[-1]["loss/eval"]


def test_a_grid_of_two_keys_is_four_jobs(tmp_path, pairs_file, run_main):
    sweep = tmp_path / "sweep"
    result = run_main(*sweep_args(tmp_path, pairs_file, sweep, "loss.beta=0.1,0.3", "lr=1e-3,1e-4", "dry_run=true"))
    assert result.returncode == 0, result.stderr[-3000:]
    swept = lambda job: [arg for arg in job.overrides if arg.startswith(("loss.beta=", "lr="))]  # noqa: E731
    found = [(job.number, swept(job), job.status) for job in jobs(sweep)]
    assert found == [
        (0, ["lr=0.001", "loss.beta=0.1"], "dry run"),  # Hydra's order: lr comes first on the command line
        (1, ["lr=0.001", "loss.beta=0.3"], "dry run"),
        (2, ["lr=0.0001", "loss.beta=0.1"], "dry run"),
        (3, ["lr=0.0001", "loss.beta=0.3"], "dry run"),
    ]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["loss.beta=0.1,-1"], "error: job 1 (loss.beta=-1): loss.beta=-1.0 must be positive"),
        (["lr=1e-3,abc"], "error: job 1 (lr=abc): lr=abc must be a number"),
        (["loss=dpo,nope"], "error: job 1 (loss=nope): unknown loss 'nope'"),
        (
            ["hydra/sweeper=nevergrad", "loss.beta=0.1,0.3"],
            "error: hydra/sweeper=nevergrad needs Hydra's plugin, which is "
            "not installed: pip install hydra-nevergrad-sweeper",
        ),  # fmt: skip
        (
            ["resume_from=auto", "local_run_dir=null", "loss.beta=0.1,0.3"],
            "error: resume_from=auto continues the sweep",
        ),
        (
            ["batch_size=4,6", "eval_every=8", "eval_batch_size=12"],  # a cross-key check: the typed Config's
            "error: job 1 (batch_size=6): eval_every=8 must be a positive multiple of batch_size=6",
        ),
        (
            ["loss.beta=interval(0.05,0.5)"],
            "error: loss.beta=interval(0.05,0.5): interval() is a continuous range, which a sampling sweeper draws "
            "from (hydra/sweeper=optuna); Hydra's basic sweeper takes a list (a,b,c), range(start,stop,step) or",
        ),
        (
            ["local_run_dir={tmp}/pairs.jsonl", "loss.beta=0.1,0.3"],
            "error: local_run_dir={tmp}/pairs.jsonl must be a directory, but {tmp}/pairs.jsonl is a file",
        ),
    ],
)
def test_a_bad_sweep_is_one_line_before_any_job_starts(tmp_path, pairs_file, run_main, overrides, message):
    sweep = tmp_path / "sweep"
    overrides = [override.format(tmp=tmp_path) for override in overrides]
    message = message.format(tmp=tmp_path)
    result = run_main(*sweep_args(tmp_path, pairs_file, sweep, *overrides))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error: ") == 1
    assert not list(tmp_path.glob("**/metrics.jsonl"))  # no job started


def stop_at_step(n: int):
    """Ctrl-C at the nth optimizer step from now, in this process (the training loop stops after that step)."""
    steps = []

    def before_step(optimizer, args, kwargs):
        if "train_step" not in [frame.name for frame in traceback.extract_stack()]:  # the memory plan's, say
            return
        steps.append(1)
        if len(steps) == n:
            signal.raise_signal(signal.SIGINT)

    return register_optimizer_step_pre_hook(before_step)


@pytest.mark.slow  # seven tiny runs: ~40 s on two cores
def test_a_stopped_sweep_resumes_where_it_stopped(tmp_path, pairs_file, run_main):
    keys = ("loss.beta=0.1,0.2,0.3", "save_every=8")
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    assert run_main(*sweep_args(tmp_path, pairs_file, whole, *keys)).returncode == 0

    hook = stop_at_step(3)  # the first step of job 1 (each job takes two)
    try:
        result = run_main(*sweep_args(tmp_path, pairs_file, stopped, *keys))
    finally:
        hook.remove()
    assert result.returncode == 128 + signal.SIGINT, result.stderr[-3000:]
    assert [job.status for job in jobs(stopped)] == ["finished", "interrupted", "pending"]
    first_log = (stopped / "0" / "metrics.jsonl").read_text()

    result = run_main(*sweep_args(tmp_path, pairs_file, stopped, *keys, "resume_from=auto"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "job 0 (loss.beta=0.1): finished in an earlier attempt of this sweep, not run again" in result.stdout
    assert (stopped / "0" / "metrics.jsonl").read_text() == first_log  # not rerun
    assert f"continuing from {stopped / '1' / 'step-8'}" in result.stdout
    states = jobs(stopped)
    assert [(job.status, job.earlier, job.resumed_from) for job in states] == [
        ("finished", True, None),
        ("finished", False, str(stopped / "1" / "step-8")),
        ("finished", False, None),
    ]
    for number in range(3):
        assert computed(stopped / str(number)) == computed(whole / str(number))


@pytest.mark.slow  # four sweeps' starts and three tiny runs: ~17 s on two cores
def test_optuna_tunes_beta_on_the_objective_each_job_returns(tmp_path, pairs_file, run_main):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper (.ci/run does)")
    sweep = tmp_path / "sweep"
    optuna = ("hydra/sweeper=optuna", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1")
    trials = sweep_args(tmp_path, pairs_file, sweep, *optuna, "hydra.sweeper.sampler.seed=0", "n_examples=8",
                        "sweep_scaled_objective=true")  # fmt: skip  # beta scales the margins: maximized all the same
    result = run_main(*trials, "loss.beta=interval(0.05,0.5)", "sweep_objective=rewards_eval/margins")
    assert result.returncode == 2 and "add hydra.sweeper.direction=maximize" in result.stderr  # not minimized

    result = run_main(*trials, "loss.beta=interval(0.05,0.5)", "hydra.sweeper.direction=maximize",
                      "sweep_objective=rewards_eval/margins")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    found = jobs(sweep)
    assert len(found) == 3 and len({job.overrides[0] for job in found}) == 3  # three values of beta
    for job in found:
        margins = [r["rewards_eval/margins"] for r in read_jsonl(job.directory / "metrics.jsonl") if "loss/eval" in r]
        assert job.objective == {"name": "rewards_eval/margins", "value": margins[-1]}
    results = (sweep / "optimization_results.yaml").read_text()
    assert f"best_value: {max(job.objective['value'] for job in found)}" in results
    assert isinstance(Job.read(found[0].directory).objective["value"], float)


@pytest.mark.slow  # a sweep of two tiny jobs and two evaluations: ~22 s on two cores
def test_evaluate_draws_one_point_per_job_and_temperature_and_refuses_two_references(tmp_path, pairs_file, run_main):
    from conftest import save_tiny_lm

    base = save_tiny_lm(tmp_path / "base", "llama")  # the jobs' policy and reference at the start
    sweep = tmp_path / "sweep"
    model = ("model=blank_model", f"model.name_or_path={base}", "model.fsdp_policy_mp=null")
    result = run_main(*sweep_args(tmp_path, pairs_file, sweep, *model, "n_examples=8", "loss.beta=0.1,0.5"))
    assert result.returncode == 0, result.stderr[-3000:]
    evaluation = (
        f"candidates=[{sweep}]", f"baseline={base}", "judge=tests.round_rewards:lowercase_letters", "n_prompts=2",
        "max_new_tokens=4", "temperatures=[0.5,1.0]", "wandb.enabled=false", f"output_dir={tmp_path / 'out'}",
        f"local_dirs=[{tmp_path}]", "bootstrap_resamples=100",
    )  # fmt: skip
    result = run_main(*evaluation, script="evaluate.py")
    assert result.returncode == 0, result.stderr[-3000:]
    points = json.loads((tmp_path / "out" / "evaluation.json").read_text())["frontier"]
    assert sorted((p["label"], p["temperature"]) for p in points) == [
        ("loss.beta=0.1", 0.5), ("loss.beta=0.1", 1.0), ("loss.beta=0.5", 0.5), ("loss.beta=0.5", 1.0)
    ]  # fmt: skip
    assert all(p["candidate"].startswith(str(sweep)) and isinstance(p["kl"], float) for p in points)
    assert "loss.beta=0.5  0.5" in result.stdout  # the table names each job by its keys
    figure, axis = plt.subplots()
    frontier.draw(axis, points)
    assert sum(len(drawn.get_offsets()) for drawn in axis.collections) == 4
    plt.close(figure)
    assert (tmp_path / "out" / "winrate.png").stat().st_size > 0

    job = sweep / "1" / "config.yaml"
    job.write_text(job.read_text().replace(f"name_or_path: {base}", f"name_or_path: {tmp_path}"))
    result = run_main(*evaluation, script="evaluate.py")
    assert result.returncode == 2 and result.stderr.count("error: ") == 1
    assert result.stderr.strip().endswith(f"trained against another reference than {sweep / '0' / 'LATEST'} "
                                          f"(model.name_or_path={tmp_path}, not {base}); a frontier needs one: "
                                          "evaluate them apart")  # fmt: skip


# One case for each check of a single run's config across keys (Config.__post_init__, its check_plan and
# check_batches, configuration/checks.py's check_* functions): (the check, the keys that fail it). A sweep's jobs are
# checked as single runs are, so each job fails with the single run's own line.
CROSS_KEY_CASES = [
    ("n_epochs or n_examples", ["n_epochs=null", "n_examples=null"]),
    ("max_prompt_length below max_length", ["max_prompt_length=600"]),
    ("check_writable_dir", ["local_dirs=[{tmp}/pairs.jsonl]"]),
    ("save_async without debug", ["save_async=true", "debug=true"]),
    ("check_layout", ["layout=padded", "pack_row_tokens=512"]),
    ("fsdp_reduce_dtype with FSDP", ["model.fsdp_reduce_dtype=bfloat16"]),
    ("check_offload", ["fsdp_cpu_offload=true"]),
    ("check_optimizer", ["+optimizer_kwargs.betas=[0.9,1.5]"]),
    ("check_speed_levers", ["liger_kernel=true"]),
    ("check_weight_copies", ["compute_weight_copies=true"]),
    ("reference_dtype with LoRA", ["lora.enabled=true", "model.reference_dtype=float32"]),
    ("check_loss", ["loss=reward", "sample_during_eval=true"]),
    ("check_winrate", ["loss=sft", "eval_winrate_prompts=2", "judge=tests.round_rewards:lowercase_letters"]),
    ("check_reference_sync", ["reference_sync_steps=8", "loss=sft"]),
    ("check_plan", ["plan.gpus_per_node=8", "plan.gpu_memory_gib=80"]),
    ("check_batches: accumulation", ["gradient_accumulation_steps=3"]),
    ("check_batches: eval_every", ["eval_every=12"]),
    ("check_batches: save_every", ["save_every=12"]),
    ("check_rounds", ["rounds.n=2", "reference_cache=false"]),
]


@pytest.mark.parametrize("keys", [keys for _, keys in CROSS_KEY_CASES], ids=[name for name, _ in CROSS_KEY_CASES])
def test_each_job_fails_every_check_across_keys_a_single_run_fails(tmp_path, pairs_file, run_main, keys):
    import config as configuration
    from utils import UserError

    keys = [key.format(tmp=tmp_path) for key in keys]
    single = [arg for arg in sweep_args(tmp_path, pairs_file, tmp_path / "single", *keys)[1:]]
    with pytest.raises(UserError) as refused:
        configuration.load(single)
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", "seed=0,1", *keys))
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == f"error: job 0 (seed=0): {refused.value}"
    assert not list(tmp_path.glob("**/metrics.jsonl"))


def test_every_check_across_keys_has_its_case():
    from configuration import checks

    functions = {
        name
        for name, value in vars(checks).items()
        if name.startswith("check_") and value.__module__ == checks.__name__
    }
    named = {name.partition(":")[0] for name, _ in CROSS_KEY_CASES}
    assert functions <= named, functions - named


def test_glob_over_a_group_sees_only_the_options_a_user_can_choose(tmp_path, pairs_file, run_main):
    from configuration.composition import CONFIG_DIR

    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", "loss=glob(dpo*)", "dry_run=true"))
    assert result.returncode == 0, result.stderr[-2000:]
    chosen = [arg for job in jobs(tmp_path / "sweep") for arg in job.overrides if arg.startswith("loss=")]
    assert chosen == [f"loss={path.stem}" for path in sorted((CONFIG_DIR / "loss").glob("dpo*.yaml"))]
    assert chosen == ["loss=dpo", "loss=dpo_norm", "loss=dpop"]  # no loss schema (dpo_norm_schema) among them


def test_a_sweep_of_the_loss_says_its_loss_does_not_rank_the_jobs(tmp_path, pairs_file, run_main):
    keys = ("loss.beta=range(0.05,0.35,0.1)", "dry_run=true")
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "beta", *keys))
    assert result.returncode == 0, result.stderr[-2000:]
    note = (
        "sweep_objective=loss/eval is on the scale of each job's loss settings, and the sweep changes loss.beta: its "
        "values do not rank the jobs; comparable between them: winrate/eval (with eval_winrate_prompts and a judge), "
        "rewards_eval/accuracies"
    )
    assert result.stdout.index(f"note: {note}") < result.stdout.index("job 0 (loss.beta=0.05)")  # before the first
    assert "job 1 (loss.beta=0.15):" in result.stdout  # as the user writes it, not 0.15000000000000002
    assert json.loads((tmp_path / "beta" / SUMMARY_JSON).read_text())["notes"] == [note]
    assert f"Note: {note}" in (tmp_path / "beta" / "sweep_summary.md").read_text()
    assert "1    loss.beta=0.15  dry run" in result.stdout

    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "lr", "lr=1e-3,1e-4", "dry_run=true"))
    assert result.returncode == 0 and "note:" not in result.stdout  # the learning rate leaves the loss's scale
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "accuracy", "loss=dpo,ipo", "dry_run=true",
                                  "sweep_objective=rewards_eval/accuracies"))  # fmt: skip
    assert result.returncode == 0 and "note:" not in result.stdout


def test_an_optimizing_sweeper_refuses_an_objective_the_swept_keys_scale(tmp_path, pairs_file, run_main):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="pip install hydra-optuna-sweeper (.ci/run does)")
    optuna = ("hydra/sweeper=optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.n_jobs=1", "loss=dpo,ipo")
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", *optuna, "dry_run=true"))
    assert result.stderr.strip().endswith("dry-run one trial's keys as a single run (or the basic sweeper's grid)")
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", *optuna))
    assert result.returncode == 2 and result.stderr.count("error: ") == 1
    assert result.stderr.strip().endswith(
        "An optimizing sweeper would follow the scale: choose one of them, or add sweep_scaled_objective=true to "
        "optimize loss/eval all the same"
    )
    assert "the sweep changes loss:" in result.stderr and not jobs(tmp_path / "sweep")
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", *optuna, "sweep_scaled_objective=true"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "note: sweep_objective=loss/eval is on the scale" in result.stdout and len(jobs(tmp_path / "sweep")) == 2


def test_a_sweep_directory_on_a_read_only_filesystem_is_one_line(tmp_path, pairs_file, run_main):
    import subprocess

    mount = tmp_path / "read-only"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"a read-only tmpfs cannot be mounted here ({made.stderr.decode().strip()})")
    try:
        result = run_main(*sweep_args(tmp_path, pairs_file, mount / "sweep", "loss.beta=0.1,0.3"))
    finally:
        subprocess.run(["umount", str(mount)], check=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: could not write {mount / 'sweep'} (Read-only file system); choose a writable local_run_dir"
    )


def test_a_swept_value_is_named_as_a_user_writes_it():
    from reporting.sweep_report import override_text, written

    assert written(0.05 + 0.1) == "0.15" and written(1e-6) == "1e-06" and written(0.1) == "0.1"
    assert override_text("loss.beta=0.15000000000000002") == "loss.beta=0.15"
    assert override_text("lr=1e-3") == "lr=0.001"
    assert override_text("local_run_dir=/runs/a.b") == "local_run_dir=/runs/a.b"
    assert override_text("loss=dpo") == "loss=dpo" and override_text("seed=3") == "seed=3"


def test_the_private_names_of_hydra_a_sweep_drives_are_where_it_finds_them():
    import hydra

    from configuration import hydra_internals

    assert hydra_internals.problem() is None, f"hydra-core {hydra.__version__}: {hydra_internals.problem()}"


def test_a_hydra_that_moved_them_stops_a_sweep_in_one_line(tmp_path, pairs_file, run_main, monkeypatch):
    import hydra

    from configuration import hydra_internals

    monkeypatch.setattr(hydra_internals, "MOVED", "No module named 'hydra._internal.hydra'")
    result = run_main(*sweep_args(tmp_path, pairs_file, tmp_path / "sweep", "loss.beta=0.1,0.3"))
    assert result.returncode == 2 and result.stderr.count("error: ") == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: train.py -m drives Hydra's multirun through its internals, which hydra-core {hydra.__version__} "
        "moved (No module named 'hydra._internal.hydra'): pip install 'hydra-core>=1.3,<1.4' (single runs need none "
        "of it)"
    )
