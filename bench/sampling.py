"""The GPU campaign's sampling stage (gpu.py): evaluate.py's sampling (generation.sampling.Sampler: its static decode
loop, a CUDA graph per batch bucket, the default; and its own loop, decoding.decode, Sampler.static_loop off; the
candidate's log-probs summed while drawing) against plain model.generate(do_sample=True) on as many rows of the same
prompts (at T = 1: generate takes one temperature a call), on the campaign's random model in bfloat16 on a GPU
(float32 on a CPU, as evaluate.py's dtype=auto chooses). The forward hooks that split prefill from decode time do not
run when a graph replays, so the static loop's split counts only the steps that ran eagerly. Our rows are
evaluate.py's: each prompt at every temperature. A random model's next token is close to uniform over the
vocabulary, so rows rarely draw their EOS and all run to max_new_tokens: the stage times decode steps, not
completions' lengths."""

import json
from pathlib import Path

import torch
import transformers

from bench.common import hh_like_rows
from bench.generate_worker import ForwardClock, time_generate, time_sampler
from generation.sampling import Sampler
from modeling.distributed import Topology


@torch.no_grad()
def sampling_worker(result_file: str, model_dir: str, n_prompts: int, temperatures: list[float], max_new_tokens: int,
                    max_length: int) -> None:  # fmt: skip
    """Our sampler's and plain generate's tokens/s on n_prompts x len(temperatures) rows, written to result_file
    (--generate's timings: generate_worker.py's)."""
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
    rows = len(prompts) * len(temperatures)
    sampler = Sampler(tokenizer, topology, max_new_tokens, n_prompts)
    clock = ForwardClock(model)
    sampler.sample(model, prompts[:2], None, [1, 2], [1.0, 1.0])  # warm-up: the kernels' first launches
    time_generate(model, tokenizer, prompts[:2], 2, 2, [1.0])
    ours, static_drawn, _ = time_sampler(sampler, model, clock, prompts, temperatures)  # prompt-major, as evaluate.py's
    sampler.static_loop = False
    own, own_drawn, _ = time_sampler(sampler, model, clock, prompts, temperatures)
    plain = time_generate(model, tokenizer, [p for p in prompts for _ in temperatures], rows, max_new_tokens, [1.0])
    for timing in (ours, own, plain):
        timing["tokens_per_second"] = timing["tokens"] / timing["seconds"]
        timing["ms_per_step"] = 1000 * timing["seconds"] / max_new_tokens
    result = {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "rows": rows,
        "prompts": n_prompts,
        "temperatures": temperatures,
        "max_new_tokens": max_new_tokens,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "ours": ours,
        "own loop": own,
        "generate": plain,
        "speedup": ours["tokens_per_second"] / plain["tokens_per_second"],
        "over own loop": ours["tokens_per_second"] / own["tokens_per_second"],
        "identical": sum(static_drawn[t] == own_drawn[t] for t in temperatures),  # completion lists of a temperature
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
        f"{r['speedup']:.2f}x plain generate and {r['over own loop']:.2f}x its own loop (the own loop: forward passes "
        f"{r['own loop']['prefill']:.2f} s prefilling and {r['own loop']['decode']:.2f} s decoding, as the host timed "
        f"them); the two loops' completions identical at {r['identical']} of {len(r['temperatures'])} temperatures.",
        "",
        "| sampler | tokens | seconds | tokens/s | ms a step, prefill included |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, key in (("ours: the static loop, graphed (evaluate.py's Sampler)", "ours"),
                      ("ours: the own loop (decoding.decode)", "own loop"),
                      ("plain generate(do_sample=True)", "generate")):  # fmt: skip
        t = r[key]
        lines.append(f"| {name} | {t['tokens']} | {t['seconds']:.2f} | {t['tokens_per_second']:.0f} | "
                     f"{t['ms_per_step']:.1f} |")  # fmt: skip
    return lines
