"""Iterative on-policy rounds (rounds.py) and their rewards (rewards.py)."""

import json
import math
import shutil

import pytest
import torch

import train
from conftest import TINY_DIR, assert_same_metrics, policy_state, read_jsonl, write_jsonl
from judging import judges
from judging.judges import RewardJudge
from judging.rewards import load_reward
from rounds import Rounds, round_lines
from utils import UserError

LOWERCASE = "rounds.reward=tests.round_rewards:lowercase_letters"
ROUNDS = (LOWERCASE, "rounds.n=3", "generation.max_new_tokens=8", "generation.temperature=1.0", "n_epochs=2")


def round_records(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if "rounds/round" in r]


def read_round(run_dir, index: int) -> list[dict]:
    return read_jsonl(run_dir / "rounds" / f"round-{index}.jsonl")


@pytest.fixture
def distinct_prompts_file(tmp_path):
    """100 pairs of 100 distinct prompts: a round samples 32 of them, the greedy reward is averaged over 24 others."""
    rows = [
        {"prompt": f"Q: {a} + {b}?\nA:", "chosen": f" {a + b}.", "rejected": f" {a + b + 1}."}
        for a in range(10)
        for b in range(10)
    ]
    return write_jsonl(tmp_path / "distinct.jsonl", rows)


def test_rounds_raise_the_reward_of_held_out_greedy_completions(make_config, distinct_prompts_file):
    # The proof the issue asks for: a random tiny model, a deterministic reward (lowercase letters counted), three
    # rounds of on-policy pairs; the greedy completions of 24 held-out prompts score higher after every round.
    data = (f"datasets=[{distinct_prompts_file}]", "n_eval_examples=24", "rounds.eval_prompts=24", "rounds.prompts=32")
    config = make_config(*ROUNDS, *data, "lr=1e-4", "eval_every=64")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    records = round_records(run_dir)
    assert [r["rounds/round"] for r in records] == [0, 1, 2, 3]  # each round's start, then the end
    heldout = [r["rounds/heldout_reward"] for r in records]
    assert heldout[0] < heldout[1] < heldout[2] < heldout[3], heldout
    for index, record in enumerate(records[:3]):
        lines = read_round(run_dir, index)
        assert record["rounds/pairs"] + record["rounds/ties"] == len(lines) > 0
        for line in lines:
            assert len(line["completions"]) == len(line["rewards"]) == 4
            assert line["rewards"] == [float(sum("a" <= ch <= "z" for ch in text)) for text in line["completions"]]
            if line["chosen"] is None:
                assert max(line["rewards"]) == min(line["rewards"])
            else:
                assert line["rewards"][line["chosen"]] == max(line["rewards"]) > min(line["rewards"])
                assert line["rewards"][line["rejected"]] == min(line["rewards"])
        chosen = [line["rewards"][line["chosen"]] for line in lines if line["chosen"] is not None]
        assert record["rounds/chosen_reward"] == pytest.approx(sum(chosen) / len(chosen))
    # each round's reference is the policy that started it: a reference file per round, each of other weights
    references = sorted((run_dir / "rounds" / "reference_logps").glob("*.pt"))
    assert len({path.name.split("-")[0] for path in references}) == 3
    # a round's first step has policy = reference: its loss is ln 2 whatever the round
    trains = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss/train" in r]
    checkpoint_steps = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("step-*"))
    round_ends = [r["step"] for r in records[1:]]
    assert set(round_ends) <= set(checkpoint_steps)  # a checkpoint at each round's end
    assert trains[0]["loss/train"] == pytest.approx(math.log(2), abs=1e-6)


def test_a_rounds_first_step_starts_from_ln2(make_config):
    # minimum_log_interval_secs=0 logs every step: the first step of each round has policy = reference exactly.
    config = make_config(*ROUNDS, "rounds.n=2")
    trainer = train.build_trainer(config, train.Topology.create(config.trainer), train.prepare_run_dir(config))
    first_losses = []
    original = trainer.train_step

    def noting_round_starts(examples):
        metrics = original(examples)
        if trainer.batch_counter == trainer.round_start:
            first_losses.append(sum(metrics["loss/train"]) / len(metrics["loss/train"]))
        return metrics

    trainer.train_step = noting_round_starts
    Rounds(trainer).run()
    assert first_losses == pytest.approx([math.log(2)] * 2, abs=1e-6)


