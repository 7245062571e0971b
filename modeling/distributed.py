"""Everything about processes: who this process is (`Topology`) and how the processes are started (`launch`);
placement.py puts models on the topology's device mesh.

The mesh is 3-D, data parallel x sequence parallel x tensor parallel ("dp", "sp", "tp"), laid out row-major, so
that the ranks of one tp group are neighbours (on one node under torchrun), and those of one sp group next. The ranks
of a tp group split every attention and MLP projection and see the same examples; the ranks of an sp group see the
same examples too, each holding a contiguous slice of every row's tokens (modeling/sequence_parallel.py); each dp
group trains on its own slice of every batch. Parameters, gradients and optimizer state are sharded by FSDP2 over
the dp x sp ranks, flattened into one dimension. This is the arrangement of torchtitan and Megatron-LM: tensor
parallelism inside a node, FSDP across nodes. A trainer name is a choice of FSDP and tensor parallelism."""

import contextlib
import ctypes
import gc
import logging
import os
import signal
import socket
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from utils import Interrupted, UserError, first_line


@dataclass(frozen=True)
class Parallelism:
    """What a `trainer=` name selects; the Trainer itself is the same for all."""

    one_process: bool  # runs in the launching process, without a process group
    fsdp: bool  # shard policy and reference over the data-parallel ranks (FSDP2, per transformer block)
    tensor_parallel_by_default: bool  # tensor_parallel_size=null means all ranks (else 1)


TRAINERS = {
    "BasicTrainer": Parallelism(one_process=True, fsdp=False, tensor_parallel_by_default=False),
    # Zhao et al. 2023, "PyTorch FSDP"; with tensor_parallel_size > 1, FSDP over dp and TP within each tp group.
    "FSDPTrainer": Parallelism(one_process=False, fsdp=True, tensor_parallel_by_default=False),
    # Megatron-LM's column/row split of attention and MLP projections (Shoeybi et al. 2019) over all ranks.
    "TensorParallelTrainer": Parallelism(one_process=False, fsdp=False, tensor_parallel_by_default=True),
}


def process_rank() -> int:
    """This process's global rank: in the process group, else as torchrun announced it, else 0."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def default_device() -> torch.device:
    """This process's GPU (LOCAL_RANK) when CUDA is present, otherwise the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def mesh_shape(
    trainer: str, world_size: int, tensor_parallel_size: int | None, sequence_parallel_size: int = 1
) -> tuple[int, int, int]:
    """(data-parallel size, sequence-parallel size, tensor-parallel size) of a `trainer` run on world_size ranks."""
    parallelism, sp = TRAINERS[trainer], sequence_parallel_size
    if sp > 1 and not parallelism.fsdp:
        raise UserError(
            f"sequence_parallel_size={sp} with {trainer}: sequence parallelism is a dimension of FSDPTrainer's mesh "
            "(its gradients reduce over data x sequence ranks); use trainer=FSDPTrainer"
        )
    default = world_size if parallelism.tensor_parallel_by_default else 1
    tp = default if tensor_parallel_size is None else tensor_parallel_size
    if tp <= 0 or world_size % tp:
        raise UserError(f"tensor_parallel_size={tp} must be a positive divisor of the world size {world_size}")
    if tp != default and not parallelism.fsdp:
        raise UserError(
            f"tensor_parallel_size={tp} with {trainer} on {world_size} ranks: use trainer=FSDPTrainer "
            "for data parallel x tensor parallel"
        )
    if sp <= 0 or world_size % (sp * tp):
        raise UserError(
            f"sequence_parallel_size={sp} x tensor_parallel_size={tp} must divide the world size {world_size}"
        )
    return world_size // (sp * tp), sp, tp


