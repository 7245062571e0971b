"""Sequence parallelism (modeling/sequence_parallel.py): each rank of an sp group holds a slice of every packed row's
tokens, attention all-to-alls heads for tokens, and the per-sequence sums are summed over the group. On 2 and 4 CPU
processes (gloo), every run reproduces one padded process (transformers' own masks, all logits, a live reference)."""

import re

import pytest
import torch

from conftest import (
    PADDED_BASELINE,
    REPO_ROOT,
    TINY_DIR,
    arithmetic_pairs,
    assert_same_metrics,
    assert_same_weights,
    read_jsonl,
    save_tiny_lm,
    write_jsonl,
)
from core.layouts import pack, segment_lengths, sequence_slice
from test_distributed import SAMPLING, run_args

pytestmark = pytest.mark.xdist_group("processes")  # see pyproject.toml
SLOW = pytest.mark.slow  # two runs, or 4 processes: the default suite keeps sp 2, dp 2 x sp 2 and a windowed Qwen2


@pytest.fixture
def launch(run_main):
    """launch(run_dir, pairs_file, *overrides, nproc=2): a finished run of train.py on nproc workers."""

    def run(run_dir, pairs_file, *overrides: str, nproc: int = 2):
        result = run_main(*run_args(run_dir, pairs_file, *overrides, nproc=nproc))
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    return run


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory):
    """BasicTrainer's padded, full-logits, live-reference run of the tiny fixture: what every sp run reproduces."""
    import train

    root = tmp_path_factory.mktemp("padded")
    pairs_file = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    train.main(run_args(root / "run", pairs_file, "trainer=BasicTrainer", *PADDED_BASELINE))
    return root / "run", pairs_file


