"""What a user of evaluate.py and the training win rate runs into (issue 53's holes): each is one line, or is
said in one line, and is tested here as the user meets it."""

import json
import re

import pytest
import transformers

import config as configuration
import evaluate
from conftest import read_jsonl, save_tiny_lm, write_jsonl
from judging.judges import load_judge
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
        "dtype=float32", f"candidates=[{model}]", f"datasets=[{data}]", f"judge={JUDGE}", "n_eval_examples=8",
        "max_new_tokens=3",
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
        judge.judge(["Q: 1?"], ["yes"], ["no"])


def test_a_win_rate_with_an_sft_loss_is_one_line(make_config):
    with pytest.raises(UserError, match="eval_winrate_prompts=4 compares the policy with its reference, and loss=sft"):
        make_config("eval_winrate_prompts=4", f"judge={JUDGE}", "loss=sft")


# ---------------------------------------------------------------------------------------------------------------
# Issue 62's: the runs' reference used, not asked for; a reference of a config alone; what a glob matches that is no
# run; a prompt longer than the model's positions.


def test_a_sweep_is_evaluated_against_its_runs_own_reference_rebuilt_from_their_seed(tmp_path, pairs_file, run_main):
    # lr=1e-30 leaves every weight as it was (a step of 1e-30 rounds away in float32): each job's policy is its
    # reference, so the sampled KL to the reference evaluate.py rebuilds (the random initialisation of model=tiny from
    # the runs' seed, 3) is 0 up to rounding; rebuilt from another seed it is not.
    from conftest import tiny_run_overrides

    sweep = tmp_path / "sweep"
    common = [arg for arg in tiny_run_overrides(tmp_path, pairs_file) if not arg.startswith(("local_run_dir", "lr="))]
    keys = ("-m", *common, f"local_run_dir={sweep}", "n_examples=8", "lr=1e-30", "seed=3", "loss.beta=0.1,0.3")
    assert run_main(*keys).returncode == 0
    args = (f"candidates=[{sweep}/*]", "baseline=chosen", f"judge={JUDGE}", "n_prompts=3", "max_new_tokens=4",
            "temperatures=[1.0]", "wandb.enabled=false", "plots=false", f"output_dir={tmp_path / 'out'}",
            f"local_dirs=[{tmp_path}]", "bootstrap_resamples=100")  # fmt: skip
    result = run_main(*args, script="evaluate.py")
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("multirun.yaml", "sweep_summary.json", "sweep_summary.md"):  # what the glob matched besides jobs
        assert f"candidates: {sweep / name} left out (is a file, not a run, sweep or model directory)" in result.stdout
    line = re.search(r"reference: (\S+) \(the runs' own: a random initialisation of (\S+) from seed 3, rebuilt\)",
                     result.stdout)  # fmt: skip
    assert line and line.group(1).startswith(str(tmp_path / "models" / "random-init-")), result.stdout[-2000:]
    results = json.loads((tmp_path / "out" / "evaluation.json").read_text())["results"]
    assert sorted(results) == [str(sweep / "0" / "LATEST"), str(sweep / "1" / "LATEST")]
    for by_temperature in results.values():
        assert abs(by_temperature["1.0"]["kl"]["value"]) < 1e-5

    # a single run's directory is its LATEST, against its own reference too
    result = run_main(*args[1:], f"candidates=[{sweep / '1'}]", script="evaluate.py")
    assert result.returncode == 0 and "(the runs' own: a random initialisation" in result.stdout
    results = json.loads((tmp_path / "out" / "evaluation.json").read_text())["results"]
    assert (
        list(results) == [str(sweep / "1" / "LATEST")]
        and abs(results[str(sweep / "1" / "LATEST")]["1.0"]["kl"]["value"]) < 1e-5
    )  # noqa: E501


def test_a_directory_that_holds_no_run_or_model_is_one_line(tmp_path, run_main):
    (tmp_path / "empty").mkdir()
    result = run_main(f"candidates=[{tmp_path / 'empty'}]", f"judge={JUDGE}", script="evaluate.py")
    assert result.returncode == 2 and result.stderr.count("error: ") == 1
    assert result.stderr.strip() == (
        f"error: candidates[0]={tmp_path / 'empty'} is not a run, sweep or model directory: it holds no LATEST/ with "
        "config.yaml, no job.json, no config.json"
    )  # not train.py's advice to set model.tokenizer_name_or_path


def test_a_reference_of_a_config_without_weights_is_one_line(tmp_path, model):
    from conftest import TINY_DIR

    data = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"Q: {i}?\nA:", "chosen": " yes", "rejected": " no"}
                                                  for i in range(20)])  # fmt: skip
    with pytest.raises(UserError) as refused:
        run(evaluation(tmp_path, model, data, f"reference={TINY_DIR}", "n_prompts=2"))
    assert str(refused.value).startswith(
        f"reference={TINY_DIR} holds no weights (no *.safetensors or *.bin file); a config alone is what a random "
        "initialisation starts from"
    )


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    """A tiny GPT-2, whose 32 positions are a table of learned embeddings."""
    return save_tiny_lm(tmp_path_factory.mktemp("positions") / "gpt2", "gpt2", max_position_embeddings=32)


def test_prompts_longer_than_the_models_positions_keep_their_end_and_are_said_once(tmp_path, short_model, capsys):
    rows = [{"prompt": f"Q: {'word ' * (40 + i)}{i}?\nA:", "chosen": " yes", "rejected": " no"} for i in range(16)]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    args = evaluation(tmp_path, short_model, data, f"baseline={short_model}", "max_new_tokens=8", "n_prompts=4")
    summary, lines = run(args)
    printed = capsys.readouterr().out
    line = ("sampling: 4 of 4 prompts do not fit the model's 32 positions with max_new_tokens=8: each keeps its last "
            "24 tokens, as training keeps a prompt's end")  # fmt: skip
    assert printed.count("prompts do not fit the model") == 1 and line in printed  # once: sampling, scoring
    assert abs(summary["results"][str(short_model)]["1.0"]["kl"]["value"]) < 1e-5  # its own reference: scored alike
    with pytest.raises(UserError, match=r"^max_new_tokens=40 leaves no room for a prompt in the model's 32 positions$"):
        run(evaluation(tmp_path, short_model, data, "max_new_tokens=40"))


def test_a_cut_prompt_keeps_its_last_tokens():
    from generation.sampling import Sampler

    class Model:
        config = transformers.GPT2Config(n_positions=10)

    sampler = Sampler(None, Topology.create("BasicTrainer"), max_new_tokens=4, batch_size=2)
    prompts = [list(range(3)), list(range(100, 108)), list(range(6))]
    assert sampler.fitted(Model(), prompts) == [[0, 1, 2], [102, 103, 104, 105, 106, 107], list(range(6))]
    assert sampler.fitted(Model(), prompts, [[1] * 2, [1] * 7, [1] * 3]) == [[0, 1, 2], [105, 106, 107], list(range(6))]
