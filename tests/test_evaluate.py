"""evaluate.py and its parts (generation/sampling.py and judging/judges.py): a model against itself wins half within
its interval, a judge that prefers the candidate by construction gives it every win, a judge that always answers
"A" gives only ties once the order is swapped, the sampled KL estimates the exact KL of a tiny model, batching and
two ranks give the same samples and verdicts as one process, images reach the candidate and a vision-language
judge; the trainer's win rate against its reference is exactly one half while they are equal."""

import json
import math
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from huggingface_hub import ModelCard
from omegaconf import OmegaConf

import config as configuration
import evaluate
import train
from conftest import (
    TINY_DIR,
    arithmetic_pairs,
    build_trainer,
    colour_rows,
    png,
    policy_state,
    read_jsonl,
    run_cli,
    save_tiny_lm,
    save_tiny_vlm,
    tiny_run_overrides,
    write_jsonl,
)
from generation.sampling import Sampler, sample_seed
from judging.judges import Judgement, PairwiseJudge, check_judge, letter_tokens, load_judge
from judging.rewards import ModelReward
from modeling.distributed import Topology
from modeling.tokenizers import load_tokenizer
from modeling.vision import pack_images, vision_tower
from reporting.data_report import length_bias
from trained import kind, load_trained, model_settings
from utils import UserError

