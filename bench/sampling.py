"""The GPU campaign's sampling stage (gpu.py): evaluate.py's sampling (core.generations.Sampler, our decode loop, the
candidate's log-probs summed while drawing) against plain model.generate(do_sample=True) on as many rows of the same
prompts (at T = 1: generate takes one temperature a call), on the campaign's random model in bfloat16 on a GPU
(float32 on a CPU, as evaluate.py's dtype=auto chooses). Our rows are evaluate.py's: each prompt at every temperature.
A random model's next token is close to uniform over the vocabulary, so rows rarely draw their EOS and both run to
max_new_tokens: the stage times decode steps, not completions' lengths."""

import json
import time
from pathlib import Path

import torch
import transformers

from bench.common import hh_like_rows
from core.generations import Sampler
from core.layouts import left_padded_prompts
from modeling.distributed import Topology


def synchronized_seconds(device: torch.device, since: float) -> float:
    """Seconds since `since`, once the device has finished what was queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - since


def tokens_to_eos(rows: list[list[int]], eos: int) -> int:
    """The tokens of completions, each counted up to its EOS."""
    return sum(row.index(eos) + 1 if eos in row else len(row) for row in rows)


@torch.no_grad()
def sampling_worker(result_file: str, model_dir: str, n_prompts: int, temperatures: list[float], max_new_tokens: int,
                    max_length: int) -> None:  # fmt: skip
    """Our sampler's and plain generate's tokens/s on n_prompts x len(temperatures) rows, written to result_file."""
    topology = Topology.create("BasicTrainer")
    device = topology.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    with torch.device(device):  # random weights made on the device: a 1.1B model's initialisation on the host is slow
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_dir), dtype=dtype
        ).eval()
    prompts = [tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] for row in
               hh_like_rows(n_prompts, max_length, seed=n_prompts)]  # fmt: skip
    rows = [(prompt, t) for prompt in prompts for t in temperatures]  # prompt-major, as evaluate.py orders them
    sampler = Sampler(tokenizer, topology, max_new_tokens, n_prompts)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    sampler.sample_rows(model, prompts[:2], None, [1, 2], [1.0, 1.0])  # warm-up: the kernels' first launches

    start = time.perf_counter()
    drawn, _ = sampler.sample_scored(model, [p for p, _ in rows], None, list(range(len(rows))), [t for _, t in rows])
    ours = {"seconds": synchronized_seconds(device, start), "tokens": tokens_to_eos(drawn, eos)}

    ids, mask = left_padded_prompts([{"prompt": p} for p, _ in rows], pad)
    ids, mask = ids.to(device), mask.to(device)
    settings = dict(do_sample=True, top_k=0, top_p=1.0, temperature=1.0, pad_token_id=pad, eos_token_id=eos)
    torch.manual_seed(0)
    model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=2, **settings)  # warm-up
    start = time.perf_counter()
    output = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, **settings)
    seconds = synchronized_seconds(device, start)
    plain = {"seconds": seconds, "tokens": tokens_to_eos(output[:, ids.shape[1] :].tolist(), eos)}
    for timing in (ours, plain):
        timing["tokens_per_second"] = timing["tokens"] / timing["seconds"]
        timing["ms_per_step"] = 1000 * timing["seconds"] / max_new_tokens
    result = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": len(rows),
        "prompts": n_prompts,
        "temperatures": temperatures,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "ours": ours,
        "generate": plain,
        "speedup": ours["tokens_per_second"] / plain["tokens_per_second"],
    }
    Path(result_file).write_text(json.dumps(result))


def render_sampling(stage: dict) -> list[str]:
    """campaign.md's lines for the stage: tokens/s and ms a step of ours and of plain generate."""
    r = stage["result"]
    lines = [
        "",
        f"## {stage['name']}",
        "",
        f"{r['rows']} rows ({r['prompts']} prompts x temperatures {r['temperatures']}, {r['mean_prompt_tokens']:.0f} "
        f"prompt tokens on average), {r['max_new_tokens']} new tokens, {r['dtype']} on {r['device']}: ours "
        f"{r['speedup']:.2f}x plain generate.",
        "",
        "| sampler | tokens | seconds | tokens/s | ms a step, prefill included |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, key in (("ours (evaluate.py's Sampler)", "ours"), ("plain generate(do_sample=True)", "generate")):
        t = r[key]
        lines.append(f"| {name} | {t['tokens']} | {t['seconds']:.2f} | {t['tokens_per_second']:.0f} | "
                     f"{t['ms_per_step']:.1f} |")  # fmt: skip
    return lines
