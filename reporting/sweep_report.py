"""A sweep's directory read back (`python train.py -m ...`, sweeps.py): each job's state (job.json, which sweeps.py
writes as the job starts and ends), its settings (the config.yaml of its run) and its final held-out metrics (its
metrics.jsonl); the keys that differ between jobs, which label each job (`loss.beta=0.05`); and the summary after a
sweep, one table printed and written as sweep_summary.json and sweep_summary.md beside the jobs. evaluate.py reads
the same to find a sweep's finished jobs and their labels."""

import json
import math
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

import storage
from persistence import checkpoint

JOB_STATE = "job.json"
SUMMARY_JSON, SUMMARY_MD = "sweep_summary.json", "sweep_summary.md"
# where a job writes, or what only names it: never what tells two jobs apart
NOT_SETTINGS = ("local_run_dir", "resume_from", "local_dirs", "exp_name")
SHOWN_METRICS = ("loss/eval", "rewards_eval/accuracies", "rewards_eval/margins", "winrate/eval")


def is_sweep(directory: Path) -> bool:
    """A sweep's directory: its jobs' directories hold job.json."""
    return any(directory.glob(f"*/{JOB_STATE}"))


@dataclass
class Job:
    """One job of a sweep, as its directory holds it."""

    directory: Path
    number: int
    overrides: list[str]
    status: str  # pending, running, finished, failed, interrupted, dry run
    reason: str | None = None  # a failed job's one-line error
    resumed_from: str | None = None  # the checkpoint this attempt continued from
    earlier: bool = False  # finished in an earlier attempt of the sweep, not run again
    objective: dict | None = None  # {"name": metric, "value": its last value}

    @classmethod
    def read(cls, directory: Path) -> "Job":
        return cls(directory=directory, **json.loads((directory / JOB_STATE).read_text()))

    def write(self) -> None:
        state = {key: value for key, value in vars(self).items() if key != "directory"}
        with storage.writing(self.directory):
            self.directory.mkdir(parents=True, exist_ok=True)
        storage.write_text(self.directory / JOB_STATE, json.dumps(state, indent=1) + "\n")

    def finished(self) -> bool:
        """Its run ended (the final checkpoint, LATEST, is complete), or it ended without checkpoints (debug)."""
        marker = checkpoint.describe(self.directory / "LATEST")
        return self.status == "finished" or bool(marker and marker.get("final"))

    def settings(self) -> dict:
        """Its run's config as flat dotted keys (nothing before the job has started)."""
        run = self.directory / "config.yaml"
        return flat(OmegaConf.to_container(OmegaConf.load(run), resolve=True)) if run.exists() else {}

    def last_value(self, metric: str) -> float | None:
        """The last value of `metric` in its metrics.jsonl: the final eval's, for an eval metric."""
        values = [record[metric] for record in self.records() if metric in record]
        return values[-1] if values else None

    def final_metrics(self) -> dict[str, float]:
        evals = [record for record in self.records() if "loss/eval" in record]
        return {key: value for key, value in evals[-1].items() if key != "step"} if evals else {}

    def records(self) -> list[dict]:
        log = self.directory / "metrics.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def flat(tree: dict, prefix: str = "") -> dict:
    """{"loss": {"beta": 0.1}} as {"loss.beta": 0.1}."""
    items = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            items.update(flat(value, f"{prefix}{key}."))
        else:
            items[f"{prefix}{key}"] = value
    return items


def jobs(sweep_dir: Path) -> list[Job]:
    """The sweep's jobs in their order."""
    found = [Job.read(state.parent) for state in sweep_dir.glob(f"*/{JOB_STATE}")]
    return sorted(found, key=lambda job: job.number)


def written(value) -> str:
    """A setting's value as the command line writes it: 0.05, true, null, [a,b]; a float at 12 significant digits,
    as a user writes it (0.15 for range()'s 0.05 + 0.1 = 0.15000000000000002)."""
    if isinstance(value, str):
        return value
    if isinstance(value, float) and math.isfinite(value):
        value = float(f"{value:.12g}")
    return json.dumps(value, separators=(",", ":")).replace('"', "")