TORCHRUN = (str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2")
LOWERCASE = "tests.round_rewards:lowercase_letters"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas (random weights of seed 0; 2 layers and 1) with the tiny tokenizer, and 60 arithmetic pairs."""
    root = tmp_path_factory.mktemp("evaluate")
    return (
        save_tiny_lm(root / "two_layers", "llama"),
        save_tiny_lm(root / "one_layer", "llama", num_hidden_layers=1),
        write_jsonl(root / "pairs.jsonl", arithmetic_pairs(60)),
    )


def evaluation_args(tmp_path: Path, pairs: Path, *overrides: str) -> list[str]:
    """An evaluation's command line, in float32 (the values the tests compare are float32's; dtype=auto would be
    bfloat16 on a CPU with fast bfloat16 matmuls); the overrides last, so that they win."""
    return [
        "dtype=float32", f"datasets=[{pairs}]", "n_eval_examples=20", "n_prompts=8", "max_new_tokens=6",
        "wandb.enabled=false", f"output_dir={tmp_path / 'out'}", f"local_dirs=[{tmp_path}]", "bootstrap_resamples=500",
        "plots=false",
        *overrides,
    ]  # fmt: skip


def run_evaluation(tmp_path: Path, pairs: Path, *overrides: str) -> tuple[dict, list[dict]]:
    """evaluate.py in this process: (evaluation.json, samples.jsonl's lines)."""
    config = configuration.load(evaluation_args(tmp_path, pairs, *overrides), "evaluate")
    output = evaluate.evaluate(config, Topology.create("BasicTrainer"))
    return json.loads((output / "evaluation.json").read_text()), read_jsonl(output / "samples.jsonl")


def test_a_model_against_itself_wins_half_within_its_interval_at_no_kl(models, tmp_path):
    two_layers, _, pairs = models
    summary, lines = run_evaluation(
        tmp_path, pairs, f"candidates=[{two_layers}]", f"baseline={two_layers}", f"judge={LOWERCASE}",
        "samples_per_prompt=4", "plots=true", "n_eval_examples=40", "n_prompts=20", "temperatures=[0.5,1.0]",
    )  # fmt: skip
    results = summary["results"][str(two_layers)]
    assert list(results) == ["0.5", "1.0"]
    for temperature, result in results.items():
        assert result["prompts"] == 20 and result["samples"] == 80
        assert result["win_rate"]["low"] <= 0.5 <= result["win_rate"]["high"], temperature
        # its own reference: log-ratios of 0 up to rounding (its log-probs summed while drawing, the reference's scored)
        assert result["kl"] == pytest.approx({"value": 0.0, "low": 0.0, "high": 0.0}, abs=1e-5)
        win, tie, loss = (result[key]["value"] for key in ("win", "tie", "loss"))
        assert win + tie + loss == pytest.approx(1.0)
    assert len(lines) == 2 * 80
    # the candidate's and the baseline's completions are drawn from seeds of their own: not all the same
    assert any(line["candidate_response"] != line["baseline_response"] for line in lines)
    for line in lines:  # each verdict is the judge's function of the two texts
        ours, theirs = (
            sum("a" <= ch <= "z" for ch in line[side]) for side in ("candidate_response", "baseline_response")
        )
        assert line["candidate_reward"] == ours and line["baseline_reward"] == theirs
        assert line["outcome"] == (ours > theirs) - (ours < theirs)
    assert (tmp_path / "out" / "winrate.png").stat().st_size > 10_000


@pytest.mark.parametrize("auto", [False, True])
def test_in_bfloat16_a_model_against_itself_is_at_a_kl_of_0_and_auto_takes_the_probes_choice(
    models, tmp_path, monkeypatch, capsys, auto
):
    # dtype=auto as training decides it: here the probe's choice is forced to bfloat16. The KL's two terms are one
    # computation in bfloat16 (both scored after sampling): against itself, exactly 0.
    two_layers, _, pairs = models
    chosen = (torch.bfloat16, "the probe measured it fast")
    monkeypatch.setattr(evaluate, "choose_compute_dtype", lambda device, cache_dir: chosen)
    loaded = []
    monkeypatch.setattr(evaluate, "load_trained", lambda *args: loaded.append(args[2]) or load_trained(*args))
    summary, _ = run_evaluation(
        tmp_path, pairs, f"candidates=[{two_layers}]", f"baseline={two_layers}", f"judge={LOWERCASE}",
        "n_prompts=6", "temperatures=[0.5,1.0]", f"dtype={'auto' if auto else 'bfloat16'}",
    )  # fmt: skip
    assert loaded == [torch.bfloat16] * 2
    said = "precision: bfloat16, because the probe measured it fast (dtype=auto; dtype=float32 for float32)"
    assert (said in capsys.readouterr().out) == auto
    for result in summary["results"][str(two_layers)].values():
        assert result["kl"] == {"value": 0.0, "low": 0.0, "high": 0.0}


def test_a_judge_that_prefers_the_candidate_by_construction_gives_it_every_win(models, tmp_path):
    # The baseline is the dataset's chosen answers, which tests.round_rewards:not_an_answer scores 0; a random model
    # never writes one. No reference: no KL.
    two_layers, _, pairs = models
    summary, lines = run_evaluation(
        tmp_path, pairs, f"candidates=[{two_layers}]", "baseline=chosen", "judge=tests.round_rewards:not_an_answer"
    )
    for result in summary["results"][str(two_layers)].values():
        assert result["win"] == {"value": 1.0, "low": 1.0, "high": 1.0}
        assert result["lc_win_rate"]["value"] > 0.99 and "kl" not in result
    assert all(line["baseline_response"].endswith(", glad to help.") for line in lines)


class AlwaysA(PairwiseJudge):
    """A pairwise judge that answers "A" whatever it is shown (probability 0.9): position bias and nothing else."""

    def __init__(self):
        self.setting = "judge=always-A"

    def p_a(self, prompts, responses_a, responses_b):
        return [0.9] * len(prompts)


def test_swapping_the_order_turns_a_judge_that_always_answers_a_into_ties():
    judgement = AlwaysA().judge(["p"] * 3, ["x", "y", "z"], ["u", "v", "w"])
    assert judgement.first_shown_first == [1, 1, 1] and judgement.second_shown_first == [-1, -1, -1]
    assert judgement.outcomes == [0, 0, 0]
    assert judgement.p_first == ([0.9] * 3, pytest.approx([0.1] * 3))
    # a verdict that holds in both orders stands
    assert Judgement([1, -1, 1], [1, -1, -1]).outcomes == [1, -1, 0]


def test_the_pairwise_judge_reads_its_next_token_probabilities_of_a_and_b(models):
    two_layers, _, _ = models
    judge = PairwiseJudge(two_layers, None, torch.device("cpu"), batch_size=2)
    prompts, first, second = (
        ["Q: 1 + 2?\nA:", "Q: 3 + 1?\nA:", "Q: 2 + 2?\nA:"],
        [" 3.", " 4.", "x"],
        [" 5", " 9", " 4."],
    )
    judgement = judge.judge(prompts, first, second)
    tokenizer = transformers.AutoTokenizer.from_pretrained(two_layers)
    model = transformers.AutoModelForCausalLM.from_pretrained(two_layers).eval()
    letters = [letter_tokens(tokenizer, letter) for letter in "AB"]
    for i, prompt in enumerate(prompts):
        for order, (a, b) in enumerate([(first[i], second[i]), (second[i], first[i])]):
            ids = judge.render(prompt, a, b)
            assert tokenizer.decode(ids).count(a.strip()) >= 1 and prompt.strip() in tokenizer.decode(ids)
            with torch.no_grad():
                logps = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
            p_a = torch.sigmoid(logps[letters[0]].logsumexp(0) - logps[letters[1]].logsumexp(0)).item()
            expected = p_a if order == 0 else 1 - p_a
            assert judgement.p_first[order][i] == pytest.approx(expected, abs=1e-5)


def test_a_hub_judge_loads_from_the_copy_an_earlier_run_downloaded(models, tmp_path):
    # Offline (the suite's HF_HUB_OFFLINE), a Hub name resolves to its snapshot in the cache, laid out as the Hub's
    # client leaves it; one that was never downloaded is one line.
    two_layers, _, _ = models
    repo = tmp_path / "models--org--judge"
    shutil.copytree(two_layers, repo / "snapshots" / ("a" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    check_judge("org/judge", None)  # a Hub name passes the config's check: it is resolved when loaded
    judge = load_judge("org/judge", None, torch.device("cpu"), 2, 64, tmp_path)
    assert isinstance(judge, PairwiseJudge) and judge.judge([" p"], ["a"], ["b"]).p_first is not None
    with pytest.raises(UserError, match="could not load model 'org/absent'"):
        load_judge("org/absent", None, torch.device("cpu"), 2, 64, tmp_path)


def test_a_template_without_its_placeholders_is_one_line(models, tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Which is better, {response_a} or {response_b}?")
    args = evaluation_args(tmp_path, tmp_path, "candidates=[x]", f"judge={models[0]}", f"judge_template={template}")
    with pytest.raises(UserError, match=r"judge_template=.*judge.txt lacks \{prompt\}"):
        configuration.load(args, "evaluate")


def exact_kl(p_model, q_model, prompt: list[int], temperature: float, eos: int) -> float:
    """KL(p_T || q_T) of completions of at most 2 tokens, summed over every one (the chain rule: the first token's
    KL, and after each first token but EOS, the second's), from each model's plain forward passes."""

    def tempered(model, rows: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor(rows)).logits[:, -1].double() / temperature, dim=-1)

    p1, q1 = tempered(p_model, [prompt])[0], tempered(q_model, [prompt])[0]
    kl = (p1.exp() * (p1 - q1)).sum()
    vocab = torch.arange(p1.numel())
    rows = [prompt + [v] for v in vocab.tolist()]
    p2, q2 = tempered(p_model, rows), tempered(q_model, rows)
    second = (p2.exp() * (p2 - q2)).sum(dim=1)
    second[eos] = 0.0  # a completion that ended at its first token has no second
    return float(kl + (p1.exp() * second).sum())


def test_the_sampled_kl_estimates_the_exact_kl_of_a_tiny_model(models):
    # 4000 completions of one prompt, two tokens at most, sampled at T = 0.7 from the two-layer model: each one's
    # log-probability is exactly its probability under the tempered model, and their mean log-ratio to the one-layer
    # model is within 4 standard errors of the KL summed over every completion.
    two_layers, one_layer, _ = models
    tokenizer = load_tokenizer(model_settings(str(two_layers), torch.float32), Path("."))
    p_model, q_model = (transformers.AutoModelForCausalLM.from_pretrained(d).eval() for d in (two_layers, one_layer))
    sampler = Sampler(tokenizer, Topology.create("BasicTrainer"), max_new_tokens=2, batch_size=1000)
    prompt, n, temperature = tokenizer("Q: 1 + 2?\nA:")["input_ids"], 4000, 0.7
    seeds = [sample_seed(b"prompt", 0, i) for i in range(n)]
    completions = sampler.sample(p_model, [prompt] * n, None, seeds, temperature)
    own = np.array(sampler.score(p_model, [prompt] * n, completions, None, temperature))
    reference = np.array(sampler.score(q_model, [prompt] * n, completions, None, temperature))
    for completion, logp in list(zip(completions, own))[:20]:
        with torch.no_grad():
            logits = p_model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion)[:, None]).sum()
        assert logp == pytest.approx(expected.item(), abs=1e-4)
    ratios = own - reference
    exact = exact_kl(p_model, q_model, prompt, temperature, tokenizer.eos_token_id)
    assert exact > 0.05  # the two models differ: the test can tell an estimate from zero
    assert abs(ratios.mean() - exact) < 4 * ratios.std() / math.sqrt(n), (ratios.mean(), exact)


@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_batching_and_two_ranks_give_the_same_samples_and_verdicts(models, tmp_path):
    two_layers, one_layer, pairs = models
    args = (f"candidates=[{two_layers}]", f"baseline={one_layer}", f"judge={LOWERCASE}", "samples_per_prompt=2")
    _, whole = run_evaluation(tmp_path / "whole", pairs, *args, "batch_size=16")
    _, small = run_evaluation(tmp_path / "small", pairs, *args, "batch_size=3")
    # Two ranks, each model sharded over them (generate, ranks in step) or whole on each (our loop on each rank)
    outputs = []
    for name, shard in (("ranks", "true"), ("replicas", "false")):
        result = run_cli(
            *evaluation_args(tmp_path / name, pairs, *args, "batch_size=3", f"shard_models={shard}"),
            launcher=TORCHRUN, script="evaluate.py", env_extra={"OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout)
    assert "sampling: transformers' generate: sharded over the ranks" in outputs[0]
    assert "sampling: our decode loop on each of 2 ranks" in outputs[1]
    ranks, replicas = (read_jsonl(tmp_path / name / "out" / "samples.jsonl") for name in ("ranks", "replicas"))
    assert len(whole) == 8 * 2 * 4
    for other in (small, ranks, replicas):
        assert len(other) == len(whole)
        for ours, theirs in zip(whole, other):
            ours, theirs = dict(ours), dict(theirs)
            assert ours.pop("log_ratio") == pytest.approx(theirs.pop("log_ratio"), abs=1e-5)
            assert ours == theirs


def test_image_prompts_reach_the_candidate_and_a_vision_language_judge(tmp_path, monkeypatch):
    # A tiny Gemma 3 answers colour questions about squares, judged by a tiny Gemma 3 reward model: the candidate's
    # vision tower encodes the prompts' images as it generates, and each reward is the reward model's on that prompt,
    # its image and the response (another colour's image scores otherwise).
    from test_vision_rewards import tiny_gemma3_reward_model

    policy_dir = save_tiny_vlm(tmp_path / "policy", "gemma3")
    model, processor = tiny_gemma3_reward_model()
    model.save_pretrained(tmp_path / "reward")
    processor.save_pretrained(tmp_path / "reward")
    data = write_jsonl(tmp_path / "colours.jsonl", colour_rows(tmp_path, 12))
    encoded = []
    load = evaluate.load_trained

    def counted(*args):
        model = load(*args)
        count = lambda module, args, kwargs: encoded.append(kwargs["pixel_values"].shape[0])  # noqa: E731
        vision_tower(model).register_forward_pre_hook(count, with_kwargs=True)
        return model

    monkeypatch.setattr(evaluate, "load_trained", counted)
    settings = (
        f"candidates=[{policy_dir}]", "baseline=chosen", f"judge={tmp_path / 'reward'}", "n_eval_examples=4",
        "n_prompts=4", "max_new_tokens=4", "temperatures=[1.0]", "max_length=96", "max_prompt_length=64",
    )  # fmt: skip
    summary, lines = run_evaluation(tmp_path, data, *settings)
    assert len(lines) == 4 and sum(encoded) >= 4
    config = configuration.load(evaluation_args(tmp_path, data, *settings), "evaluate")
    tokenizer = load_tokenizer(model_settings(str(policy_dir), torch.float32), tmp_path)
    prompts = evaluate.held_out_prompts(config, evaluate.data_settings(config), tokenizer, tmp_path)
    reward = ModelReward(tmp_path / "reward", torch.device("cpu"), batch_size=4, max_length=96)
    other = pack_images((png((1, 2, 3)),))
    for line in lines:
        own = prompts[line["prompt_index"]]["images"]
        scored = reward([line["prompt"]], [line["candidate_response"]], [own])[0]
        assert line["candidate_reward"] == pytest.approx(scored, abs=1e-5)
        assert reward([line["prompt"]], [line["candidate_response"]], [other])[0] != pytest.approx(scored, abs=1e-5)


def test_the_trainer_wins_exactly_half_against_its_reference_before_it_trains(make_config):
    # Policy and reference complete the held-out prompts from the same seeds: equal weights, equal completions, all
    # ties. After training on arithmetic pairs the rate moves.
    config = make_config(
        "eval_winrate_prompts=6", f"judge={LOWERCASE}", "generation.max_new_tokens=6", "generation.temperature=1.0"
    )
    train.run(config)
    rates = [r["winrate/eval"] for r in read_jsonl(Path(config.local_run_dir) / "metrics.jsonl") if "winrate/eval" in r]
    assert len(rates) == 4 and rates[0] == 0.5  # evals at 0, 16, 32 and the final one
    assert any(rate != 0.5 for rate in rates[1:])


def test_policy_and_reference_draw_the_same_completions_from_the_same_seeds(make_config):
    # A judge that ties only equal texts: before training every pair ties. Policy and reference sample from the
    # same seeds; a reference drawing from seeds of its own would win or lose some.
    config = make_config(
        "eval_winrate_prompts=8", "judge=tests.round_rewards:text_digest", "generation.max_new_tokens=8"
    )
    trainer = build_trainer(config)
    winrate, judged = trainer.evals.winrate, []
    judge = winrate.judge.judge
    winrate.judge.judge = lambda *args: judged.append(judge(*args)) or judged[-1]
    assert winrate(trainer.policy, trainer.reference_model) == 0.5
    assert len(winrate.prompts) == 5 and judged[0].outcomes == [0] * 5  # the 8 held-out pairs ask 5 prompts


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("eval_winrate_prompts=4",), "eval_winrate_prompts=4 needs judge="),
        ((f"judge={LOWERCASE}",), f"judge={LOWERCASE} judges the win rate at each eval, but eval_winrate_prompts=0"),
        (("eval_winrate_prompts=4", f"judge={LOWERCASE}", "loss=simpo"), "loss=simpo has none"),
        (("eval_winrate_prompts=4", "judge=nowhere"), "judge=nowhere is neither a directory nor module:function"),
    ],
)
def test_a_win_rate_that_cannot_be_measured_is_one_line(make_config, overrides, message):
    with pytest.raises(UserError, match=re.escape(message)):
        make_config(*overrides)


