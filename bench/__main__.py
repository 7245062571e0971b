"""`python -m bench [FLAGS]`: the flags, and the campaign they select (the package's docstring lists them)."""

import argparse
import sys
from pathlib import Path

import bench
from bench import (
    async_save,
    attention,
    data,
    decode_profile,
    fsdp,
    generate,
    gpu,
    kernels,
    levers,
    long,
    precision,
    profile,
    reward,
    scale,
    versus,
    vision,
    window,
)
from utils import REPO_ROOT, UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=bench.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", type=int, default=1024, help="square matmul size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fsdp", action="store_true", help="only benchmark FSDP1 against FSDP2 (2 processes)")
    parser.add_argument(
        "--fsdp-reduce", action="store_true", help="FSDP2's gradient error reducing in bfloat16 vs float32"
    )
    parser.add_argument("--levers", action="store_true", help="only benchmark the training step's speed levers")
    parser.add_argument(
        "--precision", action="store_true", help="float32, bfloat16, float16 + loss scaling and FP8 side by side"
    )
    parser.add_argument(
        "--compile", action="store_true", help="only benchmark torch.compile on the default configuration"
    )
    parser.add_argument("--lora", action="store_true", help="only benchmark LoRA against full fine-tuning")
    parser.add_argument(
        "--gpu", action="store_true", help="the GPU campaign: cuda tests, layouts and TRL on a ~1B Llama"
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs" / "gpu-campaign", help="--gpu: the folder of its results"
    )
    parser.add_argument(
        "--budget", type=float, default=gpu.BUDGET, help="--gpu: seconds for all its stages (each has its own limit)"
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="TEXT",
        help="--gpu: run only the stages whose names contain TEXT (repeatable), e.g. '1024 x 64: packed, block'",
    )
    parser.add_argument("--attention", action="store_true", help="dense vs block-mask attention bookkeeping")
    parser.add_argument("--data", action="store_true", help="data at scale: tokenizing, caching, mapping")
    parser.add_argument(
        "--versus", metavar="GIT_REF", help="the training step (or with --scale, the memory) against another version's"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="--versus, --vllm, --vision, --async-save, --precision: rounds of the configurations alternating "
        "(default 2; --generate and --precision 1)",
    )
    parser.add_argument(
        "--profile",
        nargs="*",
        metavar="KEY=VALUE",
        help="where a training step's time goes (train.py overrides); with --generate, a decode step's",
    )
    parser.add_argument("--scale", action="store_true", help="each rank's memory at load, train, save, resume")
    parser.add_argument(
        "--async-save", action="store_true", help="checkpoints written in the background against synchronous ones"
    )
    parser.add_argument(
        "--long", action="store_true", help="each rank's memory on one long pair at sequence_parallel_size 1, 2, 4"
    )
    parser.add_argument("--window", action="store_true", help="a sliding-window, soft-capped model: packed vs padded")
    parser.add_argument("--reward", action="store_true", help="reward modelling against TRL's RewardTrainer")
    parser.add_argument("--vision", action="store_true", help="vision-language DPO against TRL's DPOTrainer")
    parser.add_argument(
        "--generate", action="store_true", help="evaluate.py's sampling against plain generate and the bound"
    )
    parser.add_argument(
        "--vllm", metavar="PYTHON", help="--generate: in float32 and bfloat16, against vLLM run by PYTHON (its venv)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="--gpu, --data, --scale, --reward, --vision, --async-save, --long or --generate at tiny sizes",
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="--levers, --compile, --lora, --window, --reward, --vision: untimed steps"
    )
    parser.add_argument(
        "--steps", type=int, default=6, help="--levers, --compile, --lora, --window, --reward, --vision: timed steps"
    )
    return parser


def run(args: argparse.Namespace) -> None:
    """The campaign the flags select: the first of these flags that is set, else the kernels."""
    if args.fsdp:
        return fsdp.bench_fsdp()
    if args.fsdp_reduce:
        return fsdp.bench_fsdp_reduce()
    if args.levers:
        return levers.bench_levers(args.warmup, args.steps)
    if args.precision:
        return precision.bench_precision(args.warmup, args.steps, args.rounds or 1)
    if args.compile:
        return levers.bench_compile(args.warmup, args.steps)
    if args.lora:
        return levers.bench_lora(args.warmup, args.steps)
    if args.attention:
        return attention.bench_attention()
    if args.data:
        return data.bench_data(args.smoke)
    if args.scale:
        return scale.bench_scale(args.smoke, args.versus)
    if args.async_save:
        return async_save.bench_async_save(args.smoke, args.rounds or 2)
    if args.long:
        return long.bench_long(args.smoke)
    if args.window:
        return window.bench_window(args.warmup, args.steps)
    if args.reward:
        return reward.bench_reward(args.warmup, args.steps, args.smoke)
    if args.vision:
        return vision.bench_vision(args.warmup, args.steps, args.smoke, args.rounds or 2)
    if args.generate and args.profile is not None:
        return decode_profile.bench_decode_profile()
    if args.generate:
        return generate.bench_generate(args.smoke, args.versus, args.rounds or 1, args.vllm)
    if args.versus:
        return versus.bench_versus(args.versus, args.warmup, args.steps, args.rounds or 2)
    if args.profile is not None:
        return profile.bench_profile(args.profile, args.warmup, args.steps)
    if args.gpu:
        return gpu.bench_gpu(args.smoke, args.out, args.budget, tuple(args.only))
    return kernels.bench_kernels(args.size, args.repeats)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vllm and (args.smoke or not args.generate):
        parser.error("--vllm PYTHON goes with --generate on SmolLM2: vLLM's CPU attention takes no tiny model's heads")
    if args.generate and args.profile:
        parser.error("--generate --profile takes no overrides: it profiles --generate's workload in each dtype")
    if args.only and not args.gpu:
        parser.error("--only TEXT chooses among the stages of --gpu's campaign")
    alternating = args.versus or args.vllm or args.vision or args.async_save or args.precision
    if args.rounds is not None and (not alternating or args.rounds < 1):
        parser.error(
            f"--rounds {args.rounds}: a number of rounds of at least 1, and only with --versus, --vllm, --vision, "
            "--async-save or --precision"
        )
    if args.vllm:
        try:
            generate.check_vllm_python(args.vllm)
        except UserError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
    run(args)


if __name__ == "__main__":
    main()
