"""What a user of evaluate.py and the training win rate runs into (issue 53's holes): each is one line, or is
said in one line, and is tested here as the user meets it."""

import json
import re

import pytest
import transformers

import config as configuration
import evaluate
from conftest import build_trainer, read_jsonl, save_tiny_lm, write_jsonl
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


def test_prompts_longer_than_the_models_positions_keep_the_end_training_keeps_and_are_said_once(
    tmp_path, short_model, capsys
):
    rows = [{"prompt": f"Q{i}: {'word ' * (40 + i)}?\nA:", "chosen": " yes", "rejected": " no"} for i in range(16)]
    data = write_jsonl(tmp_path / "long.jsonl", rows)
    args = evaluation(tmp_path, short_model, data, f"baseline={short_model}", "max_new_tokens=8", "n_prompts=4")
    summary, lines = run(args)
    printed = capsys.readouterr().out
    line = ("sampling: 4 of 4 prompts do not fit the model's 32 positions with max_new_tokens=8: 4 keep their first "
            "24 tokens (keep_start), as training cuts them")  # fmt: skip
    assert printed.count("prompts do not fit the model") == 1 and line in printed  # once: sampling, scoring
    # its own reference: scored alike, each prompt cut as it was sampled (summed while drawing, then scored)
    assert abs(summary["results"][str(short_model)]["1.0"]["kl"]["value"]) < 1e-5
    with pytest.raises(UserError, match=r"^max_new_tokens=40 leaves no room for a prompt in the model's 32 positions$"):
        run(evaluation(tmp_path, short_model, data, "max_new_tokens=40"))


def test_a_held_out_prompt_is_sampled_from_the_ids_training_kept_of_it(tmp_path, short_model, capsys):
    """A prompt too long for the model's positions reaches the model cut as training cuts it (issue 70): any format
    but HH's keeps its first tokens, an HH dialogue its last; the two formats in one batch."""
    from generation.sampling import Sampler
    from persistence.tokenized import Tokenization, load_examples

    question = "word " * 60
    explicit = [{"prompt": f"Q{i}: {question}?", "chosen": " yes", "rejected": " no"} for i in range(6)]
    dialogue = [f"\n\nHuman: {question} {i}?\n\nAssistant:" for i in range(6)]
    hh = [{"chosen": f"{prompt} yes", "rejected": f"{prompt} no"} for prompt in dialogue]
    tokenizer = transformers.AutoTokenizer.from_pretrained(short_model)
    settings = Tokenization(max_length=64, max_prompt_length=48, sft=False)
    held_out = {}
    for name, rows in (("explicit", explicit), ("hh", hh)):
        test = load_examples([str(write_jsonl(tmp_path / f"{name}.jsonl", rows))], tokenizer, settings, 0, 2, tmp_path)
        held_out[name] = test["test"].take(range(len(test["test"])))
        assert len(held_out[name]) == 2 and all(len(ex["prompt"]) == 48 for ex in held_out[name])  # cut in training
    examples = held_out["explicit"] + held_out["hh"]
    model = transformers.AutoModelForCausalLM.from_pretrained(short_model)
    seen = []

    def prefilled(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] > 1:  # a prefill, not a decode step's one token
            seen.extend(row[kept.bool()].tolist() for row, kept in zip(ids, mask))

    model.register_forward_pre_hook(prefilled, with_kwargs=True)
    sampler = Sampler(tokenizer, Topology.create("BasicTrainer"), max_new_tokens=8, batch_size=4)
    prompts, keep_end = [ex["prompt"] for ex in examples], [ex["keep_end"] for ex in examples]
    sampler.sample(model, prompts, None, [0, 1, 2, 3], 1.0, keep_end=keep_end)
    starts = [ex["prompt"][:24] for ex in held_out["explicit"]]  # 32 positions less max_new_tokens=8
    ends = [ex["prompt"][-24:] for ex in held_out["hh"]]
    assert sorted(seen) == sorted(starts + ends)
    assert all(tokenizer.decode(start).startswith("Q") for start in starts)
    assert all(tokenizer.decode(end).endswith("?\n\nAssistant:") for end in ends)
    assert ("2 keep their last 24 tokens (keep_end: HH's format), 2 keep their first 24 tokens (keep_start), as "
            "training cuts them") in capsys.readouterr().out  # fmt: skip


