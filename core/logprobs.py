"""Float32 token log-probabilities, chunked over the vocabulary so that float32 logits are never materialised:
from existing logits, or fused with the LM head (hidden states in, log-probs of the scored tokens out).

Shapes: T = sequence length, V = vocabulary size, N = hidden-state rows, M = scored tokens.
"""

from dataclasses import dataclass

import torch

from modeling.placement import COMPILED_GRAPHS

# Float32 elements of one chunk of logits: the log-prob computation never holds more, whatever the batch, sequence
# length or vocabulary size. On a CPU 64 MiB (1024 rows of a 16k vocabulary, 128 rows of a 128k one) keeps a chunk
# in cache; a GPU needs larger GEMMs to run at speed (on an H100 at V = 128k, H = 4096, 8k scored tokens, 128-row
# chunks took 108 ms per forward, 2k-row ones 24 ms), so there a chunk is 1 GiB (2048 rows of a 128k vocabulary).
CHUNK_ELEMENTS = {"cpu": 2**24, "cuda": 2**28}


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    # A fixed number of rows, not the rows split evenly: a GEMM's value for one row can depend on how many rows the
    # GEMM has (MKL picks its kernels by shape). With fixed chunks every chunk but the last has the same shape in the
    # reference pass and in the policy's, which batch examples differently; split evenly, every chunk's shape
    # depended on the batch, and step 0 of the default job no longer gave rewards of exactly 0 (accuracy 0.025).
    return max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"]) // vocab_size)


class _ChunkedTokenLogps(torch.autograd.Function):
    """log_softmax(logits.float())[row, target] for selected rows of existing logits, computed chunk by chunk.

    Same values as upcasting the whole [N, V] logits to float32 and taking log_softmax, but neither the forward
    nor the backward ever holds more than one chunk of float32 rows; only the per-row logsumexp is kept for
    backward, which recomputes the softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, with_sum_sq: bool):
        # logits: [N, V] any float dtype; rows, targets: [M] long. Returns ([M] float32 log-probs, [M] float32
        # log sum_v p_v^2 of each row, or [0] unless with_sum_sq).
        step = chunk_rows(logits.shape[-1], logits.device)
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty_like(token_logps)
        log_sum_sq = torch.empty(rows.numel() if with_sum_sq else 0, dtype=torch.float32, device=logits.device)
        for start in range(0, rows.numel(), step):
            end = start + step
            chunk = logits[rows[start:end]].float()  # a copy (indexed rows)
            logsumexp[start:end] = torch.logsumexp(chunk, dim=-1)
            token_logps[start:end] = chunk.gather(-1, targets[start:end, None]).squeeze(-1) - logsumexp[start:end]
            if with_sum_sq:
                log_sum_sq[start:end] = log_sum_squares(chunk.sub_(logsumexp[start:end, None]).exp_())
        ctx.save_for_backward(logits, rows, targets, logsumexp)
        ctx.mark_non_differentiable(log_sum_sq)
        return token_logps, log_sum_sq

    @staticmethod
    def backward(ctx, grad_token_logps: torch.Tensor, _):
        logits, rows, targets, logsumexp = ctx.saved_tensors
        step = chunk_rows(logits.shape[-1], logits.device)
        grad_logits = torch.zeros_like(logits)
        for start in range(0, rows.numel(), step):
            end = start + step
            softmax = torch.exp(logits[rows[start:end]].float() - logsumexp[start:end, None])
            chunk_grad = log_softmax_grad(softmax, targets[start:end], grad_token_logps[start:end])
            grad_logits.index_add_(0, rows[start:end], chunk_grad.to(logits.dtype))
        return grad_logits, None, None, None


def log_sum_squares(probs: torch.Tensor) -> torch.Tensor:
    """[C] log sum_v p_v^2 of [C, V] probabilities, as 2 log ||p||: no [C, V] temporary. It lies in
    [-log V, 0] (uniform to one-hot), so it neither under- nor overflows in float32."""
    return torch.linalg.vector_norm(probs, dim=-1).log_().mul_(2)


def log_softmax_grad(softmax: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/dx of grad * log_softmax(x)[target] = grad * (onehot(target) - softmax(x)); [C, V] float32."""
    return (-grad[:, None] * softmax).scatter_add_(-1, targets[:, None], grad[:, None])