def test_the_data_report_names_a_length_bias():
    biased = length_bias(np.array([30, 40, 50, 10]), np.array([10, 20, 25, 20]))
    assert "longer in 75% of training pairs, 1.88x on average" in biased and "loss=ld_dpo" in biased
    balanced = length_bias(np.array([30, 10, 50, 10]), np.array([10, 20, 25, 20]))
    assert "longer in 50% of training pairs" in balanced and "ld_dpo" not in balanced


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    """A tiny DPO run and a tiny LoRA run on arithmetic pairs, with their checkpoints (step-16, step-32, LATEST)."""
    root = tmp_path_factory.mktemp("runs")
    pairs = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    train.main(tiny_run_overrides(root / "full", pairs))
    base = save_tiny_lm(root / "base", "llama")  # an adapter's base is loaded from its files
    lora = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lr=1e-2", "model=blank_model")
    lora += (f"model.name_or_path={base}", "model.fsdp_policy_mp=null")
    train.main([*tiny_run_overrides(root / "lora", pairs), *lora])
    return root / "full" / "run", root / "lora" / "run"


def test_a_trained_model_loads_from_each_place_it_is_saved(tiny_runs):
    # step-N (its shards, read as the run built the model), LATEST (its from_pretrained export) and a LoRA run's
    # adapter (its base with the adapter merged) hold the weights the run trained.
    full, lora = tiny_runs
    cpu = Topology.create("BasicTrainer")
    for directory in (full / "step-32", full / "LATEST"):
        loaded = evaluate.load_trained(str(directory), cpu, torch.float32, directory.parent)
        trained = policy_state(directory)
        assert loaded.state_dict().keys() == trained.keys()
        assert all(torch.equal(loaded.state_dict()[name], value) for name, value in trained.items())
    assert kind(str(lora / "LATEST" / "adapter")) == "adapter"
    merged = evaluate.load_trained(str(lora / "LATEST" / "adapter"), cpu, torch.float32, lora.parent)
    exported = transformers.AutoModelForCausalLM.from_pretrained(lora / "LATEST").state_dict()
    for name, value in merged.state_dict().items():
        torch.testing.assert_close(value, exported[name], rtol=0, atol=1e-6, msg=name)


