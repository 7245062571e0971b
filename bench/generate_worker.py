"""--generate's worker, run in a fresh process from the code of either version (this tree's or --versus's, by file
path: it imports only the sampling and judging modules, generation/sampling.py and judging/judges.py, before their
packages core/sampling.py and core/judges.py, before their split core/generations.py, and modeling.distributed):
evaluate.py's sampling (the Sampler) and its parts, plain model.generate on the same batches, the seeded sampler
alone on random logits, the KL's log-probs and a reward model's judging, each timed."""

import importlib
import inspect
import json
import time
from pathlib import Path

import torch
import transformers


class ForwardClock:
    """Seconds the model's forward passes take, prefill (more than one new position) apart from decode steps."""

    def __init__(self, model: torch.nn.Module):
        self.prefill = self.decode = 0.0
        self.start = 0.0

        def before(module, args, kwargs):
            self.start = time.perf_counter()

        def after(module, args, kwargs, output):
            ids = kwargs.get("input_ids", args[0] if args else None)
            width = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
            elapsed = time.perf_counter() - self.start
            if width > 1:
                self.prefill += elapsed
            else:
                self.decode += elapsed

        model.register_forward_pre_hook(before, with_kwargs=True)
        model.register_forward_hook(after, with_kwargs=True)

    def reset(self) -> None:
        self.prefill = self.decode = 0.0


def module(name: str):
    """generation.sampling or judging.judges (this tree's); in the versions before, core.sampling or core.judges, and
    before those core.generations, which held both."""
    package = {"sampling": "generation", "judges": "judging"}[name]
    for dotted in (f"{package}.{name}", f"core.{name}", "core.generations"):
        try:
            return importlib.import_module(dotted)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"no {package}.{name}, core.{name} or core.generations in this version")


def seeds_of(n: int, temperature: float, side: int = 0) -> list[int]:
    return [int(temperature * 1e6) * 10_000 + i + side * 10**13 for i in range(n)]


def time_sampler(
    sampler, model, clock, prompts, temperatures, side: int = 0, scored: bool = True
) -> tuple[dict, dict, list | None]:
    """evaluate.py's sampling of one model as one side (0: the candidate, 1: the baseline): every temperature's rows
    drawn together, prompt-major, the candidate's with their log-probs summed while drawing (the KL's first term)
    where the Sampler can and `scored` (evaluate.py's float32: sample_scored), or drawn together alone (sample, with
    one temperature per row; before, sample_rows), else one temperature at a time; seconds (whole, prefill, decode
    forward passes), tokens; the completions by temperature; and their log-probs (temperature-major), or None."""
    clock.reset()
    start, own = time.perf_counter(), None
    order = [(t, i) for i in range(len(prompts)) for t in temperatures]
    seeds = {t: seeds_of(len(prompts), t, side) for t in temperatures}
    rows = ([prompts[i] for _, i in order], None, [seeds[t][i] for t, i in order], [t for t, _ in order])
    if scored and hasattr(sampler, "sample_scored") and side == 0:
        drawn, logps = sampler.sample_scored(model, *rows)
        by_row = dict(zip(order, logps))
        own = [by_row[t, i] for t in temperatures for i in range(len(prompts))]
    rows_at_once = hasattr(sampler, "sample_rows") or hasattr(sampler, "score")  # versions before: sample_rows
    if own is None and rows_at_once:
        drawn = getattr(sampler, "sample_rows", sampler.sample)(model, *rows)
    if rows_at_once:
        completions = {t: [None] * len(prompts) for t in temperatures}
        for (t, i), completion in zip(order, drawn):
            completions[t][i] = completion
    else:
        completions = {t: sampler.sample(model, prompts, None, seeds[t], t) for t in temperatures}
    seconds = time.perf_counter() - start
    tokens = sum(len(c) for rows in completions.values() for c in rows)
    return {"seconds": seconds, "prefill": clock.prefill, "decode": clock.decode, "tokens": tokens}, completions, own


@torch.no_grad()
def time_generate(model, tokenizer, prompts, batch: int, max_new_tokens: int, temperatures) -> dict:
    """Plain model.generate(do_sample=True) on the same left-padded batches (no top-k: the full tempered
    distribution, as the Sampler draws from) on the model's device, tokens counted up to each row's EOS."""
    from core.layouts import left_padded_prompts

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seconds = tokens = 0
    torch.manual_seed(0)
    for temperature in temperatures:
        for start in range(0, len(prompts), batch):
            ids, mask = left_padded_prompts([{"prompt": p} for p in prompts[start : start + batch]], pad)
            ids, mask = ids.to(model.device), mask.to(model.device)
            began = time.perf_counter()
            output = model.generate(
                ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
            )  # fmt: skip
            if output.is_cuda:  # its last kernels finished
                torch.cuda.synchronize(output.device)
            seconds += time.perf_counter() - began
            for row in output[:, ids.shape[1] :].tolist():
                tokens += row.index(eos) + 1 if eos in row else len(row)
    return {"seconds": seconds, "tokens": tokens}