def test_the_win_rate_the_evals_samples_and_rounds_cut_prompts_as_training_did(make_config, monkeypatch, tmp_path):
    """Each sampler a training run has hands PositionFit its prompts' keep_end (Examples'): the tiny run's explicit
    pairs keep their start, so a prompt too long for the positions would keep its start there too (issue 70)."""
    from generation.sampling import PositionFit
    from rounds import Rounds
    from test_rounds import ROUNDS

    given, fit = [], PositionFit.__call__

    def noting(self, model, prompts, completions=None, keep_end=None):
        given.append(keep_end)
        return fit(self, model, prompts, completions, keep_end)

    monkeypatch.setattr(PositionFit, "__call__", noting)
    trainer = build_trainer(make_config("eval_winrate_prompts=2", f"judge={JUDGE}", "sample_during_eval=true",
                                        "n_eval_model_samples=2", "generation.max_new_tokens=4"))  # fmt: skip
    trainer.evaluate()  # the win rate's sampling (policy, reference) and the samples' (policy, reference)
    assert given == [[False] * 2] * 4
    given.clear()
    settings = ("rounds.n=1", "rounds.prompts=2", "rounds.completions=2", "rounds.eval_prompts=2")
    rounds = Rounds(build_trainer(make_config(*ROUNDS, *settings, f"local_run_dir={tmp_path / 'rounds'}")))
    rounds.sample_round(0)
    rounds.heldout_reward()
    assert given == [[False] * 4, [False] * 2]  # a round's 2 prompts x 2 completions, then the held-out greedy


def test_a_cut_prompt_keeps_the_end_training_keeps(capsys):
    from generation.sampling import Sampler

    class Model:
        config = transformers.GPT2Config(n_positions=10)

    sampler = Sampler(None, Topology.create("BasicTrainer"), max_new_tokens=4, batch_size=2)
    prompts = [list(range(3)), list(range(100, 108)), list(range(6))]
    assert sampler.fitted(Model(), prompts) == [[0, 1, 2], [102, 103, 104, 105, 106, 107], list(range(6))]
    assert sampler.fitted(Model(), prompts, [[1] * 2, [1] * 7, [1] * 3]) == [[0, 1, 2], [105, 106, 107], list(range(6))]
    # each row as its example's format is cut in training (Examples.keep_end): HH's end, any other format's start
    capsys.readouterr()
    sampler = Sampler(None, Topology.create("BasicTrainer"), max_new_tokens=4, batch_size=2)
    prompts, keep_end = [*prompts, list(range(200, 208)), list(range(300, 308))], [True, True, False, False, False]
    assert sampler.fitted(Model(), prompts, keep_end=keep_end) == [
        [0, 1, 2], [102, 103, 104, 105, 106, 107], list(range(6)), list(range(200, 206)), list(range(300, 306))
    ]  # fmt: skip
    assert capsys.readouterr().out == (
        "sampling: 3 of 5 prompts do not fit the model's 10 positions with max_new_tokens=4: 1 keep their last 6 "
        "tokens (keep_end: HH's format), 2 keep their first 6 tokens (keep_start), as training cuts them\n"
    )
    completions = [[1] * 2, [1] * 7, [1] * 3, [1] * 7, [1] * 2]  # scored: cut as sampled, to a longer completion's room
    assert sampler.fitted(Model(), prompts, completions, keep_end) == [
        [0, 1, 2], [105, 106, 107], list(range(6)), [200, 201, 202], list(range(300, 306))
    ]  # fmt: skip
