"""Reward modelling against TRL's RewardTrainer (--reward): SmolLM2-135M-Instruct made a reward model (one output) on
the first 48 pairs of HH harmless-base that neither trainer truncates or drops at max_length 512, 8 pairs a step,
the same settings in both (AdamW at lr 1e-5, gradients clipped at 1.0, no warm-up of the rate), in float32 and in
bfloat16 autocast; each configuration in a fresh process, the trainers alternating, 2 rounds: pairs/s, real tokens/s
and peak RSS. --smoke: one round of one warm-up and one timed step on 16 pairs, of a random Llama of the tests' tiny
sizes (assets/tiny-llama's shape and byte-level tokenizer), so that it runs in seconds even where bfloat16 is slow
(AVX2-only CPUs)."""

import json
import os
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import HH_FILE, peak_memory_gib, smollm2_dir, with_machine_rates, worker_subprocess
from bench.gpu import CAMPAIGN_MODELS, campaign_model_dir
from bench.step import lever_subprocess
from bench.trl import StepTimer
from modeling.precision import cpu_flags, cpu_name

MAX_LENGTH, PAIRS, ROWS = 512, 8, 48
PRECISIONS = {"float32": "null", "bfloat16": "bfloat16"}  # model.fsdp_policy_mp: autocast dtype (null: none)


def hh_pairs(model_dir: str, n: int, max_length: int) -> list[dict]:
    """The first n HH harmless-base pairs as (prompt, chosen, rejected) text, as our HH reader splits them, whose
    prompt + longer response + EOS fit max_length and prompt max_length / 2: our trainer would truncate a longer one,
    TRL's would drop it."""
    from pairs.sources import read_file_rows
    from preference_datasets import parse_rows

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    length = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    rows = []
    for pair in parse_rows(read_file_rows(HH_FILE), str(HH_FILE), tokenizer):
        prompt = length(pair.prompt)
        if prompt <= max_length // 2 and prompt + max(length(pair.chosen), length(pair.rejected)) + 1 <= max_length:
            rows.append({"prompt": pair.prompt, "chosen": pair.chosen, "rejected": pair.rejected})
        if len(rows) == n:
            return rows
    raise AssertionError(f"fewer than {n} HH pairs fit max_length {max_length}")


def trl_reward_worker(
    result_file: str, model_dir: str, data_file: str, max_length: int, pairs: int, bf16: bool, warmup: int, steps: int
) -> None:
    """TRL's RewardTrainer on the pairs of data_file: SmolLM2 with a one-output head, timed per step; its pairs/s,
    real tokens/s (a pair's prompt once and each response with its EOS, as ours counts them) and peak RSS."""
    import datasets
    from trl import RewardConfig, RewardTrainer

    transformers.logging.set_verbosity_error()  # its load report and progress bars: this process's output is a result
    datasets.disable_progress_bars()
    rows = [json.loads(line) for line in Path(data_file).read_text().splitlines()]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    model.config.pad_token_id = tokenizer.pad_token_id
    timer = StepTimer(cuda=False)
    with tempfile.TemporaryDirectory() as output_dir:
        args = RewardConfig(
            output_dir=output_dir,
            per_device_train_batch_size=pairs,
            max_length=max_length,
            learning_rate=1e-5,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            max_steps=warmup + steps,
            bf16=bf16,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1,
            disable_tqdm=True,
            seed=0,
        )
        trainer = RewardTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        trainer.train()
    pairs_per_second = pairs * steps / sum(timer.times[warmup:])
    tokens = sum(len(tokenizer(r["prompt"])["input_ids"]) for r in rows)
    tokens += sum(len(tokenizer(r[k])["input_ids"]) + 1 for r in rows for k in ("chosen", "rejected"))
    result = {
        "pairs_per_second": pairs_per_second,
        "real_tokens_per_second": pairs_per_second * tokens / len(rows),
        "peak_memory_gib": peak_memory_gib(False),
    }
    Path(result_file).write_text(json.dumps(result))


