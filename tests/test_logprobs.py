"""Chunked float32 token log-probs (logprobs.py) against the naive float32 computation."""

import pytest
import torch

from core import logprobs
from core.logprobs import token_logps_from_logits

IGNORE_INDEX = -100  # labels that are not scored


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
    return lambda rows, vocab: monkeypatch.setitem(logprobs.CHUNK_ELEMENTS, "cpu", rows * vocab)


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
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert logprobs.chunk_rows(2**14, cpu) == 1024 and logprobs.chunk_rows(2**17, cpu) == 128
    assert logprobs.chunk_rows(2**17, cpu) * 2**17 == logprobs.chunk_rows(2**14, cpu) * 2**14 == 2**24  # 64 MiB
    assert logprobs.chunk_rows(2**30, cpu) == 1
    assert logprobs.chunk_rows(2**17, cuda) == 2048  # a GPU's chunk: 1 GiB of float32 logits


# (scale, cap, temperature) of the head's output map: none, Cohere's scale, Granite's 1 / scaling, Gemma 2's soft
# cap, both; a sampling temperature (the sampled KL's log-probs) alone and after a cap.
LOGIT_MAPS = [(1.0, None, 1.0), (4.0, None, 1.0), (0.25, None, 1.0), (1.0, 0.5, 1.0), (3.0, 2.0, 1.0)]
LOGIT_MAPS += [(1.0, None, 0.7), (3.0, 2.0, 0.25)]


def mapped(logits: torch.Tensor, scale: float, cap: float | None, temperature: float) -> torch.Tensor:
    """The maps as the models write them: logits * scale, then cap * tanh(logits / cap); then a sampler's / T."""
    logits = logits * scale
    return (logits if cap is None else cap * torch.tanh(logits / cap)) / temperature


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows_per_chunk", [3, 4096])
@pytest.mark.parametrize("scale, cap, temperature", LOGIT_MAPS)
def test_fused_head_logps_match_head_then_log_softmax(
    dtype, bias, rows_per_chunk, scale, cap, temperature, chunk_rows_of
):
    # The fused head equals f(lm_head(hidden[rows]).float()).log_softmax()[targets], f the model's map of its
    # logits, in value and in the gradients of hidden, weight and bias, including rows used twice (the last prompt
    # token predicts chosen[0] and rejected[0]); in 3 chunks (two recomputed in the backward, the last kept from the
    # forward) and in one (kept). Logits of about +-3 put a cap of 0.5 deep in tanh's curve.
    chunk_rows_of(rows_per_chunk, 40)
    torch.manual_seed(2)
    hidden = (3 * torch.randn(6, 16)).requires_grad_()
    head = torch.nn.Linear(16, 40, bias=bias)
    rows = torch.tensor([0, 2, 2, 3, 5, 5, 5, 1])
    targets = torch.randint(0, 40, (8,))
    weights = torch.randn(8)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    logit_map = logprobs.LogitMap(scale, cap, temperature)
    with autocast:
        fused = logprobs.token_logps_from_hidden(hidden, head.weight, head.bias, rows, targets, logit_map=logit_map)
    (fused * weights).sum().backward()
    fused_grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    with autocast:
        logits = head(hidden)
    naive = mapped(logits.float(), scale, cap, temperature).log_softmax(-1)[rows, targets]
    (naive * weights).sum().backward()
    naive_grads = [hidden.grad, head.weight.grad] + ([head.bias.grad] if bias else [])
    assert fused.dtype == torch.float32
    # float32: log-probs to an ulp or two (they reach -40 here, where an ulp is 4e-6), gradients to 1e-5.
    tolerance, grad_tolerance = (1e-6, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    torch.testing.assert_close(fused, naive, rtol=tolerance, atol=tolerance)
    for a, b in zip(fused_grads, naive_grads):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=grad_tolerance, atol=grad_tolerance)


