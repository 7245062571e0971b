"""The data report and memory estimate (report.py) and the dry run (build.dry_run): lengths and truncation counted
by hand, the decoded example, and a dry run that loads no weights, writes no run and estimates memory from the
model's shapes."""

import re
import subprocess
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import build
import train
from conftest import TINY_DIR, tiny_run_overrides
from modeling.distributed import Topology
from modeling.precision import decide_precision
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import PreferencePair
from reporting import report


def eight_examples(tokenizer, prompt: str, chosen: str, rejected: str):
    pairs = [PreferencePair(prompt, chosen, rejected, "", "keep_start")] * 8
    return tokenize_pairs(pairs, tokenizer, Tokenization(512, 256, False))


def tiny_model():
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY_DIR))


def test_data_report_gives_length_percentiles_truncation_and_the_tokens(tiny_tokenizer):
    # The tiny tokenizer spells text byte by byte: a text of n characters is n tokens, and each response ends in EOS.
    pairs = [PreferencePair("p" * n, "c" * (n // 10), "r", "", "keep_start") for n in (10, 20, 30)]
    examples = tokenize_pairs(pairs, tiny_tokenizer, Tokenization(max_length=25, max_prompt_length=12, sft=False))
    text = report.data_report(examples.select([0, 1]), examples.select([2]), tiny_tokenizer, 25, 12)
    lines = text.splitlines()
    assert lines[0] == "data report: 2 training and 1 eval examples"
    # inclusive percentiles of 10, 20, 30: p50 20, p90 20 + 0.8 x 10 = 28, p99 29.8
    assert lines[2].split() == ["prompt", "20", "28", "30", "30"]
    assert lines[3].split() == ["chosen", "3", "4", "4", "4"]  # 1, 2, 3 characters + EOS
    assert lines[4].split() == ["rejected", "2", "2", "2", "2"]
    # 30 + 4 tokens exceed max_length=25 (20 + 3 do not): one example was cut
    assert lines[5].startswith("  truncated: 1 of 3 examples")
    eos = tiny_tokenizer.decode([tiny_tokenizer.eos_token_id])
    assert lines[7] == f"    prompt     10 tokens: {'|'.join('p' * 10)}"
    assert lines[8] == f"    chosen      2 tokens: c|{eos}"


def precision_of(config):
    """The run's dtypes as build() decides them, with `auto` compute answered float32."""
    return decide_precision(OmegaConf.to_object(config.model), autocast=True, auto_compute=lambda: None)


@pytest.mark.parametrize("reference_dtype, weights", [("null", torch.float32), ("bfloat16", torch.bfloat16)])
def test_the_estimate_and_the_run_read_reference_dtype_alike(make_config, tiny_tokenizer, reference_dtype, weights):
    # model.reference_dtype has one meaning: null loads the reference in the policy's dtype (float32 here), computing
    # in it; a dtype loads it in that dtype. The dry run's estimate counts the bytes the run's reference holds.
    config = make_config("reference_cache=false", f"model.reference_dtype={reference_dtype}")
    parts = build.build(config, Topology())
    held = sum(p.numel() * p.element_size() for p in parts.reference_model.parameters())
    assert next(parts.reference_model.parameters()).dtype == weights and parts.precision.reference_compute is None
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    policy = build.meta_policy(config, parts.precision, Path(config.local_dirs[0]))
    live = build.live_reference_model(config, needs_reference=True)
    work = report.Workload(config, policy, examples, [list(range(8))], parts.precision, live)
    assert report.memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training["reference weights"] == held


def test_dry_run_reports_and_exits_without_weights_or_a_run(tmp_path, pairs_file, monkeypatch, capsys):
    def no_weights(*args, **kwargs):
        raise AssertionError("a dry run loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setattr(build, "prepare_model", no_weights)
    train.main([*tiny_run_overrides(tmp_path, pairs_file), "dry_run=true", "trainer=FSDPTrainer", "nproc=2"])
    out = capsys.readouterr().out
    assert "loss:\n  name: dpo" in out  # the resolved config
    assert "data report: 40 training and 8 eval examples" in out
    assert "steps: 5 optimizer steps of 8 examples (40 examples)" in out
    assert "memory per rank on 1 machine x 2 CPU processes" in out and "FSDPTrainer dp 2 x tp 1" in out
    assert "\nfits: " in out
    assert not (tmp_path / "run").exists()


def test_dry_run_checks_the_checkpoint_it_would_resume_from(make_config, tmp_path, pairs_file, capsys):
    config = make_config("n_examples=8")
    train.run(config)
    latest = Path(config.local_run_dir) / "LATEST"
    train.main([*tiny_run_overrides(tmp_path, pairs_file), "dry_run=true", "resume_from=auto"])
    assert f"resume: {latest} fits this run" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit:  # the same checkpoint, but not for a LoRA policy
        train.main(
            [*tiny_run_overrides(tmp_path, pairs_file), "dry_run=true", f"resume_from={latest}", "lora.enabled=true"]
        )
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith(f"error: resume_from={latest}: {latest / 'policy'} does not fit")


@pytest.mark.parametrize(
    "overrides, shards, optimizer_states, intermediates",
    [
        ((), 1, 2, 0),  # AdamW, fused by default: updated in place
        (("trainer=FSDPTrainer", "nproc=2"), 2, 2, 0),
        (("optimizer=SGD",), 1, 0, 0),
        (("+optimizer_kwargs.foreach=true",), 1, 2, 1),  # the multi-tensor step: an intermediate per parameter
    ],
)
def test_memory_estimate_counts_the_real_model(
    make_config, tiny_tokenizer, overrides, shards, optimizer_states, intermediates
):
    config = make_config(*overrides)
    model = tiny_model()
    n_parameters = sum(p.numel() for p in model.parameters())
    examples = eight_examples(tiny_tokenizer, "q" * 5, "a" * 3, "b" * 6)
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    work = report.Workload(config, policy, examples, [list(range(8))], precision, False)
    parts = report.memory_plan(work, config.trainer, (shards, 1, 1), on_gpu=False).training
    assert parts["policy weights"] == n_parameters * 4 / shards  # float32
    assert parts["gradients"] == n_parameters * 4 / shards
    assert parts[f"{config.optimizer} state"] == optimizer_states * n_parameters * 4 / shards
    assert parts["optimizer step intermediates"] == intermediates * n_parameters * 4 / shards
    assert parts["reference weights"] == 0  # reference_cache=true: no reference model is held
    micro = 8 // shards  # packed: each example is 5 + (3 + 1) + (6 + 1) = 16 token positions
    hidden, layers = model.config.hidden_size, model.config.num_hidden_layers
    assert parts[f"activations ({16 * micro} token positions)"] == 16 * micro * 34 * hidden * 4 / 2 * layers
    assert parts["attention mask (packed, dense)"] == micro * 16 * 16 * (1 + 4)  # a row of 16 per pair, float32


def test_memory_estimate_counts_a_dense_mask_per_layer_type(make_config, tiny_tokenizer):
    # Sliding-window and full layers each take their own [R, 1, T, T] mask (Gemma 2 and 3, GPT-OSS): twice the bytes.
    config = make_config()
    examples = eight_examples(tiny_tokenizer, "q" * 5, "a" * 3, "b" * 6)
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    masks = []
    for layer_types in (None, ["sliding_attention", "full_attention"]):
        policy.config.layer_types = layer_types
        work = report.Workload(config, policy, examples, [list(range(8))], precision, False)
        masks.append(report.memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training)
    assert [parts["attention mask (packed, dense)"] for parts in masks] == [8 * 16 * 16 * 5, 2 * 8 * 16 * 16 * 5]


def test_tensor_parallel_memory_estimate_counts_the_unfused_step(make_config, tiny_tokenizer):
    # tensor parallelism alone leaves norms and embeddings plain beside the DTensors: torch's default step, not fused
    config = make_config("trainer=TensorParallelTrainer", "nproc=2")
    n_parameters = sum(p.numel() for p in tiny_model().parameters())
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    work = report.Workload(config, policy, examples, [list(range(8))], precision, False)
    plan = report.memory_plan(work, config.trainer, (1, 1, 2), on_gpu=False)
    assert plan.training["optimizer step intermediates"] == n_parameters * 4 / 2


def test_memory_estimate_of_lora_counts_the_adapters(make_config, tiny_tokenizer):
    from modeling.adapters import apply_lora

    config = make_config("lora.enabled=true", "lora.rank=4")
    lora_model = apply_lora(tiny_model(), config.lora)
    trainable = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    work = report.Workload(config, policy, examples, [list(range(8))], precision, False)
    plan = report.memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False)
    assert plan.training["gradients"] == trainable * 4
    assert f"{trainable / 1e6:.2f}M trainable" in plan.header


GIB = 2**30


def tiny_plan(make_config, tiny_tokenizer, *overrides, mesh=(1, 1, 1), on_gpu=False):
    """(the tiny model's Workload on eight 16-token pairs, its memory plan on `mesh`)."""
    config = make_config(*overrides)
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    examples = eight_examples(tiny_tokenizer, "q" * 5, "a" * 3, "b" * 6)
    work = report.Workload(config, policy, examples, [list(range(8))], precision, False)
    return work, report.memory_plan(work, config.trainer, mesh, on_gpu)


@pytest.mark.parametrize("on_gpu", [False, True])
def test_each_moment_of_the_plan_counts_what_a_rank_holds(make_config, tiny_tokenizer, on_gpu):
    # Reading: one weight's shard at a time (FSDP shards each over the data-parallel ranks). Saving: a rank's share of
    # the weights serialised in memory by DCP (after a copy to the host, from a GPU), and the export's whole tensors
    # one at a time. A GPU rank's host holds the larger of the two; a CPU rank's holds its training state too.
    work, plan = tiny_plan(make_config, tiny_tokenizer, "trainer=FSDPTrainer", "nproc=2", mesh=(2, 1, 1), on_gpu=on_gpu)
    largest = max(p.numel() for p in work.policy.parameters()) * 4  # float32
    weights_share = sum(p.numel() for p in work.policy.parameters()) * 4 / 2
    assert plan.load == {"a weight's shard, read at a time": largest / 2}
    assert plan.save == {
        "a checkpoint file, serialised": weights_share * (2 if on_gpu else 1),
        "the export: one whole weight at a time": largest,
    }
    transient = max(largest / 2, weights_share * (2 if on_gpu else 1) + largest)
    assert plan.host_peak() == (transient if on_gpu else sum(plan.training.values()) + transient)


def test_a_plan_fits_or_names_what_is_short(make_config, tiny_tokenizer):
    _, plan = tiny_plan(make_config, tiny_tokenizer, on_gpu=True)
    device, host = plan.device_peak(), plan.host_peak()
    assert plan.fit_problem(report.Hardware(1, 4, device, 4 * host)) is None  # exactly enough
    assert plan.fit_problem(report.Hardware(1, 4, device - 1, None)).startswith(f"a GPU needs {device / GIB:.1f} GiB")
    assert plan.fit_problem(report.Hardware(1, 4, device, 4 * host - 1)).startswith("a node's 4 ranks need")


def test_the_smallest_mesh_fits_and_none_with_a_node_fewer_does(make_config, tiny_tokenizer):
    # GPUs too small for one node of 2 of them: the search names the fewest nodes (then the smallest tensor-parallel
    # size) that fit, and every mesh of fewer nodes does not.
    work, one_node = tiny_plan(
        make_config, tiny_tokenizer, "trainer=FSDPTrainer", "nproc=2", mesh=(2, 1, 1), on_gpu=True
    )
    hardware = report.Hardware(1, 2, one_node.device_peak() * 0.3, None)
    plan, problem = report.fit_verdict(work, hardware, (2, 1, 1))
    assert problem.startswith("this run does not fit 1 node x 2 GPUs of 0 GiB: a GPU needs") and plan is not None
    found = re.search(r"fits: (\d+) nodes? x 2 GPUs .* tensor_parallel_size=(\d)", problem)
    nodes, tp = int(found[1]), int(found[2])

    def fits(n: int, t: int) -> bool:
        candidate = report.memory_plan(work, "FSDPTrainer", (n * 2 // t, 1, t), on_gpu=True)
        return candidate.fit_problem(hardware.with_nodes(n)) is None

    assert fits(nodes, tp) and not any(fits(n, t) for n in range(1, nodes) for t in (1, 2))
    assert tp == 1 or not fits(nodes, 1)


LLAMA_CONFIGS = Path(__file__).parents[1] / "assets" / "configs"


def planned_dry_run(run_main, model: str, nodes: int, *overrides: str) -> subprocess.CompletedProcess:
    """A dry run of an assets/configs model (its config.json alone) planned for nodes x 8 GPUs of 80 GiB."""
    return run_main(
        "dry_run=true", "model=blank_model", f"model.name_or_path={LLAMA_CONFIGS / model}",
        f"model.tokenizer_name_or_path={TINY_DIR}", "trainer=FSDPTrainer", "activation_checkpointing=true",
        f"plan.nodes={nodes}", "plan.gpus_per_node=8", "plan.gpu_memory_gib=80", "plan.host_memory_gib=2048",
        "batch_size=64", "eval_batch_size=64", "eval_every=128", "wandb.enabled=false", *overrides,
    )  # fmt: skip


def test_a_70b_run_is_planned_on_16_gpus_and_a_405b_one_refused_with_the_mesh_it_needs(tmp_path, run_main):
    fits = planned_dry_run(run_main, "llama-3.1-70b", 2, f"local_dirs=[{tmp_path}]")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert (
        "memory per rank on 2 nodes x 8 GPUs of 80 GiB, 2048 GiB of host memory a node (70.55B parameters"
        in fits.stdout
    )
    assert "\nfits: " in fits.stdout
    refused = planned_dry_run(run_main, "llama-3.1-405b", 2, f"local_dirs=[{tmp_path}]")
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this run does not fit 2 nodes x 8 GPUs of 80 GiB")
    assert "the smallest mesh that fits: " in lines[0]


def test_a_run_that_cannot_fit_this_machine_stops_before_reading_a_weight(tmp_path, run_main):
    # Llama-3.1-70B from its config alone (no weights here): one process would need over a terabyte.
    result = run_main(
        "model=blank_model", f"model.name_or_path={LLAMA_CONFIGS / 'llama-3.1-70b'}",
        f"model.tokenizer_name_or_path={TINY_DIR}", "wandb.enabled=false", f"local_dirs=[{tmp_path}]",
        f"local_run_dir={tmp_path / 'run'}", "n_eval_examples=8",
    )  # fmt: skip
    assert result.returncode == 2
    error = result.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: this run does not fit 1 machine x 1 CPU process"), error
    assert "the smallest mesh that fits: " in error[0] or "fits it" in error[0]