def test_a_runs_checkpoint_is_evaluated_on_its_held_out_prompts_and_its_card_gains_the_results(tiny_runs, tmp_path):
    # datasets=null: the run's datasets and held-out split; the export's model card gains a model-index entry per
    # temperature and win-rate kind, with the values of evaluation.json.
    full, _ = tiny_runs
    candidate = full / "LATEST"
    config = configuration.load(
        [f"candidates=[{candidate}]", "baseline=chosen", "judge=tests.round_rewards:not_an_answer", "n_prompts=3",
         "max_new_tokens=4", "temperatures=[1.0]", "wandb.enabled=false", f"output_dir={tmp_path / 'out'}",
         f"local_dirs=[{full.parent}]", "bootstrap_resamples=100"], "evaluate",
    )  # fmt: skip
    output = evaluate.evaluate(config, Topology.create("BasicTrainer"))
    lines = read_jsonl(output / "samples.jsonl")
    run_config = OmegaConf.load(full / "config.yaml")
    held_out = [json.loads(line) for line in Path(run_config.datasets[0]).read_text().splitlines()]
    assert {line["prompt"] for line in lines} <= {row["prompt"] for row in held_out}
    card = ModelCard.load(candidate / "README.md")
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    summary = json.loads((output / "evaluation.json").read_text())["results"][str(candidate)]["1.0"]
    assert results[next(name for name in results if name.startswith("win rate %"))] == round(
        summary["win_rate"]["value"] * 100, 2
    )
    assert len(results) == 2 and card.data.model_name