def override_text(arg: str) -> str:
    """An override as a user writes it: its value, where it is a float, as `written` writes one."""
    key, equals, value = arg.partition("=")
    try:
        number = float(value) if any(mark in value.lower() for mark in ".e") else None
    except ValueError:
        number = None
    return f"{key}={written(number)}" if equals and number is not None and math.isfinite(number) else arg


def differing_keys(settings: list[dict]) -> list[str]:
    """The keys whose values are not the same in every one of `settings`, in the first one's order."""
    keys = list(dict.fromkeys(key for one in settings for key in one))
    values = lambda key: {json.dumps(one.get(key), sort_keys=True) for one in settings}  # noqa: E731
    return [key for key in keys if key not in NOT_SETTINGS and len(values(key)) > 1]


def labels(settings: dict[str, dict]) -> dict[str, dict]:
    """Each name's differing keys and their values ({name: {key: value}}), from its settings (flat dicts)."""
    keys = differing_keys(list(settings.values()))
    return {name: {key: one.get(key) for key in keys} for name, one in settings.items()}


def label(keys: dict) -> str:
    return " ".join(f"{key}={written(value)}" for key, value in keys.items())


def status_text(job: Job) -> str:
    if job.status == "failed":
        return f"failed: {job.reason}"
    if job.status == "finished" and job.earlier:
        return "finished (an earlier attempt; not rerun)"
    if job.status == "finished" and job.resumed_from:
        return f"finished (resumed from {Path(job.resumed_from).name})"
    return job.status


def summary(sweep_dir: Path, notes: list[str] = ()) -> dict:
    """What sweep_summary.json holds: each job's differing keys, status, final held-out metrics and objective; the
    sweep's notes (an objective that does not rank its jobs)."""
    found = jobs(sweep_dir)
    keys = labels({str(job.number): job.settings() for job in found})
    shared = set.intersection(*(set(job.overrides) for job in found)) if found else set()
    return {
        "sweep": str(sweep_dir),
        "notes": list(notes),
        "jobs": [
            {
                "job": job.number,
                "directory": str(job.directory),
                "keys": keys[str(job.number)] if job.settings() else {},
                "overrides": job.overrides,
                "swept": [override_text(arg) for arg in job.overrides if arg not in shared],  # a job not yet run's
                "status": job.status,
                "status_text": status_text(job),
                "final_metrics": job.final_metrics(),
                "objective": job.objective,
            }
            for job in found
        ],
    }


def table_rows(report: dict) -> list[list[str]]:
    """The summary as rows of text, a header first: the metrics shown are those some job logged."""
    metrics = [m for m in SHOWN_METRICS if any(m in job["final_metrics"] for job in report["jobs"])]
    objective = next((job["objective"]["name"] for job in report["jobs"] if job["objective"]), None)
    header = ["job", "keys", "status", *metrics] + ([f"objective ({objective})"] if objective else [])
    rows = [header]
    for job in report["jobs"]:
        shown = [number(job["final_metrics"].get(metric)) for metric in metrics]
        value = [number(job["objective"]["value"] if job["objective"] else None)] if objective else []
        keys = label(job["keys"]) or " ".join(job["swept"]) or "-"
        rows.append([str(job["job"]), keys, job["status_text"], *shown, *value])
    return rows


def number(value) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def write_summary(sweep_dir: Path, notes: list[str] = ()) -> str:
    """sweep_summary.json and .md in the sweep directory; the table as text, to print, each note a line below it."""
    report = summary(sweep_dir, notes)
    rows = table_rows(report)
    storage.write_text(sweep_dir / SUMMARY_JSON, json.dumps(report, indent=1) + "\n")
    markdown = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * len(rows[0])]
    markdown += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows[1:]]
    written_notes = "".join(f"\nNote: {note}\n" for note in notes)
    storage.write_text(sweep_dir / SUMMARY_MD, f"# Sweep {sweep_dir}\n\n" + "\n".join(markdown) + "\n" + written_notes)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = [("  ".join(cell.ljust(width) for cell, width in zip(row, widths))).rstrip() for row in rows]
    return "\n".join(table + [f"note: {note}" for note in notes])