def test_completions_tie_when_the_reward_cannot_tell_them_apart(make_config):
    config = make_config(*ROUNDS, "rounds.n=1", "rounds.reward=tests.round_rewards:constant")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    record = round_records(run_dir)[0]
    lines = read_round(run_dir, 0)
    assert record["rounds/pairs"] == 0 and record["rounds/ties"] == len(lines) > 0
    assert all(line["chosen"] is None and line["rejected"] is None for line in lines)
    assert not [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss/train" in r]  # nothing to train on


def test_a_round_takes_its_share_of_prompts_in_turn_and_reports_its_pairs(make_config, capsys):
    config = make_config(*ROUNDS, "rounds.n=2", "rounds.prompts=5", "rounds.completions=2")
    train.run(config)
    run_dir = train.Path(config.local_run_dir)
    first, second = (read_round(run_dir, i) for i in (0, 1))
    assert len(first) == len(second) == 5
    assert not {line["prompt"] for line in first} & {line["prompt"] for line in second}
    # each round prints its rewards and the data report of its pairs: lengths, and the first pair token by token
    output = capsys.readouterr().out
    pairs = sum(line["chosen"] is not None for line in second)
    report = output[output.index("round 1: 5 prompts x 2 completions") :]
    assert f"; {pairs} pairs (mean reward " in report.splitlines()[0]
    assert report.splitlines()[1] == "  tokens     p50    p90    p99    max"
    assert "first training example, token by token" in report and "    rejected" in report


def test_resuming_inside_a_round_or_at_its_end_matches_the_uninterrupted_run(make_config, tmp_path):
    common = (*ROUNDS, "save_every=8")
    whole = tmp_path / "whole"
    train.run(make_config(f"local_run_dir={whole}", *common))
    ends = [r["step"] for r in round_records(whole)[1:3]]
    steps = sorted(int(p.name.split("-")[1]) for p in whole.glob("step-*"))
    inside = next(step for step in steps if ends[0] < step < ends[1])
    # the rounds' progress is a checkpoint part of its own; an earlier version noted it in checkpoint.json's loop
    assert torch.load(whole / f"step-{inside}" / "rounds.pt")["state"]["round"] == 1
    for resume_at, earlier in ((inside, False), (ends[0], False), (inside, True)):
        resumed = tmp_path / f"resumed-{resume_at}-{earlier}"
        resumed.mkdir()
        # what a run killed later leaves: its logs and rounds past the checkpoint, which the resume cuts back or redoes
        shutil.copy(whole / "metrics.jsonl", resumed / "metrics.jsonl")
        shutil.copytree(whole / "rounds", resumed / "rounds")
        shutil.copytree(whole / f"step-{resume_at}", resumed / f"step-{resume_at}")
        if earlier:
            part, marker = (
                resumed / f"step-{resume_at}" / "rounds.pt",
                resumed / f"step-{resume_at}" / "checkpoint.json",
            )
            noted = json.loads(marker.read_text())
            noted["loop"]["round"] = torch.load(part)["state"]
            marker.write_text(json.dumps(noted))
            part.unlink()
        train.run(make_config(f"local_run_dir={resumed}", "resume_from=auto", *common))
        assert_same_metrics(read_jsonl(whole / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl"))
        for index in range(3):
            assert read_round(resumed, index) == read_round(whole, index)
        a, b = policy_state(whole / "LATEST"), policy_state(resumed / "LATEST")
        for name in a:
            torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("rounds.n=2",), "rounds.n=2 scores each round's completions: set rounds.reward=module:function"),
        ((LOWERCASE,), "rounds.reward=tests.round_rewards:lowercase_letters sets iterative rounds, but rounds.n=0"),
        (("rounds.prompts=5",), "rounds.prompts=5 sets iterative rounds, but rounds.n=0 runs none$"),
        (("rounds.n=1", "rounds.reward=no_such_module:f"), "rounds.reward=no_such_module:f: cannot import no_such_mo"),
        (("rounds.n=1", "rounds.reward=tests.round_rewards:nothing"), "rounds.reward=tests.round_rewards:nothing: te"),
        (("rounds.n=1", "rounds.reward=brevity"), "rounds.reward=brevity is neither a directory nor module:function"),
        ((LOWERCASE, "rounds.n=1", "rounds.completions=1"), "rounds.completions=1 must be 2 or more"),
        ((LOWERCASE, "rounds.n=1", "reference_cache=false"), "rounds.n=1: each round's reference is the policy t"),
        ((LOWERCASE, "rounds.n=1", "model.reference_dtype=float32"), "rounds.n=1: each round's reference is the polic"),
        ((LOWERCASE, "rounds.n=1", "sample_during_eval=true"), "rounds.n=1: sample_during_eval=true samples the f"),
        ((LOWERCASE, "rounds.n=1", "generation.do_sample=false"), "rounds.n=1 samples 4 completions a prompt: generat"),
        ((LOWERCASE, "rounds.n=1", "loss=sft"), "rounds.n=1 trains the policy on generated pairs; loss=sft trains"),
        ((LOWERCASE, "rounds.n=1", "loss=reward"), "rounds.n=1 trains the policy on generated pairs; loss=reward t"),
    ],
)
def test_round_settings_that_cannot_work_are_one_line(make_config, overrides, message):
    with pytest.raises(UserError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        make_config(*overrides)


def test_a_reward_that_returns_no_number_is_one_line(make_config):
    config = make_config(*ROUNDS, "rounds.n=1", "rounds.reward=tests.round_rewards:not_a_number")
    with pytest.raises(UserError, match=r"^rounds.reward=tests.round_rewards:not_a_number returned 'high' for the co"):
        train.run(config)


def save_reward_model(directory, num_labels: int = 1):
    """A randomly initialised 2-layer Llama with num_labels outputs, and the tiny tokenizer, in `directory`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig.from_pretrained(TINY_DIR, num_labels=num_labels)
    LlamaForSequenceClassification(config).save_pretrained(directory)
    AutoTokenizer.from_pretrained(TINY_DIR).save_pretrained(directory)
    return directory


@pytest.fixture
def reward_model_dir(tmp_path):
    return save_reward_model(tmp_path / "reward_model")


def test_a_reward_model_scores_each_text_as_it_would_alone(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = load_reward(str(reward_model_dir), torch.device("cpu"), batch_size=3, max_length=64)
    prompts = ["Q: 2 + 3?\nA:", "Q: 1 + 1?\nA:", "Hi", "Q: 7 + 2?\nA:"]
    completions = [" 5, glad to help.", " 9", " there, a longer answer than the others", ""]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():
        alone = [
            model(**tokenizer(p + c, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
            for p, c in zip(prompts, completions)
        ]
    assert reward(prompts, completions) == pytest.approx(alone, abs=1e-5)
    assert len(set(alone)) == 4  # the texts score apart: padding them together could not pass unnoticed


def test_a_judging_reward_model_reads_each_prompt_once_for_both_completions(reward_model_dir):
    # A judge's reward model (evaluate.py) scores two completions of each prompt: in one packed segment, the prompt
    # computed once, each reward equal to its text's alone; the verdict follows the rewards.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = load_reward(str(reward_model_dir), torch.device("cpu"), batch_size=4, max_length=64)
    prompts = ["Q: 2 + 3?\nA:", "Q: 1 + 1 + 1 + 1?\nA:", "Hi"]
    first, second = [" 5, glad to help.", " 4", " there"], [" 6", " four, I think", " you, a longer answer"]
    model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    with torch.no_grad():
        alone = [
            model(**tokenizer(p + c, add_special_tokens=False, return_tensors="pt")).logits[0, 0].item()
            for p, c in zip(prompts * 2, first + second)
        ]
    read = []
    hook = reward.model.register_forward_pre_hook(
        lambda m, a, kw: read.append(kw["input_ids"].numel()), with_kwargs=True
    )
    judgement = RewardJudge(reward).judge(prompts, first, second)
    hook.remove()
    assert judgement.rewards[0] + judgement.rewards[1] == pytest.approx(alone, abs=1e-5)
    assert judgement.outcomes == [math.copysign(1, a - b) for a, b in zip(alone[:3], alone[3:])]
    length = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    once = sum(length(p + a + b) for p, a, b in zip(prompts, first, second))
    twice = sum(length(p + a) + length(p + b) for p, a, b in zip(prompts, first, second))
    assert once <= sum(read) < twice  # the prompt once (packed rows' tails padded)


def test_a_reward_judge_rewards_each_distinct_completion_of_a_prompt_once_across_pairs(monkeypatch):
    # evaluate.py judges every candidate at every temperature against the baseline in one judge_all: a baseline
    # completion judged against two candidates, or the same text at two temperatures, is rewarded once; each pair's
    # judgement is the one it gets judged alone.
    calls = []

    def reward(prompts, completions, images=None):
        calls.extend(zip(prompts, completions))
        return [len(c) - 0.1 * len(p) for p, c in zip(prompts, completions)]

    judge = RewardJudge(reward)
    monkeypatch.setattr(judges, "PROMPTS_PER_CALL", 2)
    prompts = ["Q: a", "Q: bb", "Q: ccc"]
    baseline = [" one", " two two", " three"]
    candidates = [[" 1", " two two", " 333"], [" 11", " 2", " three"], [" 1", " 22", " 3"]]
    pairs = [(candidate, baseline) for candidate in candidates]
    judgements = judge.judge_all(prompts, pairs)
    assert len(calls) == len(set(calls)) == 9  # 12 completions, 3 of them a text already read for their prompt
    for (first, second), judgement in zip(pairs, judgements):
        assert judgement == judge.judge(prompts, first, second)
        expected = [math.copysign(1, len(a) - len(b)) if len(a) != len(b) else 0 for a, b in zip(first, second)]
        assert judgement.outcomes == expected


def test_a_reward_model_keeps_a_prompt_that_fits_whole(reward_model_dir):
    # 26 prompt and 5 completion tokens: within max_length nothing is cut, whatever room is left over (a room
    # between one and two prompts' lengths once cut the prompt's start)
    prompt, completion = "Q: what is two plus three?", " five"
    rewards = [
        load_reward(str(reward_model_dir), torch.device("cpu"), 2, max_length)([prompt], [completion])[0]
        for max_length in (31, 36, 40, 100)
    ]
    assert rewards == pytest.approx([rewards[-1]] * 4, abs=1e-6)


def test_rounds_train_with_a_reward_model(make_config, reward_model_dir):
    config = make_config(*ROUNDS, "rounds.n=1", f"rounds.reward={reward_model_dir}")
    train.run(config)
    lines = read_round(train.Path(config.local_run_dir), 0)
    assert lines and all(len(set(line["rewards"])) > 1 for line in lines)


def test_a_classifier_of_two_labels_is_no_reward_model(tmp_path):
    directory = save_reward_model(tmp_path / "classifier", num_labels=2)
    with pytest.raises(UserError, match=r"has 2 outputs; a reward model has one$"):
        load_reward(str(directory), torch.device("cpu"), batch_size=3, max_length=64)


def test_a_prompts_pair_is_its_first_best_and_last_worst_completion():
    prompts, groups, texts = [[1], [2]], [10, 20], ["p", "q"]
    completions = [[5], [6], [7], [8], [9], [3], [4], [5], [6], [7]]
    rewards = [1.0, 3.0, 3.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    first, second = round_lines(7, prompts, groups, texts, list("abcdefghij"), completions, rewards)
    assert (first["chosen"], first["rejected"]) == (1, 4)
    assert first["completions"] == list("abcde") and first["completion_ids"] == completions[:5]
    assert (second["chosen"], second["rejected"]) == (None, None)  # five equal rewards: a tie
    assert (first["round"], first["group"], second["prompt"], second["prompt_ids"]) == (7, 10, "q", [2])


def test_a_resume_inside_a_round_whose_files_are_gone_is_one_line(make_config, tmp_path):
    # The weights that started the round are gone once it trained: its pairs and reference log-probs can only be
    # read back, never recomputed; without them the resume stops with one line instead of training on other numbers.
    common = (*ROUNDS, "save_every=8")
    whole = tmp_path / "whole"
    train.run(make_config(f"local_run_dir={whole}", *common))
    start = round_records(whole)[1]["step"]
    inside = min(int(p.name.split("-")[1]) for p in whole.glob("step-*") if int(p.name.split("-")[1]) > start)
    for missing, message in [
        ("rounds/reference_logps", "the reference log-probs of the round this checkpoint is in, is missing"),
        ("rounds/round-1.jsonl", "the pairs of the round this checkpoint is in cannot be read"),
    ]:
        resumed = tmp_path / missing.replace("/", "-")
        shutil.copytree(whole / "rounds", resumed / "rounds")
        shutil.copytree(whole / f"step-{inside}", resumed / f"step-{inside}")
        shutil.copy(whole / "metrics.jsonl", resumed / "metrics.jsonl")
        target = resumed / missing
        shutil.rmtree(target) if target.is_dir() else target.unlink()
        with pytest.raises(UserError, match=message + r".*resume from the checkpoint that ends the round before"):
            train.run(make_config(f"local_run_dir={resumed}", "resume_from=auto", *common))
        assert (resumed / f"step-{inside}" / "checkpoint.json").exists()  # nothing written was lost


def test_a_judges_reward_model_reads_in_the_evaluations_dtype(reward_model_dir):
    # evaluate.py loads its judge in the evaluation's dtype (bfloat16 where dtype=auto chooses it): the rewards are
    # the float32 model's to bfloat16's rounding
    from judging.judges import load_judge

    cpu, dtypes = torch.device("cpu"), (torch.float32, torch.bfloat16)
    judge = {
        dtype: load_judge(str(reward_model_dir), None, cpu, 3, 64, reward_model_dir.parent, dtype) for dtype in dtypes
    }
    assert [next(judge[dtype].reward.model.parameters()).dtype for dtype in dtypes] == list(dtypes)
    prompts = ["Q: 2 + 3?\nA:", "Q: 1 + 1?\nA:", "Hi"]
    rewards = {
        dtype: judge[dtype].judge(prompts, [" 5", " 2", " there"], [" 6", " 9", " you"]).rewards for dtype in dtypes
    }
    exact, rounded = (torch.tensor(rewards[dtype]) for dtype in dtypes)
    assert not torch.equal(exact, rounded)
    torch.testing.assert_close(rounded, exact, rtol=0.05, atol=0.02)