def test_the_data_keys_left_null_are_the_runs_and_given_ones_win(tiny_runs, models, tmp_path):
    # A run's checkpoint: its datasets, lengths and split seed; a key given on the command line replaces the run's.
    # A model without a run: train.py's defaults, the split drawn with `seed`.
    full, _ = tiny_runs
    run = OmegaConf.load(full / "config.yaml")
    args = ["judge=tests.round_rewards:lowercase_letters", "seed=5"]
    of_run = evaluate.data_settings(configuration.load([f"candidates=[{full / 'LATEST'}]", *args], "evaluate"))
    assert list(of_run.datasets) == list(run.datasets) and of_run.max_length == run.max_length
    assert of_run.n_eval_examples == run.n_eval_examples == 8 and of_run.seed == run.seed
    given = configuration.load(
        [f"candidates=[{full / 'LATEST'}]", "max_length=77", "max_prompt_length=20", *args], "evaluate"
    )
    assert evaluate.data_settings(given).max_length == 77 and evaluate.data_settings(given).max_prompt_length == 20
    without_run = configuration.load([*without_run_args(models), *args], "evaluate")
    settings = evaluate.data_settings(without_run)
    assert (settings.max_length, settings.max_prompt_length, settings.n_eval_examples, settings.seed) == (
        512,
        256,
        256,
        5,
    )
    with pytest.raises(UserError, match="max_prompt_length=600 must be positive and below max_length=512"):
        evaluate.data_settings(
            configuration.load([*without_run_args(models), "max_prompt_length=600", *args], "evaluate")
        )


def without_run_args(models) -> list[str]:
    return [f"candidates=[{models[0]}]", f"datasets=[{models[2]}]"]


def test_a_reward_model_given_as_a_model_to_sample_is_one_line(tmp_path):
    config = transformers.AutoConfig.from_pretrained(TINY_DIR, num_labels=1)
    transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(tmp_path / "rm")
    with pytest.raises(UserError, match=r"rm is a reward model, which generates nothing: a judge \(judge="):
        evaluate.load_trained(str(tmp_path / "rm"), Topology.create("BasicTrainer"), torch.float32, tmp_path)