def token_logps_from_logits(logits, rows, targets, with_sum_sq: bool = False):
    """[M] float32 log_softmax(logits[rows].float())[targets]; logits: [N, V], rows and targets: [M]. with_sum_sq:
    also [M] log sum_v p_v^2 of each row (no gradient), computed in the same pass: (token_logps, log_sum_sq)."""
    token_logps, log_sum_sq = _ChunkedTokenLogps.apply(logits, rows, targets, with_sum_sq)
    return (token_logps, log_sum_sq) if with_sum_sq else token_logps


@dataclass(frozen=True)
class LogitMap:
    """The elementwise map some models apply to their LM head's output before the softmax: times `scale` (Cohere's
    `logit_scale`; Granite divides by `logits_scaling`), then soft-capped into (-cap, cap) as cap * tanh(x / cap)
    (Gemma 2's `final_logit_softcapping`, Team Gemma 2024, arXiv:2408.00118); cap None: no cap; then divided by a
    sampling `temperature` (the distribution a completion sampled at it was drawn from: the sampled KL's). The
    identity by default. Applied in float32 to the upcast logits, in place."""

    scale: float = 1.0
    cap: float | None = None
    temperature: float = 1.0

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.cap is not None:
            logits.div_(self.cap).tanh_().mul_(self.cap)
        if self.temperature != 1.0:
            logits.div_(self.temperature)
        return logits

    def slope(self, mapped: torch.Tensor) -> torch.Tensor | float:
        """The map's derivative at each element, from its output y: the scale, times 1 - (y / cap)^2 = 1 - tanh^2
        under a cap, over the temperature (a new tensor, the shape of `mapped`; a float without a cap)."""
        if self.cap is None:
            return self.scale / self.temperature
        capped = mapped * self.temperature if self.temperature != 1.0 else mapped
        return (capped / self.cap).square_().neg_().add_(1).mul_(self.scale / self.temperature)

    def describe(self) -> str:
        parts = [f"times {self.scale:g}"] if self.scale != 1.0 else []
        parts += [f"soft-capped at {self.cap:g}"] if self.cap is not None else []
        parts += [f"at temperature {self.temperature:g}"] if self.temperature != 1.0 else []
        return ", ".join(parts)


IDENTITY = LogitMap()


