"""evaluate.py's models resolved from what a user names: each candidate (a run's checkpoint, a from_pretrained
directory or Hub name, a peft adapter; a run's directory, a sweep's directory or a glob of them, each replaced by its
finished runs' final checkpoints), the reference the KL is measured against (the runs' own where they share one,
rebuilt where it was a random initialisation), and the one tokenizer every model must share. Its errors name
evaluate.py's key that gave the model (candidates[i], baseline, reference)."""

import contextlib
import glob
from pathlib import Path

from omegaconf import DictConfig

from configuration.messages import as_override
from reporting import sweep_report
from trained import kind, reference_differs, run_reference, runs_reference, trained_tokenizer
from utils import UserError

CHOSEN = "chosen"  # baseline=chosen: the dataset's chosen responses


def resolve_reference(config: DictConfig, cache_dir: Path) -> tuple[DictConfig | None, object]:
    """The runs' own reference set as config.reference where the candidates share one (its run's config returned,
    else None), and the candidates' tokenizer, checked to be every other model's (baseline, reference)."""
    run = runs_reference(config)
    if run is not None:  # the runs' own, trained with the candidates' tokenizer: no vocabulary to compare
        config.reference = run_reference(run, cache_dir)
    with named_key(config, config.candidates[0]):
        tokenizer = trained_tokenizer(config.candidates[0], cache_dir)
    for spec in [*config.candidates[1:], config.baseline, None if run else config.reference]:
        if spec not in (None, CHOSEN):
            with named_key(config, spec):
                other = trained_tokenizer(spec, cache_dir)
            check_same_vocabulary(tokenizer, other, config.candidates[0], spec)
    return run, tokenizer


def check_same_vocabulary(tokenizer, other, first: str, spec: str) -> None:
    """The models must read and write the same token ids: a completion's ids are scored by the reference."""
    if tokenizer.get_vocab() != other.get_vocab():
        raise UserError(f"{spec} has another tokenizer than {first}: their completions cannot be compared as token ids")


@contextlib.contextmanager
def named_key(config: DictConfig, spec: str):
    """A model's loading errors name evaluate.py's key that gave it (candidates[i], baseline, reference), not the
    key train.py would have read it from."""
    keys = [f"candidates[{i}]" for i, c in enumerate(config.candidates) if c == spec]
    keys += [key for key in ("baseline", "reference") if config[key] == spec]
    try:
        yield
    except UserError as error:
        key = keys[0] if keys else "candidates"
        raise UserError(str(error).replace("model.name_or_path=", f"{key}=")) from None


def sweep_jobs(config: DictConfig) -> dict[str, dict]:
    """The candidates with each sweep directory, run directory or glob replaced by the final checkpoints (LATEST)
    of its finished runs (in config.candidates); the keys that set a sweep's or a glob's runs apart, by candidate ({}
    without either), for the frontier, whose runs must share one reference (trained.REFERENCE_KEYS). What a glob matches
    that holds no run or model (a sweep's multirun.yaml, its summary) is left out, with a line."""
    candidates, runs = [], {}
    for i, spec in enumerate(config.candidates):
        matched = sorted(glob.glob(spec)) if glob.has_magic(spec) else [spec]
        if not matched:
            raise UserError(f"candidates: {spec} matches no directory")
        for path in map(Path, matched):
            found = sweep_report.jobs(path) if sweep_report.is_sweep(path) else []
            if (path / "LATEST").is_dir() and (path / "config.yaml").exists():
                found = [sweep_report.Job(path, len(runs), [], "run")]  # a run's directory; LATEST says if done
            problem = None if found else not_a_model(path)
            if problem and glob.has_magic(spec):
                print(f"candidates: {path} left out ({problem})")
                continue
            if problem:
                raise UserError(f"candidates[{i}]={spec} {problem}")
            for job in found:
                if job.finished() and (job.directory / "LATEST").is_dir():  # a sweep's or a glob's runs: labelled
                    labelled = glob.has_magic(spec) or job.overrides
                    runs[str(job.directory / "LATEST")] = job.settings() if labelled else None
                else:
                    print(f"candidates: {job.directory} left out ({job.status}: no final checkpoint)")
            candidates += [str(job.directory / "LATEST") for job in found if str(job.directory / "LATEST") in runs]
            candidates += [] if found else [str(path)]
    if not candidates:
        raise UserError(f"candidates={as_override(list(config.candidates))}: no finished run among them to evaluate")
    config.candidates = candidates
    swept = {name: settings for name, settings in runs.items() if settings is not None}  # a sweep's or a glob's
    if swept:
        check_same_reference(swept)
    return sweep_report.labels(swept) if swept else {}


def not_a_model(path: Path) -> str | None:
    """Why a local path is no candidate (a file; a directory holding no model, checkpoint or adapter), or None (a
    model's directory, or no local path: a Hub name)."""
    if not path.exists():
        return None
    if not path.is_dir():
        return "is a file, not a run, sweep or model directory"
    if (path / "config.json").exists() or kind(str(path)) != "model":
        return None
    return "is not a run, sweep or model directory: it holds no LATEST/ with config.yaml, no job.json, no config.json"


def check_same_reference(runs: dict[str, dict]) -> None:
    """The runs were trained against one reference, or their KLs are to different models."""
    first, settings = next(iter(runs.items()))
    for name, other in runs.items():
        differ = reference_differs(settings, other)
        if differ:
            raise UserError(
                f"candidates: {name} was trained against another reference than {first} ({differ}="
                f"{other.get(differ)}, not {settings.get(differ)}); a frontier needs one: evaluate them apart"
            )


def reference_line(config: DictConfig, run: DictConfig | None) -> str:
    """The one line that says which model the KL is measured against, and why that one."""
    if run is not None:
        how = f": a random initialisation of {run.model.name_or_path} from seed {run.seed}, rebuilt"
        return f"reference: {config.reference} (the runs' own{how if run.model.random_init else ''})"
    if config.reference is not None:
        return f"reference: {config.reference}"
    if config.baseline != CHOSEN:
        return f"reference: {config.baseline} (the baseline; reference=null)"
    return "reference: none (baseline=chosen, and the candidates share no run's reference): no KL; give reference=MODEL"
