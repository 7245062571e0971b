"""The typed config (config.py): every bad value is one line naming the key."""

import dataclasses
import re

import pytest

import train
from utils import UserError


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["batch_size=6", "gradient_accumulation_steps=4"],
            "batch_size=6 must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = 4",
        ),
        (["eval_batch_size=6", "gradient_accumulation_steps=4"], "eval_batch_size=6 must be a positive multiple"),
        (["eval_every=12"], "eval_every=12 must be a positive multiple of batch_size=8"),
        (["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be positive"),
        (["batch_size=abc"], "batch_size=abc must be an integer"),
        (["loss.beta=abc"], "loss.beta=abc must be a number"),
        (["trainer=Foo"], "unknown trainer 'Foo'; valid: BasicTrainer, FSDPTrainer, TensorParallelTrainer"),
        (
            ["nproc=2"],
            "BasicTrainer runs on one process; for 2 use trainer=FSDPTrainer or trainer=TensorParallelTrainer",
        ),
        (["n_epochs=null"], "set n_epochs or n_examples"),
        (["n_eval_examples=0"], "n_eval_examples=0 must be positive"),
        (["optimizer=Adamm"], "unknown optimizer 'Adamm'; torch.optim has: "),
        (
            ["model.policy_dtype=float64"],
            "model.policy_dtype=float64 is not a dtype; expected one of float32, bfloat16, float16",
        ),
        (
            ["model.policy_dtype=auto"],
            "model.policy_dtype=auto is not a dtype; expected one of float32, bfloat16, float16$",
        ),
        (
            ["model.fsdp_policy_mp=fp8"],
            "model.fsdp_policy_mp=fp8 is not a dtype; expected one of float32, bfloat16, float16, auto",
        ),
        (["layout=ragged"], "layout=ragged is not a layout; expected one of packed, padded"),
        (["reference_cache=maybe"], "reference_cache=maybe must be true or false"),
        (["scored_logits_only=1"], "scored_logits_only=1 must be true or false"),
        (["model=blank_model"], "model.name_or_path must be set"),
        # Silently accepted or a traceback before the typed config:
        (["warmup_steps=-1"], "warmup_steps=-1 must be zero or more"),
        (["lr=-1e-5"], "lr=-1e-05 must be positive"),
        (["n_epochs=0"], "n_epochs=0 must be positive, or null to train by n_examples"),
        (["wandb.enabled=maybe"], "wandb.enabled=maybe must be true or false"),
        (["datasets=[]"], "datasets=[] names no dataset; give at least one, e.g. datasets=[demo]"),
        (["lrr=1e-5"], "unknown key 'lrr' in the config (did you mean 'lr'?); valid: seed, exp_name, batch_size"),
        (
            ["generation.top_k=5"],
            "unknown key 'generation.top_k' in the config (did you mean 'top_p'?); valid: max_new_tokens",
        ),
        (
            ["loss=ipo", "loss.label_smoothing=0.1"],
            "unknown key 'loss.label_smoothing' in loss=ipo; valid: name, beta, nll_weight, length_normalized, "
            "reference_free",
        ),
        (["loss.label_smoothing=0.6"], "loss.label_smoothing=0.6 must be in [0, 0.5]"),
        (["loss=robust", "loss.label_smoothing=0.5"], "loss.label_smoothing=0.5 must be in (0, 0.5)"),
        (["loss=simpo", "loss.length_normalized=true"], "unknown key 'loss.length_normalized' in loss=simpo"),
        (["loss=dpop", "loss.dpop_lambda=-1"], "loss.dpop_lambda=-1.0 must be zero or more"),
        (["loss=cpo", "loss.beta=0"], "loss.beta=0.0 must be positive"),
        (["loss=mpo", "loss.terms.dpo.beta=-1"], "loss.terms.dpo: loss.beta=-1.0 must be positive"),
        (["loss=mpo", "loss.terms.dpo.weight=0"], "loss.terms.dpo.weight=0 must be a positive number"),
        (["loss=mpo", "+loss.terms.sft={weight:1}"], "loss.terms.sft is not a pair loss; valid: dpo, dpo_norm, ipo"),
        (["loss=mpo", "+loss.terms.dpo.gamma=1"], "loss.terms.dpo: Key 'gamma' not in 'DPOConfig'"),
        (["trainer=FSDPtrainer"], "unknown trainer 'FSDPtrainer' (did you mean 'FSDPTrainer'?); valid: BasicTrainer"),
        (["layout=pack"], "layout=pack is not a layout (did you mean 'packed'?); expected one of packed, padded"),
        (
            ["trainer=FSDPTrainer", "nproc=4", "tensor_parallel_size=3"],
            "tensor_parallel_size=3 must be a positive divisor of the world size 4",
        ),
        (
            ["trainer=TensorParallelTrainer", "nproc=4", "tensor_parallel_size=2"],
            "use trainer=FSDPTrainer for data parallel x tensor parallel",
        ),
        (
            ["trainer=FSDPTrainer", "nproc=4", "tensor_parallel_size=2", "batch_size=9"],
            "batch_size=9 must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = 2",
        ),
        (["seed=[1"], "the command line: no viable alternative at input '[1'"),
        (["optimizer_kwargs=3"], "optimizer_kwargs=3 must be a mapping, e.g. {key: value}"),
        (["loss.name=ipo"], "loss.name=ipo names another loss than its keys; choose it with loss=ipo"),
        (
            ["activation_checkpointing=true", "model.block_name=GPT2Block"],
            "model.block_name=GPT2Block matches no module of LlamaForCausalLM; its blocks: LlamaDecoderLayer",
        ),
    ],
)
def test_config_errors(make_config, overrides, message):
    # A trailing $ anchors the message's end; the rest is literal text.
    with pytest.raises(UserError, match=re.escape(message.removesuffix("$")) + ("$" if message.endswith("$") else "")):
        train.run(make_config(*overrides))


def test_a_directory_below_a_regular_file_is_one_line(make_config, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    with pytest.raises(UserError, match=f"local_run_dir={blocker}/run must be a directory, but {blocker} is a file"):
        make_config(f"local_run_dir={blocker / 'run'}")
    with pytest.raises(
        UserError, match=rf"local_dirs\[0\]={blocker}/cache must be a directory, but {blocker} is a file"
    ):
        make_config(f"local_dirs=[{blocker / 'cache'}]")


def test_a_list_key_given_one_value_is_a_one_element_list(make_config, pairs_file):
    assert make_config(f"datasets={pairs_file}").datasets == [str(pairs_file)]
    assert make_config(f"datasets={pairs_file},demo").datasets == [str(pairs_file), "demo"]
    assert make_config(f"datasets=[{pairs_file},demo]").datasets == [str(pairs_file), "demo"]


def test_every_key_of_config_yaml_has_a_type_and_the_schema_no_other(make_config):
    # The schema and config.yaml name the same keys, in the same order (the order "valid:" lists them in).
    from omegaconf import OmegaConf

    from config import CONFIG_DIR, Config

    yaml_keys = [key for key in OmegaConf.load(CONFIG_DIR / "config.yaml") if key != "defaults"]
    assert yaml_keys + ["model", "loss"] == [f.name for f in dataclasses.fields(Config)]


def test_block_attention_without_cuda_is_one_line(make_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=r"^packed_attention=block needs a CUDA GPU: FlexAttention has no backward"):
        make_config("packed_attention=block")
