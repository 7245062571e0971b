"""Entry point: python train.py [key=value ...] (Hydra overrides of config/config.yaml; types in config.py); with -m
(--multirun), a sweep of such runs (sweeps.py).

BasicTrainer runs in this process. FSDPTrainer and TensorParallelTrainer run on every rank of a torch.distributed
process group: under torchrun this process is one rank; otherwise train.py starts one worker per GPU (or `nproc`
CPU workers) on this machine (distributed.launch)."""

from reporting.host_memory import use_huge_pages

use_huge_pages()  # before torch allocates anything (host_memory.py)

import torch

torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

import contextlib
import sys
from pathlib import Path
from typing import Callable

from omegaconf import DictConfig, OmegaConf

import config as configuration
import rounds
import storage
import sweeps
from build import build, dry_run
from modeling.distributed import Topology, launch, process_rank, reported_errors
from persistence import checkpoint
from persistence.run_lock import RunLock
from reporting.wandb_run import init_wandb, wants_wandb
from trainers import Trainer
from training.run_log import LOGS
from utils import UserError, get_local_run_dir, set_seed


def prepare_run_dir(config: DictConfig, hold: contextlib.ExitStack | None = None) -> Path:
    """The run directory, created, with this run's config.yaml; resume_from=auto resolved to the newest complete
    checkpoint there, or to null: a fresh start, which clears the logs of an attempt that never reached one.
    First of all the directory is locked (run_lock: one run per directory; another run's directory is refused in
    one line): on `hold` until it closes (run: the whole run), else for this call only."""
    run_dir = (
        Path(config.local_run_dir) if config.local_run_dir else get_local_run_dir(config.exp_name, config.local_dirs)
    )
    with contextlib.ExitStack() as this_call:
        (this_call if hold is None else hold).enter_context(RunLock(run_dir))
        if config.resume_from == "auto":
            resume = checkpoint.newest(run_dir)
            print("resume_from=auto: " + (f"continuing from {resume}" if resume else f"no checkpoint in {run_dir} yet"))
            for log in LOGS if resume is None else ():
                (run_dir / log).unlink(missing_ok=True)
            config.resume_from = str(resume) if resume else None
        elif (run_dir / "metrics.jsonl").exists() and config.resume_from is None:
            raise UserError(
                f"{run_dir} already holds a run; choose another local_run_dir, or continue it with resume_from=auto "
                f"local_run_dir={run_dir}"
            )
        config.local_run_dir = str(run_dir)
        storage.write_text(run_dir / "config.yaml", OmegaConf.to_yaml(config, resolve=True))
    return run_dir


def build_trainer(config: DictConfig, topology: Topology, run_dir: Path, wandb_run=None) -> Trainer:
    """The run's parts (build.py) and the Trainer over them, resumed where resume_from says; a run of rounds keeps
    its progress as a checkpoint part of its own (rounds.RoundProgress)."""
    more_parts = {rounds.PART: rounds.RoundProgress()} if config.rounds.n else {}
    return Trainer(build(config, topology), run_dir, wandb_run, more_parts)


def run(config: DictConfig) -> None:
    """One rank's whole run (the only rank, for BasicTrainer), on a checked config (config.load)."""
    topology = Topology.create(config.trainer, config.tensor_parallel_size, config.sequence_parallel_size)
    set_seed(config.seed)
    with contextlib.ExitStack() as lock:  # rank 0 holds the run directory's lock until the run ends, however it ends
        run_dir, config.resume_from = topology.broadcast(
            topology.run_on_main(lambda: (str(prepare_run_dir(config, lock)), config.resume_from))
        )
        run_dir = Path(run_dir)
        config.local_run_dir = str(run_dir)
        print(f"run directory: {run_dir}; {topology.describe()}")
        wandb_run = topology.run_on_main(lambda: init_wandb(config, run_dir)) if wants_wandb(config) else None
        trainer = build_trainer(config, topology, run_dir, wandb_run)
        lock.enter_context(trainer.checkpoints)  # a save in the background ends before the lock is let go
        if config.rounds.n:
            rounds.Rounds(trainer).run()
        else:
            trainer.train()
        trainer.finish()
        if wandb_run is not None:
            wandb_run.finish()


def start(config: DictConfig, world_size: int, rank_main: Callable[[DictConfig], None] = run) -> None:
    """A checked config's run: a dry run in this process, else rank_main(config) on each of its processes."""
    OmegaConf.resolve(config)  # workers resolve nothing: the run directory and exp_name are fixed here
    if config.dry_run:  # one process, whatever the trainer: nothing is computed
        with reported_errors():
            if process_rank() == 0:
                dry_run(config, world_size)
    else:
        launch(rank_main, config, world_size)


def main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{__doc__}\nThe defaults (config/config.yaml, config/model/, config/loss/):\n")
        print(OmegaConf.to_yaml(configuration.load([])))
        return
    if sweeps.requested(args):  # -m or --multirun: one job per combination of values, each one run as here
        sweeps.main(args, start, run)
        return
    try:
        config = configuration.load(args)
        world_size = configuration.processes(config)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    start(config, world_size)


if __name__ == "__main__":
    main(sys.argv[1:])