@dataclass
class Topology:
    """Who this process is: ranks, the 3-D mesh, and the collectives the run needs. Without a process group
    (BasicTrainer) it is rank 0 of 1, and every helper is the identity."""

    trainer: str = "BasicTrainer"
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0
    dp_size: int = 1
    tp_size: int = 1
    mesh: DeviceMesh | None = None
    device: torch.device = torch.device("cpu")
    sp_rank: int = 0
    sp_size: int = 1
    dp_sp_mesh: DeviceMesh | None = None  # with sequence parallelism, the dp x sp ranks flattened (fsdp_mesh)

    @classmethod
    def create(cls, trainer: str, tensor_parallel_size: int | None = None, sequence_parallel_size: int = 1):
        device = default_device()
        if not dist.is_initialized():
            return cls(trainer=trainer, device=device)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        dp, sp, tp = mesh_shape(trainer, world_size, tensor_parallel_size, sequence_parallel_size)
        mesh = init_device_mesh(device.type, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"))
        flat = mesh["dp", "sp"]._flatten("dp_sp") if sp > 1 else None  # made once: it makes a process group
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        dp_rank, sp_rank = mesh["dp"].get_local_rank(), mesh["sp"].get_local_rank()
        return cls(trainer, rank, world_size, local_rank, dp_rank, dp, tp, mesh, device, sp_rank, sp, flat)

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """What FSDP shards over and reduces gradients over: the dp ranks, and with sequence parallelism the dp x sp
        ranks as one dimension (an sp group's ranks hold one model, each a slice of the tokens)."""
        return self.dp_sp_mesh if self.sp_size > 1 else self.mesh["dp"]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def fsdp(self) -> bool:
        return TRAINERS[self.trainer].fsdp

    def describe(self) -> str:
        sequence = f" x sp {self.sp_size}" if self.sp_size > 1 else ""
        return f"{self.trainer} x{self.world_size} (dp {self.dp_size}{sequence} x tp {self.tp_size})"

    def shard(self, items: list) -> tuple[list, int]:
        """This data-parallel rank's contiguous share of `items` and how many of it are real: a short share is
        padded with copies of items[0], so that every rank runs the same number of forward passes (sharded models
        need all ranks in each one)."""
        size = -(-len(items) // self.dp_size)
        local = items[self.dp_rank * size : (self.dp_rank + 1) * size]
        return local + [items[0]] * (size - len(local)), len(local)

    def micro_batches(self, items: list, batch_size: int, accumulation: int) -> tuple[list[list], int]:
        """This rank's share of `items` (a batch of at most batch_size) in micro-batches of
        batch_size / (accumulation x dp ranks), and how many of the share are real (see shard)."""
        local, n_real = self.shard(items)
        size = batch_size // (accumulation * self.dp_size)
        return [local[i : i + size] for i in range(0, len(local), size)], n_real

    def real_shares(self, n_items: int) -> list[int]:
        """How many of each data-parallel rank's share of n_items are real (see shard)."""
        size = -(-n_items // self.dp_size)
        return [max(0, min(size, n_items - rank * size)) for rank in range(self.dp_size)]

    def gather_columns(self, local: torch.Tensor, n_items: int) -> torch.Tensor:
        """[M, n_items]: this rank's [M, share] columns (a share of n_items, see shard) concatenated with the other
        data-parallel ranks' in rank order, which is batch order, without their padding copies. On the device, with
        no host synchronisation: one all_gather of the stacked metrics instead of one object transfer per list."""
        if self.dp_size > 1:
            parts = [torch.empty_like(local) for _ in range(self.dp_size)]
            dist.all_gather(parts, local.contiguous(), group=self.mesh.get_group("dp"))
        else:
            parts = [local]
        return torch.cat([part[:, :real] for part, real in zip(parts, self.real_shares(n_items))], dim=1)

    def gather(self, values: dict[str, list]) -> dict[str, list]:
        """Each list (of any objects) concatenated over the data-parallel ranks, in rank order (which is batch
        order)."""
        if self.dp_size == 1:
            return dict(values)
        parts = [None] * self.dp_size
        dist.all_gather_object(parts, dict(values), group=self.mesh.get_group("dp"))
        return {name: [v for part in parts for v in part[name]] for name in parts[0]}

    def sum_over_dp(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the data-parallel ranks (every rank of a tensor- or sequence-parallel group holds the
        same)."""
        if self.dp_size > 1:
            tensor = tensor.clone()
            dist.all_reduce(tensor, group=self.mesh.get_group("dp"))
        return tensor

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank; every rank gets the same answer."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast(self, obj, group=None):
        """Rank 0's `obj` on every rank (over `group`, of every rank; None: the default one)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]

    def run_everywhere(self, fn: Callable):
        """fn() on every rank; its result there. A UserError it raises on any rank is raised on every rank (the first
        rank's, in rank order), so that no rank goes on into a collective that another has left."""
        result = error = None
        try:
            result = fn()
        except UserError as e:
            error = str(e)
        errors = [e for e in self.all_gather(error) if e is not None]
        if errors:
            raise UserError(errors[0])
        return result

    def run_on_main(self, fn: Callable, group=None):
        """fn() on rank 0 only; its result there (None elsewhere). A UserError it raises is raised on every rank,
        so that no rank is left waiting in a collective for one that stopped. group: a process group of every rank
        to agree over (None: the default one), such as the background saves' own."""
        result = error = None
        if self.is_main:
            try:
                result = fn()
            except UserError as e:
                error = str(e)
        error = self.broadcast(error, group)
        if error is not None:
            raise UserError(error)
        return result

    @contextlib.contextmanager
    def main_first(self):
        """Local rank 0 runs the block first and the other ranks of its machine after it, so they find its
        downloads, conversions and caches complete instead of racing to write them."""
        first = self.local_rank == 0
        if self.world_size > 1 and not first:
            dist.barrier()
        try:
            yield
        finally:  # also on an error: the others then meet the same error themselves instead of a broken barrier
            if self.world_size > 1 and first:
                dist.barrier()


# -------------------------------------------------------------------------------------------------------------
# Launching: in this process, as one rank under torchrun, or as `nproc` workers spawned here


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def planned_world_size(trainer: str, nproc: int | None) -> int:
    """How many processes the run takes: torchrun's world, 1 for BasicTrainer, else `nproc` or one per GPU."""
    if launched_by_torchrun():
        if nproc is not None:
            raise UserError(
                f"nproc={nproc} is for train.py's own launcher; under torchrun the world size comes from "
                "torchrun (--nproc_per_node, --nnodes)"
            )
        return int(os.environ["WORLD_SIZE"])
    if TRAINERS[trainer].one_process:
        if nproc is not None:
            raise UserError(
                f"{trainer} runs on one process; for {nproc} use trainer=FSDPTrainer or trainer=TensorParallelTrainer"
            )
        return 1
    gpus = torch.cuda.device_count()
    if gpus and nproc is not None and nproc > gpus:
        raise UserError(f"nproc={nproc} but this machine has {gpus} GPUs (one process per GPU)")
    return nproc or gpus or 2


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """torchrun's variables for rank `rank` of a single-machine world."""
    return dict(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(timeout_secs: float) -> None:
    """Join the process group described by torchrun's variables: NCCL with one GPU per process (this process's
    GPU, LOCAL_RANK, made current first and bound to the group, so that NCCL connects eagerly and barriers know
    their device), else gloo."""
    timeout = timedelta(seconds=timeout_secs)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def report_and_exit(error: Exception) -> None:
    """Every rank meets the same error or stop; rank 0 says it in one line. Exit code 2, as for a bad command line,
    after an error; 128 + the signal's number after a stop on a signal."""
    if process_rank() == 0:
        prefix = "" if isinstance(error, Interrupted) else "error: "
        print(f"{prefix}{error}", file=sys.stderr)
    # The failed run's frames hold the Trainer (models, DTensors, the mesh's process groups): let them go now, so that
    # run_rank collects them before it destroys the process groups. Kept alive into the interpreter's teardown, they
    # aborted ranks at exit ("terminate called without an active exception": about 1 in 15 Ctrl-C's on 2 CPU ranks;
    # none in 40 since).
    traceback.clear_frames(error.__traceback__)
    sys.exit(error.exit_code if isinstance(error, Interrupted) else 2)


@contextlib.contextmanager
def reported_errors():
    """A UserError, a stop on a signal, or a file that cannot be read or written (a full disk, no permission)
    ends the process with one line instead of a traceback; so does Ctrl-C outside the training loop (which stops
    after a step, see trainers.StopSignals) or a second one inside it."""
    try:
        yield
    except (UserError, Interrupted) as error:
        report_and_exit(error)
    except OSError as error:
        if error.filename is None:
            raise
        report_and_exit(UserError(f"{error.filename}: {error.strerror or first_line(error)}"))
    except KeyboardInterrupt:
        report_and_exit(Interrupted("interrupted (SIGINT); the checkpoints written so far are intact", signal.SIGINT))


def run_rank(run: Callable, config, timeout_secs: float) -> None:
    """Join the process group (set up by torchrun or `spawn`), run(config), and leave it."""
    init_process_group(timeout_secs)
    if dist.get_rank() != 0:
        sys.stdout = open(os.devnull, "w")  # rank 0 reports for all
    try:
        with reported_errors():
            run(config)
            dist.barrier()  # leave together: rank 0 may still be writing the last checkpoint
    finally:
        leave_process_group()


def leave_process_group() -> None:
    """Destroy the process groups after what still holds them: a Trainer, a sharded model or a failed run's frames
    (report_and_exit) often sit in reference cycles, and left to the interpreter's teardown they outlive the groups
    and abort the rank at exit now and then ("terminate called without an active exception")."""
    gc.collect()
    dist.destroy_process_group()


def spawned_worker(local_rank: int, nproc: int, port: int, run: Callable, config, timeout_secs: float) -> None:
    # Signals reach the workers through the launcher (spawn), once: a terminal's Ctrl-C goes to the foreground
    # process group, which the workers leave. And a worker dies with its launcher, even one killed with SIGKILL.
    os.setpgrp()
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    os.environ.update(rank_environment(local_rank, nproc, port))
    # CPU ranks, and the host optimizer steps of offloaded ones (fsdp_cpu_offload), which run on all ranks at once
    host_compute = not torch.cuda.is_available() or config.fsdp_cpu_offload
    if host_compute and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # oversubscribed cores slow every rank
    run_rank(run, config, timeout_secs)


def launch(run: Callable, config, world_size: int) -> None:
    """run(config) in this process (one-process trainers), as this torchrun rank, or on `world_size` workers
    started here (one per GPU, or CPU workers with an equal share of the cores), waiting for them."""
    if launched_by_torchrun():
        run_rank(run, config, config.distributed_timeout_secs)
    elif TRAINERS[config.trainer].one_process:
        with reported_errors():
            run(config)
    else:
        spawn(run, config, world_size)


def spawn(run: Callable, config, nproc: int) -> None:
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # its notes would bury a rank's error
    backend = "nccl, one per GPU" if torch.cuda.is_available() else "gloo, on the CPU"
    print(f"{config.trainer}: starting {nproc} processes ({backend})")
    args = (nproc, free_port(), run, config, config.distributed_timeout_secs)
    context = torch.multiprocessing.spawn(spawned_worker, args=args, nprocs=nproc, join=False)

    def forward(signum, frame):  # the workers stop after their current step, with a checkpoint
        for process in context.processes:
            if process.is_alive():
                os.kill(process.pid, signum)

    handlers = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not context.join():
            pass
    except torch.multiprocessing.ProcessExitedException as error:
        # A rank that stopped on a UserError has printed it; one that was killed has not.
        if error.exit_code is None or error.exit_code < 0:
            print(f"error: rank {error.error_index} was killed ({error.signal_name})", file=sys.stderr)
        sys.exit(error.exit_code if error.exit_code and error.exit_code > 0 else 1)
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
