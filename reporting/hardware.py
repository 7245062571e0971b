"""The machines a run's ranks have (Hardware): this one, or those that `plan.*` describes for a dry run; what the
memory plan (memory_plan.py) is checked against and describes."""

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """What a run's ranks have: the nodes, ranks on each, each rank's GPU memory (None: CPU ranks, whose device is the
    host) and each node's host memory (None: not known, not checked); gpu_free_bytes: what this rank's GPU has free
    now (None: not known, as on planned machines)."""

    nodes: int
    ranks_per_node: int
    gpu_bytes: float | None
    host_bytes: float | None
    gpu_free_bytes: float | None = None

    @classmethod
    def here(cls, world_size: int) -> "Hardware":
        """This machine, for a run of world_size ranks: torchrun's ranks per node, else all of them here."""
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        cuda = torch.cuda.is_available()
        gpu = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda else None
        free = torch.cuda.mem_get_info()[0] if cuda else None
        return cls(max(1, world_size // per_node), per_node, gpu, host_memory(), free)

    @classmethod
    def planned(cls, plan) -> "Hardware | None":
        """The machines `plan.*` describes (dry_run=true for other machines than this one), or None: this one."""
        if plan.gpus_per_node is None:
            return None
        host = None if plan.host_memory_gib is None else plan.host_memory_gib * GIB
        return cls(plan.nodes, plan.gpus_per_node, plan.gpu_memory_gib * GIB, host)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def with_nodes(self, nodes: int) -> "Hardware":
        return dataclasses.replace(self, nodes=nodes)

    def describe(self, host: bool = True) -> str:
        shown = host and self.host_bytes is not None
        memory = f", {self.host_bytes / GIB:.0f} GiB of host memory a node" if shown else ""
        if self.gpu_bytes is None:
            return f"{plural(self.nodes, 'machine')} x {plural(self.ranks_per_node, 'CPU process')}{memory}"
        gpus = f"{plural(self.ranks_per_node, 'GPU')} of {self.gpu_bytes / GIB:.0f} GiB"
        return f"{plural(self.nodes, 'node')} x {gpus}{memory}"


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('s') else 's'}"


def host_memory() -> float | None:
    """This machine's memory in bytes (Linux: MemTotal), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
