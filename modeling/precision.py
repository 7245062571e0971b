"""`auto` precision: bfloat16 compute where the device runs it fast, float32 elsewhere.

CUDA GPUs answer through torch (native bf16 support: emulated bf16, as on a T4 or V100, is slow). CPUs differ within
one machine kind: with AVX512-BF16 or AMX a bfloat16 matmul runs several times faster than float32, without them
~100x slower. No flag tells reliably what oneDNN will do, so a micro-probe times both, once per machine, and the
measured rates are cached in the run's cache directory, keyed by everything they depend on (machine_key); they are
also the CPU's peak in the runs' MFU (telemetry.py).
"""

import functools
import json
import os
import platform
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import storage
from utils import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# bfloat16 must beat float32 by this factor: the probe only has to tell ~4x faster from ~100x slower.
REQUIRED_SPEEDUP = 1.5
PROBE_SIZE = 512  # smaller matmuls time too noisily here (256: 1.6-3.0x on one AVX512-BF16 CPU; 512: 2.2-2.5x)


def parse_dtype(name: str | None, key: str, allow_auto: bool = False) -> torch.dtype | str | None:
    if name is None or (allow_auto and name == "auto"):
        return name
    if name not in DTYPES:
        valid = [*DTYPES, "auto"] if allow_auto else list(DTYPES)
        raise UserError(f"{key}={name} is not a dtype; expected one of {', '.join(valid)}")
    return DTYPES[name]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_cpu_matmul_flops(rounds: int = 10, emulated_seconds: float = 0.05) -> dict[str, float]:
    """FLOP/s of a PROBE_SIZE square matmul on this CPU, by dtype name (float32, bfloat16, float16): the best time of
    each, the dtypes alternating round by round, so that other processes on a shared machine slow them alike rather
    than one of them (the best, because load only ever slows a matmul down). float32 takes about 3 ms at 0.1
    TFLOP/s; a 16-bit dtype where it is emulated takes about 0.2 s, so it stops after half the rounds once its best
    is slower than emulated_seconds (the answer is clear by then). float16 is measured for the line that says a
    configured dtype runs slowly (slow_precision_note) and for MFU, never for `auto`'s choice."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    operands = {dtype: torch.randn(PROBE_SIZE, PROBE_SIZE).to(dtype) for dtype in dtypes}
    best = dict.fromkeys(operands, float("inf"))
    for a in operands.values():
        a @ a  # warm-up: kernel selection and first-touch
    for index in range(rounds):
        for dtype, a in operands.items():
            if dtype != torch.float32 and index >= rounds // 2 and best[dtype] > emulated_seconds:
                continue
            start = time.perf_counter()
            a @ a
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    flops = 2 * PROBE_SIZE**3
    return {str(dtype).removeprefix("torch."): flops / seconds for dtype, seconds in best.items()}


# The CPU flags that decide how fast a bfloat16 matmul can run: native bf16 dot products (AVX512-BF16, AMX) or
# their absence, where oneDNN converts to float32 (AVX512F, AVX2).
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f", "avx2")


def cpu_flags() -> list[str]:
    """The BF16_FLAGS this CPU reports (Linux); empty where /proc/cpuinfo is absent."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    return [flag for flag in BF16_FLAGS if flag in flags]


def machine_key() -> str:
    """Everything the probe's answer depends on: the CPU and its bf16-relevant flags, the kernels torch dispatches
    to (its CPU capability, which ATEN_CPU_CAPABILITY lowers) and oneDNN's ISA limit (ONEDNN_MAX_CPU_ISA), the
    threads a matmul uses, and torch's version. CPUs of one model name differ in these flags (AVX2-only and
    AVX512-BF16 machines of one cloud kind report the same name), and a cache directory may be shared by a
    cluster's nodes."""
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "unlimited"
    flags = " ".join(cpu_flags()) or "no flags read"
    return (
        f"{cpu_name()} [{flags}] capability {torch.backends.cpu.get_cpu_capability()} oneDNN {onednn} "
        f"threads {torch.get_num_threads()} torch {torch.__version__}"
    )


