"""Model cards (reporting/model_card.py): every export (a run's LATEST, export.py's directory, a LoRA adapter) holds a
README.md that huggingface_hub reads, with the run's loss, steps, final held-out metrics as metrics.jsonl has them and
the command that composes the run's config again; add_results adds evaluation results to its model-index."""

import re
import shlex

import pytest
from huggingface_hub import ModelCard
from omegaconf import OmegaConf

import config
import export
import train
from config import NOT_REPRODUCED
from conftest import read_jsonl
from reporting.model_card import add_results
from training.model_card import card_text

METRIC_ROW = re.compile(r"^\| (\S+) \| (\S+) \|$", re.MULTILINE)


def card_metrics(card: ModelCard) -> dict[str, float]:
    """The final held-out metrics table of a card, read back."""
    section = card.text.split("## Final held-out metrics")[1].split("##")[0]
    return {name: float(value) for name, value in METRIC_ROW.findall(section) if name not in ("metric", "---")}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished tiny LoRA run (so LATEST holds the merged model and adapter/), and its checkpoint at 16 examples."""
    from conftest import arithmetic_pairs, tiny_run_overrides, write_jsonl

    root = tmp_path_factory.mktemp("card")
    pairs = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    train.run(config.load([*tiny_run_overrides(root, pairs), "lora.enabled=true", "loss.beta=0.2"]))
    return root / "run"


def test_latest_carries_a_card_with_the_loss_steps_and_final_metrics_of_metrics_jsonl(lora_run):
    card = ModelCard.load(lora_run / "LATEST" / "README.md")
    log = read_jsonl(lora_run / "metrics.jsonl")
    final = [record for record in log if "loss/eval" in record][-1]
    assert card.data.library_name == "transformers" and card.data.model_name == "run"
    assert card.data.tags == ["dpo", "lora"] and "| `loss.beta` | `0.2` |" in card.text
    assert card_metrics(card) == {k: v for k, v in final.items() if k != "step" and not k.startswith("counters/")}
    assert (
        f"Trained on {final['counters/examples']} examples in {final['counters/updates']} optimizer steps." in card.text
    )
    adapter = ModelCard.load(lora_run / "LATEST" / "adapter" / "README.md")
    assert adapter.data.library_name == "peft" and card_metrics(adapter) == card_metrics(card)


def test_the_cards_command_composes_the_runs_config_again(lora_run):
    card = ModelCard.load(lora_run / "LATEST" / "README.md")
    command = card.text.split("```bash\n")[1].split("\n```")[0]
    words = shlex.split(command)
    assert words[:2] == ["python", "train.py"] and "lora.enabled=true" in words and "loss.beta=0.2" in words
    again = OmegaConf.to_container(config.load(words[2:]), resolve=True)
    ran = OmegaConf.to_container(OmegaConf.load(lora_run / "config.yaml"), resolve=True)
    for key in NOT_REPRODUCED:
        again.pop(key), ran.pop(key)
    assert again == ran


def test_export_py_writes_the_checkpoints_card(lora_run, tmp_path):
    export.main([str(lora_run / "step-16"), str(tmp_path / "out")])
    card = ModelCard.load(tmp_path / "out" / "README.md")
    at_16 = next(r for r in read_jsonl(lora_run / "metrics.jsonl") if r["step"] == 16 and "loss/eval" in r)
    assert card.data.model_name == "out" and "at 16 examples" in card.text
    assert card_metrics(card) == {k: v for k, v in at_16.items() if k != "step" and not k.startswith("counters/")}
    assert ModelCard.load(tmp_path / "out" / "adapter" / "README.md").data.library_name == "peft"


def test_the_card_names_hub_models_and_datasets_and_leaves_out_local_ones(lora_run):
    run = OmegaConf.load(lora_run / "config.yaml")
    run.model.name_or_path, run.model.random_init = "HuggingFaceTB/SmolLM2-135M-Instruct", False
    run.datasets = ["hh", "HuggingFaceH4/ultrafeedback_binarized:train_prefs", str(lora_run / "pairs.jsonl"), "demo"]
    card = ModelCard(card_text(run, "transformers", "m", 40, 5, {"loss/eval": 0.5}))
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert card.data.datasets == ["Anthropic/hh-rlhf", "HuggingFaceH4/ultrafeedback_binarized"]
    local = ModelCard(card_text(OmegaConf.load(lora_run / "config.yaml"), "transformers", "m", None, None, {}))
    assert local.data.base_model is None and local.data.datasets is None  # a local model and file: no Hub name
    assert "Trained on" not in local.text and "## Final held-out metrics" not in local.text


def result(dataset: str, metric: str, value: float) -> dict:
    return dict(
        task_type="text-generation",
        dataset_type=f"org/{dataset}",
        dataset_name=dataset,
        metric_type="accuracy",
        metric_name=metric,
        metric_value=value,
        metric_config=None,
    )


def test_add_results_adds_to_the_model_index_and_replaces_a_result_of_the_same_dataset_and_metric(lora_run, tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "README.md").write_bytes((lora_run / "LATEST" / "README.md").read_bytes())
    assert add_results(directory, [result("a", "accuracy", 0.5), result("b", "accuracy", 0.6)])
    assert add_results(directory, [result("a", "accuracy", 0.7), result("a", "win rate", 0.1)])
    card = ModelCard.load(directory / "README.md")
    found = [(r.dataset_name, r.metric_name, r.metric_value) for r in card.data.eval_results]
    assert found == [("b", "accuracy", 0.6), ("a", "accuracy", 0.7), ("a", "win rate", 0.1)]
    assert card.data.model_name == "run" and card.data.library_name == "transformers" and "## Reproduce" in card.text
    assert not add_results(tmp_path, [result("a", "accuracy", 0.5)])  # no README.md
    (tmp_path / "README.md").write_text("# notes, not a model card\n")
    assert not add_results(tmp_path, [result("a", "accuracy", 0.5)])


def test_a_run_whose_config_no_longer_composes_gets_a_card_without_the_command(lora_run, monkeypatch):
    # A run of another version of the config files: its card leaves the command out, and the card (so the checkpoint
    # it goes in) is still written.
    def fails(*args, **kwargs):
        raise config.UserError("unknown key 'old_key' in the config")

    monkeypatch.setattr(config, "composed", fails)
    text = card_text(OmegaConf.load(lora_run / "config.yaml"), "transformers", "m", 40, 5, {"loss/eval": 0.5})
    assert "## Reproduce" not in text and "loss/eval" in text
