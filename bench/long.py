"""Long pairs (--long): each rank's peak resident memory while it trains on one long pair a step, at
sequence_parallel_size = 1, 2 and 4 (FSDPTrainer on as many CPU processes, gloo, one thread each, each size a fresh
launch; float32, AdamW, the packed layout with its dense mask), beside the dry run's estimate of the same run's
training memory per rank (the memory plan, reporting/memory_plan.py) and its activations part, which sequence
parallelism divides by sp. Each rank's peak is the kernel's high-water mark (VmHWM), reset as training starts, so that
the reference log-probs computed before it do not count.

The model is a random Llama of 8 layers, hidden 256, 8 heads (MLP 1024), with the tiny byte-level tokenizer (a
character is a token); each step trains one pair of a 160-token prompt and two 3999-character responses, each with its
EOS: 8160 tokens in one packed row, two pairs, two steps. Why 8160: on the 2-core machine this campaign was written for
(24 GiB), time, not memory, bounds the length. One process peaked near 3 GiB at 8160 tokens, but attention over a row
is quadratic: at this length it is 0.55 of the 0.68 TFLOP of a forward pass (about 2 TFLOP a step with the backward
pass, and a forward more for the reference log-probs), so twice the length makes each step about 3.6x longer, while
the 4 ranks of sp = 4 share the 2 cores. At 8160 tokens the three launches take a few minutes in all.

--long --smoke: a hidden-64 Llama of 2 layers and 4 heads and a 64-token pair, as the test suite runs it."""

import json
import os
import tempfile
from pathlib import Path

import torch

from bench.common import with_machine_rates, worker_subprocess
from bench.gpu import campaign_model_dir
from bench.scale_ranks import PhasePeaks
from modeling.precision import cpu_flags, cpu_name
from utils import REPO_ROOT

SEQUENCE_PARALLEL_SIZES = (1, 2, 4)
TINY_VOCABULARY = 259  # assets/tiny-llama's byte-level tokenizer
LONG_SIZES = {
    "full": {
        "model": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=TINY_VOCABULARY, max_position_embeddings=8192),
        "prompt": 160,
        "response": 3999,  # + EOS: 160 + 2 x 4000 = 8160 tokens, a multiple of every sp size
    },
    "smoke": {
        "model": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, vocab_size=TINY_VOCABULARY, max_position_embeddings=128),
        "prompt": 16,
        "response": 23,  # 16 + 2 x 24 = 64 tokens
    },
}  # fmt: skip
STEPS = 2
# the memory plan's parts (memory_plan.device_memory)
ACTIVATIONS, MASK = "activations (", "attention mask (packed, dense)"


def long_pairs(directory: Path, prompt: int, response: int) -> Path:
    """A dataset directory: STEPS training pairs of random lowercase text (a token a character under the tiny
    tokenizer) of these lengths, and a one-pair test file (the run's final eval, outside the measured training)."""
    import random

    rng = random.Random(0)
    text = lambda n: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))  # noqa: E731
    pair = lambda p, r: json.dumps({"prompt": text(p), "chosen": text(r), "rejected": text(r)}) + "\n"  # noqa: E731
    directory.mkdir(parents=True)
    (directory / "train.jsonl").write_text("".join(pair(prompt, response) for _ in range(STEPS)))
    (directory / "test.jsonl").write_text(pair(4, 4))
    return directory


def long_overrides(tmp: Path, model_dir: Path, pairs: Path, size: dict, sp: int) -> list[str]:
    """The run at sequence_parallel_size=sp on sp CPU processes: one pair a step, no eval or checkpoint before the
    end, the whole pair kept (max_length: the prompt and the longer response with its EOS)."""
    return [
        "model=blank_model", f"model.name_or_path={model_dir}", "model.random_init=true", "model.fsdp_policy_mp=null",
        "trainer=FSDPTrainer", f"nproc={sp}", f"sequence_parallel_size={sp}", "layout=packed",
        "packed_attention=dense", f"datasets=[{pairs}]", f"local_dirs=[{tmp}]", f"local_run_dir={tmp / f'run-{sp}'}",
        f"max_length={size['prompt'] + size['response'] + 1}", f"max_prompt_length={size['prompt']}",
        "batch_size=1", "eval_batch_size=1", "n_eval_examples=1", "do_first_eval=false", f"eval_every={10 * STEPS}",
        "n_epochs=1", "warmup_steps=0", "loss.beta=0.1", "wandb.enabled=false", "debug=true", "plots=false",
    ]  # fmt: skip


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmRSS"))
    return int(line.split()[1]) * 1024


def long_rank(config) -> None:
    """One rank of a measured run (train.run, on a process distributed.launch started): its resident memory as
    training starts and its peak while it trains, to memory.<rank>.json in the run directory."""
    import train
    import trainers

    torch.set_num_threads(1)
    peaks, started = PhasePeaks(), {}
    train_loop = trainers.Trainer.train

    def measured_train(self, *args, **kwargs):
        started["train"] = resident_bytes()
        with peaks.phase("train"):
            train_loop(self, *args, **kwargs)

    trainers.Trainer.train = measured_train
    train.run(config)
    memory = {"start": started["train"], "peak": peaks.peaks["train"], "seconds": peaks.seconds["train"]}
    Path(config.local_run_dir, f"memory.{torch.distributed.get_rank()}.json").write_text(json.dumps(memory))


