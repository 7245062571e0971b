"""python train.py -m KEY=A,B [KEY=range(..) ...]: a sweep, as Hydra runs one (`-m` or `--multirun`).

Hydra's sweeper turns the command line into jobs (the basic sweeper: the grid of every comma list, range(), choice()
and glob(); hydra/sweeper=optuna: trials it chooses), and its launcher runs them (the basic one: one after another,
in this process; hydra/launcher=submitit_slurm: Slurm jobs). Each job is the single run of its keys, run as
`python train.py KEYS` runs it (an FSDP job starts its ranks as a single run does), in its own numbered run
directory of one sweep directory:

    SWEEP/                      local_run_dir, else <local_dir>/<user>/<exp_name>_<timestamp>/
      multirun.yaml             Hydra's record of the sweep
      sweep_summary.json, .md   each job's differing keys, final held-out metrics, status and objective
      0/, 1/, ...               one run directory per job: config.yaml, metrics.jsonl, LATEST, ... and job.json

Every job's config is composed and checked before the first job starts (an error names the job and its keys).
`resume_from=auto local_run_dir=SWEEP` on the same command skips the finished jobs and continues the others from
their newest checkpoints. Each job returns `sweep_objective` (default loss/eval: its last logged value) to the
sweeper, which is what Optuna's minimizes or maximizes. The jobs' wandb runs share one group, the sweep's name."""

import copy
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hydra.core.config_loader import ConfigLoader
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

import config as configuration
import storage
from configuration import hydra_internals
from configuration.checks import check_writable_dir
from configuration.composition import CONFIG_DIR, explain, hydra_quoted, normalized, selected_options
from modeling.distributed import process_rank
from persistence import checkpoint
from reporting.sweep_report import JOB_STATE, SUMMARY_MD, Job, jobs, override_text, write_summary
from utils import UserError, first_line, get_local_run_dir

