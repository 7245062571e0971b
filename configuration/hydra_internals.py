"""Hydra's private API, fenced: the one place that imports `hydra._internal`, for a sweep (`train.py -m`, sweeps.py).

Why the public API does not serve: `@hydra.main` runs a multirun whole, and its sweeper hands each batch of jobs to
the launcher, which starts each job as it comes, so a job's config is first checked when that job starts: a bad value
in job 19 of an overnight sweep would be a traceback hours in. Checking every job before the first one starts needs
the multirun's steps (Hydra.multirun's) taken one at a time, with the sweeper's launcher wrapped so that it sees each
batch first: Hydra's own classes below, which its public API does not export. This is also what lets a job compose
configs of its own (its model card's reproducing command) without Hydra's global state. hydra-core is pinned to 1.3
(requirements.txt); where a release moves these names, single runs go on, a sweep stops with one line, and
tests/test_sweeps.py fails with one line naming the installed version."""

from typing import Callable

import hydra
from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, RunMode
from omegaconf import DictConfig, OmegaConf

from utils import UserError

try:
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path

    MOVED = None if hasattr(Sweeper, "validate_batch_is_legal") else "Sweeper.validate_batch_is_legal"
except ImportError as error:
    MOVED = str(error)


def problem() -> str | None:
    """One line where the installed Hydra lacks a private name a sweep uses, else None."""
    if MOVED is None:
        return None
    return (
        f"train.py -m drives Hydra's multirun through its internals, which hydra-core {hydra.__version__} moved "
        f"({MOVED}): pip install 'hydra-core>=1.3,<1.4' (single runs need none of it)"
    )


def app(config_dir: str) -> "Hydra":
    """Hydra over `config_dir`, as @hydra.main would create it, without holding Hydra's global state."""
    moved = problem()
    if moved:
        raise UserError(moved)
    search_path = create_config_search_path(config_dir)
    return Hydra(task_name="train", config_loader=ConfigLoaderImpl(config_search_path=search_path))


def compose(hydra_app: "Hydra", overrides: list[str]) -> DictConfig:
    """The multirun's config (Hydra's node included), as Hydra.multirun composes it."""
    return hydra_app.compose_config("config", overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=True)


def multirun(hydra_app: "Hydra", config: DictConfig, task: Callable, wrapped: Callable) -> None:
    """Hydra.multirun's steps: the configured sweeper over `task`, its launcher replaced by wrapped(launcher) (which
    checks each batch of jobs, naming the job at fault, before it launches any: the sweeper's own batch check is
    left to it), run between Hydra's callbacks."""
    callbacks = Callbacks(config)
    context = HydraContext(config_loader=hydra_app.config_loader, callbacks=callbacks)
    sweeper = Plugins.instance().instantiate_sweeper(config=config, hydra_context=context, task_function=task)
    launching = getattr(sweeper, "sweeper", sweeper)  # a plugin's sweeper keeps its launcher in its implementation
    launching.launcher = wrapped(launching.launcher)
    launching.validate_batch_is_legal = lambda batch: None
    callbacks.on_multirun_start(config=config, config_name="config")
    sweeper.sweep(arguments=OmegaConf.to_container(config.hydra.overrides.task))
    callbacks.on_multirun_end(config=config, config_name="config")
