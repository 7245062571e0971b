"""Placement (placement.py): which modules are the blocks, and the tensor-parallel plan read from the model."""

import re

import pytest
import torch

from conftest import TINY_DIR
from modeling.placement import find_blocks, tensor_parallel_plan
from utils import UserError


def test_blocks_come_from_block_name_or_no_split_modules():
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR))
    assert find_blocks(model, "LlamaDecoderLayer") == find_blocks(model, None) == list(model.model.layers)
    with pytest.raises(
        UserError, match=r"model.block_name is null and Sequential declares no _no_split_modules: set model.block_name"
    ):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)


def test_tensor_parallel_plan_needs_a_column_row_split_and_divisible_heads():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, Qwen3Config

    llama = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR))  # 4 query heads, 2 key/value heads
    plan = tensor_parallel_plan(llama, 2, 2, "TensorParallelTrainer")
    assert isinstance(plan["layers.*.self_attn.q_proj"], ColwiseParallel) and isinstance(
        plan["layers.*.mlp.down_proj"], RowwiseParallel
    )
    with pytest.raises(
        UserError, match=r"LlamaForCausalLM has num_key_value_heads=2, not a multiple of the world size 4"
    ):
        tensor_parallel_plan(llama, 4, 4, "TensorParallelTrainer")
    with pytest.raises(
        UserError, match=r"^FSDPTrainer splits .* num_key_value_heads=2, not a multiple of tensor_parallel_size=4$"
    ):
        tensor_parallel_plan(llama, 4, 8, "FSDPTrainer")  # a 2 x 4 mesh
    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=259))
    with pytest.raises(UserError, match=r"GPT2LMHeadModel has no tensor-parallel plan .*; use trainer=FSDPTrainer"):
        tensor_parallel_plan(gpt2, 2, 2, "TensorParallelTrainer")
    qwen3 = AutoModelForCausalLM.from_config(
        Qwen3Config(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=259,
        )
    )
    with pytest.raises(
        UserError,
        match=r"Qwen3ForCausalLM's tensor-parallel plan uses replicated_with_grad_allreduce; "
        r"TensorParallelTrainer implements colwise, rowwise",
    ):
        tensor_parallel_plan(qwen3, 2, 2, "TensorParallelTrainer")


def random_pairs(shapes: list[tuple[int, int, int]], vocab: int) -> list[dict]:
    """Pairs of random token ids, of (prompt, chosen, rejected) lengths."""
    generator = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    return [{"prompt": ids(p), "responses": [ids(a), ids(b)]} for p, a, b in shapes]


def test_compiled_blocks_equal_eager_and_compile_once_for_a_bucket_of_row_lengths(capsys):
    # torch.compile per block (compile_blocks): log-probs and gradients equal eager's to float rounding; packed rows
    # round up to 128 tokens, so that batches of other lengths in one bucket reuse the graph: no new compile
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from core.scoring import Scorer
    from modeling import placement

    torch.manual_seed(0)
    eager = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR)).eval()
    compiled = copy.deepcopy(eager)
    placement.compile_blocks(compiled, "LlamaDecoderLayer")
    scorer = Scorer("packed", "dense", True, 0, torch.device("cpu"), False, row_tokens=128, row_multiple=128)
    start = placement.COMPILED_GRAPHS.count
    for shapes in ([(9, 7, 3), (1, 12, 1), (14, 2, 9)], [(20, 30, 5), (3, 1, 6)]):
        batch = scorer.batch(random_pairs(shapes, eager.config.vocab_size))
        assert batch.input_ids.shape == (1, 128)  # one row of 128 tokens either way
        results = []
        for model in (eager, compiled):
            model.zero_grad()
            logps = scorer(model, batch, None)
            logps.sum().backward()
            results.append((logps, {name: p.grad for name, p in model.named_parameters()}))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-5)
        for name, grad in results[0][1].items():
            torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert placement.COMPILED_GRAPHS.count == start + 1  # one graph for both batches and both blocks
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("compile_blocks: graph")]
    assert len(lines) == 1 and re.fullmatch(
        rf"compile_blocks: graph {start + 1} compiled in \d+\.\d s \(inputs 1x128x64, 64x64, 32x64, 32x64, 1x128x16, "
        r"1x128x16, 1x1x128x128, 64x64, 128x64, 128x64, 64x128\)", lines[0]
    ), lines  # fmt: skip


def test_the_step_levers_auto_leaves_off_are_named_in_one_line():
    # auto is on with CUDA only: on a CPU the levers left to auto are named together, the ones set are not
    from omegaconf import OmegaConf

    from modeling.placement import STEP_LEVERS, levers_off_line

    config = OmegaConf.create({"shape_buckets": "auto", "compile_blocks": "false", "sync_free_steps": "AUTO"})
    line = levers_off_line(config, "cpu")
    assert line.startswith("shape_buckets, sync_free_steps: off (auto turns them on with CUDA only; on a CPU")
    assert levers_off_line(config, "cuda") is None
    assert levers_off_line(OmegaConf.create({key: "true" for key in STEP_LEVERS}), "cpu") is None
