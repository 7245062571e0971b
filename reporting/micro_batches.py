"""Micro-batches sized by memory (micro_batch_memory): the budget it gives one rank's training (a number of GiB, or
auto: a share of the GPU's free memory), and the fewest micro-batches a step whose memory plan fits it."""

import dataclasses
import math

from reporting.hardware import GIB, Hardware, plural
from reporting.memory_plan import Workload, memory_plan, micro_batch_shapes
from utils import UserError

# micro_batch_memory=auto fills this share of the GPU's free memory: the plan is a lower bound (the allocator's
# fragmentation, kernels' workspaces and the attention's own buffers are not in it)
AUTO_MEMORY_SHARE = 0.8


def micro_batch_gib(setting: str | None) -> float | str | None:
    """micro_batch_memory as a number of GiB, "auto" or None; anything else is a one-line UserError."""
    if setting is None or setting == "auto":
        return setting
    try:
        gib = float(setting)
    except ValueError:
        gib = math.nan
    if not (math.isfinite(gib) and gib > 0):
        raise UserError(f"micro_batch_memory={setting} must be auto, a positive number of GiB, or null")
    return gib


def micro_batch_budget(setting: str | None, hardware: Hardware) -> tuple[float, str, bool] | None:
    """(bytes one rank's training may fill, where that figure comes from, whether it is the user's own) by
    micro_batch_memory, or None: the micro-batches stay as gradient_accumulation_steps cuts them (null; auto on CPU
    ranks)."""
    gib = micro_batch_gib(setting)
    if gib is None or gib == "auto" and hardware.gpu_bytes is None:
        return None
    if gib != "auto":
        return gib * GIB, f"micro_batch_memory={setting}", True
    free = hardware.gpu_bytes if hardware.gpu_free_bytes is None else hardware.gpu_free_bytes
    share = f"{AUTO_MEMORY_SHARE:.0%} of {free / GIB:.1f} GiB free"
    return AUTO_MEMORY_SHARE * free, f"micro_batch_memory=auto: {share}", False


def choose_micro_batches(
    work: Workload, trainer: str, mesh: tuple[int, int, int], on_gpu: bool, budget: tuple[float, str, bool]
) -> tuple[int, str]:
    """(micro-batches a step, the line that says so): the fewest, at least gradient_accumulation_steps, that split
    each rank's share of batch_size and of eval_batch_size evenly and whose plan (memory_plan, at the schedule's
    largest micro-batch in token positions) fits the budget; batch_size stays as it is. Where none fits, a budget
    the user gave is a UserError naming micro_batch_memory; auto leaves the micro-batches as given, for the fit
    check (fit_verdict) to judge against the whole GPU and to name a mesh that fits."""
    config, (dp, sp, _) = work.config, mesh
    share, limit, given = config.batch_size // dp, budget[0], budget[2]
    counts = [
        k
        for k in range(config.gradient_accumulation_steps, share + 1)
        if share % k == 0 and config.eval_batch_size % (k * dp) == 0
    ]
    peaks = {}
    for k in counts:  # the fewest micro-batches first: the first that fits is the choice
        peaks[k] = memory_plan(with_accumulation(work, k), trainer, mesh, on_gpu).device_peak()
        if peaks[k] <= limit:
            break
    else:
        finest = counts[-1]
        short = (
            f"the smallest micro-batches (gradient_accumulation_steps={finest}, {plural(share // finest, 'example')} "
            f"a rank; eval_batch_size={config.eval_batch_size} splits into no more) need {peaks[finest] / GIB:.3g} "
            f"GiB of the {limit / GIB:.3g} GiB budget"
        )
        if given:
            raise UserError(f"{budget[1]}: {short}")
        k = config.gradient_accumulation_steps
        return k, f"micro-batches: {k} a step, as given (gradient_accumulation_steps={k}): {short} ({budget[1]})"
    micro = share // k
    positions = max(rows * length for rows, length in micro_batch_shapes(work, micro, sp)) // sp
    return k, (
        f"micro-batches: {k} a step of {plural(micro, 'example')} a rank (gradient_accumulation_steps={k}), "
        f"at most {positions:,} token positions each; {peaks[k] / GIB:.3g} GiB of the {limit / GIB:.3g} GiB "
        f"budget ({budget[1]})"
    )


def with_accumulation(work: Workload, accumulation: int) -> Workload:
    """`work` in `accumulation` micro-batches a step."""
    return dataclasses.replace(work, accumulation=accumulation)
