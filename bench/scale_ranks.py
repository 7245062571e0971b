"""What each rank of a --scale run does (scale.py's worker): build the run, its policy's placement and reading timed
as "load", train, save the final checkpoint and export; or build and resume that checkpoint; each phase's peak
resident memory and seconds.

It runs over any version's code (--scale --versus GIT_REF), so it stands outside the package: scale.py copies it
beside that code under a name of its own (scale_bench.py: the version's modules come first on sys.path, its bench
among them), it imports nothing of bench, and it takes the project's modules from the tree it is given, laid out in
packages (modeling.distributed) or flat (distributed), as versions before the packages were."""

import contextlib
import importlib
import json
import os
import time
from pathlib import Path

import torch


def module_name(tree: str, name: str) -> str:
    """The name under which the code in `tree` has the project's module `name` (as this version lays it out,
    modeling.distributed): the same, or in a version from before the packages, its flat namesake (distributed)."""
    if "." in name and not (Path(tree) / name.split(".")[0]).is_dir():
        return name.rsplit(".", 1)[-1]
    return name


def distributed_module(tree: str):
    """The code in `tree`'s modeling.distributed (distributed, flat): ranks, process groups, free ports."""
    return importlib.import_module(module_name(tree, "modeling.distributed"))


class PhasePeaks:
    """This process's peak resident memory in each named phase: the kernel's high-water mark (VmHWM), reset as each
    phase starts (/proc/self/clear_refs), and the phase's seconds. What peaks between phases counts as "other"."""

    def __init__(self):
        self.peaks, self.seconds = {"other": 0}, {}

    @staticmethod
    def high_water_mark() -> int:
        line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        return int(line.split()[1]) * 1024

    @contextlib.contextmanager
    def phase(self, name: str):
        self.peaks["other"] = max(self.peaks["other"], self.high_water_mark())
        Path("/proc/self/clear_refs").write_text("5")
        start = time.perf_counter()
        yield
        self.seconds[name] = time.perf_counter() - start
        self.peaks[name] = max(self.peaks.get(name, 0), self.high_water_mark())
        Path("/proc/self/clear_refs").write_text("5")

    def result(self) -> dict:
        self.peaks["other"] = max(self.peaks["other"], self.high_water_mark())
        return {"peaks": self.peaks, "seconds": self.seconds}


def scale_rank(
    rank: int, world: int, port: int, tree: str, overrides: list[str], resume: str | None, result_file: str
) -> None:
    """One rank of a --scale run over the code in `tree`: build (its policy's placement and reading timed as "load"),
    train, save the final checkpoint and export ("save"); or, with `resume`, build and read that checkpoint
    ("resume")."""
    import build
    import config as configuration
    from trainers import Trainer

    distributed = distributed_module(tree)
    os.environ.update(distributed.rank_environment(rank, world, port))
    torch.set_num_threads(1)
    if world > 1:
        distributed.init_process_group(timeout_secs=1800)
    peaks = PhasePeaks()
    place = build.place

    def timed_place(*args, is_policy: bool = False, **kwargs):
        if not is_policy:
            return place(*args, is_policy=is_policy, **kwargs)
        with peaks.phase("load"):
            return place(*args, is_policy=is_policy, **kwargs)

    build.place = timed_place
    config = configuration.load(overrides + ([f"resume_from={resume}"] if resume else []))
    topology = distributed.Topology.create(config.trainer)
    run_dir = Path(config.local_run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    parts = build.build(config, topology)
    if resume:
        config.resume_from = None
        trainer = Trainer(parts, run_dir)
        with peaks.phase("resume"):
            trainer.resume(Path(resume))
    else:
        trainer = Trainer(parts, run_dir)
        with peaks.phase("train"):
            trainer.train()
        with peaks.phase("save"):
            trainer.save(run_dir / "LATEST", {}, final=True)
    Path(f"{result_file}.{rank}").write_text(json.dumps(peaks.result()))
    if world > 1:
        distributed.leave_process_group()


def scale_launch(result_file: str, tree: str, world: int, overrides: list[str], resume: str | None) -> None:
    """A --scale run of `world` ranks over the code in `tree` (spawned here, a fresh process group); each rank's
    result, in a list, to result_file."""
    args = (world, distributed_module(tree).free_port(), tree, overrides, resume, result_file)
    if world == 1:
        scale_rank(0, *args)
    else:
        torch.multiprocessing.spawn(scale_rank, args=args, nprocs=world)
    ranks = [json.loads(Path(f"{result_file}.{rank}").read_text()) for rank in range(world)]
    Path(result_file).write_text(json.dumps(ranks))
