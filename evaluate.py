"""python evaluate.py candidates=[DIR,...] judge=DIR_OR_FUNCTION [key=value ...]: did the model get better?

Each candidate (a run's LATEST or step-N, a from_pretrained directory, a peft adapter) and the baseline (another
model, e.g. the SFT model, or the dataset's own chosen responses) answer the first n_prompts distinct held-out
prompts of the datasets at each temperature, samples_per_prompt times, every completion sampled from its own seed of
(seed, prompt, sample, temperature) and side; a judge (a reward model, a pairwise LLM judge, or a function) says which
of each two is better. Per candidate and temperature: win, tie and loss rates with 95% bootstrap intervals, the
length-controlled win rate, each side's mean length, the judge's mean rewards (a reward's), and the sampled
KL(candidate || reference) of the candidate's own completions: each temperature one point of the DPO paper's
reward-against-KL figure (Rafailov et al. 2023, Figures 2 and 3). Written to the output directory: evaluation.json,
samples.jsonl, winrate.png; a wandb table; and the results in each candidate's model card, where it has one.

Under torchrun the prompts are shared out over the ranks and each model is sharded over them (FSDP) as training
shards it, or with shard_models=false held whole by every rank (data parallel: no gathering of weights, our decode
loop on every rank); the result is the same as on one process. Config: config/evaluate.yaml (types and checks below)."""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import tqdm
from omegaconf import MISSING, DictConfig, OmegaConf

import config as configuration
from configuration.checks import check_writable_dir
from configuration.composition import register
from configuration.messages import as_override, expect
from configuration.sections import WandbConfig
from generation.sampling import Sampler, sample_seed
from generation.server_sampling import ServerSampler
from judging.candidates import CHOSEN, named_key, reference_line, resolve_reference, sweep_jobs
from judging.judges import check_judge, load_judge
from judging.winrates import summarize
from modeling.distributed import (
    Topology,
    init_process_group,
    launched_by_torchrun,
    leave_process_group,
    reported_errors,
)
from modeling.precision import DTYPE_NAMES, choose_compute_dtype
from pairs.chat_templates import template_kwargs_problem
from persistence.tokenized import Tokenization, first_of_each_group, load_examples
from reporting import evaluation_report
from trained import kind, load_trained, run_config
from utils import (
    POSITIVE,
    Range,
    UserError,
    check_ranges,
    get_local_dir,
    get_local_run_dir,
    ranged,
    release_free_memory,
)


