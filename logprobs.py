"""Float32 token log-probabilities, chunked over the vocabulary so that float32 logits are never materialised:
from existing logits, or fused with the LM head (hidden states in, log-probs of the scored tokens out).

Shapes: T = sequence length, V = vocabulary size, N = hidden-state rows, M = scored tokens.
"""

import torch

# Float32 elements of one chunk of logits: the log-prob computation never holds more, whatever the batch, sequence
# length or vocabulary size. On a CPU 64 MiB (1024 rows of a 16k vocabulary, 128 rows of a 128k one) keeps a chunk
# in cache; a GPU needs larger GEMMs to run at speed (on an H100 at V = 128k, H = 4096, 8k scored tokens, 128-row
# chunks took 108 ms per forward, 2k-row ones 24 ms), so there a chunk is 1 GiB (2048 rows of a 128k vocabulary).
CHUNK_ELEMENTS = {"cpu": 2**24, "cuda": 2**28}


def chunk_rows(vocab_size: int, device: torch.device) -> int:
    return max(1, CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["cuda"]) // vocab_size)


class _ChunkedTokenLogps(torch.autograd.Function):
    """log_softmax(logits.float())[row, target] for selected rows of existing logits, computed chunk by chunk.

    Same values as upcasting the whole [N, V] logits to float32 and taking log_softmax, but neither the forward
    nor the backward ever holds more than one chunk of float32 rows; only the per-row logsumexp is kept for
    backward, which recomputes the softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits: [N, V] any float dtype; rows, targets: [M] long. Returns [M] float32.
        step = chunk_rows(logits.shape[-1], logits.device)
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty_like(token_logps)
        for start in range(0, rows.numel(), step):
            end = start + step
            chunk = logits[rows[start:end]].float()
            logsumexp[start:end] = torch.logsumexp(chunk, dim=-1)
            token_logps[start:end] = chunk.gather(-1, targets[start:end, None]).squeeze(-1) - logsumexp[start:end]
        ctx.save_for_backward(logits, rows, targets, logsumexp)
        return token_logps

    @staticmethod
    def backward(ctx, grad_token_logps: torch.Tensor):
        logits, rows, targets, logsumexp = ctx.saved_tensors
        step = chunk_rows(logits.shape[-1], logits.device)
        grad_logits = torch.zeros_like(logits)
        for start in range(0, rows.numel(), step):
            end = start + step
            softmax = torch.exp(logits[rows[start:end]].float() - logsumexp[start:end, None])
            chunk_grad = log_softmax_grad(softmax, targets[start:end], grad_token_logps[start:end])
            grad_logits.index_add_(0, rows[start:end], chunk_grad.to(logits.dtype))
        return grad_logits, None, None


def log_softmax_grad(softmax: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """d/dx of grad * log_softmax(x)[target] = grad * (onehot(target) - softmax(x)); [C, V] float32."""
    return (-grad[:, None] * softmax).scatter_add_(-1, targets[:, None], grad[:, None])


def token_logps_from_logits(logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[M] float32 log_softmax(logits[rows].float())[targets]; logits: [N, V], rows and targets: [M]."""
    return _ChunkedTokenLogps.apply(logits, rows, targets)


class _ChunkedHeadLogps(torch.autograd.Function):
    """log_softmax((hidden[rows] @ weight.T + bias).float())[target]: the LM head and the float32 log-softmax
    fused, chunk by chunk, so that the [M, V] logits never exist; backward recomputes each chunk's logits.

    The logits are computed in `compute_dtype` (the autocast dtype, or the weight's), exactly as the model's own
    head would under the same autocast, then upcast, as the reference implementation upcasts its logits.
    """

    @staticmethod
    @torch.profiler.record_function("fused head forward")
    def forward(ctx, hidden, weight, bias, rows, targets, compute_dtype):
        # hidden: [N, H]; weight: [V, H]; bias: [V] or None; rows, targets: [M]. Returns [M] float32.
        step = chunk_rows(weight.shape[0], weight.device)
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(token_logps)
        weight_c, bias_c = cast(weight, compute_dtype), cast(bias, compute_dtype)  # once, not per chunk
        for start in range(0, rows.numel(), step):
            end = start + step
            logits = head_logits(hidden[rows[start:end]], weight_c, bias_c, compute_dtype).float()
            logsumexp[start:end] = torch.logsumexp(logits, dim=-1)
            token_logps[start:end] = logits.gather(-1, targets[start:end, None]).squeeze(-1) - logsumexp[start:end]
        ctx.save_for_backward(hidden, weight, bias, rows, targets, logsumexp)
        ctx.compute_dtype = compute_dtype
        return token_logps

    @staticmethod
    @torch.profiler.record_function("fused head backward")
    def backward(ctx, grad_token_logps):
        hidden, weight, bias, rows, targets, logsumexp = ctx.saved_tensors
        dtype = ctx.compute_dtype
        step = chunk_rows(weight.shape[0], weight.device)
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[2] else None
        )
        weight_c, bias_c = cast(weight, dtype), cast(bias, dtype)  # once, not per chunk
        for start in range(0, rows.numel(), step):
            end = start + step
            chunk_hidden = hidden[rows[start:end]].to(dtype)
            softmax = torch.exp(head_logits(chunk_hidden, weight_c, bias_c, dtype).float() - logsumexp[start:end, None])
            grad_logits = log_softmax_grad(softmax, targets[start:end], grad_token_logps[start:end]).to(dtype)
            if grad_hidden is not None:
                grad_hidden.index_add_(0, rows[start:end], (grad_logits @ weight_c).to(hidden.dtype))
            if grad_weight is not None and dtype == torch.float32:
                grad_weight.addmm_(grad_logits.T, chunk_hidden)  # in place: no [V, H] temporary
            elif grad_weight is not None:
                grad_weight += grad_logits.T @ chunk_hidden  # a 16-bit [V, H] product, accumulated in float32
            if grad_bias is not None:
                grad_bias += grad_logits.float().sum(0)
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
        return grad_hidden, grad_weight, grad_bias, None, None, None


def cast(tensor: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(dtype)


def head_logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """hidden @ weight.T + bias in `dtype`; weight and bias already in it."""
    with torch.autocast(hidden.device.type, enabled=False):  # dtypes are explicit here, forward and backward alike
        return torch.nn.functional.linear(hidden.to(dtype), weight, bias)


def token_logps_from_hidden(hidden, weight, bias, rows, targets) -> torch.Tensor:
    """[M] float32 log-probs of `targets` under the LM head applied to hidden[rows], never holding [M, V] logits.

    hidden: [N, H]; weight: [V, H]; bias: [V] or None; rows, targets: [M] (rows may repeat: the last prompt token
    predicts the first token of every response)."""
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    return _ChunkedHeadLogps.apply(hidden, weight, bias, rows, targets, compute_dtype)
