"""Model cards: the README.md beside every export (a run's LATEST, export.py's directory, a LoRA adapter), in the
Hub's format: YAML metadata (base_model, datasets where they are Hub names, library_name, tags, model_name) and what
the run knows of itself: the loss and its settings, the examples and optimizer steps trained, the final held-out
metrics as metrics.jsonl has them, and the command that reproduces the run (config.reproducing_command). What a run
cannot know (a local model's or data's origin, a legacy checkpoint's settings) is left out rather than guessed.
Written here, above the config layer, by what knows the run's config: the checkpointer (training/checkpointer.py)
and export.py; reporting/model_card.py adds evaluation results to a card afterwards."""

import json
import re
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from omegaconf import DictConfig, OmegaConf

from config import reproducing_command
from pairs.sources import FILE_SUFFIXES, HUB_DATASETS, HUB_ID
from reporting.model_card import CARD

HUB_MODEL = re.compile(r"^[\w.-]+(/[\w.-]+)?$")  # a Hub model id: org/name, or a legacy name alone (gpt2-large)
RUN_SETTINGS = ("batch_size", "lr", "warmup_steps", "max_length", "max_prompt_length", "n_epochs", "seed", "layout")


def write_cards(directory: Path, run_dir: Path, examples: int | None, metrics: dict, model_name: str) -> None:
    """The cards of an export in `directory`: README.md where the merged model's weights are (library transformers),
    adapter/README.md for a LoRA adapter (library peft). The run's settings from run_dir/config.yaml and its steps
    from run_dir/metrics.jsonl, where they are; `examples` and `metrics` are the checkpoint's."""
    settings = run_dir / "config.yaml"
    run = OmegaConf.load(settings) if settings.is_file() else None
    steps = steps_at(run_dir / "metrics.jsonl", examples)
    for target, library in ((directory, "transformers"), (directory / "adapter", "peft")):
        if any(target.glob("*.safetensors")):  # a QLoRA export has no merged weights: its adapter's card alone
            ModelCard(card_text(run, library, model_name, examples, steps, metrics)).save(target / CARD)


def steps_at(log: Path, examples: int | None) -> int | None:
    """The optimizer steps taken at `examples`, as the run's metrics.jsonl counts them, or None."""
    if examples is None or not log.is_file():
        return None
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return next((r["counters/updates"] for r in reversed(records) if r.get("counters/examples") == examples), None)


def card_text(run, library: str, model_name: str, examples, steps, metrics: dict) -> str:
    data = ModelCardData(library_name=library, model_name=model_name)
    lines = [f"# {model_name}", ""]
    if run is not None:
        data.base_model, data.datasets = hub_base_model(run.model), hub_datasets(run.datasets) or None
        loss = run.loss.name
        data.tags = (["reward-model"] if loss == "reward" else [loss]) + (["lora"] if run.lora.enabled else [])
        lines += training_lines(run, library)
    trained = [f"{examples} examples"] if examples is not None else []
    trained += [f"{steps} optimizer steps"] if steps is not None else []
    if trained:
        lines += [f"Trained on {' in '.join(trained)}.", ""]
    if metrics:
        lines += [f"## Final held-out metrics (at {examples} examples)", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {name} | {value!r} |" for name, value in metrics.items()] + [""]
    command = reproducing_command(run) if run is not None else None
    if command is not None:
        lines += ["## Reproduce", "", "```bash", command, "```", ""]
    return f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)


def training_lines(run: DictConfig, library: str) -> list[str]:
    """The model, data and loss with its settings, as the run's config gives them."""
    model = run.model
    start = "a random initialisation of the config of" if model.random_init else "the weights of"
    what = "A LoRA adapter (peft) of" if library == "peft" else "A model fine-tuned from"
    lines = [f"{what} {start} `{model.name_or_path}`" + (f", then `{model.archive}`" if model.archive else "") + "."]
    lines += ["", f"Data: {', '.join(f'`{name}`' for name in run.datasets)}.", "", "## Training", ""]
    lines += [f"Loss `{run.loss.name}`; its settings and the run's:", "", "| setting | value |", "| --- | --- |"]
    loss = flattened(OmegaConf.to_container(run.loss, resolve=True), "loss")
    lora = flattened(OmegaConf.to_container(run.lora, resolve=True), "lora") if run.lora.enabled else {}
    shown = {**loss, **{key: run[key] for key in RUN_SETTINGS}, **lora}
    return lines + [f"| `{key}` | `{json.dumps(value)}` |" for key, value in shown.items()] + [""]


def flattened(values: dict, prefix: str) -> dict:
    """{"loss.beta": 0.1, ...}: nested mappings by their dotted keys."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}.{key}"
        flat.update(flattened(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def hub_base_model(model: DictConfig) -> str | None:
    """The Hub id the weights started from: none for a random initialisation or a local directory."""
    name = model.name_or_path
    return name if not model.random_init and HUB_MODEL.match(name) and not Path(name).exists() else None


def hub_datasets(names) -> list[str]:
    """The Hub datasets among the run's (hh, shp and se by their Hub names); local files and demo are left out."""
    found = []
    for name in names:
        if name in HUB_DATASETS:
            found.append(HUB_DATASETS[name])
        elif HUB_ID.match(name) and not name.endswith(FILE_SUFFIXES) and not Path(name).exists():
            found.append(name.partition(":")[0])
    return list(dict.fromkeys(found))
