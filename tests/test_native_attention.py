"""The decode steps' CPU attention kernel (generation/native_attention.py, generation/csrc/decode_attention.cpp):
the float64 attention of each row's columns on both of its paths, the static loop's draws through it, its fallback
to SDPA in one line."""

import functools

import pytest
import torch

import test_static_decoding
from generation import native_attention
from generation.decode_attention import grouped_attention
from generation.static_decoding import static_decode
from test_static_decoding import greedy, likely_eos, seeded  # noqa: F401 (likely_eos: the fixture, used by name)

CPU = torch.device("cpu")

# the kernel's paths (the `avx512` parameter): the plain C++ one everywhere, the AVX512-BF16 one where the CPU has it
PATH_IDS = ["generic", "avx512_bf16"]


@pytest.fixture(scope="module")
def kernel():
    """The kernel built once for the session (torch's extension cache; a machine builds it once, under its lock)."""
    assert native_attention.built(), "the native decode attention did not build"


def use_path(avx512: bool) -> bool:
    """The `generic` argument that runs the path; skips where the CPU has no AVX512-BF16."""
    if avx512 and not native_attention.avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16")
    return not avx512


def reference(query, key, value, mask, scale):
    """[R, H, D] float64 attention with each key/value head repeated for its query heads, -inf where masked."""
    heads, groups = query.shape[1], key.shape[1]
    repeat = lambda x: x.double().repeat_interleave(heads // groups, dim=1)  # noqa: E731
    scores = (query.double() @ repeat(key).transpose(-1, -2)) * scale
    return (scores.masked_fill(~mask, -torch.inf).softmax(-1) @ repeat(value))[:, :, 0]


def decode_inputs(dtype, heads, groups, dim, starts, ends, length, generator):
    """(query [R, H, 1, D] as a model's projection gives it, key and value [R, G, L, D] as the cache's views: the
    first L of more reserved columns, mask [R, 1, 1, L] true from each row's start to before its end)."""
    rows = len(starts)
    query = torch.randn(rows, 1, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    cache = torch.randn(2, rows, groups, length + 37, dim, generator=generator).to(dtype)
    columns = torch.arange(length)
    mask = (columns >= torch.tensor(starts)[:, None]) & (columns < torch.tensor(ends)[:, None])
    return query, cache[0, :, :, :length], cache[1, :, :, :length], mask[:, None, None, :]


@pytest.mark.parametrize("avx512", [False, True], ids=PATH_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, groups, dim", [(9, 3, 64), (4, 2, 16), (8, 8, 128), (6, 1, 48)])
def test_the_kernel_is_the_float64_attention_of_each_rows_columns(kernel, avx512, dtype, heads, groups, dim):
    # Rows left-padded (ragged starts, one at a block's edge), one attending a single column, one ending early (as a
    # padded slot's mask does), over 300 columns (five blocks of 64) and 700 (a long row). float32 within 1e-5 of
    # float64 attention; bfloat16 within the output's rounding (2^-8 of the value) of the float64 attention of the
    # same bfloat16 inputs: the products are exact and every sum is float32.
    generic = use_path(avx512)
    generator = torch.Generator().manual_seed(0)
    for length in (300, 700):
        starts = [0, 5, 64, length - 1, 100, length // 2, 1]
        ends = [length, length, length, length, 101, length, length - 3]
        query, key, value, mask = decode_inputs(dtype, heads, groups, dim, starts, ends, length, generator)
        got = native_attention.decode_attention(query, key, value, mask, dim**-0.5, generic=generic)
        expected = reference(query, key, value, mask, dim**-0.5)
        assert got.dtype == dtype and got.shape == (len(starts), heads, dim)
        tolerance = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-6)
        torch.testing.assert_close(got.double(), expected, **tolerance)


@pytest.mark.parametrize("avx512", [False, True], ids=PATH_IDS)
def test_large_scores_and_a_fully_masked_row(kernel, avx512):
    # Scores near 1e4 (exp overflows without the running max) give the float64 softmax; a row that attends nothing
    # gives zeros, not NaN.
    generic = use_path(avx512)
    query, key, value, mask = decode_inputs(torch.float32, 4, 2, 32, [0, 3], [200, 90], 200, torch.Generator())
    query = query * 100
    mask[1] = False
    got = native_attention.decode_attention(query, key, value, mask, 1.0, generic=generic)
    expected = reference(query[:1], key[:1], value[:1], mask[:1], 1.0)
    torch.testing.assert_close(got[:1].double(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[1], torch.zeros_like(got[1]))


@pytest.mark.parametrize("avx512", [False, True], ids=PATH_IDS)
def test_the_static_loop_draws_by_the_kernel_what_sdpa_draws(kernel, likely_eos, monkeypatch, avx512):  # noqa: F811
    # float32: token for token, greedy and seeded, the static loop's completions with SDPA, and the log-probs summed
    # while drawing within 1e-6; the kernel ran every decode step.
    generic = use_path(avx512)
    policy, eos, prompts = likely_eos
    args = (30, 256, eos, CPU)
    calls = []
    run = functools.partial(native_attention.decode_attention, generic=generic)
    monkeypatch.setattr(native_attention, "decode_attention", lambda *a: calls.append(1) or run(*a))
    kernel_greedy = static_decode(policy, prompts, greedy, *args)
    kernel_draws = seeded(len(prompts), 30, 0.8)
    kernel_seeded = static_decode(policy, prompts, kernel_draws, *args)
    assert len(calls) >= 2 * 29 and max(map(len, kernel_seeded)) == 30  # two layers a step, 29 decode steps
    monkeypatch.setattr(native_attention, "decode_attention", lambda *a: None)  # SDPA
    assert static_decode(policy, prompts, greedy, *args) == kernel_greedy
    sdpa_draws = seeded(len(prompts), 30, 0.8)
    assert static_decode(policy, prompts, sdpa_draws, *args) == kernel_seeded
    assert len(set(map(len, kernel_seeded))) >= 4  # rows finishing at different steps
    torch.testing.assert_close(kernel_draws.logps[:-1], sdpa_draws.logps[:-1], rtol=0, atol=1e-6)


def test_the_chi_square_check_passes_through_the_kernel(kernel, make_config, monkeypatch, capsys):
    # tests/test_static_decoding.py's exact-sample check (6,000 seeded rows, two temperatures, the first and second
    # tokens against the float64 tempered nucleus), its decode steps' attention the kernel's.
    calls = []
    run = native_attention.decode_attention
    monkeypatch.setattr(native_attention, "decode_attention", lambda *a, **k: calls.append(1) or run(*a, **k))
    test_static_decoding.test_the_static_loops_draws_are_an_exact_sample_of_the_tempered_nucleus(
        make_config, monkeypatch, capsys
    )
    assert calls


@pytest.fixture
def fresh_kernel_state(monkeypatch):
    """The loader's once-a-process state cleared for the test and after it (the kernel loads again from its cache)."""
    monkeypatch.setattr(native_attention, "_said", set())
    native_attention.built.cache_clear()
    yield
    native_attention.built.cache_clear()


def test_a_failed_build_unsupported_inputs_or_cpu_fall_back_to_sdpa_in_one_line(fresh_kernel_state, monkeypatch,
                                                                                capsys):  # fmt: skip
    # A build that fails (the line quotes its compiler's last line), inputs the kernel does not take (float16) and a
    # CPU without AVX512-BF16 each say so once, and grouped_attention gives SDPA's output.
    query, key, value, mask = decode_inputs(torch.float32, 4, 2, 16, [0, 7], [50, 50], 50, torch.Generator())

    def sdpa():
        packed = query.reshape(2, 2, 2, 16)
        output = torch.nn.functional.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=0.25)
        return output.reshape(2, 4, 1, 16).transpose(1, 2)

    def said_once() -> list[str]:
        for _ in range(2):
            assert torch.equal(grouped_attention(None, query, key, value, mask, scaling=0.25)[0], sdpa())
        return capsys.readouterr().out.splitlines()

    def failing_build():
        raise RuntimeError(
            "Error building extension 'dpo_decode_attention': [1/2] c++ -c decode_attention.cpp\n"
            "FAILED: decode_attention.o\nc++: fatal error: no input files\n"
            "ninja: build stopped: subcommand failed.\n"
        )

    build = native_attention.build
    monkeypatch.setattr(native_attention, "build", failing_build)
    assert said_once() == ["decode attention: SDPA, the native CPU kernel did not build: c++: fatal error: no input "
                           "files"]  # fmt: skip
    monkeypatch.setattr(native_attention, "build", build)
    native_attention.built.cache_clear()
    monkeypatch.setattr(native_attention, "avx512_bf16", lambda: False)
    assert said_once() == ["decode attention: SDPA, this CPU has no AVX512-BF16 (the native kernel's fast path)"]
    query, key, value = (x.half() for x in (query, key, value))
    assert said_once() == ["decode attention: SDPA, the native CPU kernel does not take torch.float16 (it takes "
                           "float32 and bfloat16)"]  # fmt: skip
