"""TRL's DPOTrainer in a worker of the GPU campaign (--gpu): the same model, data and precision recipe as ours, its
reference log-probs precomputed as our cache does, timed per step, its rates reported as ours are; the vision
campaign (--vision, vision.py) trains it the same way."""

import json
import tempfile
import time
from pathlib import Path

import torch
import transformers

from bench.common import peak_memory_gib


class StepTimer(transformers.TrainerCallback):
    """Each training step's seconds, the GPU synchronised at both ends."""

    def __init__(self, cuda: bool):
        self.cuda, self.times = cuda, []

    def on_step_begin(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())

    def on_step_end(self, *args, **kwargs):
        if self.cuda:
            torch.cuda.synchronize()
        self.times[-1] = time.perf_counter() - self.times[-1]


def train_timed(
    model,
    processing_class,
    rows: list[dict],
    cuda: bool,
    pairs: int,
    max_length: int,
    checkpointing: bool,
    max_steps: int,
    live_reference=None,
    accumulation: int = 1,
    liger: bool = False,
    fp16: bool = False,
) -> list[float]:
    """Each step's seconds of DPOTrainer training `model` on `rows`, `pairs` per step (float32 weights, bfloat16
    autocast on a GPU; float32 on a CPU), nothing saved or reported. processing_class: the tokenizer, or a
    vision-language model's processor (rows with an `images` column). live_reference: a reference model that scores
    each step's batch (TRL 1.16 refuses to precompute reference log-probs for images); None: they are precomputed
    before training, as our cache does. accumulation: micro-batches a step, of pairs / accumulation pairs each; liger:
    use_liger_kernel (Liger-Kernel's layer kernels, TRL keeping its own fused head); fp16: float16 autocast with
    Accelerate's loss scaling instead of bfloat16 on a GPU (`fp16=True`)."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    timer = StepTimer(cuda)
    with tempfile.TemporaryDirectory() as output_dir:
        args = DPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=pairs // accumulation,
            gradient_accumulation_steps=accumulation,
            use_liger_kernel=liger,
            max_length=max_length,
            beta=0.1,
            learning_rate=1e-6,
            max_steps=max_steps,
            bf16=cuda and not fp16,
            fp16=cuda and fp16,
            use_cpu=not cuda,
            precompute_ref_log_probs=live_reference is None,
            gradient_checkpointing=checkpointing,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = DPOTrainer(
            model=model,
            ref_model=live_reference,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=processing_class,
            callbacks=[timer],
        )
        trainer.train()
    return timer.times


def trl_rates(model, rows: list[dict], pairs_per_second: float, cuda: bool) -> dict:
    """pairs/s, real tokens/s, MFU and peak memory; TRL draws its own batches: per-pair tokens and FLOPs are the
    data's means."""
    from reporting.telemetry import ModelFlops, peak_flops

    examples = [
        {"prompt": [0] * len(r["prompt"]), "responses": [[0] * (len(r[k]) + 1) for k in ("chosen", "rejected")]}
        for r in rows
    ]
    flops_model = ModelFlops.of(model, list(model.model.layers))
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    peak = peak_flops(
        torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32, Path(tempfile.gettempdir())
    ).flops
    return {
        "pairs_per_second": pairs_per_second,
        "real_tokens_per_second": pairs_per_second
        * mean([len(e["prompt"]) + sum(map(len, e["responses"])) for e in examples]),
        "mfu": pairs_per_second * mean([flops_model.example(e, False) for e in examples]) / peak,
        "peak_memory_gib": peak_memory_gib(cuda),
    }


def trl_worker(
    result_file: str,
    model_dir: str,
    data_file: str,
    max_length: int,
    pairs: int,
    checkpointing: bool,
    warmup: int,
    steps: int,
    accumulation: int = 1,
    liger: bool = False,
    fp16: bool = False,
) -> None:
    """TRL's DPOTrainer on the same model, data and precision recipe as ours (float32 weights, bfloat16 autocast on
    a GPU; float32 on a CPU), its reference log-probs precomputed as our cache does, timed per step; `pairs` a step
    in `accumulation` micro-batches, with use_liger_kernel where `liger`, in float16 where `fp16` (train_timed)."""
    cuda = torch.cuda.is_available()
    rows = [json.loads(line) for line in Path(data_file).read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir))
    times = train_timed(
        model, tokenizer, rows, cuda, pairs, max_length, checkpointing, warmup + steps, None, accumulation, liger, fp16
    )
    result = trl_rates(model, rows, pairs * steps / sum(times[warmup:]), cuda)
    Path(result_file).write_text(json.dumps(result))