MULTIRUN = ("-m", "--multirun")
OBJECTIVE = "sweep_objective"
DEFAULT_OBJECTIVE = "loss/eval"
SCALED = "sweep_scaled_objective"  # =true: optimize an objective whose scale the swept keys change, all the same
NOT_SWEPT = ("local_run_dir", "local_dirs", "resume_from")  # one sweep directory, continued as a whole
# Hydra's official plugins: (group, option) -> (the module that brings the option, the package to pip install)
PLUGINS = {
    ("sweeper", "optuna"): ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper"),
    ("sweeper", "ax"): ("hydra_plugins.hydra_ax_sweeper", "hydra-ax-sweeper"),
    ("sweeper", "nevergrad"): ("hydra_plugins.hydra_nevergrad_sweeper", "hydra-nevergrad-sweeper"),
    ("launcher", "submitit_slurm"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    ("launcher", "submitit_local"): ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher"),
    ("launcher", "joblib"): ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher"),
    ("launcher", "rq"): ("hydra_plugins.hydra_rq_launcher", "hydra-rq-launcher"),
    ("launcher", "ray"): ("hydra_plugins.hydra_ray_launcher", "hydra-ray-launcher"),
}
# metrics a sweep should maximize; any other logged metric (a loss) is minimized
HIGHER_IS_BETTER = ("winrate/", "rewards_eval/accuracies", "rewards_eval/margins", "rewards_train/accuracies")
# metrics on the scale of a job's own loss settings: the loss, and the implicit rewards beta x log-ratio (DPO's beta
# scales both); their accuracies, the win rate and the policy's log-probs are comparable between any two jobs
SCALED_BY_LOSS = ("loss/", "rewards_")
COMPARABLE = "winrate/eval (with eval_winrate_prompts and a judge), rewards_eval/accuracies"

Start = Callable[[DictConfig, int, Callable[[DictConfig], None]], None]  # train.start: a checked config's run


def requested(args: list[str]) -> bool:
    return any(arg in MULTIRUN for arg in args)


@dataclass
class Plan:
    """A sweep's command line, read: Hydra's own overrides (with the sweep directory and logging), train.py's keys
    (the swept ones as Hydra reads them, the others as a single run reads them), and what each job returns."""

    hydra_overrides: list[str]
    task_overrides: list[str]
    directory: Path
    objective: str
    resume: bool
    swept: list[str]  # the keys whose values the sweeper chooses, which name each job
    scale_note: str | None  # the objective's scale moves with the swept keys (scale_note)
    scaled_allowed: bool  # sweep_scaled_objective=true: an optimizing sweeper may follow it all the same
    dry_run: bool  # every job plans and computes nothing

    @classmethod
    def read(cls, args: list[str]) -> "Plan":
        args = [arg for arg in args if arg not in MULTIRUN]
        objectives = [arg.partition("=")[2] for arg in args if arg.startswith(f"{OBJECTIVE}=")]
        scaled = [arg.partition("=")[2] for arg in args if arg.startswith(f"{SCALED}=")]
        if any(value not in ("true", "false") for value in scaled):
            raise UserError(f"{SCALED}={scaled[-1]} must be true or false")
        ours = [arg for arg in args if arg.startswith((f"{OBJECTIVE}=", f"{SCALED}="))]
        hydra_args = [arg for arg in args if arg.lstrip("+~").startswith(("hydra.", "hydra/"))]
        task_args = [arg for arg in args if arg not in hydra_args and arg not in ours]
        for arg in hydra_args:
            check_hydra_override(arg)
        swept = [arg for arg in task_args if is_sweep(arg)]
        fixed = [arg for arg in task_args if arg not in swept]
        for arg in swept:
            if arg.lstrip("+").partition("=")[0] in NOT_SWEPT:
                raise UserError(f"{arg}: a sweep has one directory and resumes as a whole; give one value")
        base = configuration.composed(fixed)  # one line naming the key, as for a single run
        directory = Path(base.local_run_dir or get_local_run_dir(base.exp_name, list(base.local_dirs)))
        check_directory(base, directory)
        if base.resume_from == "auto" and any(arg.startswith("hydra/sweeper=") for arg in hydra_args):
            raise UserError(
                "resume_from=auto continues a sweep whose jobs are fixed before it starts (the basic sweeper's "
                "grid); another sweeper chooses them as it goes: start a new sweep in another local_run_dir"
            )
        create_directory(directory)  # once the command line is known to start a sweep there
        ours = [f"hydra.sweep.dir={hydra_quoted(str(directory))}"]
        for group in ("job_logging", "hydra_logging"):  # jobs print as single runs do, not through Hydra's logging
            if not any(arg.startswith(f"hydra/{group}=") for arg in hydra_args):
                ours.append(f"hydra/{group}=none")
        group = os.environ.get("WANDB_RUN_GROUP", directory.name)  # wandb reads it at each job's wandb.init
        ours.append(f"++hydra.job.env_set.WANDB_RUN_GROUP={hydra_quoted(group)}")
        as_single_run = dict(zip(fixed, normalized(fixed, selected_options(fixed))))
        task = [as_single_run.get(arg, arg) for arg in task_args]  # in the order given: a later value wins
        objective = objectives[-1] if objectives else DEFAULT_OBJECTIVE
        swept_keys = [arg.lstrip("+").partition("=")[0] for arg in swept]
        resume, allowed = base.resume_from == "auto", scaled[-1:] == ["true"]
        note = scale_note(objective, swept_keys)
        return cls(hydra_args + ours, task, directory, objective, resume, swept_keys, note, allowed, base.dry_run)


def scale_note(objective: str, swept: list[str]) -> str | None:
    """One line where the objective is on the scale of each job's own loss settings and the swept keys change them
    (the loss, or a loss.* key): its values then measure each job by a yardstick of its own and do not rank the
    jobs (a larger beta alone lowers DPO's loss), so the line names objectives that do."""
    moved = [key for key in swept if key == "loss" or key.startswith("loss.")]
    if not moved or not objective.startswith(SCALED_BY_LOSS) or objective.endswith("/accuracies"):
        return None
    return (
        f"sweep_objective={objective} is on the scale of each job's loss settings, and the sweep changes "
        f"{' and '.join(moved)}: its values do not rank the jobs; comparable between them: {COMPARABLE}"
    )


def is_sweep(arg: str) -> bool:
    """Whether Hydra reads `arg` as a sweep (a,b; range(); choice(); glob(); interval(); tag())."""
    try:
        return OverridesParser.create().parse_override(arg).is_sweep_override()
    except HydraException:
        return False  # not Hydra's syntax at all: the single run's reading of it says what is wrong


def check_hydra_override(arg: str) -> None:
    """A plugin's option needs its package; the sweep directory is local_run_dir."""
    key, _, value = arg.partition("=")
    if key.startswith("hydra/") and (key[len("hydra/") :], value) in PLUGINS:
        module, package = PLUGINS[key[len("hydra/") :], value]
        if not installed(module):
            raise UserError(f"{arg} needs Hydra's plugin, which is not installed: pip install {package}")
    if key.lstrip("+") == "hydra.sweep.dir":
        raise UserError(
            f"{arg}: a sweep's directory is local_run_dir=DIR (null: <local_dir>/<user>/<exp_name>_<timestamp>), "
            "its jobs in DIR/0, DIR/1, ..."
        )


def is_interval(arg: str) -> bool:
    """Whether `arg` sweeps a continuous range (interval(), tagged or not): a sampling sweeper's syntax."""
    try:
        return OverridesParser.create().parse_override(arg).value_type == ValueType.INTERVAL_SWEEP
    except HydraException:
        return False


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no Hydra plugin at all: not even their namespace, hydra_plugins
        return False


def check_directory(base: DictConfig, directory: Path) -> None:
    """A new sweep takes a directory no sweep or run holds; resume_from=auto continues the one named."""
    if base.resume_from not in (None, "auto"):
        raise UserError(
            f"resume_from={base.resume_from} would start every job of the sweep from one checkpoint; a sweep takes "
            "resume_from=auto (each job continues in its own directory) or null"
        )
    if base.resume_from == "auto" and base.local_run_dir is None:
        raise UserError(
            "resume_from=auto continues the sweep in local_run_dir, but local_run_dir=null names a new directory "
            "each time; set local_run_dir=DIR and re-run the same command after a crash"
        )
    if (directory / "metrics.jsonl").exists():
        raise UserError(f"{directory} holds a single run; a sweep needs a directory of its own (local_run_dir)")
    if jobs(directory) and base.resume_from is None:
        raise UserError(
            f"{directory} already holds a sweep; choose another local_run_dir, or continue it with resume_from=auto "
            f"local_run_dir={directory}"
        )


def create_directory(directory: Path) -> None:
    """The sweep directory, created now and written to once: where it cannot be (a file in its path, a read-only
    filesystem, a full disk; an existing directory too), one line says so, as a single run's would, before Hydra's
    sweeper tries to write its multirun.yaml there."""
    check_writable_dir("local_run_dir", str(directory))
    with storage.writing(directory, advice="choose a writable local_run_dir"):
        directory.mkdir(parents=True, exist_ok=True)
    storage.check_writable(directory, advice="choose a writable local_run_dir")


def main(args: list[str], start: Start, run: Callable[[DictConfig], None]) -> None:
    """The sweep, then its summary (after a failed job or a stop too); an error is one line, with exit code 2."""
    try:
        plan = Plan.read(args)
    except UserError as error:
        exit_with(error)
    print(f"sweep: {plan.directory}")
    error = None
    try:
        sweep(plan, start, run)
    except UserError as raised:  # a job that fails its checks, before any job starts; or the first failed job
        error = raised
    finally:  # a stop on a signal passes through, after the summary
        if process_rank() == 0 and jobs(plan.directory):
            notes = [plan.scale_note] if plan.scale_note else []
            print(f"{write_summary(plan.directory, notes)}\nsweep summary: {plan.directory / SUMMARY_MD}")
    failed = [job for job in jobs(plan.directory) if job.status == "failed"]
    if failed:
        first = failed[0]
        error = UserError(
            f"{len(failed)} of {len(jobs(plan.directory))} jobs failed; job {first.number} "
            f"({named(first.overrides, plan.swept)}): {first.reason}"
        )
    if error is not None:
        exit_with(error)


def exit_with(error: UserError) -> None:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


def sweep(plan: Plan, start: Start, run: Callable[[DictConfig], None]) -> None:
    """Hydra's multirun (configuration/hydra_internals.py), each batch of jobs checked before its launcher starts
    any (CheckedLauncher)."""
    app = hydra_internals.app(str(CONFIG_DIR))
    overrides = plan.hydra_overrides + plan.task_overrides
    try:
        config = hydra_internals.compose(app, overrides)
    except (HydraException, OmegaConfBaseException) as error:
        raise UserError(explain(error, overrides, selected_options([]))) from None
    basic = config.hydra.sweeper._target_.endswith("BasicSweeper")
    check_sweeper(plan, basic)
    check_direction(config, plan.objective, basic)
    task = functools.partial(job, start, run, plan.objective, not basic, plan.swept)
    launchers = []

    def checked(launcher) -> CheckedLauncher:
        launchers.append(CheckedLauncher(launcher, app.config_loader, config, plan))
        return launchers[-1]

    try:
        hydra_internals.multirun(app, config, task, checked)
    except OSError as error:
        if any(launcher.batches for launcher in launchers):
            raise
        # Before its first batch, Hydra's sweeper writes only its record of the sweep, with OmegaConf.save (no
        # storage helper): a disk that filled since create_directory's check fails there, without a filename
        # where the write rather than the open failed.
        where = Path(error.filename) if error.filename else plan.directory / "multirun.yaml"
        raise storage.failed(where, error) from None


def check_sweeper(plan: Plan, basic: bool) -> None:
    """What the sweeper takes: interval() only where it samples; an objective that ranks the jobs where it
    optimizes (unless sweep_scaled_objective=true), else a note before the first job."""
    interval = next((arg for arg in plan.task_overrides if is_interval(arg)), None)
    if basic and interval:
        raise UserError(
            f"{interval}: interval() is a continuous range, which a sampling sweeper draws from (hydra/sweeper=optuna"
            "); Hydra's basic sweeper takes a list (a,b,c), range(start,stop,step) or choice(a,b)"
        )
    if plan.dry_run and not basic:
        raise UserError(
            "dry_run=true with an optimizing sweeper: it chooses each trial from the objectives of the trials before, "
            "which a dry run does not compute; dry-run one trial's keys as a single run (or the basic sweeper's grid)"
        )
    if plan.scale_note and not basic and not plan.scaled_allowed:
        raise UserError(
            f"{plan.scale_note}. An optimizing sweeper would follow the scale: choose one of them, or add "
            f"{SCALED}=true to optimize {plan.objective} all the same"
        )
    if plan.scale_note:
        print(f"note: {plan.scale_note}")


def check_direction(config: DictConfig, objective: str, basic: bool) -> None:
    """A sweeper that optimizes must go the objective's way (Optuna minimizes unless told)."""
    direction = OmegaConf.select(config, "hydra.sweeper.direction")
    if basic or direction is None or OmegaConf.is_list(direction):  # several objectives: the user's to order
        return
    direction = getattr(direction, "name", direction)  # Optuna's is an enum
    wanted = "maximize" if objective.startswith(HIGHER_IS_BETTER) else "minimize"
    if direction != wanted:
        raise UserError(
            f"sweep_objective={objective} is better {'higher' if wanted == 'maximize' else 'lower'}, but "
            f"hydra.sweeper.direction={direction}: add hydra.sweeper.direction={wanted}"
        )


class JobFailed(UserError):
    """A job ended with an error (its one line is in its job.json); the sweep goes on to the next job."""


class CheckedLauncher:
    """The sweeper's launcher, given each batch of jobs only once all of them compose and pass the checks a
    single run passes (configuration.check, the processes it takes), each job's keys read as a single run reads
    them; an error is one line naming the job."""

    def __init__(self, launcher, loader: ConfigLoader, config: DictConfig, plan: Plan):
        self.launcher, self.loader, self.config = launcher, loader, config
        self.objective, self.swept = plan.objective, plan.swept
        self.batches = 0  # handed over by the sweeper: from the first on, an error is no longer the sweeper's own

    def launch(self, job_overrides, initial_job_idx: int):
        self.batches += 1
        batch = []
        for number, overrides in enumerate(job_overrides, initial_job_idx):
            try:
                batch.append(self.checked(list(overrides), number))
            except UserError as error:
                raise UserError(f"job {number} ({named(overrides, self.swept)}): {error}") from None
        for number, (overrides, job_dir) in enumerate(zip(job_overrides, batch), initial_job_idx):
            if not (job_dir / JOB_STATE).exists():  # listed in the summary before it starts
                Job(job_dir, number, list(overrides), "pending").write()
        return self.launcher.launch([normalized_job(list(o)) for o in job_overrides], initial_job_idx)

    def checked(self, overrides: list[str], number: int) -> Path:
        """The job's config checked as its run will be; its directory."""
        try:
            config = self.loader.load_sweep_config(self.config, normalized_job(overrides))
        except (HydraException, OmegaConfBaseException) as error:
            raise UserError(explain(error, overrides, selected_options(overrides))) from None
        with open_dict(config):
            config.hydra.job.num = config.hydra.job.id = number  # as the launchers set them, for the subdir
        job_dir = Path(config.hydra.sweep.dir) / str(OmegaConf.select(config, "hydra.sweep.subdir"))
        task = job_config(config, job_dir)
        configuration.check(task)
        configuration.processes(task)
        if self.objective.startswith("winrate/") and not task.eval_winrate_prompts:
            objective = f"sweep_objective={self.objective}"
            raise UserError(f"{objective} is logged only with eval_winrate_prompts > 0 and a judge")
        check_same_job(task, job_dir)
        return job_dir


def named(overrides: list[str], swept: list[str]) -> str:
    """A job by the values of the swept keys, each as a user writes it: loss.beta=0.15 lr=0.001 (range() adds in
    binary: its 0.15000000000000002 is the 0.15 the user meant)."""
    return " ".join(override_text(arg) for arg in overrides if arg.lstrip("+").partition("=")[0] in swept)


def normalized_job(overrides: list[str]) -> list[str]:
    """A job's keys as a single run reads them (configuration.composition.normalized)."""
    return normalized(overrides, selected_options(overrides))


def job_config(config: DictConfig, job_dir: Path) -> DictConfig:
    """The run config of a job: Hydra's node taken out, its run directory the job's. A copy that keeps the typed
    `Config` (OmegaConf.masked_copy would make a plain mapping of it), so that configuration.check runs every check
    of Config.__post_init__, the cross-key ones among them, as Hydra's run_job also keeps it."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    task.local_run_dir = str(job_dir)
    return task


def check_same_job(task: DictConfig, job_dir: Path) -> None:
    """A job directory an earlier attempt left holds a run of this very job: a changed sweep command would resume
    another job's run under these keys."""
    before = job_dir / "config.yaml"
    if not before.exists():
        return
    earlier = OmegaConf.to_container(OmegaConf.load(before), resolve=True)
    changed = configuration.differences(earlier, OmegaConf.to_container(task, resolve=True), "", str)
    if changed:
        raise UserError(
            f"{job_dir} holds a run of other settings (this job changes {' '.join(changed[:3])}); run the sweep's "
            "own command again, or start a new sweep in another local_run_dir"
        )


def job(start: Start, run: Callable, objective: str, required: bool, swept: list[str], config: DictConfig):
    """One job, as Hydra's launcher calls it: the single run of its keys in its own directory (skipped when an
    earlier attempt finished it); its objective's last value, for the sweeper."""
    hydra = HydraConfig.get()
    job_dir, number = Path(hydra.runtime.output_dir), hydra.job.num
    config.local_run_dir = str(job_dir)
    state = Job(job_dir, number, list(hydra.overrides.task), "running")
    keys = named(state.overrides, swept)
    if config.resume_from == "auto" and (job_dir / JOB_STATE).exists() and Job.read(job_dir).finished():
        print(f"job {number} ({keys}): finished in an earlier attempt of this sweep, not run again")
        state = Job.read(job_dir)
        state.status, state.earlier = "finished", True
        state.write()
        return objective_value(state, objective, required)
    resumed = checkpoint.newest(job_dir) if config.resume_from == "auto" else None
    state.resumed_from = str(resumed) if resumed else None
    print(f"job {number} ({keys}): {job_dir}" + (f", continuing from {resumed.name}" if resumed else ""))
    state.write()
    try:
        start(config, configuration.processes(config), functools.partial(job_rank, run))
    except SystemExit as exit:
        stopped = isinstance(exit.code, int) and exit.code > 128  # a signal: the whole sweep stops
        reason = Job.read(job_dir).reason or f"exit code {exit.code}, its error printed above"
        state.status, state.reason = ("interrupted" if stopped else "failed"), reason
        state.write()
        if stopped:
            raise
        raise JobFailed(state.reason or f"exit code {exit.code}, its error printed above") from None
    except Exception as error:  # a bug's traceback: Hydra keeps it, and raises it after the other jobs
        state.status, state.reason = "failed", first_line(error)
        state.write()
        raise
    state.status = "dry run" if config.dry_run else "finished"
    state.objective = {"name": objective, "value": state.last_value(objective)}
    state.write()
    return objective_value(state, objective, required)


def job_rank(run: Callable[[DictConfig], None], config: DictConfig) -> None:
    """run(config) on one rank of a job; rank 0 notes an error's line in the job's job.json before it goes on up."""
    try:
        run(config)
    except Exception as error:
        if process_rank() == 0:
            state = Job.read(Path(config.local_run_dir))
            state.reason = first_line(error)
            state.write()
        raise


def objective_value(state: Job, objective: str, required: bool) -> float | None:
    """What the sweeper gets back: the objective's last logged value (an optimizing sweeper needs one)."""
    value = state.last_value(objective)
    if value is None and required:
        logged = sorted({key for record in state.records() for key in record} - {"step"})
        missing = f"sweep_objective={objective} was not logged by job {state.number}"
        raise JobFailed(f"{missing}; it logged: {', '.join(logged)}")
    return value
