"""How a training process maps its CPU memory: blocks of 2 MiB and more on transparent huge pages.

A training step frees and allocates again the same large tensors every step: activations, logit chunks, gradients.
glibc serves blocks above its mmap threshold with fresh mappings, so each step page-faults that memory in anew,
4 KiB at a time (~120-145k faults and 1.5-1.9 s of kernel time per 7 s step on a 2-core EPYC, SmolLM2 at 256 x 4;
`python -m bench --profile` prints both). On 2 MiB pages the same memory takes 512 times fewer faults and TLB entries:
PyTorch's CPU allocator aligns such blocks to 2 MiB and asks the kernel for huge pages (madvise) when
THP_MEM_ALLOC_ENABLE=1, which it reads once, at its first allocation.

Measured and not taken: also keeping freed memory in malloc's heap (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=-1)
removed most remaining faults (1.12x pairs/s at 256 x 4), but glibc then serves PyTorch's aligned blocks
(posix_memalign) badly: allocating and freeing one 64 MiB block grows the heap to 512 MiB before it is reused.
"""

import os


def use_huge_pages() -> None:
    """PyTorch's CPU blocks of 2 MiB and more on transparent huge pages, unless THP_MEM_ALLOC_ENABLE is set already
    (0 keeps small pages). Call it before torch allocates anything: PyTorch reads the setting once, then."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