def device_key(device: torch.device) -> str:
    """The kernels a device computes with, for caches of computed numbers (the reference's log-probs): a GPU's name
    and CUDA version, or the CPU's machine_key. Another kernel set rounds differently."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} CUDA {torch.version.cuda} torch {torch.__version__}"
    return machine_key()


def cpu_matmul_flops(cache_dir: Path, again: bool = False) -> dict[str, float]:
    """This CPU's matmul FLOP/s by dtype name (probe_cpu_matmul_flops), measured once per machine and cached in
    cache_dir/precision_probe.json; a damaged or older file is measured again. again: measure now and keep the
    faster of each rate (a probe that ran while the machine was loaded measured too little)."""
    machine = machine_key()
    cache_file = cache_dir / "precision_probe.json"
    try:
        cached = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cached = {}
    cached = cached if isinstance(cached, dict) else {}
    rates = cached.get(machine)
    valid = isinstance(rates, dict) and all(  # float16's rate came later: a file without it stands
        isinstance(rates.get(name), (int, float)) for name in ("float32", "bfloat16")
    )
    if valid and not again:
        return rates
    measured = probe_cpu_matmul_flops()
    rates = {name: max(rate, rates.get(name, 0.0)) for name, rate in measured.items()} if valid else measured
    try:
        storage.write_text(cache_file, json.dumps({**cached, machine: rates}, indent=1))
    except storage.WriteFailed as error:  # the answer stands; it is measured again next time
        print(f"precision probe: not cached ({error})")
    return rates


def choose_compute_dtype(device: torch.device, cache_dir: Path) -> tuple[torch.dtype | None, str]:
    """(the compute dtype, why) for `auto`: None means float32 compute. A GPU computes in bfloat16 where it runs it
    natively (compute capability 8.0 on: Ampere, Hopper, Blackwell), else in float16 with loss scaling where its
    tensor cores run float16 (7.x: V100, T4, whose float32 is 8-15x slower), else in float32 (older GPUs have no
    tensor cores); a CPU in bfloat16 where the probe measures it fast (float16 is never faster than float32 there)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        major, minor = torch.cuda.get_device_capability(device)
        gpu = f"{name} (compute capability {major}.{minor})"
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, f"{gpu} runs bfloat16 natively"
        if major >= 7:
            return torch.float16, f"{gpu} has float16 tensor cores but no native bfloat16; the loss is scaled"
        return None, f"{gpu} has neither native bfloat16 nor float16 tensor cores"
    rates = cpu_matmul_flops(cache_dir)
    speedup = rates["bfloat16"] / rates["float32"]
    cache_file = cache_dir / "precision_probe.json"
    verdict = f"bfloat16 matmuls run {speedup:.2g}x as fast as float32 on this CPU ({cpu_name()}; {cache_file})"
    return (torch.bfloat16 if speedup >= REQUIRED_SPEEDUP else None), verdict


def auto_compute_dtype(topology, cache_dir: Path, autocast: bool) -> torch.dtype | None:
    """`auto`'s compute dtype on this topology: bfloat16 where its device runs it fast, else None (float32); decided
    on rank 0 for all ranks (they must compute alike). One line says what was chosen and why."""
    dtype, why = topology.run_on_main(lambda: choose_compute_dtype(topology.device, cache_dir)) or (None, None)
    dtype, why = topology.broadcast((dtype, why))
    how = "float32 weights under autocast" if autocast else "FSDP mixed precision over float32 shards"
    what = f"{DTYPE_NAMES[dtype]} compute ({how})" if dtype else "float32"
    print(f"precision: {what}, because {why} (model.fsdp_policy_mp=auto)")
    return dtype


# An explicit compute dtype this many times slower than `auto`'s choice gets a line: bfloat16 on an AVX2-only CPU
# (~100x), not float32 where bfloat16 is merely faster (2-4x on AVX512-BF16: float32's exactness may be the point).
SLOW_FACTOR = 10


def slow_precision_note(setting: str | None, precision: "Precision", device: torch.device, cache_dir: Path):
    """One line where an explicit model.fsdp_policy_mp (setting: anything but auto) has the policy compute far
    slower on this device than `auto` would, with the measured ratio and the key to change; None otherwise. The run
    goes on: the user asked for it."""
    if setting == "auto":
        return None
    compute = precision.policy_compute or precision.policy_weights
    name = DTYPE_NAMES.get(compute)
    if device.type == "cuda":
        if compute == torch.bfloat16 and not torch.cuda.is_bf16_supported(including_emulation=False):
            gpu, auto = torch.cuda.get_device_name(device), choose_compute_dtype(device, cache_dir)[0]
            return (
                f"precision: bfloat16 compute, as configured, is emulated on {gpu} (no native bfloat16), slower than "
                f"float32; model.fsdp_policy_mp=auto computes in {DTYPE_NAMES[auto or torch.float32]} here"
            )
        return None
    rates = cpu_matmul_flops(cache_dir)
    if name not in rates:  # float16 in a probe file written before it was measured
        return None
    auto = "bfloat16" if rates["bfloat16"] / rates["float32"] >= REQUIRED_SPEEDUP else "float32"
    ratio = rates[auto] / rates[name]
    if ratio < SLOW_FACTOR:
        return None
    return (
        f"precision: {name} compute, as configured, runs matmuls {ratio:.3g}x slower than {auto} on this CPU "
        f"({cpu_name()}: {rates[name] / 1e12:.3g} against {rates[auto] / 1e12:.3g} TFLOP/s, "
        f"{cache_dir / 'precision_probe.json'}); model.fsdp_policy_mp=auto computes in {auto} here"
    )


