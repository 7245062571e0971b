"""The run's Weights & Biases run: online with a login, offline without one (one line says so), never a prompt and
never a crash; train.py's and evaluate.py's."""

import netrc
import os
import secrets
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

import storage
from utils import first_line


def init_wandb(config: DictConfig, run_dir: Path):
    """A wandb run: online with a login, else offline (one line says so); never a prompt, never a crash. A run
    directory keeps one wandb run: a resumed run logs on to it (the steps redone after a crash log the same values,
    which wandb keeps once)."""
    import wandb  # on use: ~1.3 s to import, and only runs that log to wandb need it

    id_file = run_dir / "wandb-run-id"
    if not id_file.exists():
        storage.write_text(id_file, secrets.token_hex(8))  # wandb run ids: letters and digits

    mode = os.environ.get("WANDB_MODE") or None
    if mode is None and not has_wandb_login():
        mode = "offline"
        print(f"wandb: no login found, logging offline to {run_dir}/wandb (upload later with `wandb sync`)")
    kwargs = dict(
        entity=config.wandb.entity,
        project=config.wandb.project,
        name=config.exp_name,
        dir=str(run_dir),
        config=OmegaConf.to_container(config, resolve=True),
        settings=wandb.Settings(init_timeout=30, console="off"),
        id=id_file.read_text().strip(),
        resume="allow",
    )
    try:
        return wandb.init(mode=mode or "online", **kwargs)
    except Exception as error:  # no network, server down, bad key: log offline rather than lose the run
        if mode == "offline":
            return no_wandb(error, run_dir)
        print(f"wandb: could not start online ({type(error).__name__}), logging offline to {run_dir}/wandb")
        wandb.teardown()  # the failed attempt still holds the run id in wandb's service
    try:
        return wandb.init(mode="offline", **kwargs)
    except Exception as error:
        return no_wandb(error, run_dir)


def no_wandb(error: Exception, run_dir: Path) -> None:
    """No wandb run (its offline directory cannot be written, say): the run goes on, logging to metrics.jsonl."""
    import wandb  # on use: ~1.3 s to import, and only runs that log to wandb need it

    print(f"wandb: could not start ({first_line(error)}); the run logs to {run_dir / 'metrics.jsonl'} only")
    wandb.teardown()


def wants_wandb(config: DictConfig) -> bool:
    return config.wandb.enabled and not config.debug


def has_wandb_login() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False
