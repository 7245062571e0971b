"""Whether a run fits its machines, checked before any weight is read (build.check_fit): its memory plan against
each rank's memory and, where it does not fit, the smallest mesh that would, or fsdp_cpu_offload on the same GPUs."""

import torch

from modeling.distributed import TRAINERS
from modeling.placement import tensor_parallel_plan
from reporting.hardware import GIB, Hardware
from reporting.memory_plan import MemoryPlan, Workload, memory_plan
from utils import UserError


def fit_verdict(work: Workload, hardware: Hardware, mesh: tuple[int, int, int]) -> tuple[MemoryPlan, str | None]:
    """(the run's memory plan on its mesh, why it does not fit `hardware` with the smallest mesh that would, or
    None). Checked before any weight is read; a lower bound, so a run it refuses could not have fitted."""

    def plan(trainer: str, candidate: tuple[int, int, int]) -> MemoryPlan:
        return memory_plan(work, trainer, candidate, on_gpu=hardware.gpu_bytes is not None)

    current = plan(work.config.trainer, mesh)
    problem = current.fit_problem(hardware)
    if problem is None:
        return current, None
    found = smallest_mesh(work, hardware, plan) + offload_instead(work, hardware, mesh)
    return current, f"this run does not fit {hardware.describe()}: {problem} ({current.header}); {found}"


def offload_instead(work: Workload, hardware: Hardware, mesh: tuple[int, int, int]) -> str:
    """Where an FSDP run on GPUs does not fit but would with fsdp_cpu_offload=true, on the same GPUs and a host
    memory that is known: a clause that says so, with its memory; else ""."""
    config = work.config
    if config.fsdp_cpu_offload or config.lora.enabled or not TRAINERS[config.trainer].fsdp:
        return ""
    if hardware.gpu_bytes is None or hardware.host_bytes is None:
        return ""
    candidate = memory_plan(work, config.trainer, mesh, on_gpu=True, offload=True)
    if candidate.fit_problem(hardware) is not None:
        return ""
    node = candidate.host_peak() * hardware.ranks_per_node
    return (
        f"; or on these GPUs with fsdp_cpu_offload=true ({candidate.device_peak() / GIB:.1f} GiB a GPU, "
        f"{node / GIB:.1f} GiB of host memory a node)"
    )


MAX_NODES = 256


def smallest_mesh(work: Workload, hardware: Hardware, plan) -> str:
    """The fewest nodes of hardware's kind (then the smallest tensor-parallel size within a node, then the smallest
    sequence-parallel size in what is left of it) on which FSDPTrainer fits the run, by plan(trainer, (dp, sp, tp))."""
    config, policy, per_node = work.config, work.policy, hardware.ranks_per_node
    divisors = [size for size in range(1, per_node + 1) if per_node % size == 0]
    sizes = [1] if config.lora.enabled else divisors
    sizes = [tp for tp in sizes if tp == 1 or splits_heads(policy, tp)]
    heads = policy.config.get_text_config().num_attention_heads
    packed = config.layout == "packed"
    for nodes in range(1, MAX_NODES + 1):
        for tp, sp in [(tp, sp) for tp in sizes for sp in divisors if per_node % (tp * sp) == 0]:
            if sp > 1 and (not packed or heads % (sp * tp)):
                continue
            dp = nodes * per_node // (tp * sp)
            candidate = plan("FSDPTrainer", (dp, sp, tp))
            fitting = hardware.with_nodes(nodes)
            if candidate.fit_problem(fitting) is None:
                step = work.micro_batches * dp
                unit = "GPU" if candidate.on_gpu else "process"
                sequence = f" sequence_parallel_size={sp}" if sp > 1 else ""
                shape = f"dp {dp}{f' x sp {sp}' if sp > 1 else ''} x tp {tp}"
                return (
                    f"the smallest mesh that fits: {fitting.describe(host=False)}, trainer=FSDPTrainer "
                    f"tensor_parallel_size={tp}{sequence} ({shape}: {candidate.device_peak() / GIB:.1f} GiB a {unit}; "
                    f"batch_size a multiple of {step})"
                )
    return f"none of up to {hardware.with_nodes(MAX_NODES).describe(host=False)} fits it"


def splits_heads(policy: torch.nn.Module, tp: int) -> bool:
    """Whether tensor parallelism of size tp can place the policy (its plan, its heads)."""
    try:
        tensor_parallel_plan(policy, tp, tp, "FSDPTrainer")
    except UserError:
        return False
    return True