def time_processor(vocab: int, batch: int, steps: int, temperature: float, top_p: float) -> float:
    """Seconds per call of the seeded sampler (SeededSampling) on [batch, vocab] random logits."""
    SeededSampling = module("sampling").SeededSampling

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(steps, batch, vocab, generator=generator) * 3
    sampler = SeededSampling(torch.rand(batch, steps, generator=generator), 0, temperature, top_p)
    sampler(torch.zeros(batch, 0, dtype=torch.long), logits[0])  # warm-up
    start = time.perf_counter()
    for step in range(steps):
        sampler(torch.zeros(batch, step, dtype=torch.long), logits[step])
    return (time.perf_counter() - start) / steps


def time_logps(sampler, model, prompts: list[list[int]], completions: dict[float, list[list[int]]]) -> list[float]:
    """The KL's log-probs of every completion, as evaluate.py asks for them: every temperature's in one call where
    the Sampler takes one temperature per completion, else one temperature at a time."""
    temperatures = list(completions)
    score = getattr(sampler, "score", None) or sampler.logps  # named logps before
    if "temperatures" in inspect.signature(score).parameters:
        rows = [row for t in temperatures for row in completions[t]]
        each = [t for t in temperatures for _ in prompts]
        return score(model, prompts * len(temperatures), rows, None, each)
    return [logp for t in temperatures for logp in score(model, prompts, completions[t], None, t)]


def generate_worker(result_file: str, model_dir: str, judge_dir: str, prompts_file: str, batch: int,
                    max_new_tokens: int, temperatures: list[float], plain: bool, dtype: str = "float32",
                    static: bool = True) -> None:  # fmt: skip
    """Every timing of one version's code into result_file (JSON), the models in `dtype` as evaluate.py's dtype= loads
    them (in bfloat16 the KL's first term scored after sampling, as evaluate.py scores it there); static: this tree's
    static decode loop (its default), else its own loop (Sampler.static_loop; versions before have the own loop)."""
    RewardJudge, Sampler = module("judges").RewardJudge, module("sampling").Sampler
    from judging.rewards import ModelReward
    from modeling.distributed import Topology

    torch.manual_seed(0)
    prompts = json.loads(Path(prompts_file).read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    topology = Topology.create("BasicTrainer")
    sampler = Sampler(tokenizer, topology, max_new_tokens, batch)
    sampler.static_loop = static
    clock = ForwardClock(model)
    sampler.sample(model, prompts[:2], None, [1, 2], 1.0)  # warm-up
    result = {"threads": torch.get_num_threads()}
    scored = dtype == "float32"
    result["sampler"], completions, own = time_sampler(sampler, model, clock, prompts, temperatures, scored=scored)
    result["baseline"], baseline, _ = time_sampler(sampler, model, clock, prompts, temperatures, side=1)
    result["processor"] = {
        f"top_p={top_p}": time_processor(model.config.vocab_size, batch, 16, 1.0, top_p) for top_p in (1.0, 0.9)
    }
    if plain:
        result["generate"] = time_generate(model, tokenizer, prompts, batch, max_new_tokens, temperatures[-1:])
    start = time.perf_counter()
    for _ in range(1 if own else 2):  # the KL's passes: under the model (unless summed while drawing), the reference
        logps = time_logps(sampler, model, prompts, completions)
    result["logps"] = {"seconds": time.perf_counter() - start, "values": logps, "while drawing": own}
    del model
    # the judge in the evaluation's dtype where the version takes one (float32 before, as its evaluate.py's)
    takes = "dtype" in inspect.signature(ModelReward).parameters
    judge = RewardJudge(ModelReward(Path(judge_dir), topology.device, batch, 512, "judge",
                                    **({"dtype": getattr(torch, dtype)} if takes else {})))  # fmt: skip
    texts = [tokenizer.decode(ids) for ids in prompts]
    start, rewards = time.perf_counter(), []
    decode = lambda rows: tokenizer.batch_decode(rows, skip_special_tokens=True)  # noqa: E731
    pairs = [(decode(completions[t]), decode(baseline[t])) for t in temperatures]  # the candidate's, the baseline's
    if hasattr(judge, "judge_all"):
        judgements = judge.judge_all(texts, pairs)
    else:
        judgements = [judge(texts, ours, theirs, None) for ours, theirs in pairs]
    for judgement in judgements:
        rewards += judgement.rewards[0] + judgement.rewards[1]
    result["judge"] = {"seconds": time.perf_counter() - start, "values": rewards}
    result["candidate_completions"] = {str(t): rows for t, rows in completions.items()}
    result["baseline_completions"] = {str(t): rows for t, rows in baseline.items()}
    Path(result_file).write_text(json.dumps(result))