def ours(model_dir: str, data_file: str, precision: str, warmup: int, steps: int, n_rows: int) -> dict:
    """Our reward model on the same pairs, in a fresh process (bench.step.lever_worker)."""
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"model.name_or_path={model_dir}",
            f"local_dirs=[{with_machine_rates(tmp)}]",
            "loss=reward",
            f"max_length={MAX_LENGTH}",
            f"max_prompt_length={MAX_LENGTH // 2}",
            f"batch_size={PAIRS}",
            f"eval_batch_size={PAIRS}",
            "n_epochs=4",
            "lr=1e-5",
            "warmup_steps=0",
            "max_grad_norm=1.0",
            f"model.fsdp_policy_mp={PRECISIONS[precision]}",
            "wandb.enabled=false",
            "debug=true",
        ]
        result_file = str(Path(tmp) / "result.json")
        return lever_subprocess(overrides, warmup, steps, result_file, data_file=data_file, n_rows=n_rows)


def trl(model_dir: str, data_file: str, precision: str, warmup: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        settings = dict(max_length=MAX_LENGTH, pairs=PAIRS, bf16=precision == "bfloat16", warmup=warmup, steps=steps)
        result_file = str(Path(tmp) / "result.json")
        return worker_subprocess(trl_reward_worker, result_file, model_dir=model_dir, data_file=data_file, **settings)


def tiny_model_dir(directory: Path) -> str:
    """A random Llama of the tests' tiny sizes with its weights (both trainers load them), seeded."""
    campaign_model_dir(directory, CAMPAIGN_MODELS["smoke"])
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(directory)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return str(directory)


def bench_reward(warmup: int, steps: int, smoke: bool, rounds: int = 2) -> None:
    n_rows = 2 * PAIRS if smoke else ROWS
    rounds, warmup, steps = (1, 1, 1) if smoke else (rounds, warmup, steps)
    speeds = {}
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:
            model_dir, model = tiny_model_dir(Path(tmp) / "model"), "a random tiny Llama"
        else:
            model_dir, model = smollm2_dir(), "SmolLM2-135M-Instruct"
        print(
            f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
            f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; torch {torch.__version__}, {torch.get_num_threads()} "
            f"threads\n{model} as a reward model, the first {n_rows} HH harmless-base pairs that fit max_length "
            f"{MAX_LENGTH}, {PAIRS} pairs a step, AdamW lr 1e-5, clipping 1.0; {warmup} warm-up + {steps} timed "
            f"steps; alternating, {rounds} rounds, each run in a fresh process"
        )
        print(f"{'trainer':28s} {'pairs/s':>8s} {'tokens/s':>9s} {'peak RSS':>9s}")
        data_file = Path(tmp) / "pairs.jsonl"
        data_file.write_text("".join(json.dumps(row) + "\n" for row in hh_pairs(model_dir, n_rows, MAX_LENGTH)))
        for _ in range(rounds):
            for precision in PRECISIONS:
                for name, measure in (("ours", ours), ("TRL RewardTrainer", trl)):
                    args = (model_dir, str(data_file), precision, warmup, steps)
                    result = measure(*args, n_rows) if name == "ours" else measure(*args)
                    label = f"{name}, {precision}"
                    speeds.setdefault(label, []).append(result["pairs_per_second"])
                    print(
                        f"{label:28s} {result['pairs_per_second']:8.3f} {result['real_tokens_per_second']:9.0f} "
                        f"{result['peak_memory_gib']:7.2f} GiB",
                        flush=True,
                    )
    for precision in PRECISIONS:
        ratio = sum(speeds[f"ours, {precision}"]) / sum(speeds[f"TRL RewardTrainer, {precision}"])
        print(f"{precision}: ours {ratio:.2f}x TRL RewardTrainer's pairs/s")
