"""What a user of evaluate.py and the training win rate runs into (issue 53's holes): each is one line, or is
said in one line, and is tested here as the user meets it."""

import json
import re

import pytest

import config as configuration
import evaluate
from conftest import read_jsonl, save_tiny_lm, write_jsonl
from core.generations import load_judge
from modeling.distributed import Topology
from utils import UserError


def raises(prompt: str, completion: str) -> float:
    return 1 / 0


def one_argument(completion: str) -> float:
    return 1.0


def letters(prompt: str, completion: str) -> float:
    return float(sum(c.isalpha() for c in completion))


JUDGE = "tests.test_evaluation_holes:letters"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("holes") / "model", "llama")


def evaluation(tmp_path, model, data, *overrides) -> list[str]:
    return [
        f"candidates=[{model}]", f"datasets=[{data}]", f"judge={JUDGE}", "n_eval_examples=8", "max_new_tokens=3",
        "temperatures=[1.0]", "wandb.enabled=false", "plots=false", f"output_dir={tmp_path / 'out'}",
        f"local_dirs=[{tmp_path}]", "bootstrap_resamples=100", *overrides,
    ]  # fmt: skip


def run(args: list[str]):
    output = evaluate.evaluate(configuration.load(args, "evaluate"), Topology.create("BasicTrainer"))
    return json.loads((output / "evaluation.json").read_text()), read_jsonl(output / "samples.jsonl")


def test_baseline_chosen_on_unpaired_data_is_the_desirable_completions(tmp_path, model, capsys):
    # KTO's data: each prompt has a desirable and an undesirable completion, and some only an undesirable one;
    # baseline=chosen compares with the desirable ones alone and says which prompts it left out.
    rows = []
    for i in range(12):
        rows.append({"prompt": f"Q: {i} + {i}?\nA:", "completion": f" bad {i}", "label": False})
        if i % 3:
            rows.append({"prompt": f"Q: {i} + {i}?\nA:", "completion": f" good {i}", "label": True})
    data = write_jsonl(tmp_path / "unpaired.jsonl", rows)
    _, lines = run(evaluation(tmp_path, model, data, "baseline=chosen", "n_prompts=12"))
    baselines = {line["baseline_response"].strip() for line in lines}
    assert baselines and all(text.startswith("good") for text in baselines), baselines
    printed = capsys.readouterr().out
    assert re.search(r"baseline=chosen on unpaired data: .* (\d+) of (\d+) held-out prompts have none", printed)


def test_more_prompts_than_the_held_out_split_has_is_said_and_counted(tmp_path, model, capsys):
    data = write_jsonl(tmp_path / "pairs.jsonl", [
        {"prompt": f"Q: {i}?\nA:", "chosen": " yes", "rejected": " no"} for i in range(40)
    ])  # fmt: skip
    summary, _ = run(evaluation(tmp_path, model, data, "n_prompts=1000", "baseline=chosen"))
    captured = capsys.readouterr()
    assert "n_prompts=1000: the held-out split has 8 distinct prompts, all evaluated" in captured.out
    assert summary["generation"]["prompts"] == 8
    for what in ("sampling", "judging"):  # the progress bars, with their ETA
        assert what in captured.err, captured.err[-500:]


def test_evaluates_own_errors_name_its_own_keys(tmp_path):
    with pytest.raises(UserError, match=re.escape("(e.g. candidates=[runs/dpo/LATEST] judge=runs/rm/LATEST)")):
        configuration.load([f"judge={JUDGE}"], "evaluate")
    config = configuration.load(evaluation(tmp_path, "nobody/no-such-model", tmp_path / "none.jsonl"), "evaluate")
    with pytest.raises(UserError, match=r"pass candidates\[0\]=/path/to/model_dir") as error:
        evaluate.evaluate(config, Topology.create("BasicTrainer"))
    assert "model.name_or_path" not in str(error.value)


@pytest.mark.parametrize("function, exception", [("raises", "ZeroDivisionError"), ("one_argument", "TypeError")])
def test_a_judge_function_that_fails_is_one_line_naming_it(tmp_path, function, exception):
    spec = f"tests.test_evaluation_holes:{function}"
    judge = load_judge(spec, None, Topology.create("BasicTrainer").device, 4, 64, tmp_path)
    with pytest.raises(UserError, match=re.escape(f"judge={spec} raised {exception} (")):
        judge(["Q: 1?"], ["yes"], ["no"])


def test_a_win_rate_with_an_sft_loss_is_one_line(make_config):
    with pytest.raises(UserError, match="eval_winrate_prompts=4 compares the policy with its reference, and loss=sft"):
        make_config("eval_winrate_prompts=4", f"judge={JUDGE}", "loss=sft")
