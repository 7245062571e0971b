import math

import pytest
import torch

import losses
from losses import preference_loss, token_logps_from_logits

IGNORE_INDEX = -100  # labels that are not scored


def log1p_exp(x: float) -> float:
    return math.log(1 + math.exp(x))


# h = (pi_c - pi_r) - (ref_c - ref_r) = (-1 - -3) - (-2 - -2) = 2
POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED = -1.0, -3.0, -2.0, -2.0


def loss_for(**kwargs) -> tuple[float, float, float]:
    tensors = [torch.tensor([v]) for v in (POLICY_CHOSEN, POLICY_REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED)]
    losses, chosen_rewards, rejected_rewards = preference_loss(*tensors, **kwargs)
    return losses.item(), chosen_rewards.item(), rejected_rewards.item()


def test_dpo_closed_form():
    # -log sigmoid(beta h) = log(1 + exp(-beta h)), beta h = 1
    loss, chosen_reward, rejected_reward = loss_for(beta=0.5)
    assert loss == pytest.approx(log1p_exp(-1.0), abs=1e-7)
    assert chosen_reward == pytest.approx(0.5 * (-1 - -2))
    assert rejected_reward == pytest.approx(0.5 * (-3 - -2))


def test_conservative_dpo_closed_form():
    loss, _, _ = loss_for(beta=0.5, label_smoothing=0.25)
    assert loss == pytest.approx(0.75 * log1p_exp(-1.0) + 0.25 * log1p_exp(1.0), abs=1e-7)


def test_label_smoothing_symmetry():
    # Swapping chosen and rejected with eps -> 1 - eps gives the same loss; at eps = 1/2 the order is irrelevant.
    logps = [torch.tensor([v]) for v in (-1.3, -2.9, -2.2, -1.7)]
    swapped = [logps[1], logps[0], logps[3], logps[2]]
    for eps in (0.1, 0.3):
        a = preference_loss(*logps, beta=0.7, label_smoothing=eps)[0]
        b = preference_loss(*swapped, beta=0.7, label_smoothing=1 - eps)[0]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7)
    half = preference_loss(*logps, beta=0.7, label_smoothing=0.5)[0]
    torch.testing.assert_close(half, preference_loss(*swapped, beta=0.7, label_smoothing=0.5)[0], rtol=0, atol=1e-7)
    assert not torch.allclose(preference_loss(*logps, beta=0.7)[0], preference_loss(*swapped, beta=0.7)[0])


def test_ipo_closed_form():
    assert loss_for(beta=0.5, ipo=True)[0] == pytest.approx((2 - 1 / (2 * 0.5)) ** 2)
    assert loss_for(beta=0.1, ipo=True)[0] == pytest.approx((2 - 5) ** 2)


def test_ln2_and_zero_rewards_when_policy_equals_reference():
    logps = torch.tensor([-12.5, -3.25, -40.0])
    other = torch.tensor([-7.0, -9.5, -1.0])
    losses, chosen_rewards, rejected_rewards = preference_loss(logps, other, logps.clone(), other.clone(), beta=0.1)
    torch.testing.assert_close(losses, torch.full((3,), math.log(2)))
    assert chosen_rewards.abs().max() == 0 and rejected_rewards.abs().max() == 0


def test_dpo_gradient_closed_form():
    # d/d pi_c of -log sigmoid(beta h) = -beta sigmoid(-beta h); rewards carry no gradient.
    policy_chosen = torch.tensor([POLICY_CHOSEN], requires_grad=True)
    losses, chosen_rewards, _ = preference_loss(
        policy_chosen,
        torch.tensor([POLICY_REJECTED]),
        torch.tensor([REFERENCE_CHOSEN]),
        torch.tensor([REFERENCE_REJECTED]),
        beta=0.5,
    )
    losses.sum().backward()
    assert policy_chosen.grad.item() == pytest.approx(-0.5 / (1 + math.exp(1.0)), abs=1e-7)
    assert not chosen_rewards.requires_grad


