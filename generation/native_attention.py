"""The decode steps' attention on a CPU by a small C++ kernel of our own (csrc/decode_attention.cpp), built at first
use by torch.utils.cpp_extension: each key and value row read once for its whole group of query heads, the scores
by _mm512_dpbf16_ps where the CPU has AVX512-BF16 (a plain C++ path elsewhere), a float32 online softmax. torch's
CPU flash-attention kernel for one query token was a third of a bfloat16 decode step of SmolLM2 at 128 rows.

Optional: where the kernel does not build (no compiler, no ninja), does not take the inputs (another dtype, more
than 16 query heads a key/value head, head_dim over 256 or not a multiple of 16) or the CPU has no AVX512-BF16 (its
plain C++ path, there so that every machine tests the kernel's logic, is slower than SDPA), one line says so, once a
process, and the caller runs SDPA. The build is torch's extension cache's (TORCH_EXTENSIONS_DIR, else
~/.cache/torch_extensions), keyed by the source's hash: one build per machine and source, shared by processes under
its file lock."""

import functools
import pathlib
import sys

import torch

SOURCE = pathlib.Path(__file__).parent / "csrc" / "decode_attention.cpp"
NAME = "dpo_decode_attention"

# the kernel's limits (MAX_GROUP, MAX_DIM in the source)
MAX_GROUP = 16
MAX_DIM = 256

_said: set[str] = set()


def say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        print(line)


def build() -> None:
    """The kernel built (or found built) and loaded: torch.ops.dpo_decode. Raises where it does not build."""
    from torch.utils import cpp_extension  # on use: only a CPU's decode steps need it

    openmp = ["-fopenmp"] if sys.platform.startswith("linux") else []  # torch's own OpenMP, for at::parallel_for
    cpp_extension.load(NAME, [str(SOURCE)], extra_cflags=["-O3", *openmp], extra_ldflags=openmp,
                       is_python_module=False)  # fmt: skip


@functools.cache
def built() -> bool:
    """Whether the kernel is loaded; where it does not build, one line says why."""
    try:
        build()
    except Exception as error:  # a compiler's, ninja's or the loader's failure: each means SDPA
        say_once(f"decode attention: SDPA, the native CPU kernel did not build: {build_failure(error)}")
        return False
    return True


def build_failure(error: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error (cpp_extension's message opens with the
    command and ends with ninja's "build stopped"), else the message's last line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()] or [type(error).__name__]
    return next((line for line in lines[1:] if "error:" in line), lines[-1])


def avx512_bf16() -> bool:
    """Whether the kernel runs its AVX512-BF16 path on this CPU (False where it did not build)."""
    return built() and torch.ops.dpo_decode.avx512_bf16()


def problem(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
            generic: bool) -> str | None:  # fmt: skip
    """Why the kernel does not take these inputs (None: it does), from query [R, H, 1, D], key and value
    [R, G, L, D] and attention_mask [R, 1, 1, L]; on its AVX512-BF16 path unless `generic`."""
    if query.dtype not in (torch.float32, torch.bfloat16):
        return f"{query.dtype} (it takes float32 and bfloat16)"
    if {key.dtype, value.dtype} != {query.dtype}:
        return f"a {query.dtype} query over {key.dtype} keys and {value.dtype} values (it takes one dtype)"
    rows, length = query.shape[0], key.shape[2]
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.shape != (rows, 1, 1, length):
        return "a mask other than bool [R, 1, 1, L]"
    heads, dim, groups = query.shape[1], query.shape[-1], key.shape[1]
    if heads % groups or heads // groups > MAX_GROUP or dim > MAX_DIM:
        return f"{heads} heads over {groups} and head_dim {dim} (it takes up to 16 a group and head_dim 256)"
    if not generic and dim % 16:
        return f"head_dim {dim} (its AVX512-BF16 path takes multiples of 16)"
    return None


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                     scale: float, generic: bool = False) -> torch.Tensor | None:  # fmt: skip
    """[R, H, D] the attention of query [R, H, 1, D] (one token a row) over key and value [R, G, L, D] (the cache's
    views; H / G query heads a key/value head, in order) where attention_mask [R, 1, 1, L] (bool) is true, scores
    times `scale`; None where the kernel does not build, take them or run its AVX512-BF16 path on this CPU (one line,
    once, says why). `generic` runs its plain C++ path instead: slower than SDPA (no AVX-512), it is there for the
    tests, so that every machine tests the kernel's logic."""
    why = problem(query, key, value, attention_mask, generic)
    if why is not None:
        say_once(f"decode attention: SDPA, the native CPU kernel does not take {why}")
        return None
    if not built():
        return None
    if not generic and not avx512_bf16():
        say_once("decode attention: SDPA, this CPU has no AVX512-BF16 (the native kernel's fast path)")
        return None
    rows, heads, _, dim = query.shape
    inputs = (query.reshape(rows, heads, dim), key, value, attention_mask.reshape(rows, key.shape[2]))
    last_contiguous = (x if x.stride(-1) == 1 else x.contiguous() for x in inputs)  # the cache's views already are
    return torch.ops.dpo_decode.attention(*last_contiguous, scale, generic)