@dataclass(frozen=True)
class Precision:
    """Every dtype of a run, decided once from the model config (decide_precision). A compute dtype of None means
    the weights' own."""

    policy_weights: torch.dtype
    policy_compute: torch.dtype | None
    reference_weights: torch.dtype
    reference_compute: torch.dtype | None
    reference_like_policy: bool  # model.reference_dtype=auto: loaded and computed exactly like the policy
    autocast: bool  # the compute dtype is applied by torch.autocast (else by FSDP's mixed precision)

    @property
    def loss_scaled(self) -> bool:
        """Whether the policy's gradients flow through float16, whose range needs the loss scaled (loss_scale.*)."""
        return self.policy_compute == torch.float16


def decide_precision(model, autocast: bool, auto_compute: Callable[[], torch.dtype | None]) -> Precision:
    """The run's dtypes from the typed model config (configuration.sections.ModelConfig). auto_compute() answers
    model.fsdp_policy_mp=auto (auto_compute_dtype; called only then).

    model.reference_dtype: `auto`, the reference is the initial policy: its weights' dtype and its compute dtype, so
    that at step 0 they agree to the last bit; a dtype, the reference is loaded in it and computes in it; null, the
    reference is loaded in the policy's weights dtype and computes in it, without the policy's mixed precision."""
    weights = parse_dtype(model.policy_dtype, "model.policy_dtype")
    compute = parse_dtype(model.fsdp_policy_mp, "model.fsdp_policy_mp", allow_auto=True)
    compute = auto_compute() if compute == "auto" else compute
    reference = parse_dtype(model.reference_dtype, "model.reference_dtype", allow_auto=True)
    like_policy = reference == "auto"
    return Precision(
        policy_weights=weights,
        policy_compute=compute,
        reference_weights=weights if like_policy or reference is None else reference,
        reference_compute=compute if like_policy else None,
        reference_like_policy=like_policy,
        autocast=autocast,
    )


class CastCopy(torch.autograd.Function):
    """`copy`, a compute-dtype copy of `master` made beforehand, in place of `master.to(copy.dtype)` in a forward:
    the same values, and the same backward (the gradient cast to the master's dtype, accumulated into its .grad)."""

    @staticmethod
    def forward(ctx, master: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        ctx.dtype = master.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.to(ctx.dtype), None


class ComputeWeights:
    """compute_weight_copies: a compute-dtype copy of each linear layer's weight and bias kept beside the master
    (float32) tensor and cast again only after the master changes, instead of autocast casting every weight in every
    forward. A change is any optimizer's step (torch's global step hook: fused AdamW updates the weights without
    moving their version counters) or an in-place write that moves the master's version counter (a resumed
    checkpoint, a reference update). Linear layers are what autocast casts weights for; embeddings and norms compute
    as they would, and the output embedding is left to the fused head, which casts it once per pass."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.copies: dict[int, tuple[int, torch.Tensor]] = {}  # id(master) -> (its version when cast, the copy)
        self.casts = 0  # copies made so far (tested: none between optimizer steps)
        alive = weakref.ref(self)

        def stale(optimizer, args, kwargs) -> None:
            if alive() is not None:
                alive().copies.clear()

        handle = register_optimizer_step_post_hook(stale)
        weakref.finalize(self, handle.remove)

    def apply(self, model: torch.nn.Module) -> int:
        """Route the forward of each plain nn.Linear of `model` (not subclasses: bitsandbytes' 4-bit layers) but the
        output embedding through the copies; the number of layers routed."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m is not head]
        for layer in layers:
            layer.forward = functools.partial(self.linear, layer)
        return len(layers)

    def copy(self, master: torch.Tensor | None) -> torch.Tensor | None:
        if master is None or not master.is_floating_point() or master.dtype == self.dtype:
            return master
        version, copy = self.copies.get(id(master), (None, None))
        if version != master._version:
            with torch.no_grad():
                copy = master.to(self.dtype)
            self.copies[id(master)] = (master._version, copy)
            self.casts += 1
        return CastCopy.apply(master, copy)

    def linear(self, layer: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
        """The layer's forward: on the copies where autocast would cast its weights to this dtype, else (the
        probes, which run without autocast) on the master tensors as they are."""
        device = input.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == self.dtype:
            return torch.nn.functional.linear(input, self.copy(layer.weight), self.copy(layer.bias))
        return torch.nn.functional.linear(input, layer.weight, layer.bias)