def scored_rows(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(flat positions, targets) of labelled tokens: position t predicts token t + 1."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    rows = (targets.flatten() != IGNORE_INDEX).nonzero().squeeze(-1)
    return rows, targets.flatten()[rows]


def naive_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The reference's computation: upcast all logits, shift, log_softmax, gather, mask, sum."""
    logits = logits[:, :-1].float()
    labels = labels[:, 1:].clone()
    mask = labels != IGNORE_INDEX
    labels[~mask] = 0
    token_logps = logits.log_softmax(-1).gather(2, labels.unsqueeze(2)).squeeze(2)
    return (token_logps * mask).sum(-1)


def chunked_sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    rows, targets = scored_rows(labels)
    token_logps = token_logps_from_logits(logits.flatten(0, 1), rows, targets)
    return torch.zeros(labels.shape[0]).index_add_(0, rows // labels.shape[1], token_logps)


@pytest.fixture
def chunk_rows_of(monkeypatch):
    """Chunks of `rows` rows of a `vocab` vocabulary: many chunks even for small test tensors."""
    return lambda rows, vocab: monkeypatch.setattr(losses, "CHUNK_ELEMENTS", rows * vocab)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [1, 7, 4096])
def test_chunked_logps_match_naive_float32(dtype, rows_per_chunk, chunk_rows_of):
    chunk_rows_of(rows_per_chunk, 50)
    torch.manual_seed(0)
    logits = (torch.randn(4, 9, 50) * 3).to(dtype)
    labels = torch.randint(0, 50, (4, 9))
    labels[:, :3] = IGNORE_INDEX  # prompt
    labels[1, 6:] = IGNORE_INDEX  # padding
    logits_a = logits.clone().requires_grad_()
    logits_b = logits.clone().requires_grad_()
    chunked = chunked_sequence_logps(logits_a, labels)
    naive = naive_sequence_logps(logits_b, labels)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, naive, rtol=0, atol=1e-5)
    weights = torch.randn(4)
    (chunked * weights).sum().backward()
    (naive * weights).sum().backward()
    assert logits_a.grad.dtype == dtype
    torch.testing.assert_close(
        logits_a.grad.float(), logits_b.grad.float(), rtol=1e-6 if dtype == torch.float32 else 1e-2, atol=1e-6
    )


def test_chunked_logps_per_token_precision(chunk_rows_of):
    # Per token, the chunked log-prob equals the naive float32 upcast to 1e-6.
    chunk_rows_of(1, 1000)
    torch.manual_seed(1)
    logits = torch.randn(2, 6, 1000, dtype=torch.bfloat16) * 4
    labels = torch.randint(0, 1000, (2, 6))
    labels[:, :5] = IGNORE_INDEX  # score exactly one token per sequence
    torch.testing.assert_close(
        chunked_sequence_logps(logits, labels), naive_sequence_logps(logits, labels), rtol=0, atol=1e-6
    )


def test_chunked_logps_never_hold_full_float32_logits(chunk_rows_of):
    batch, length, vocab, rows_per_chunk = 4, 16, 300, 8
    chunk_rows_of(rows_per_chunk, vocab)
    logits = torch.randn(batch, length, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, length))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        total = chunked_sequence_logps(logits, labels).sum()
    float32_saved = [t.numel() for t in saved if t.dtype == torch.float32]
    assert max(float32_saved, default=0) < rows_per_chunk * vocab  # the naive upcast saves batch*length*vocab
    total.backward()
    assert logits.grad.shape == logits.shape


def test_chunk_size_is_bounded_in_elements_not_rows():
    assert losses.chunk_rows(2**14) == 1024 and losses.chunk_rows(2**17) == 128
    assert losses.chunk_rows(2**17) * 2**17 == losses.chunk_rows(2**14) * 2**14 == losses.CHUNK_ELEMENTS
    assert losses.chunk_rows(2**30) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_logps_match_head_then_log_softmax(dtype, bias, chunk_rows_of):
    # The fused head equals lm_head(hidden[rows]).float().log_softmax()[targets], in value and in the gradients of
    # hidden, weight and bias, including rows used twice (the last prompt token predicts chosen[0] and rejected[0]).
    chunk_rows_of(3, 40)
    torch.manual_seed(2)
    hidden = torch.randn(6, 16, requires_grad=True)
    head = torch.nn.Linear(16, 40, bias=bias)
    rows = torch.tensor([0, 2, 2, 3, 5, 5, 5, 1])
    targets = torch.randint(0, 40, (8,))
    weights = torch.randn(8)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with autocast:
        fused = losses.token_logps_from_hidden(hidden, head.weight, head.bias, rows, targets)
    (fused * weights).sum().backward()
    fused_grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    with autocast:
        logits = head(hidden)
    naive = logits.float().log_softmax(-1)[rows, targets]
    (naive * weights).sum().backward()
    naive_grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    assert fused.dtype == torch.float32
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, naive, rtol=0, atol=tolerance)
    for a, b in zip(fused_grads, naive_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)


def test_fused_head_never_holds_logits(chunk_rows_of):
    # Nothing of size rows x vocabulary is saved for backward: only hidden, weight and per-row statistics.
    chunk_rows_of(4, 500)
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    rows = torch.arange(64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        total = losses.token_logps_from_hidden(hidden, weight, None, rows, torch.randint(0, 500, (64,))).sum()
    assert max(t.numel() for t in saved) == weight.numel() and all(t.shape != (64, 500) for t in saved)
    total.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
