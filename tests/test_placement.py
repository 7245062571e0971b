"""Placement (placement.py): which modules are the blocks, and the tensor-parallel plan read from the model."""

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