def test_fused_head_never_holds_logits(chunk_rows_of):
    # Nothing of size rows x vocabulary is saved for backward: hidden, weight, per-row statistics, and the softmax
    # of one chunk (the last, 4 of the 64 rows here).
    chunk_rows_of(4, 500)
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    rows = torch.arange(64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        total = logprobs.token_logps_from_hidden(hidden, weight, None, rows, torch.randint(0, 500, (64,))).sum()
    assert max(t.numel() for t in saved) == weight.numel()
    assert sorted(t.shape for t in saved if t.shape[-1:] == (500,)) == [(4, 500)]
    total.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape


def test_fused_head_casts_its_weight_once_per_pass(chunk_rows_of):
    # Under bfloat16 autocast the [V, H] float32 weight is cast once in the forward and once in the backward,
    # however many chunks there are (16 here), not once per chunk.
    from torch.utils._python_dispatch import TorchDispatchMode

    class WeightCasts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and is_weight(args[0]):
                WeightCasts.count += 1
            return func(*args, **(kwargs or {}))

    chunk_rows_of(4, 500)
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    is_weight = lambda tensor: tensor.data_ptr() == weight.data_ptr()  # noqa: E731 (the [V, H] gradient is not)
    with WeightCasts(), torch.autocast("cpu", dtype=torch.bfloat16):
        token_logps = logprobs.token_logps_from_hidden(hidden, weight, None, torch.arange(64), torch.zeros(64).long())
    assert WeightCasts.count == 1
    with WeightCasts():
        token_logps.sum().backward()
    assert WeightCasts.count == 2


def test_float32_weight_gradient_is_summed_inside_its_gemm(chunk_rows_of):
    # In float32 each chunk's P^T (g * h) is added to the [V, H] gradient by the GEMM itself (addmm_), so the
    # backward makes one new [V, H] tensor, the sum, however many chunks there are (16 here), not one per chunk.
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewWeightSized(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)]
            new_memory = isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in inputs
            if new_memory and out.shape == weight.shape:  # not in-place, not a view
                NewWeightSized.count += 1
            return out

    chunk_rows_of(4, 500)
    hidden = torch.randn(64, 8, requires_grad=True)
    weight = torch.randn(500, 8, requires_grad=True)
    token_logps = logprobs.token_logps_from_hidden(hidden, weight, None, torch.arange(64), torch.randint(0, 500, (64,)))
    with NewWeightSized():
        token_logps.sum().backward()
    assert NewWeightSized.count == 1


@pytest.mark.parametrize("rows_per_chunk, logits_computed", [(4096, 1), (3, 3 + 2)])
def test_the_last_chunk_of_logits_is_computed_once(chunk_rows_of, rows_per_chunk, logits_computed):
    # The forward keeps its last chunk's softmax for the backward: a micro-batch of one chunk computes its [M, V]
    # logits once (not twice); of three chunks, the backward recomputes two.
    from torch.utils._python_dispatch import TorchDispatchMode

    class LogitProducts(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm) and out.shape[-1] == 40:
                LogitProducts.count += 1
            return out

    chunk_rows_of(rows_per_chunk, 40)
    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    rows, targets = torch.tensor([0, 2, 2, 3, 5, 5, 5, 1]), torch.randint(0, 40, (8,))
    with LogitProducts():
        logprobs.token_logps_from_hidden(hidden, weight, None, rows, targets).sum().backward()
    assert LogitProducts.count == logits_computed