@dataclass
class EvaluateConfig:
    """Every key of config/evaluate.yaml, in its order; comments and values are there."""

    exp_name: str = MISSING
    candidates: list[str] = MISSING
    baseline: str = MISSING
    reference: Optional[str] = MISSING
    judge: str = MISSING
    judge_template: Optional[str] = MISSING
    datasets: Optional[list[str]] = MISSING
    n_eval_examples: Optional[int] = ranged(Range(0, low_open=True, null="for the run's (or train.py's)"))
    max_length: Optional[int] = ranged(Range(0, low_open=True, null="for the run's (or train.py's)"))
    max_prompt_length: Optional[int] = ranged(Range(0, low_open=True, null="for the run's (or train.py's)"))
    chat_template_kwargs: Optional[dict[str, Any]] = MISSING
    n_prompts: int = ranged(POSITIVE)
    samples_per_prompt: int = ranged(POSITIVE)
    temperatures: list[float] = MISSING
    max_new_tokens: int = ranged(POSITIVE)
    seed: int = ranged(Range(0, 2**32 - 1))
    batch_size: int = ranged(POSITIVE)
    dtype: str = MISSING
    shard_models: bool = MISSING
    server: Optional[str] = MISSING
    server_timeout: float = ranged(Range(0, low_open=True))
    bootstrap_resamples: int = ranged(Range(100), expected="100 or more")
    output_dir: Optional[str] = MISSING
    local_dirs: list[str] = MISSING
    plots: bool = MISSING
    wandb: WandbConfig = MISSING

    def __post_init__(self):
        check_ranges(self)
        if not self.candidates:
            raise UserError("candidates=[] names no model to evaluate; give at least one, e.g. candidates=[run/LATEST]")
        named = [*((f"candidates[{i}]", spec) for i, spec in enumerate(self.candidates)), ("baseline", self.baseline)]
        for key, spec in named:
            if spec != CHOSEN and Path(spec).exists() and not Path(spec).is_dir():
                raise UserError(f"{key}={spec} is a file; a model is a directory (or a Hub name)")
        if self.reference == CHOSEN:
            raise UserError("reference=chosen: the KL is measured against a model; name one, or null")
        if not self.temperatures or any(not (isinstance(t, (int, float)) and t > 0) for t in self.temperatures):
            raise UserError(f"temperatures={list(self.temperatures)} must be positive numbers, at least one")
        if self.datasets is not None and not self.datasets:
            raise UserError("datasets=[] names no dataset; give one, or null for the first candidate's run's")
        problem = template_kwargs_problem(self.chat_template_kwargs or {})
        if problem:
            raise UserError(f"chat_template_kwargs={as_override(self.chat_template_kwargs)} {problem}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise UserError(f"dtype={self.dtype} must be auto, float32 or bfloat16")
        ServerSampler.check_url("server", self.server)
        for i, directory in enumerate(self.local_dirs):
            check_writable_dir(f"local_dirs[{i}]", directory)
        if self.output_dir is not None:
            check_writable_dir("output_dir", self.output_dir)
        check_judge(self.judge, self.judge_template)


register("evaluate", EvaluateConfig)


DATA_KEYS = ("datasets", "n_eval_examples", "max_length", "max_prompt_length", "chat_template_kwargs")


@dataclass(frozen=True)
class DataSettings:
    """Where the held-out prompts come from (data_settings): train.py's keys of these names, and the seed the
    held-out split is drawn with."""

    datasets: list[str]
    n_eval_examples: int | None
    max_length: int
    max_prompt_length: int
    chat_template_kwargs: dict
    seed: int


def data_settings(config: DictConfig) -> DataSettings:
    """What the held-out prompts come from: each of DATA_KEYS as given, or where null the first candidate's run's
    (its config.yaml beside the checkpoint; without a run, train.py's default), and the seed its held-out split is
    drawn with (the run's; without a run, `seed`): a run's held-out prompts are the ones it never trained on."""
    first = Path(config.candidates[0])
    run = first.parent / "config.yaml"
    if config.datasets is None and not run.exists():
        raise UserError(
            f"datasets=null takes the datasets of the first candidate's run, but {first} is not a run's checkpoint "
            "(no config.yaml beside it): set datasets=[...]"
        )
    base = run_config(first) if run.exists() else configuration.composed([])
    given = {key: config[key] if config[key] is not None else base[key] for key in DATA_KEYS}
    plain = {key: OmegaConf.to_container(v) if OmegaConf.is_config(v) else v for key, v in given.items()}
    settings = DataSettings(**plain, seed=base.seed if run.exists() else config.seed)
    expect(
        0 < settings.max_prompt_length < settings.max_length,
        "max_prompt_length",
        settings.max_prompt_length,
        f"positive and below max_length={settings.max_length}",
    )
    return settings


def held_out_prompts(config: DictConfig, data: DataSettings, tokenizer, cache_dir: Path) -> list[dict]:
    """The first n_prompts distinct held-out prompts of `data` (data_settings), each the first example of its
    prompt: {"prompt", "responses" (its chosen and rejected), "key", and "images" where it has any}."""
    settings = Tokenization(data.max_length, data.max_prompt_length, False, dict(data.chat_template_kwargs))
    splits = load_examples(list(data.datasets), tokenizer, settings, data.seed, data.n_eval_examples, cache_dir)
    held_out = splits["test"]
    if config.baseline == CHOSEN and held_out.labelled:  # KTO's unpaired data: "chosen" is a desirable completion
        n_prompts = len(np.unique(held_out.groups))
        held_out = held_out.select(np.flatnonzero(held_out.labels == 1))
        left_out = n_prompts - len(np.unique(held_out.groups))
        print(
            f"baseline=chosen on unpaired data: each prompt's first desirable completion (label true); {left_out} "
            f"of {n_prompts} held-out prompts have none and are left out"
        )
    held_out = first_of_each_group(held_out)
    if not len(held_out):
        raise UserError(f"datasets={list(data.datasets)} hold no held-out prompt to evaluate on")
    if len(held_out) < config.n_prompts:
        print(f"n_prompts={config.n_prompts}: the held-out split has {len(held_out)} distinct prompts, all evaluated")
    return held_out.take(range(min(config.n_prompts, len(held_out))))


def compute_dtype(name: str, topology: Topology, cache_dir: Path) -> torch.dtype:
    """The models' dtype: float32 or bfloat16 as given; auto as training's model.fsdp_policy_mp=auto decides it
    (modeling.precision.choose_compute_dtype: bfloat16 on a GPU that runs it natively, float16 on one with float16
    tensor cores only (V100, T4: no gradient here, so nothing to scale), bfloat16 on a CPU whose measured bfloat16
    matmuls are fast enough (AVX512-BF16, AMX); else float32), decided on rank 0 for every rank and said in one line,
    as training says it."""
    if name != "auto":
        return getattr(torch, name)
    dtype, why = topology.broadcast(topology.run_on_main(lambda: choose_compute_dtype(topology.device, cache_dir)))
    print(f"precision: {DTYPE_NAMES[dtype or torch.float32]}, because {why} (dtype=auto; dtype=float32 for float32)")
    return dtype or torch.float32


class CompletionStore:
    """Every side's completions of the prompts, [P * S] per temperature (prompt-major), and the candidates' log-probs
    under themselves and under the reference (the sampled KL's two terms), computed one model at a time so that
    one model is held at once; with the seconds and tokens spent sampling."""

    def __init__(self, config: DictConfig, topology: Topology, tokenizer, prompts: list[dict]):
        self.config, self.topology, self.prompts = config, topology, prompts
        self.sampler = Sampler(tokenizer, topology, config.max_new_tokens, config.batch_size)
        self.server = ServerSampler(config.server, tokenizer, config.max_new_tokens, config.server_timeout, topology) \
            if config.server else None  # fmt: skip
        self.cache_dir = get_local_dir(config.local_dirs)
        self.dtype = compute_dtype(config.dtype, topology, self.cache_dir)
        s = config.samples_per_prompt
        self.prompt_ids = [ex["prompt"] for ex in prompts for _ in range(s)]
        self.images = [ex.get("images", b"") for ex in prompts for _ in range(s)]
        self.keep_end = [ex["keep_end"] for ex in prompts for _ in range(s)]  # a prompt cut as training cuts it
        self.completions: dict[tuple[str, str], dict[float, list[list[int]]]] = {}  # by (side, model)
        self.own_logps: dict[str, dict[float, list[float]]] = {}
        self.reference_logps: dict[str, dict[float, list[float]]] = {}
        self.seconds = self.tokens = 0.0

    def seeds(self, side: str, temperature: float) -> list[int]:
        """Each completion's seed: of the run's seed, the side (candidate or baseline), the temperature, which
        sample, and the prompt."""
        s = self.config.samples_per_prompt
        return [sample_seed(ex["key"], self.config.seed, side, temperature, j) for ex in self.prompts for j in range(s)]

    def load(self, spec: str) -> torch.nn.Module:
        print(f"loading {spec} ({kind(spec)})")
        with named_key(self.config, spec):
            return load_trained(spec, self.topology, self.dtype, self.cache_dir)

    def sample(self, model, name: str, side: str, kl: bool) -> None:
        """The model's completions as `side` (candidate or baseline) at every temperature, drawn together (rows of
        one prompt share its prefill) and, with kl, their log-probs under it: in float32 summed as they are drawn;
        in bfloat16 scored after sampling, as the reference's are (`score`), so that the KL's two terms come from one
        computation (a decode step's bfloat16 rounding is not the scoring pass's) and a model against itself is at 0."""
        temperatures, n = list(self.config.temperatures), len(self.prompt_ids)
        seeds = {t: self.seeds(side, t) for t in temperatures}
        order = [(t, i) for i in range(n) for t in temperatures]  # prompt-major: a prompt's rows in one batch
        rows = ([self.prompt_ids[i] for _, i in order], [self.images[i] for _, i in order],
                [seeds[t][i] for t, i in order], [t for t, _ in order])  # fmt: skip
        keep_end = [self.keep_end[i] for _, i in order]
        start = time.time()
        if self.server and side == "candidate":  # the server's draws, scored by ours (below)
            drawn = self.server.sample(rows[0], rows[3], top_p=1.0)
        elif kl and self.dtype == torch.float32:
            drawn, logps = self.sampler.sample_scored(model, *rows, keep_end=keep_end)
            self.own_logps[name] = {t: [None] * n for t in temperatures}
            for (t, i), logp in zip(order, logps):
                self.own_logps[name][t][i] = logp
        else:
            drawn = self.sampler.sample(model, *rows, keep_end=keep_end)
        self.seconds += time.time() - start
        self.tokens += sum(map(len, drawn))
        self.completions[side, name] = {t: [None] * n for t in temperatures}
        for (t, i), completion in zip(order, drawn):
            self.completions[side, name][t][i] = completion
        if kl and (self.dtype != torch.float32 or (self.server and side == "candidate")):
            self.own_logps[name] = self.score(model, self.completions[side, name])

    def score(self, model, completions: dict[float, list[list[int]]]) -> dict[float, list[float]]:
        """Each completion's log-prob under `model` at its temperature: every temperature's together, so that a
        prompt is computed once for all its completions."""
        temperatures, n = list(completions), len(self.prompt_ids)
        logps = self.sampler.score(
            model, self.prompt_ids * len(temperatures), [c for t in temperatures for c in completions[t]],
            self.images * len(temperatures), [t for t in temperatures for _ in range(n)],
            self.keep_end * len(temperatures),  # each prompt cut as it was sampled
        )  # fmt: skip
        return {t: logps[k * n : (k + 1) * n] for k, t in enumerate(temperatures)}

    def run(self) -> None:
        """Candidates first, then the baseline, then the reference where it is another model."""
        c = self.config
        reference = c.reference or (c.baseline if c.baseline != CHOSEN else None)
        if self.server and len(c.candidates) > 1:
            raise UserError(f"server={c.server} serves one model: give one candidate, not {len(c.candidates)}")
        if self.server:  # before any model loads: a server of another model stops the evaluation at once
            self.server.check(c.candidates[0])
        for name in c.candidates:
            model = self.load(name)
            self.sample(model, name, "candidate", kl=reference is not None)
            del model
            release_free_memory()
        if c.baseline == CHOSEN:
            chosen = [ex["responses"][0] for ex in self.prompts for _ in range(c.samples_per_prompt)]
            self.completions["baseline", CHOSEN] = dict.fromkeys(c.temperatures, chosen)
        else:
            model = self.load(c.baseline)
            self.sample(model, c.baseline, "baseline", kl=False)
            if reference == c.baseline:
                self.score_under_reference(model)
            del model
        if reference is not None and reference != c.baseline:
            self.score_under_reference(self.load(reference))
        release_free_memory()

    def score_under_reference(self, reference: torch.nn.Module) -> None:
        for name in self.config.candidates:
            self.reference_logps[name] = self.score(reference, self.completions["candidate", name])

    def log_ratios(self, name: str, temperature: float) -> np.ndarray | None:
        if name not in self.reference_logps:
            return None
        own, reference = self.own_logps[name][temperature], self.reference_logps[name][temperature]
        return self.shaped(np.array(own) - np.array(reference))

    def shaped(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).reshape(len(self.prompts), self.config.samples_per_prompt)


def text_length(ids: list[int], eos_token_id: int) -> int:
    """A completion's tokens without its closing EOS."""
    return len(ids) - (1 if ids and ids[-1] == eos_token_id else 0)


def judge_all(config: DictConfig, store: CompletionStore, tokenizer, device, max_length: int) -> tuple[dict, list]:
    """(rank 0) Each candidate against the baseline at each temperature, judged (a reward model reads max_length
    tokens): {candidate: {temperature: summary}} and every judged pair as a line of samples.jsonl."""
    cache_dir = get_local_dir(config.local_dirs)
    judge = load_judge(
        config.judge, config.judge_template, device, config.batch_size, max_length, cache_dir, store.dtype
    )
    prompt_texts = [tokenizer.decode(ids) for ids in store.prompt_ids]  # as the policy read it
    baseline = config.baseline
    decode = lambda batch: tokenizer.batch_decode(batch, skip_special_tokens=True)  # noqa: E731
    lengths = lambda batch: store.shaped([text_length(ids, tokenizer.eos_token_id) for ids in batch])  # noqa: E731
    pairs = [(name, t) for name in config.candidates for t in config.temperatures]
    texts = {(side, name): {t: decode(batch) for t, batch in by_t.items()}
             for (side, name), by_t in store.completions.items()}  # fmt: skip
    sides = [(texts["candidate", name][t], texts["baseline", baseline][t]) for name, t in pairs]
    with tqdm.tqdm(total=len(prompt_texts) * len(pairs), desc="judging", unit="pair", leave=False) as bar:
        judgements = judge.judge_all(prompt_texts, sides, store.images, bar)
    results, lines = {name: {} for name in config.candidates}, []
    for (name, temperature), (ours_text, theirs_text), judgement in zip(pairs, sides, judgements):
        ours = store.completions["candidate", name][temperature]
        theirs = store.completions["baseline", baseline][temperature]
        rewards = judgement.rewards and tuple(store.shaped(r) for r in judgement.rewards)
        log_ratios = store.log_ratios(name, temperature)
        results[name][temperature] = summarize(
            store.shaped(judgement.outcomes), lengths(ours), lengths(theirs), config.bootstrap_resamples,
            config.seed, log_ratios, rewards,
        )  # fmt: skip
        lines += evaluation_report.sample_lines(
            name, temperature, config.samples_per_prompt, prompt_texts, ours_text, theirs_text, judgement,
            lengths(ours), lengths(theirs), log_ratios,
        )  # fmt: skip
    return results, lines


def evaluate(config: DictConfig, topology: Topology, labels: dict[str, dict] | None = None) -> Path | None:
    """The whole evaluation on this rank; the output directory (rank 0's; None on the others). `labels`: the keys
    that set a sweep's jobs apart (sweep_jobs), for its frontier."""
    cache_dir = get_local_dir(config.local_dirs)
    with topology.main_first():
        run, tokenizer = resolve_reference(config, cache_dir)
        data = data_settings(config)
        prompts = held_out_prompts(config, data, tokenizer, cache_dir)
    if topology.is_main:
        print(reference_line(config, run))
    store = CompletionStore(config, topology, tokenizer, prompts)
    store.run()
    rate = store.tokens / max(store.seconds, 1e-9)
    print(f"generation: {int(store.tokens)} tokens in {store.seconds:.1f} s, {rate:.1f} tokens/s")

    def report() -> Path:
        results, lines = judge_all(config, store, tokenizer, topology.device, data.max_length)
        output = Path(config.output_dir) if config.output_dir else get_local_run_dir(config.exp_name, config.local_dirs)
        speed = {"tokens": int(store.tokens), "seconds": store.seconds, "tokens_per_second": rate,
                 "prompts": len(prompts)}  # fmt: skip
        evaluation_report.write(output, config, results, lines, speed, labels or {})
        return output

    return topology.run_on_main(report)


def main(args: list[str]) -> None:
    if args and args[0] in ("-h", "--help"):
        print(f"{__doc__}\nThe defaults (config/evaluate.yaml):\n")
        print(OmegaConf.to_yaml(configuration.composed([], "evaluate")))
        return
    try:
        config = configuration.load(args, "evaluate")
        labels = sweep_jobs(config)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    distributed = launched_by_torchrun()
    if distributed:
        init_process_group(timeout_secs=1800)
    try:
        with reported_errors():
            sharded = distributed and config.shard_models  # else every rank holds each model whole (data parallel)
            evaluate(config, Topology.create("FSDPTrainer" if sharded else "BasicTrainer"), labels)
    finally:
        if distributed:
            leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