def scaled_(tensor: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """tensor * factor in place, and no pass over `tensor` for a factor of 1."""
    return tensor if isinstance(factor, float) and factor == 1.0 else tensor.mul_(factor)


# Below about -87.3 float32's exp is subnormal, and a CPU's vectorised exp takes a slow path from there down (2-core
# Xeon: 291 ms for 16.8M values in [-100, -88], 122 ms in [-200, -110], 3.6 ms in [-50, 0]): logits at a temperature
# of 0.25, as the sampled KL scores them, spread that far. Floored here, each such term of a logsumexp adds at most
# e^-87 = 1.6e-38 to a sum of at least 1 (the row's maximum gives e^0): all of them, under V 2^-126, stay below the
# sum's float32 resolution of 2^-24.
EXP_FLOOR = -87.0


class ChunkBuffers:
    """The [C, V] tensors of one pass's chunks, allocated once and reused by every chunk: the head's logits in the
    compute dtype, their float32 upcast and a float32 scratch. A fresh tensor per chunk pays its page faults anew on a
    CPU (glibc maps each block over 32 MiB on its own and unmaps it when freed: a chunk is 64 MiB): on a 2-core Xeon a
    chunk of 341 x 49,152 took 31 ms for torch.logsumexp with its temporary allocated, 14 ms in a reused one."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device, product_only: bool = False):
        """product_only: the head's logits alone (the compiled kernels read them as they are)."""
        self.head = torch.empty(rows, vocab, dtype=dtype, device=device)
        if not product_only:
            self.upcast = self.head if dtype == torch.float32 else torch.empty_like(self.head, dtype=torch.float32)
            self.scratch = torch.empty_like(self.head, dtype=torch.float32)

    def product(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[C, V] hidden @ weight.T + bias computed in the dtype of weight and bias (the compute dtype, as the model's
        own head computes under the same autocast), in the buffers: torch.nn.functional.linear's GEMM, written out=."""
        head = self.head[: len(hidden)]
        with torch.autocast(hidden.device.type, enabled=False):
            hidden = hidden.to(weight.dtype)
            if bias is None:
                torch.mm(hidden, weight.t(), out=head)
            else:
                torch.addmm(bias, hidden, weight.t(), out=head)
        return head

    def logits(self, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[C, V] float32 upcast of the product, in the buffers."""
        head = self.product(hidden, weight, bias)
        return head if head.dtype == torch.float32 else self.upcast[: len(hidden)].copy_(head)

    def logsumexp(self, logits: torch.Tensor) -> torch.Tensor:
        """[C] torch.logsumexp(logits, dim=-1), computed as it computes it (the row maxima, infinite ones read as 0,
        subtracted, exponentiated, summed, logged and added back), its temporary in the scratch buffer, and each
        difference floored at EXP_FLOOR."""
        maxes = logits.amax(dim=-1)
        empty = maxes == -float("inf")  # a row of -inf alone: its sum is 0, whatever the floor
        maxes.masked_fill_(maxes.abs() == float("inf"), 0)
        shifted = torch.sub(logits, maxes[:, None], out=self.scratch[: len(logits)]).clamp_(min=EXP_FLOOR).exp_()
        return shifted.sum(dim=-1).log_().add_(maxes).masked_fill_(empty, -float("inf"))


class _ChunkedHeadLogps(torch.autograd.Function):
    """log_softmax(f(hidden[rows] @ weight.T + bias))[target], f a LogitMap applied after the upcast: the LM head
    and the float32 log-softmax fused, chunk by chunk, so that the [M, V] logits never exist.

    The logits are computed in `compute_dtype` (the autocast dtype, or the weight's), exactly as the model's own
    head would under the same autocast, then upcast, as the reference implementation upcasts its logits.

    Backward, with g the gradient of each scored token's log-prob, P the softmax of its mapped logits and f' the
    map's slope: d/dlogits = g (onehot(target) - P) * f' = g (f'_target onehot(target) - Q), Q = P * f', so
      grad_hidden = g f'_target * W[target] - g * (Q @ W)            (the row scale applied to [C, H], not [C, V])
      grad_weight = scatter(target, g f'_target * h) - Q^T @ (g * h)  (likewise)
    Q is the only [C, V] operand (P itself without a map): one pass turns the recomputed logits into it in place
    (exp(f(logits) - logsumexp), times f' under a map), and the last chunk's Q is kept from the forward (at most one
    chunk: 64 MiB on a CPU), so a micro-batch of one chunk's rows computes its logits once, not twice. Three [C, V]
    GEMMs per chunk instead of four, no [C, V] temporaries besides Q (and f' under a soft cap), and the weight cast
    to the compute dtype once per pass.
    """

    @staticmethod
    @torch.profiler.record_function("fused head forward")
    def forward(ctx, hidden, weight, bias, rows, targets, compute_dtype, logit_map, keep_probs, with_sum_sq, compiled):
        # hidden: [N, H]; weight: [V, H]; bias: [V] or None; rows, targets: [M]. Returns ([M] float32 log-probs,
        # [M] float32 log sum_v p_v^2 of each row, or [0] unless with_sum_sq). keep_probs: a backward will follow
        # (needs_input_grad cannot tell: it is set under no_grad too, as in the reference pass). compiled: each
        # chunk's elementwise work in CompiledChunks' kernels.
        if compiled:
            return CompiledChunks.forward(ctx, hidden, weight, bias, rows, targets, compute_dtype, logit_map,
                                          keep_probs, with_sum_sq)  # fmt: skip
        step = chunk_rows(weight.shape[0], weight.device)
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(token_logps)
        log_sum_sq = torch.empty(rows.numel() if with_sum_sq else 0, dtype=torch.float32, device=hidden.device)
        weight_c, bias_c = cast(weight, compute_dtype), cast(bias, compute_dtype)  # once, not per chunk
        buffers = ChunkBuffers(min(step, rows.numel()), weight.shape[0], compute_dtype, hidden.device)
        kept = None
        for start in range(0, rows.numel(), step):
            end = start + step
            logits = logit_map.apply_(buffers.logits(hidden[rows[start:end]], weight_c, bias_c))
            logsumexp[start:end] = buffers.logsumexp(logits)
            token_logps[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - logsumexp[start:end]
            keep = keep_probs and end >= rows.numel()
            if with_sum_sq or keep:  # the softmax, in place: these logits are not needed again
                slope = logit_map.slope(logits) if keep else 1.0  # before the softmax overwrites the mapped logits
                probs = logits.sub_(logsumexp[start:end, None]).exp_()
                if with_sum_sq:
                    log_sum_sq[start:end] = log_sum_squares(probs)
                kept = scaled_(probs, slope) if keep else None  # a view: it keeps its buffer for the backward
        ctx.save_for_backward(hidden, weight, bias, rows, targets, token_logps, logsumexp, kept)
        ctx.compute_dtype, ctx.logit_map, ctx.compiled = compute_dtype, logit_map, False
        ctx.mark_non_differentiable(log_sum_sq)
        return token_logps, log_sum_sq

    @staticmethod
    @torch.profiler.record_function("fused head backward")
    def backward(ctx, grad_token_logps, _):
        hidden, weight, bias, rows, targets, token_logps, logsumexp, last_probs = ctx.saved_tensors
        dtype, logit_map = ctx.compute_dtype, ctx.logit_map
        step = chunk_rows(weight.shape[0], weight.device)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 sums over the chunks; zeros where there are no rows (a sequence-parallel slice of prompt tokens),
        # as every rank that FSDP reduces the head's gradient over must hold one
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        weight_c, bias_c = cast(weight, dtype), cast(bias, dtype)  # once, not per chunk
        starts = range(0, rows.numel(), step)
        buffers = None
        if len(starts) > 1:
            buffers = ChunkBuffers(min(step, rows.numel()), weight.shape[0], dtype, hidden.device, ctx.compiled)
        for start in starts:
            end = start + step
            chunk_hidden = hidden[rows[start:end]].to(dtype)
            if start == starts[-1]:
                probs = last_probs
            elif ctx.compiled:
                probs = CompiledChunks.probs(buffers.product(chunk_hidden, weight_c, bias_c), logsumexp[start:end],
                                             logit_map, dtype, sloped=True)  # fmt: skip
            else:  # recomputed: exp(f(logits) - logsumexp) * f', in place
                logits = logit_map.apply_(buffers.logits(chunk_hidden, weight_c, bias_c))
                slope = logit_map.slope(logits)
                probs = scaled_(logits.sub_(logsumexp[start:end, None]).exp_(), slope)
            probs = probs.to(dtype)  # the GEMMs' operand (a copy only under 16-bit compute)
            grad, chunk_targets = grad_token_logps[start:end], targets[start:end]
            # g f'_target: the target's mapped logit is its log-prob plus the logsumexp.
            target_grad = grad * logit_map.slope(token_logps[start:end] + logsumexp[start:end])
            if grad_hidden is not None:
                from_probs = torch.mm(probs, weight_c).float().mul_(-grad[:, None])
                from_targets = weight_c[chunk_targets].float().mul_(target_grad[:, None])
                grad_hidden.index_add_(0, rows[start:end], from_probs.add_(from_targets).to(hidden.dtype))
            if ctx.needs_input_grad[1]:
                scaled = chunk_hidden * -grad[:, None].to(dtype)  # [C, H]: the row scale, on the small operand
                if dtype == torch.float32:  # summed inside the GEMM: no [V, H] product to write, read and add
                    grad_weight.addmm_(probs.T, scaled)
                else:  # a [V, H] product in the compute dtype, summed in float32
                    grad_weight.add_(torch.mm(probs.T, scaled))
                grad_weight.index_add_(0, chunk_targets, chunk_hidden.float() * target_grad[:, None])
            if ctx.needs_input_grad[2]:
                grad_bias.add_(torch.mv(probs.T.float(), -grad))
                grad_bias.index_add_(0, chunk_targets, target_grad.float())
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


class CompiledChunks:
    """The fused head's elementwise work on each chunk compiled (inductor, through compile_blocks' backend: each graph
    told in one line): _ChunkedHeadLogps with `compiled`. Eager, a chunk's logits pass through memory once an
    operation: the upcast, the maximum, the difference, the floor, the exponential, the sum (about ten passes over
    [C, V], float32 mostly); compiled, the statistics read the compute-dtype logits twice (the maximum, then the sum)
    and the backward's probabilities once, writing them in the GEMM's dtype. The same values as eager's up to float
    rounding (a fused exp and sum). A chunk's rows are a dynamic size: one graph for every row count above 1."""

    @staticmethod
    def statistics(logits: torch.Tensor, targets: torch.Tensor, logit_map: LogitMap):
        """([C] logsumexp, [C] target log-probs) of [C, V] head logits mapped by logit_map in float32, the logsumexp
        as ChunkBuffers.logsumexp computes it."""
        mapped = logit_map.apply_(logits.to(torch.float32, copy=True))
        maxes = mapped.amax(dim=-1)
        finite = torch.where(maxes.abs() == float("inf"), 0.0, maxes)  # a row of -inf alone sums to 0
        sums = (mapped - finite[:, None]).clamp(min=EXP_FLOOR).exp().sum(dim=-1)
        logsumexp = torch.where(maxes == -float("inf"), -float("inf"), sums.log() + finite)
        return logsumexp, mapped.gather(-1, targets[:, None]).squeeze(-1) - logsumexp

    @staticmethod
    def probabilities(logits: torch.Tensor, logsumexp: torch.Tensor, logit_map: LogitMap, dtype: torch.dtype,
                      sloped: bool) -> torch.Tensor:  # fmt: skip
        """[C, V] in `dtype`: exp(f(logits) - logsumexp), times f' where sloped (the backward's Q)."""
        mapped = logit_map.apply_(logits.to(torch.float32, copy=True))
        probs = (mapped - logsumexp[:, None]).exp()
        return (probs * logit_map.slope(mapped) if sloped else probs).to(dtype)

    @staticmethod
    def kernel(function):
        """function compiled, once a process: fullgraph, the chunk's rows (dimension 0) marked dynamic at each call,
        autocast off (it computes in the dtypes it names; autocast is a guard, and the backward runs without it). A
        chunk's [C] slices (targets, logsumexp) go in as tensors of their own: a slice's storage offset is guarded
        (0, 1 or more), so the first chunk's and the others' would compile apart."""
        if function not in COMPILED_KERNELS:
            compiled = torch.compile(function, backend=COMPILED_GRAPHS, fullgraph=True)

            def call(*args, **kwargs):
                args = [arg.clone() if isinstance(arg, torch.Tensor) and arg.dim() == 1 else arg for arg in args]
                for tensor in args:
                    if isinstance(tensor, torch.Tensor):
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
                with torch.autocast(args[0].device.type, enabled=False):  # as in the backward: one global state
                    return compiled(*args, **kwargs)

            COMPILED_KERNELS[function] = call
        return COMPILED_KERNELS[function]

    @staticmethod
    def probs(logits, logsumexp, logit_map, dtype, sloped):
        return CompiledChunks.kernel(CompiledChunks.probabilities)(logits, logsumexp, logit_map, dtype, sloped)

    @staticmethod
    def forward(ctx, hidden, weight, bias, rows, targets, compute_dtype, logit_map, keep_probs, with_sum_sq):
        """_ChunkedHeadLogps.forward through the kernels: the head's logits in the compute dtype, never upcast whole;
        the last chunk's probabilities kept in the compute dtype, the backward's GEMM operand."""
        step = chunk_rows(weight.shape[0], weight.device)
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(token_logps)
        log_sum_sq = torch.empty(rows.numel() if with_sum_sq else 0, dtype=torch.float32, device=hidden.device)
        weight_c, bias_c = cast(weight, compute_dtype), cast(bias, compute_dtype)
        buffers = ChunkBuffers(min(step, rows.numel()), weight.shape[0], compute_dtype, hidden.device, True)
        statistics, kept = CompiledChunks.kernel(CompiledChunks.statistics), None
        for start in range(0, rows.numel(), step):
            end = start + step
            logits = buffers.product(hidden[rows[start:end]], weight_c, bias_c)
            logsumexp[start:end], token_logps[start:end] = statistics(logits, targets[start:end], logit_map)
            if with_sum_sq:
                probs = CompiledChunks.probs(logits, logsumexp[start:end], logit_map, torch.float32, sloped=False)
                log_sum_sq[start:end] = log_sum_squares(probs)
            if keep_probs and end >= rows.numel():
                kept = CompiledChunks.probs(logits, logsumexp[start:end], logit_map, compute_dtype, sloped=True)
        ctx.save_for_backward(hidden, weight, bias, rows, targets, token_logps, logsumexp, kept)
        ctx.compute_dtype, ctx.logit_map, ctx.compiled = compute_dtype, logit_map, True
        ctx.mark_non_differentiable(log_sum_sq)
        return token_logps, log_sum_sq


COMPILED_KERNELS = {}  # CompiledChunks.kernel's: a function's compiled call


def cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def token_logps_from_hidden(
    hidden, weight, bias, rows, targets, with_sum_sq: bool = False, logit_map=IDENTITY, compiled: bool = False
):
    """[M] float32 log-probs of `targets` under the LM head applied to hidden[rows], then `logit_map`, never holding
    [M, V] logits (compiled: each chunk's elementwise work in CompiledChunks' kernels).

    hidden: [N, H]; weight: [V, H]; bias: [V] or None; rows, targets: [M] (rows may repeat: the last prompt token
    predicts the first token of every response). with_sum_sq: also [M] log sum_v p_v^2 of each row (no gradient),
    from the same logits: (token_logps, log_sum_sq)."""
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    trains = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    token_logps, log_sum_sq = _ChunkedHeadLogps.apply(
        hidden, weight, bias, rows, targets, compute_dtype, logit_map, trains, with_sum_sq, compiled
    )
    return (token_logps, log_sum_sq) if with_sum_sq else token_logps