@pytest.mark.parametrize("grad", [False, True])
def test_no_grad_passes_do_not_prepare_the_backward(chunk_rows_of, grad):
    # The reference-cache pass and evals run under no_grad with weights that require grad: the forward then leaves
    # its last chunk's logits as they are (no softmax pass over [C, V] for a backward that never comes): one
    # exponential of the chunk, its logsumexp's, not two.
    from torch.utils._python_dispatch import TorchDispatchMode

    class VocabularyExps(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.exp_.default, torch.ops.aten.exp.default) and args[0].shape[-1] == 40:
                VocabularyExps.count += 1
            return func(*args, **(kwargs or {}))

    chunk_rows_of(4096, 40)
    hidden = torch.randn(6, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    with VocabularyExps(), torch.set_grad_enabled(grad):
        logprobs.token_logps_from_hidden(hidden, weight, None, torch.arange(6), torch.randint(0, 40, (6,)))
    assert VocabularyExps.count == (2 if grad else 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk", [3, 4096])
def test_log_sum_of_squared_probs_comes_with_the_log_probs(dtype, rows_per_chunk, chunk_rows_of):
    # WPO's log sum_v p_v^2 per scored token, from the fused head and from existing logits, equals
    # logsumexp(2 log_softmax(logits.float())), and asking for it changes neither the log-probs nor their gradients.
    chunk_rows_of(rows_per_chunk, 40)
    torch.manual_seed(3)
    hidden = torch.randn(6, 16) * 2
    head = torch.nn.Linear(16, 40)
    rows = torch.tensor([0, 2, 2, 3, 5, 5, 5, 1])
    targets = torch.randint(0, 40, (8,))
    weights = torch.randn(8)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with autocast:
        logits = head(hidden)
    expected = torch.logsumexp(2 * logits.float().log_softmax(-1), dim=-1)[rows]
    assert -3.6 < expected.min() and expected.max() < -0.5  # neither uniform (-log 40 = -3.69) nor one-hot (0)

    def fused(with_sum_sq):
        leaf = hidden.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        with autocast:
            out = logprobs.token_logps_from_hidden(leaf, head.weight, head.bias, rows, targets, with_sum_sq)
        token_logps = out[0] if with_sum_sq else out
        (token_logps * weights).sum().backward()
        return out, [leaf.grad, head.weight.grad, head.bias.grad]

    (token_logps, log_sum_sq), grads = fused(True)
    plain, plain_grads = fused(False)
    assert not log_sum_sq.requires_grad and log_sum_sq.dtype == torch.float32
    torch.testing.assert_close(log_sum_sq, expected, rtol=0, atol=1e-5)
    assert torch.equal(token_logps, plain)
    for a, b in zip(grads, plain_grads):
        assert torch.equal(a, b)
    with_sum_sq, plain = logits.detach().requires_grad_(), logits.detach().requires_grad_()
    token_logps, log_sum_sq = logprobs.token_logps_from_logits(with_sum_sq, rows, targets, with_sum_sq=True)
    torch.testing.assert_close(log_sum_sq, expected, rtol=0, atol=1e-5)
    (token_logps * weights).sum().backward()
    (logprobs.token_logps_from_logits(plain, rows, targets) * weights).sum().backward()
    assert torch.equal(with_sum_sq.grad, plain.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reused_chunk_buffers_give_exactly_what_fresh_tensors_gave(dtype):
    # The head's logits written into reused buffers, and the logsumexp computed in one, equal bit for bit the fresh
    # tensors' (torch.nn.functional.linear's upcast, torch.logsumexp), rows of -inf and of +inf included, and a row
    # spread past exp's subnormal range; a chunk of fewer rows than the buffers reads only its own.
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 16, generator=generator) * 3
    weight, bias = torch.randn(40, 16, generator=generator).to(dtype), torch.randn(40, generator=generator).to(dtype)
    buffers = logprobs.ChunkBuffers(7, 40, dtype, hidden.device)
    for rows in (7, 4):
        for b in (None, bias):
            got = buffers.logits(hidden[:rows], weight, b)
            expected = torch.nn.functional.linear(hidden[:rows].to(dtype), weight, b).float()
            assert got.shape == (rows, 40) and torch.equal(got, expected)
            got[0] = -torch.inf
            got[1, 3] = torch.inf
            got[2] *= 40  # spread past exp's subnormal range: floored at EXP_FLOOR, below the sum's resolution
            assert (got[2] - got[2].max() < logprobs.EXP_FLOOR).sum() > 5
            assert torch.equal(buffers.logsumexp(got), torch.logsumexp(got, dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_chunks_equal_eager_and_compile_once_for_every_row_count(chunk_rows_of, dtype):
    # compile_blocks' head: each chunk's statistics and probabilities in compiled kernels, the logits in the compute
    # dtype (bfloat16 under autocast), a soft cap and a scale applied: log-probs, log sum p^2 and the gradients of
    # hidden, weight and bias equal eager's to float rounding over three chunks (40, 40, 20 rows), in three graphs
    # (the statistics, the probabilities for log sum p^2 and for the backward), dynamic in the rows from the first;
    # a second call of other row counts (40, 30) compiles nothing more
    from torch._dynamo.utils import counters

    chunk_rows_of(40, 64)
    torch.manual_seed(5)
    hidden, head = torch.randn(50, 16) * 3, torch.nn.Linear(16, 64)
    logit_map = logprobs.LogitMap(scale=1.5, cap=4.0)
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)

    def run(rows, targets, compiled):
        leaf = hidden.clone().requires_grad_()
        head.zero_grad(set_to_none=True)
        with autocast:
            token_logps, log_sum_sq = logprobs.token_logps_from_hidden(
                leaf, head.weight, head.bias, rows, targets, True, logit_map, compiled
            )
        (token_logps * torch.linspace(-1, 2, len(rows))).sum().backward()
        return [token_logps, log_sum_sq, leaf.grad, head.weight.grad, head.bias.grad]

    graphs = [counters["stats"]["unique_graphs"]]
    for n_rows in (100, 70):
        rows, targets = torch.randint(0, 50, (n_rows,)), torch.randint(0, 64, (n_rows,))
        for got, want in zip(run(rows, targets, True), run(rows, targets, False)):
            torch.testing.assert_close(got, want, **tolerance)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] - graphs[0] == 3 and graphs[2] == graphs[1]
