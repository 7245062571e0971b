"""The data report (reporting/data_report.py), the memory estimate and what reads it (memory_plan.py, fit_check.py,
micro_batches.py) and the dry run (build.dry_run): lengths and truncation counted by hand, the decoded example, a dry
run that loads no weights, writes no run and estimates memory from the model's shapes, and the estimate's activations
against what a training forward keeps (a text model, a VLM's images)."""

import re
import subprocess
import weakref
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf

import build
import config as configuration
import references
import train
from conftest import (
    TINY_DIR,
    colour_rows,
    planned_training_peaks,
    tiny_run_overrides,
    vlm_overrides,
    write_jsonl,
)
from modeling.distributed import Topology
from modeling.precision import decide_precision
from modeling.vision import freeze_vision_tower, vision_projector, vision_tower
from pairs.formats import PreferencePair
from persistence.tokenized import Tokenization, tokenize_pairs
from reporting.data_report import data_report
from reporting.fit_check import fit_verdict
from reporting.hardware import Hardware
from reporting.memory_plan import Workload, memory_plan
from reporting.micro_batches import AUTO_MEMORY_SHARE


def eight_examples(tokenizer, prompt: str, chosen: str, rejected: str):
    pairs = [PreferencePair(prompt, chosen, rejected, "", "keep_start")] * 8
    return tokenize_pairs(pairs, tokenizer, Tokenization(512, 256, False))


def tiny_model():
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY_DIR))