def long_launch(result_file: str, overrides: list[str], sp: int) -> None:
    """The run of `overrides` launched as train.py launches it (sp CPU workers, gloo), each rank measured by
    long_rank; the ranks' measurements, in a list, to result_file."""
    from omegaconf import OmegaConf

    import config as configuration
    from modeling.distributed import launch
    from reporting.host_memory import use_huge_pages

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU processes on any machine: their resident memory is the measure
    use_huge_pages()  # as train.py maps its workers' memory; they inherit the setting
    config = configuration.load(overrides)
    OmegaConf.resolve(config)  # as train.py does: the workers resolve nothing
    launch(long_rank, config, sp)
    ranks = [json.loads(Path(config.local_run_dir, f"memory.{rank}.json").read_text()) for rank in range(sp)]
    Path(result_file).write_text(json.dumps(ranks))


def dry_run_worker(result_file: str, runs: dict[int, list[str]]) -> None:
    """`train.py dry_run=true` of each run ({sp: its overrides}); the training memory its plan gives a rank
    ({part: bytes}, as memory_plan.memory_plan computes it), by sp, to result_file."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the plan of CPU processes, as measured
    import build
    import train

    plans, verdict = {}, build.fit_verdict

    def kept_verdict(work, hardware, mesh):
        plan, problem = verdict(work, hardware, mesh)
        plans[mesh[1]] = plan.training
        return plan, problem

    build.fit_verdict = kept_verdict
    for overrides in runs.values():
        train.main([*overrides, "dry_run=true"])
    Path(result_file).write_text(json.dumps(plans))


def part(plan: dict[str, float], prefix: str) -> float:
    return next(value for name, value in plan.items() if name.startswith(prefix))


def bench_long(smoke: bool) -> None:
    size = LONG_SIZES["smoke" if smoke else "full"]
    model = size["model"]
    tokens = size["prompt"] + 2 * (size["response"] + 1)
    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
        f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; torch {torch.__version__}, one thread a rank"
    )
    (REPO_ROOT / ".cache").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=REPO_ROOT / ".cache") as tmp:
        tmp = Path(with_machine_rates(tmp))
        model_dir = campaign_model_dir(tmp / "model", model)
        pairs = long_pairs(tmp / "pairs", size["prompt"], size["response"])
        runs = {sp: long_overrides(tmp, model_dir, pairs, size, sp) for sp in SEQUENCE_PARALLEL_SIZES}
        planned = worker_subprocess(dry_run_worker, str(tmp / "plans.json"), runs=runs)
        plans = {int(sp): plan for sp, plan in planned.items()}  # JSON's keys are strings
        print(
            f"--long: a random Llama of {model['num_hidden_layers']} layers, hidden {model['hidden_size']}, "
            f"{model['num_attention_heads']} heads, MLP {model['intermediate_size']}; one {tokens}-token pair a step "
            f"({size['prompt']}-token prompt, two {size['response'] + 1}-token responses), {STEPS} steps, FSDPTrainer "
            "on sp CPU processes (gloo), float32, AdamW, packed layout, dense mask. Per rank, GiB: resident memory as "
            "training starts, its peak while training (VmHWM), the growth; the dry run's training estimate (no "
            "framework), its activations and its mask (whole on every rank)",
            flush=True,
        )
        print(" sp rank    start     peak   growth |   estimate  activations     mask | train s")
        measured = {}
        for sp in SEQUENCE_PARALLEL_SIZES:
            measured[sp] = worker_subprocess(long_launch, str(tmp / f"memory-{sp}.json"), overrides=runs[sp], sp=sp)
            plan = plans[sp]
            estimate = [sum(plan.values()), part(plan, ACTIVATIONS), plan[MASK]]
            for rank, memory in enumerate(measured[sp]):
                cells = [memory["start"], memory["peak"], memory["peak"] - memory["start"]]
                print(
                    f"{sp:3d} {rank:4d} {' '.join(f'{v / 2**30:8.2f}' for v in cells)} | {estimate[0] / 2**30:10.3f} "
                    f"{estimate[1] / 2**30:12.3f} {estimate[2] / 2**30:8.3f} | {memory['seconds']:7.1f}",
                    flush=True,
                )
    one = plans[1]
    for sp in SEQUENCE_PARALLEL_SIZES[1:]:
        activations = [part(one, ACTIVATIONS), part(plans[sp], ACTIVATIONS)]
        growth = [max(r["peak"] - r["start"] for r in measured[k]) for k in (1, sp)]
        peak = [max(r["peak"] for r in measured[k]) for k in (1, sp)]
        print(
            f"sp 1 / sp {sp}, per rank: the dry run's activations {activations[0] / activations[1]:.3f}x "
            f"({activations[0]:.0f} / {activations[1]:.0f} bytes); measured, the highest rank's growth while "
            f"training {growth[0] / growth[1]:.2f}x and its peak {peak[0] / peak[1]:.2f}x"
        )
