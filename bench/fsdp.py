"""FSDP on a 4-layer Llama: FSDP1 (`FullyShardedDataParallel`) against FSDP2 (`fully_shard`) on 2 processes (--fsdp:
gloo on the CPU, NCCL with 2+ GPUs), both sharding per Llama block: the training step's time and the largest
parameter difference from one process training on the same batches (which decides the FSDP that FSDPTrainer uses);
and FSDP2's gradient error reducing in bfloat16 against float32 on 2 and 4 processes (--fsdp-reduce)."""

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from modeling.distributed import free_port, leave_process_group, rank_environment

FSDP_STEPS, FSDP_BATCH, FSDP_LENGTH = 6, 8, 128  # global batch of 8 sequences of 128 tokens
REDUCE_BATCH, REDUCE_STEPS = 16, 4  # global sequences of FSDP_LENGTH tokens per step; steps whose gradients count


def llama(seed: int = 0) -> torch.nn.Module:
    """A 4-layer Llama of ~21M parameters, randomly initialised (the same weights for every seed user)."""
    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8192,
        max_position_embeddings=FSDP_LENGTH,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def train_steps(
    model: torch.nn.Module, device: torch.device, rank: int, world_size: int
) -> tuple[float, torch.nn.Module]:
    """Seconds per step (the mean after the first) and the model after FSDP_STEPS SGD steps. SGD, because AdamW
    would turn float rounding in near-zero gradient entries into lr-sized weight differences."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    times = []
    for step in range(FSDP_STEPS):
        ids = torch.randint(0, 8192, (FSDP_BATCH, FSDP_LENGTH), generator=torch.Generator().manual_seed(step))
        ids = ids.chunk(world_size)[rank].to(device)
        start = time.perf_counter()
        model(ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sum(times[1:]) / len(times[1:]), model


def fsdp_rank(rank: int, world_size: int, port: int, variant: str, result_file: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    os.environ.update(rank_environment(rank, world_size, port))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("nccl" if cuda else "gloo")
    model = llama()
    if variant == "FSDP1":
        model = FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}), device_id=device
        )
    else:
        for block in model.model.layers:
            fully_shard(block)
        fully_shard(model)
    seconds, model = train_steps(model, device, rank, world_size)
    # Without cpu_offload: FSDP1's CPU-offloaded full state dict fails on CPU ranks (torch 2.13).
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save({"seconds": seconds, "state": {name: value.cpu() for name, value in state.items()}}, result_file)
    del model, state
    leave_process_group()


def bench_fsdp() -> None:
    world_size = 2
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(
        f"{FSDP_STEPS} SGD steps, global batch {FSDP_BATCH} x {FSDP_LENGTH} tokens, 4-layer Llama of "
        f"{sum(p.numel() for p in llama().parameters()) / 1e6:.0f}M parameters, float32"
    )
    seconds, single = train_steps(llama().to(device), device, 0, 1)
    print(f"one process ({torch.get_num_threads()} threads){'':8s} {seconds * 1e3:8.1f} ms/step")
    expected = {name: value.cpu() for name, value in single.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        for variant in ("FSDP1", "FSDP2"):
            result_file = str(Path(tmp) / f"{variant}.pt")
            torch.multiprocessing.spawn(
                fsdp_rank, args=(world_size, free_port(), variant, result_file), nprocs=world_size
            )
            result = torch.load(result_file, weights_only=True)
            difference = max(
                (result["state"][name].float() - value).abs().max().item() for name, value in expected.items()
            )
            print(
                f"{variant} {world_size} processes ({'nccl' if cuda else 'gloo'}){'':6s} "
                f"{result['seconds'] * 1e3:8.1f} ms/step, "
                f"max |parameter - one process| {difference:.1e}"
            )


def reduce_batch(step: int) -> torch.Tensor:
    return torch.randint(0, 8192, (REDUCE_BATCH, FSDP_LENGTH), generator=torch.Generator().manual_seed(100 + step))


def reduce_rank(rank: int, world_size: int, port: int, reduce_dtype: str, result_file: str) -> None:
    """One FSDP2 rank computing in bfloat16 and reducing gradients in reduce_dtype: the full gradient of each of
    REDUCE_STEPS batches (each rank its share, SGD steps in between), written by rank 0."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    os.environ.update(rank_environment(rank, world_size, port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=getattr(torch, reduce_dtype))
    for block in model.model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gradients = []
    for step in range(REDUCE_STEPS):
        ids = reduce_batch(step).chunk(world_size)[rank]
        model(ids, labels=ids, use_cache=False).loss.backward()
        gradients.append({name: p.grad.full_tensor().float() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    if rank == 0:
        torch.save(gradients, result_file)
    del model, optimizer
    leave_process_group()


def bench_fsdp_reduce() -> None:
    """The gradient error of FSDP2's reduction in bfloat16 and in float32, both computing in bfloat16, against one
    float32 process on the same batches (each step's gradient, after the same SGD updates), on 2 and 4 processes."""
    reference, model = [], llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(REDUCE_STEPS):
        ids = reduce_batch(step)
        model(ids, labels=ids, use_cache=False).loss.backward()
        reference.append({name: p.grad.clone() for name, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()

    def relative_error(gradients: list[dict]) -> float:
        """The mean over steps of |g - g_float32| / |g_float32| over all parameters."""
        errors = []
        for got, want in zip(gradients, reference):
            difference = sum(((got[n] - want[n]) ** 2).sum() for n in want).sqrt()
            errors.append((difference / sum((want[n] ** 2).sum() for n in want).sqrt()).item())
        return sum(errors) / len(errors)

    print(
        f"FSDP2 over a 4-layer Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters), bfloat16 "
        f"compute, gloo on {os.cpu_count()} CPU cores; {REDUCE_STEPS} steps of {REDUCE_BATCH} x {FSDP_LENGTH} tokens; "
        "gradient error relative to one float32 process"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for world_size in (2, 4):
            errors = {}
            for reduce_dtype in ("bfloat16", "float32"):
                result_file = str(Path(tmp) / f"{reduce_dtype}.pt")
                torch.multiprocessing.spawn(
                    reduce_rank, args=(world_size, free_port(), reduce_dtype, result_file), nprocs=world_size
                )
                errors[reduce_dtype] = relative_error(torch.load(result_file, weights_only=True))
            print(
                f"{world_size} processes: reduce in bfloat16 {errors['bfloat16']:.3e}, "
                f"in float32 {errors['float32']:.3e} ({errors['bfloat16'] / errors['float32']:.2f}x)",
                flush=True,
            )