def test_data_report_gives_length_percentiles_truncation_and_the_tokens(tiny_tokenizer):
    # The tiny tokenizer spells text byte by byte: a text of n characters is n tokens, and each response ends in EOS.
    pairs = [PreferencePair("p" * n, "c" * (n // 10), "r", "", "keep_start") for n in (10, 20, 30)]
    examples = tokenize_pairs(pairs, tiny_tokenizer, Tokenization(max_length=25, max_prompt_length=12, sft=False))
    text = data_report(examples.select([0, 1]), examples.select([2]), tiny_tokenizer, 25, 12)
    lines = text.splitlines()
    assert lines[0] == "data report: 2 training and 1 eval examples"
    # inclusive percentiles of 10, 20, 30: p50 20, p90 20 + 0.8 x 10 = 28, p99 29.8
    assert lines[2].split() == ["prompt", "20", "28", "30", "30"]
    assert lines[3].split() == ["chosen", "3", "4", "4", "4"]  # 1, 2, 3 characters + EOS
    assert lines[4].split() == ["rejected", "2", "2", "2", "2"]
    # 30 + 4 tokens exceed max_length=25 (20 + 3 do not): one example was cut
    assert lines[5].startswith("  truncated: 1 of 3 examples")
    # chosen 1 + EOS and 2 + EOS tokens against rejected 1 + EOS: longer in one pair of two, (2/2 + 3/2) / 2 = 1.25x
    assert lines[6] == "  length bias: the chosen response is longer in 50% of training pairs, 1.25x on average"
    eos = tiny_tokenizer.decode([tiny_tokenizer.eos_token_id])
    assert lines[8] == f"    prompt     10 tokens: {'|'.join('p' * 10)}"
    assert lines[9] == f"    chosen      2 tokens: c|{eos}"


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
    live = references.live_reference_model(config, needs_reference=True)
    work = Workload(config, policy, examples, [list(range(8))], parts.precision, live)
    assert memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training["reference weights"] == held


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


def test_the_dry_run_plans_the_micro_batches_that_fill_a_planned_gpu(make_config, tmp_path, pairs_file, capsys):
    # micro_batch_memory=auto on a planned GPU: 80% of its memory, here between the GPU plan's peaks at 4 and 2
    # micro-batches a step; the plan printed after the choice is the chosen micro-batches' (its training total).
    peaks = planned_training_peaks(make_config(), on_gpu=True)
    gpu_gib = (peaks[4] + peaks[2]) / 2 / AUTO_MEMORY_SHARE / 2**30
    planned = ("dry_run=true", "plan.gpus_per_node=1", f"plan.gpu_memory_gib={gpu_gib:.9f}")
    train.main([*tiny_run_overrides(tmp_path, pairs_file), *planned])
    out = capsys.readouterr().out
    choice = out.index("micro-batches: 4 a step of 2 examples a rank (gradient_accumulation_steps=4), at most ")
    assert f"{peaks[4] / 2**30:.3g} GiB of the " in out[choice:].splitlines()[0]
    assert "(micro_batch_memory=auto: 80% of " in out[choice:].splitlines()[0]
    plan = out.index("memory per rank on 1 node x 1 GPU")
    assert choice < plan
    training = re.search(r"GPU while training +([0-9.]+) GiB", out[plan:]).group(1)
    assert training == f"{peaks[4] / 2**30:.2f}"


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
    work = Workload(config, policy, examples, [list(range(8))], precision, False)
    parts = memory_plan(work, config.trainer, (shards, 1, 1), on_gpu=False).training
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
        work = Workload(config, policy, examples, [list(range(8))], precision, False)
        masks.append(memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training)
    assert [parts["attention mask (packed, dense)"] for parts in masks] == [8 * 16 * 16 * 5, 2 * 8 * 16 * 16 * 5]


def test_tensor_parallel_memory_estimate_counts_the_unfused_step(make_config, tiny_tokenizer):
    # tensor parallelism alone leaves norms and embeddings plain beside the DTensors: torch's default step, not fused
    config = make_config("trainer=TensorParallelTrainer", "nproc=2")
    n_parameters = sum(p.numel() for p in tiny_model().parameters())
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    work = Workload(config, policy, examples, [list(range(8))], precision, False)
    plan = memory_plan(work, config.trainer, (1, 1, 2), on_gpu=False)
    assert plan.training["optimizer step intermediates"] == n_parameters * 4 / 2


def test_memory_estimate_of_lora_counts_the_adapters(make_config, tiny_tokenizer):
    from modeling.adapters import apply_lora

    config = make_config("lora.enabled=true", "lora.rank=4")
    lora_model = apply_lora(tiny_model(), config.lora)
    trainable = sum(p.numel() for p in lora_model.parameters() if p.requires_grad)
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    work = Workload(config, policy, examples, [list(range(8))], precision, False)
    plan = memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False)
    assert plan.training["gradients"] == trainable * 4
    assert f"{trainable / 1e6:.2f}M trainable" in plan.header


def kept_for_backward(model: torch.nn.Module, forward) -> dict[str, int]:
    """{part: bytes} of the tensors autograd still keeps for the backward pass once forward() has returned, by the part
    of a vision-language model that saved them ("tower", "projector", or "rest"): each storage once, the parameters'
    not (the plan counts them as weights)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, part = [], ["rest"]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()  # the saved tensor itself would keep a saved output alive through its own grad_fn
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes(), part[0]))
        return tensor

    hooks = []
    for name, module in (("tower", vision_tower(model)), ("projector", vision_projector(model))):
        if module is not None:
            hooks.append(module.register_forward_pre_hook(lambda *_, name=name: part.__setitem__(0, name)))
            hooks.append(module.register_forward_hook(lambda *_: part.__setitem__(0, "rest")))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = forward()
    for hook in hooks:
        hook.remove()
    alive = {pointer: (size, where) for ref, pointer, size, where in saved if ref() is not None}
    del output
    parts = ("tower", "projector", "rest")
    return {name: sum(size for size, where in alive.values() if where == name) for name in parts}


def activations_against_kept(config, parts) -> tuple[dict[str, float], dict[str, int]]:
    """(the plan's training terms, kept_for_backward's bytes) for the run's one micro-batch, its forward as training
    runs it."""
    batch = parts.scorer.batch(parts.data.train_examples.take(parts.data.schedule[0]))
    kept = kept_for_backward(parts.policy, lambda: parts.scorer(parts.policy, batch, parts.precision.policy_compute))
    policy = build.meta_policy(config, parts.precision, Path(config.local_dirs[0]))
    work = Workload(config, policy, parts.data.train_examples, parts.data.schedule, parts.precision, False)
    planned = memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training
    trainable = sum(p.numel() * p.element_size() for p in parts.policy.parameters() if p.requires_grad)
    assert planned["gradients"] == trainable  # the dry run's policy trains what the run's does
    activations = sum(
        value
        for name, value in planned.items()
        if name.startswith(("activations", "vision", "attention mask", "full logits"))
    )
    assert 0.5 * sum(kept.values()) <= activations <= sum(kept.values())
    return planned, kept


def test_the_planned_activations_are_a_lower_bound_of_what_a_forward_keeps(make_config, vlm_dir, tmp_path):
    # One micro-batch of 8 pairs (float32 on the CPU, no checkpointing): the plan's activation terms against the bytes
    # autograd keeps for the backward pass once the forward has returned. The plan leaves out what it cannot know
    # from shapes alone (normalisation statistics, a patch embedding's pixels): it is between half and all of what is
    # kept, for the text model and for a VLM whose tower is trained or frozen. A frozen tower keeps nothing; the
    # projector, trained, keeps its inputs.
    text = make_config("n_examples=8")
    planned, kept = activations_against_kept(text, build.build(text, Topology()))
    assert planned["vision tower and projector activations"] == 0 and kept["tower"] == kept["projector"] == 0
    data = write_jsonl(tmp_path / "pairs.jsonl", colour_rows(tmp_path, 16))
    trained = configuration.load(
        vlm_overrides(tmp_path, vlm_dir, data, "n_examples=8", "n_eval_examples=8", "model.freeze_vision=false")
    )
    parts = build.build(trained, Topology())
    for config in (trained, OmegaConf.merge(trained, {"model": {"freeze_vision": True}})):
        if config.model.freeze_vision:
            freeze_vision_tower(parts.policy)  # as build() does: the same run, its tower frozen
        planned, kept = activations_against_kept(config, parts)
        vision = planned["vision tower and projector activations"]
        assert kept["projector"] > 0 and (kept["tower"] > 0) == (not config.model.freeze_vision)
        assert 0.5 * (kept["tower"] + kept["projector"]) <= vision <= kept["tower"] + kept["projector"]
    # padded rows hold a pair's prompt, and encode its images, once for each response
    planned = []
    for layout in ("packed", "padded"):
        config = OmegaConf.merge(trained, {"layout": layout})
        policy = build.meta_policy(config, parts.precision, Path(config.local_dirs[0]))
        work = Workload(config, policy, parts.data.train_examples, parts.data.schedule, parts.precision, False)
        planned.append(memory_plan(work, config.trainer, (1, 1, 1), on_gpu=False).training)
    packed, padded = (terms["vision tower and projector activations"] for terms in planned)
    assert packed > 0 and padded == 2 * packed


GIB = 2**30


def tiny_plan(make_config, tiny_tokenizer, *overrides, mesh=(1, 1, 1), on_gpu=False):
    """(the tiny model's Workload on eight 16-token pairs, its memory plan on `mesh`)."""
    config = make_config(*overrides)
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    examples = eight_examples(tiny_tokenizer, "q" * 5, "a" * 3, "b" * 6)
    work = Workload(config, policy, examples, [list(range(8))], precision, False)
    return work, memory_plan(work, config.trainer, mesh, on_gpu)


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
    assert plan.fit_problem(Hardware(1, 4, device, 4 * host)) is None  # exactly enough
    assert plan.fit_problem(Hardware(1, 4, device - 1, None)).startswith(f"a GPU needs {device / GIB:.1f} GiB")
    assert plan.fit_problem(Hardware(1, 4, device, 4 * host - 1)).startswith("a node's 4 ranks need")


def test_the_smallest_mesh_fits_and_none_with_a_node_fewer_does(make_config, tiny_tokenizer):
    # GPUs too small for one node of 2 of them: the search names the fewest nodes (then the smallest tensor-parallel
    # size) that fit, and every mesh of fewer nodes does not.
    work, one_node = tiny_plan(
        make_config, tiny_tokenizer, "trainer=FSDPTrainer", "nproc=2", mesh=(2, 1, 1), on_gpu=True
    )
    hardware = Hardware(1, 2, one_node.device_peak() * 0.3, None)
    plan, problem = fit_verdict(work, hardware, (2, 1, 1))
    assert problem.startswith("this run does not fit 1 node x 2 GPUs of 0 GiB: a GPU needs") and plan is not None
    found = re.search(r"fits: (\d+) nodes? x 2 GPUs .* tensor_parallel_size=(\d)", problem)
    nodes, tp = int(found[1]), int(found[2])

    def fits(n: int, t: int) -> bool:
        candidate = memory_plan(work, "FSDPTrainer", (n * 2 // t, 1, t), on_gpu=True)
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


def plan_parts(stdout: str) -> dict[str, float]:
    """The dry run's memory parts, name -> GiB as printed (3 decimals)."""
    found = re.findall(r"^    (\S.*?)\s+(\d+\.\d{3}) GiB$", stdout, flags=re.MULTILINE)
    return {name: float(value) for name, value in found}


def test_a_70b_run_fits_one_node_with_cpu_offload_and_names_16_gpus_without(tmp_path, run_main):
    # Llama-3.1-70B (its config.json): hidden h, 80 layers, an MLP of 28672, 8 KV heads of 128, 128256 tokens, an
    # untied head. Float32 weights, bfloat16 compute, AdamW (fused: no step intermediates), 8 ranks a node (dp 8).
    h, layers, mlp, kv, vocab = 8192, 80, 28672, 8 * 128, 128256
    block = 2 * h * h + 2 * h * kv + 3 * h * mlp + 2 * h  # q, o; k, v; gate, up, down; two norms
    n = layers * block + 2 * vocab * h + h  # + embeddings, head, final norm
    assert n == 70_553_706_496
    # FSDP pins each weight's and gradient's float32 shard (a 1/8 of its rows), rounded up to a power of two bytes:
    # q, o: 2^25 (exact); k, v: 2^22; gate, up, down 117440512 -> 2^27; a norm 2^12; embeddings, head 525336576 -> 2^29
    pinned = layers * (2 * 2**25 + 2 * 2**22 + 3 * 2**27 + 2 * 2**12) + 2 * 2**29 + 2**12
    adamw = 2 * n * 4 / 8  # two float32 states a weight, an 8th a rank

    offloaded = planned_dry_run(run_main, "llama-3.1-70b", 1, f"local_dirs=[{tmp_path}]", "fsdp_cpu_offload=true")
    assert offloaded.returncode == 0, offloaded.stderr[-2000:]
    parts = plan_parts(offloaded.stdout)
    positions = int(re.search(r"activations \((\d+) token positions\)", offloaded.stdout)[1])
    # activation checkpointing: each layer's bfloat16 input kept, one layer's 34 h bytes a token recomputed
    activations = positions * (2 * h * 2 * layers + 34 * h)
    device = {
        "gathered block (FSDP)": 2 * block * 2,  # this block and the next, gathered in bfloat16
        f"activations ({positions} token positions)": activations,
        "two blocks' shards, host <-> device": 2 * block * 4 / 8,
    }
    host = {"policy weights (pinned)": pinned, "gradients (pinned)": pinned, "AdamW state": adamw}
    for name, value in {**device, **host}.items():
        assert parts[name] == round(value / GIB, 3), name
    assert "policy weights" not in parts and "gradients" not in parts  # none of the sharded state is on the GPUs
    # the host's moments besides: saving, a checkpoint file of at most 512 MiB (on the host already: no staging copy)
    # and the export's largest whole weight, the head's; reading, an 8th of it
    save = 2**29 + vocab * h * 4
    assert parts["a checkpoint file, serialised"] == 0.5 and parts["the export: one whole weight at a time"] == 3.914
    assert parts["a weight's shard, read at a time"] == round(vocab * h * 4 / 8 / GIB, 3)
    node = 8 * (sum(host.values()) + save)
    fits = f"fits: {sum(device.values()) / GIB:.1f} GiB a GPU and {node / GIB:.1f} GiB of host memory a node"
    assert fits in offloaded.stdout and round(node / GIB) == 1147  # of the node's 2048

    # Without offload the GPUs hold it all (142.1 GiB each): the smallest mesh is 2 nodes, as before, or offload
    plain = planned_dry_run(run_main, "llama-3.1-70b", 1, f"local_dirs=[{tmp_path}]")
    assert plain.returncode == 2
    # micro_batch_memory=auto finds no micro-batches that fit 80% of a GPU: it leaves them as given, for the fit check
    assert "micro-batches: 1 a step, as given (gradient_accumulation_steps=1): the smallest micro-batches (gradi" in (
        plain.stdout
    )
    line = plain.stderr.strip()
    on_gpu = 4 * n * 4 / 8 + 2 * block * 2 + activations  # weights, gradients, AdamW's two states; block; activations
    assert line.startswith(f"error: this run does not fit 1 node x 8 GPUs of 80 GiB, 2048 GiB of host memory a node: "
                           f"a GPU needs {on_gpu / GIB:.1f} GiB of its 80 GiB")  # fmt: skip
    assert "the smallest mesh that fits: 2 nodes x 8 GPUs of 80 GiB, trainer=FSDPTrainer tensor_parallel_size=1" in line
    assert line.endswith(
        f"; or on these GPUs with fsdp_cpu_offload=true ({sum(device.values()) / GIB:.1f} GiB a GPU, "
        f"{node / GIB:.1f} GiB of host memory a node)"
    )

    # Offloaded onto a host too small for it: the node's ranks need more than it has; 2 nodes halve each rank's share
    short = planned_dry_run(
        run_main, "llama-3.1-70b", 1, f"local_dirs=[{tmp_path}]", "fsdp_cpu_offload=true", "plan.host_memory_gib=1024"
    )
    assert short.returncode == 2
    assert f"a node's 8 ranks need {node / GIB:.1f} GiB of its 1024 GiB of host memory" in short.stderr
    assert "the smallest mesh that fits: 2 nodes x 8 GPUs of 80 GiB" in short.stderr


def test_offload_moves_the_sharded_state_to_the_host_and_keeps_the_rest_on_the_device(make_config, tiny_tokenizer):
    # The tiny model on dp 2 with a live reference: the plan offloaded against the same plan on the GPUs.
    config = make_config("trainer=FSDPTrainer", "nproc=2", "reference_cache=false")
    precision = precision_of(config)
    policy = build.meta_policy(config, precision, Path(config.local_dirs[0]))
    examples = eight_examples(tiny_tokenizer, "q", "a", "b")
    work = Workload(config, policy, examples, [list(range(8))], precision, True)
    on_gpus = memory_plan(work, "FSDPTrainer", (2, 1, 1), on_gpu=True)
    offloaded = memory_plan(work, "FSDPTrainer", (2, 1, 1), on_gpu=True, offload=True)
    moved = ("policy weights", "gradients", "AdamW state", "optimizer step intermediates", "reference weights")
    assert not on_gpus.host_training and "CPU offload" in offloaded.header
    assert {k: v for k, v in on_gpus.training.items() if k not in moved} == {
        k: v for k, v in offloaded.training.items() if k != "two blocks' shards, host <-> device"
    }
    # pinned shards take at least their bytes, and less than twice as many (a power of two above each)
    for name in ("policy weights", "gradients", "reference weights"):
        assert on_gpus.training[name] <= offloaded.host_training[f"{name} (pinned)"] < 2 * on_gpus.training[name]
    assert offloaded.host_training["AdamW state"] == on_gpus.training["AdamW state"]
    assert offloaded.host_peak() == sum(offloaded.host_training.values()) + max(
        sum(offloaded.load.values()), sum(offloaded.save.values())
    )


@pytest.mark.parametrize("overrides", [(), ("lora.enabled=true", "lora.rank=4")], ids=["full", "lora"])
def test_the_plan_counts_the_copy_a_background_save_is_written_from(make_config, tiny_tokenizer, overrides):
    """save_async=true: the host holds a copy of what a checkpoint's collective parts hold (the weights, LoRA's
    adapters only, and AdamW's two moments) while it is written; the plan counts it to the byte, but for AdamW's
    step counts (a 4-byte scalar per parameter)."""
    from conftest import build_trainer
    from modeling import weights
    from persistence import checkpoint_parts as checkpoint

    _, synchronous = tiny_plan(make_config, tiny_tokenizer, *overrides)
    _, plan = tiny_plan(make_config, tiny_tokenizer, "save_async=true", *overrides)
    added = {name: value for name, value in plan.save.items() if name not in synchronous.save}
    trainer = build_trainer(make_config("save_async=true", *overrides))
    parts = trainer.checkpoints.parts
    copies = {name: weights.staged(part.state()) for name, part in parts.items() if checkpoint.collective(part)}
    leaves = torch.utils._pytree.tree_leaves(copies)
    steps = [state["step"] for state in copies["optimizer"]["state"].values()]  # AdamW's, a float32 scalar each
    copied = sum(leaf.nbytes for leaf in leaves if torch.is_tensor(leaf)) - sum(step.nbytes for step in steps)
    assert copies.keys() == {"policy", "optimizer"} and steps and all(step.numel() == 1 for step in steps)
    assert added == {"the copy written in the background (save_async)": copied}
