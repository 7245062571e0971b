"""Preference losses and the float32 sequence log-probabilities they are computed from.

Shapes: B = pairs in a batch, T = sequence length, V = vocabulary size.
"""
import torch
import torch.nn.functional as F

# Labels equal to this are not scored (prompt and padding positions).
IGNORE_INDEX = -100

# Rows of logits upcast to float32 at once. 1024 rows of a 50k vocabulary is ~200 MB of
# float32, bounded whatever the batch and sequence length.
DEFAULT_CHUNK_ROWS = 1024


class _ChunkedTokenLogps(torch.autograd.Function):
    """log_softmax(logits.float())[row, target] for selected rows, computed chunk by chunk.

    Same values as upcasting the whole [N, V] logits to float32 and taking log_softmax, but
    neither the forward nor the backward ever holds more than `chunk_rows` float32 rows; only
    the per-row logsumexp is kept for backward, which recomputes the softmax chunk by chunk.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        # logits: [N, V] any float dtype; rows, targets: [M] long. Returns [M] float32.
        token_logps = torch.empty(rows.numel(), dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty_like(token_logps)
        for start in range(0, rows.numel(), chunk_rows):
            end = start + chunk_rows
            chunk = logits[rows[start:end]].float()
            logsumexp[start:end] = torch.logsumexp(chunk, dim=-1)
            token_logps[start:end] = chunk.gather(-1, targets[start:end, None]).squeeze(-1) - logsumexp[start:end]
        ctx.save_for_backward(logits, rows, targets, logsumexp)
        ctx.chunk_rows = chunk_rows
        return token_logps

    @staticmethod
    def backward(ctx, grad_token_logps: torch.Tensor):
        logits, rows, targets, logsumexp = ctx.saved_tensors
        grad_logits = torch.zeros_like(logits)
        for start in range(0, rows.numel(), ctx.chunk_rows):
            end = start + ctx.chunk_rows
            grad = grad_token_logps[start:end, None]
            # d log_softmax(x)[y] / dx = onehot(y) - softmax(x)
            softmax = torch.exp(logits[rows[start:end]].float() - logsumexp[start:end, None])
            chunk_grad = (-grad * softmax).scatter_add_(-1, targets[start:end, None], grad)
            grad_logits[rows[start:end]] = chunk_grad.to(logits.dtype)
        return grad_logits, None, None, None


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Summed float32 log-probability of each sequence's labelled tokens.

    Args:
        logits: [B, T, V] in the model's dtype; position t predicts token t + 1.
        labels: [B, T] token ids, IGNORE_INDEX where a token is not scored.
    Returns:
        [B] float32: sum over scored t of log_softmax(logits[:, t - 1].float())[labels[:, t]].
    """
    batch, length, vocab = logits.shape
    # Shift the labels rather than the logits: slicing logits would force a full copy.
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    targets = targets.reshape(-1)
    rows = (targets != IGNORE_INDEX).nonzero().squeeze(-1)
    token_logps = _ChunkedTokenLogps.apply(logits.reshape(-1, vocab), rows, targets[rows], chunk_rows)
    return torch.zeros(batch, dtype=torch.float32, device=logits.device).index_add_(0, rows // length, token_logps)


def preference_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    reference_chosen_logps: torch.Tensor,
    reference_rejected_logps: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and implicit rewards; all inputs and outputs are [B].

    With h = (log pi(y_w) - log pi(y_l)) - (log ref(y_w) - log ref(y_l)):
      DPO (Rafailov et al. 2023, eq. 7):   -log sigmoid(beta * h)
      conservative DPO (Mitchell 2023):    -(1 - eps) log sigmoid(beta * h) - eps log sigmoid(-beta * h),
                                           eps = label_smoothing, the assumed rate of flipped labels
      IPO (Azar et al. 2023, eq. 17):      (h - 1 / (2 beta))^2
    Reference-free DPO passes zeros as the reference log-probs (a uniform reference).
    Rewards are beta * (log pi - log ref), detached: they are metrics, not loss terms.
    """
    logits = (policy_chosen_logps - policy_rejected_logps) - (reference_chosen_logps - reference_rejected_logps)
    if ipo:
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing) - F.logsigmoid(-beta * logits) * label_smoothing
    chosen_rewards = beta * (policy_chosen_logps - reference_chosen_logps).detach()
    rejected_rewards = beta * (policy_rejected_logps - reference_rejected_logps).detach()
    return losses, chosen_rewards, rejected_rewards