def test_every_pair_is_longer_than_a_slice():
    # The packed rows of these runs hold one pair each (dense attention: a row is the longest segment), so with
    # sp = 2 every pair spans both ranks, and attention and the scored tokens cross the slices' boundary.
    lengths = [len(pair["prompt"] + pair["chosen"] + pair["rejected"]) + 2 for pair in arithmetic_pairs(48)]
    assert min(lengths) > -(-max(lengths) // 2)


def test_each_scored_token_is_scored_once_by_the_slice_that_predicts_it():
    # The rank whose slice holds the position predicting a token scores it (a slice's last token predicts the next
    # slice's first), with the hidden state the head reads at that position, the token's id and its place among the
    # batch's scored tokens: every token exactly once over the ranks.
    examples = [
        {"prompt": [1, 2, 3, 4, 5], "responses": [[6, 7, 8], [9, 10, 11, 12]]},
        {"prompt": [1], "responses": [[2, 3, 4, 5, 6, 7], [8]]},
        {"prompt": [3, 4], "responses": [[5, 6, 7, 8, 9], [10, 11]]},
    ]
    batch = pack(examples, 0, row_tokens=12, multiple=4)
    rows, length = batch.input_ids.shape
    assert rows > 1 and max(segment_lengths(examples)) > length // 2  # a segment over several slices
    for size in (2, 4):
        width, seen = length // size, []
        for rank in range(size):
            part = sequence_slice(batch, rank, size)
            assert torch.equal(part.input_ids, batch.input_ids[:, rank * width : (rank + 1) * width])
            assert torch.equal(part.position_ids, batch.position_ids[:, rank * width : (rank + 1) * width])
            columns = part.score_positions % width
            assert torch.equal(part.keep_positions.flatten()[part.score_rows], columns)  # what the head reads
            assert torch.equal(part.score_rows // part.keep_positions.shape[1], part.score_positions // width)
            whole = part.score_positions // width * length + columns + rank * width  # in the whole rows
            assert torch.equal(whole, batch.score_positions[part.score_index])
            assert torch.equal(part.score_targets, batch.score_targets[part.score_index])
            seen += part.score_index.tolist()
        assert sorted(seen) == list(range(batch.score_targets.numel()))
        boundary = batch.score_positions % width == width - 1  # predicts the next slice's first token
        assert boundary.any()


@pytest.mark.parametrize(
    "mesh,nproc",
    [
        pytest.param(("sequence_parallel_size=2",), 2, id="sp2"),
        pytest.param(("sequence_parallel_size=4",), 4, id="sp4", marks=SLOW),
        pytest.param(("sequence_parallel_size=2",), 4, id="dp2xsp2"),
        pytest.param(("sequence_parallel_size=2", "tensor_parallel_size=2"), 4, id="sp2xtp2", marks=SLOW),
    ],
)
def test_sequence_parallel_matches_one_padded_process(padded_run, tmp_path, launch, mesh, nproc):
    # Per-step losses, rewards and gradient norms, every eval, the samples' steps and the final weights: 1e-5 and
    # 5e-6. With 2 accumulation micro-batches a rank, activation checkpointing (each block's forward, attention's
    # all-to-alls included, runs again in the backward pass) and greedy samples at each eval (generation runs the
    # model's own attention). The tiny Llama has 4 query and 2 key-value heads: sp = 4, and sp 2 x tp 2 (1 key-value
    # head a tp rank), replicate the key-value heads.
    padded_dir, pairs_file = padded_run
    run_dir = tmp_path / "run"
    levers = ("gradient_accumulation_steps=2", "activation_checkpointing=true", *SAMPLING)
    result = launch(run_dir, pairs_file, "trainer=FSDPTrainer", *mesh, *levers, nproc=nproc)
    sp = int(mesh[0].split("=")[1])
    tp = 2 if "tensor_parallel_size=2" in mesh else 1
    assert f"FSDPTrainer x{nproc} (dp {nproc // (sp * tp)} x sp {sp} x tp {tp})" in result.stdout
    assert f"each row's tokens over {sp} sequence-parallel ranks" in result.stdout
    assert_same_metrics(read_jsonl(padded_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(padded_dir, run_dir)
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [0] * 3 + [16] * 3 + [32] * 3 + [40] * 3


def test_a_sequence_parallel_checkpoint_resumes_on_one_process_and_on_data_parallel_ranks(padded_run, tmp_path, launch):
    # The sp = 2 run's FSDP shards (over dp x sp) are read back by one process and by 2 data-parallel ranks, each
    # ending where the uninterrupted padded run did.
    padded_dir, pairs_file = padded_run
    expected = read_jsonl(padded_dir / "metrics.jsonl")
    sp = tmp_path / "sp"
    launch(sp, pairs_file, "trainer=FSDPTrainer", "sequence_parallel_size=2")
    assert_same_metrics(expected, read_jsonl(sp / "metrics.jsonl"))
    for name, trainer in (("one", "trainer=BasicTrainer"), ("dp", "trainer=FSDPTrainer")):
        launch(tmp_path / name, pairs_file, trainer, f"resume_from={sp / 'step-16'}")
        assert_same_metrics([r for r in expected if r["step"] > 16], read_jsonl(tmp_path / name / "metrics.jsonl"))
        assert_same_weights(padded_dir, tmp_path / name)


@pytest.mark.parametrize(
    "model_type,window",
    [
        pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1), id="qwen2"),
        pytest.param("gemma2", dict(sliding_window=4, final_logit_softcapping=0.5), id="gemma2", marks=SLOW),
    ],
)
def test_a_sliding_window_model_matches_one_padded_process(tmp_path, pairs_file, launch, model_type, window):
    # A Qwen2 with a 4-token window on its second layer and full attention on its first; a Gemma 2 with a 4-token
    # window on its first, eager attention (its attention scores are soft-capped) and a soft-capped head. Each layer
    # type's mask, whole, reaches its layers on every rank, and windows cross the slices' boundary.
    model_dir = save_tiny_lm(tmp_path / model_type, model_type, **window)
    model = ("model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null")
    launch(tmp_path / "padded", pairs_file, *model, "trainer=BasicTrainer", *PADDED_BASELINE)
    result = launch(tmp_path / "sp", pairs_file, *model, "trainer=FSDPTrainer", "sequence_parallel_size=2")
    assert "full_attention full, sliding_attention window 4" in result.stdout
    padded, sp = read_jsonl(tmp_path / "padded" / "metrics.jsonl"), read_jsonl(tmp_path / "sp" / "metrics.jsonl")
    assert_same_metrics(padded, sp)
    assert_same_weights(tmp_path / "padded", tmp_path / "sp")


@pytest.mark.parametrize("loss", [pytest.param(loss, marks=SLOW) for loss in ("kto", "sft", "wpo")] + ["reward"])
def test_other_losses_match_one_padded_process(tmp_path, pairs_file, launch, loss):
    # kto: the KL estimate over mismatched examples, scored by both ranks of each sp group; sft: one response a
    # segment; wpo: the head's second output (log sum_v p_v^2), summed over the group like the log-probs; reward:
    # each sequence's reward read on the rank whose slice holds its last token.
    launch(tmp_path / "padded", pairs_file, "trainer=BasicTrainer", f"loss={loss}", *PADDED_BASELINE)
    launch(tmp_path / "sp", pairs_file, "trainer=FSDPTrainer", "sequence_parallel_size=2", f"loss={loss}")
    padded, sp = read_jsonl(tmp_path / "padded" / "metrics.jsonl"), read_jsonl(tmp_path / "sp" / "metrics.jsonl")
    assert_same_metrics(padded, sp)
    assert_same_weights(tmp_path / "padded", tmp_path / "sp")


def test_a_65k_token_pair_of_llama7b_fits_8_gpus_of_80_gb_with_sp_8_and_not_without(tmp_path, run_main):
    # The dry run's plan for Llama-7B (its published shapes, assets/configs/llama-7b) on 8 x 80 GB, one pair of 65k
    # tokens a micro-batch: each of 8 sp ranks holds 1/8 of the pair's activations (47 GiB a GPU, fits); 8
    # data-parallel ranks would each hold all of them (285 GiB a GPU, refused).
    pairs = [
        {"prompt": f"reasoning {i} " * 2730 + "A:", "chosen": " yes" * 4095, "rejected": " no!" * 4095}
        for i in range(10)
    ]
    pairs_file = write_jsonl(tmp_path / "long.jsonl", pairs)
    plan = (
        "dry_run=true", "model=llama7b", f"model.name_or_path={REPO_ROOT / 'assets' / 'configs' / 'llama-7b'}",
        f"model.tokenizer_name_or_path={TINY_DIR}", "trainer=FSDPTrainer", "plan.gpus_per_node=8",
        "plan.gpu_memory_gib=80", "plan.host_memory_gib=2048", f"datasets=[{pairs_file}]", "max_length=65536",
        "max_prompt_length=32768", "batch_size=8", "eval_batch_size=8", "eval_every=8", "n_eval_examples=2",
        "wandb.enabled=false", f"local_dirs=[{tmp_path}]",
    )  # fmt: skip
    sequence = run_main(*plan, "sequence_parallel_size=8", "gradient_accumulation_steps=8")
    assert sequence.returncode == 0, sequence.stderr[-2000:]
    assert "FSDPTrainer dp 1 x sp 8 x tp 1; packed layout" in sequence.stdout and "\nfits: " in sequence.stdout
    data = run_main(*plan)
    assert data.returncode == 2
    error = data.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: this run does not fit 1 node x 8 GPUs of 80 GiB")

    def activations(output: str) -> tuple[int, float]:
        found = re.search(r"activations \((\d+) token positions(?: a rank)?\)\s+([\d.]+) GiB", output)
        return int(found[1]), float(found[2])

    (sliced, sliced_bytes), (whole, whole_bytes) = activations(sequence.stdout), activations(data.stdout)
    assert sliced == -(-whole // 8) and sliced_bytes == pytest.approx(whole_bytes / 8, rel=1e-3)


@pytest.mark.parametrize(
    "overrides,line",
    [
        (("trainer=BasicTrainer",), "sequence_parallel_size=2 with BasicTrainer: sequence parallelism is a dimension"),
        (("trainer=TensorParallelTrainer", "nproc=2"), "sequence_parallel_size=2 with TensorParallelTrainer"),
        (("trainer=FSDPTrainer", "nproc=2", "layout=padded"), "layout=padded rows take masks built from a rank's"),
        (("trainer=FSDPTrainer", "nproc=6", "tensor_parallel_size=2"), "x tensor_parallel_size=2 must divide the"),
    ],
)
def test_what_sequence_parallelism_does_not_take_is_one_line(make_config, overrides, line):
    from utils import UserError

    with pytest.raises(UserError, match=re.escape(line)):
        make_config("sequence_parallel_size=2", *overrides)


def test_query_heads_that_do_not_divide_over_the_ranks_are_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    from modeling.sequence_parallel import check_sequence_parallel
    from utils import UserError

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_DIR))  # 4 query heads
    check_sequence_parallel(model, 2, 2)
    check_sequence_parallel(model, 4, 1)
    with pytest.raises(UserError, match="num_attention_heads=4, not a multiple of 8"):
        check_sequence_parallel(model, 4, 2)


def test_the_group_sum_warns_of_nothing_and_has_a_backward(tmp_path):
    # torch.distributed.nn's all_reduce warns that it is deprecated (torch 2.11 and 2.13) at every call, on every sp
    # rank; the group sum is torch.distributed's own all_reduce, with the same all-reduce as its backward.
    import warnings

    from modeling.sequence_parallel import SequenceGroup

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = SequenceGroup(torch.distributed.group.WORLD, size=1, rank=0)
        parts = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            total = group.sum(parts * 2)
            (total * torch.tensor([1.0, 10.0, 100.0])).sum().backward()
    finally:
        torch.distributed.destroy_process_group()
    assert [str(warning.message) for warning in caught] == []
    assert total.tolist() == [2.0, 4.0, 6.0] and parts.grad.tolist() == [2.0, 20.0, 200.0]
