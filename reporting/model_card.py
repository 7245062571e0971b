"""A model card's model-index: evaluation results added to the card (README.md, in the Hub's format) of an export
that holds one (training/model_card.py writes them), each replacing a result of the same dataset and metric."""

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard

import storage
from utils import UserError, first_line

CARD = "README.md"


def add_results(directory: Path, results: list[dict]) -> bool:
    """Add evaluation results to the model card in directory/README.md (its model-index): each result replaces one
    with the same (dataset_name, metric_name), the others stay. False where there is no card (no README.md, or one
    without YAML metadata). Each result: task_type, dataset_type, dataset_name, metric_type, metric_name,
    metric_value (a float) and metric_config (a str or None)."""
    path = Path(directory) / CARD
    if not path.is_file():
        return False
    try:
        card = ModelCard.load(path)
    except ValueError as error:
        raise UserError(f"{path}: its YAML metadata cannot be read ({first_line(error)})") from None
    if not card.data.to_dict():
        return False
    added = {(r["dataset_name"], r["metric_name"]): EvalResult(**r) for r in results}
    kept = [r for r in card.data.eval_results or [] if (r.dataset_name, r.metric_name) not in added]
    card.data.eval_results = kept + list(added.values())
    card.data.model_name = card.data.model_name or Path(directory).resolve().name
    storage.write_text(path, card.content)  # written whole: a card that fails to save is the card it was
    return True
