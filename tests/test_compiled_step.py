"""Compiled blocks over fixed shapes (compile_blocks with shape_buckets): whole blocks (fullgraph), one graph per
bucket, no graph break and no recompile once every bucket was seen (dynamo's own counters), eager's numbers; float16's
loss scale and the fused optimizer through compiled blocks; inductor's cache in the run's directory."""

import copy
import os
import random

import pytest
import torch
from torch._dynamo.utils import counters

from conftest import TINY_DIR, build_trainer
from core.scoring import Scorer
from modeling import placement
from test_fixed_shapes import random_examples


def test_compiled_blocks_compile_once_a_bucket_and_never_again_without_graph_breaks(capsys):
    # static shapes (dynamic=False) over shape buckets: batches of other lengths in a bucket reuse its graph; the
    # second pass over both buckets compiles nothing; log-probs and gradients equal eager's to float rounding
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR)).eval()
    compiled = copy.deepcopy(eager)
    placement.compile_blocks(compiled, "LlamaDecoderLayer", static=True)
    scorer = Scorer("packed", "dense", True, 0, torch.device("cpu"), False, row_multiple=128, buckets=True)
    rng, by_shape = random.Random(0), {}
    while len(by_shape) < 2 or min(map(len, by_shape.values())) < 3:  # three batches in each of two buckets
        batch = scorer.batch(random_examples(rng, rng.choice([3, 6]), eager.config.vocab_size))
        if batch.input_ids.shape[0] > 1:  # torch specialises a size of 1: two such shapes would compile two graphs
            by_shape.setdefault(tuple(batch.input_ids.shape), []).append(batch)  # even under dynamic shapes
    first, second = sorted(by_shape.values(), key=len, reverse=True)[:2]
    batches = [first[0], second[0], first[1], second[1], first[2], second[2]]
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    seen = {}
    for batch in batches:
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            logps = scorer(model, batch, None)
            logps.sum().backward()
            results.append((logps.detach(), [p.grad for p in model.parameters()]))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
        for a, b in zip(results[1][1], results[0][1]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
        seen.setdefault(tuple(batch.input_ids.shape), counters["stats"]["unique_graphs"])
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one graph a bucket, for every block
    assert counters["stats"]["unique_graphs"] == max(seen.values())  # nothing compiled after the first pass
    assert sum(counters["graph_break"].values()) == breaks
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile_blocks: graph")]
    for rows, length in seen:  # each graph static, for its bucket's shape (a dynamic one would show a symbol)
        assert sum(f"(inputs {rows}x{length}x64," in line for line in lines) == 1, lines
    assert not any("dynamic" in line for line in lines), lines


def test_float16_loss_scaling_trains_through_compiled_blocks_and_the_fused_optimizer(make_config, capsys):
    # float16 autocast, the dynamic loss scale, fused AdamW and compiled blocks over buckets together: the compiled
    # run's steps equal eager float16's to float16's rounding, the scale applied and logged; the compile time told
    base = ("model.fsdp_policy_mp=float16", "shape_buckets=true", "max_grad_norm=1e9")
    eager = build_trainer(make_config(*base, "compile_blocks=false"))
    compiled = build_trainer(make_config(*base, "compile_blocks=true", f"local_run_dir={eager.run_dir}_compiled"))
    assert compiled.optimizer.defaults["fused"] and compiled.loss_scale is not None
    for indices in eager.data.schedule[:2]:
        expected, metrics = (t.train_step(eager.data.train_examples.take(indices)) for t in (eager, compiled))
        assert metrics["loss_scale"] == expected["loss_scale"] and metrics["nonfinite_steps"] == [0.0]
        assert metrics["loss/train"] == pytest.approx(expected["loss/train"], abs=2e-3)
    for a, b in zip(eager.policy.parameters(), compiled.policy.parameters()):
        # AdamW moves a weight by about lr whatever its gradient's size: where float16's rounding flips a gradient
        # near 0, the two runs differ by up to 2 lr a step
        assert (b - a).abs().max() <= 2 * 2 * eager.config.lr
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile_blocks: graph")]
    assert lines and all(" compiled in " in line for line in lines), lines


def test_inductor_s_cache_goes_to_the_run_s_cache_directory(monkeypatch, tmp_path):
    # a second run compiles from the cache of the first: inductor's directory in local_dirs, one per CPU limit; a
    # directory the user chose stays
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    placement.inductor_cache(str(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor" / "avx2-none")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    placement.inductor_cache(str(tmp_path))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
