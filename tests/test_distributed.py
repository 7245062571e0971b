"""Many processes (distributed.py): FSDP, tensor parallelism and both on a 2-D mesh, 2 and 4 CPU processes (gloo),
compared with BasicTrainer on the same data; the topology's sharding helpers."""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

from conftest import (
    PADDED_BASELINE,
    PARAMETER_ATOL,
    REPO_ROOT,
    arithmetic_pairs,
    assert_same_metrics,
    assert_same_weights,
    build_trainer,
    read_jsonl,
    run_cli,
    save_tiny_lm,
    tiny_run_overrides,
    wrapped_batch_loss,
    write_jsonl,
)
from modeling.distributed import (
    Topology,
    free_port,
    init_process_group,
    leave_process_group,
    mesh_shape,
    rank_environment,
)
from persistence import checkpoint
from test_async_save import assert_same_run

pytestmark = pytest.mark.xdist_group("processes")  # see pyproject.toml

TORCHRUN = (str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2")


def run_args(run_dir: Path, pairs_file: Path, *overrides: str, nproc: int | None = 2) -> list[str]:
    """train.py's command line for a tiny-model run in run_dir, on nproc workers (None: torchrun's world)."""
    # Gradient norms here run from 2.6 down to 1.2: max_grad_norm=1.5 clips most steps but not all.
    # AdamW's eps at 1e-6: with the default 1e-8, a gradient entry of ~1e-10 moves its weight by ~lr whatever its
    # rounding, so summation order alone could move a weight by a fraction of lr = 1e-3.
    args = [
        *tiny_run_overrides(run_dir.parent, pairs_file),
        f"local_run_dir={run_dir}",
        "distributed_timeout_secs=120",
        "max_grad_norm=1.5",
        "+optimizer_kwargs.eps=1e-6",
        *overrides,
    ]
    return args if nproc is None or "trainer=BasicTrainer" in overrides else [*args, f"nproc={nproc}"]


@pytest.fixture
def launch(run_main):
    """launch(run_dir, pairs_file, *overrides, launcher="spawn", nproc=2): a finished run of train.py. "spawn":
    its main in this process, starting nproc workers (BasicTrainer: none); "torchrun": torchrun starting 2 ranks."""

    def run(run_dir, pairs_file, *overrides: str, launcher: str = "spawn", nproc: int = 2):
        if launcher == "torchrun":
            args = run_args(run_dir, pairs_file, *overrides, nproc=None)
            result = run_cli(*args, launcher=TORCHRUN, env_extra={"OMP_NUM_THREADS": "1"})
        else:
            result = run_main(*run_args(run_dir, pairs_file, *overrides, nproc=nproc))
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    return run


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory):
    """BasicTrainer's run of the tiny fixture in the padded layout, with full logits and a live reference: the run
    every distributed one must reproduce with the default levers."""
    import train

    root = tmp_path_factory.mktemp("basic")
    pairs_file = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    train.main(run_args(root / "run", pairs_file, "trainer=BasicTrainer", *PADDED_BASELINE))
    return root / "run", pairs_file


SAMPLING = ("sample_during_eval=true", "n_eval_model_samples=3", "generation.max_new_tokens=4")


@pytest.mark.parametrize("trainer,launcher", [("FSDPTrainer", "spawn"), ("TensorParallelTrainer", "torchrun")])
def test_distributed_trainer_matches_basic_trainer(basic_run, tmp_path, launch, trainer, launcher):
    # Per-step losses, rewards and gradient norms, every eval, and the final weights, all to ~1e-5, with 2
    # accumulation micro-batches a rank, activation checkpointing, and samples at each eval; either launcher.
    basic_dir, pairs_file = basic_run
    run_dir = tmp_path / "run"
    levers = ("gradient_accumulation_steps=2", "activation_checkpointing=true", *SAMPLING)
    result = launch(run_dir, pairs_file, f"trainer={trainer}", *levers, launcher=launcher)
    assert result.stdout.count("run directory:") == 1  # rank 0 reports for all
    assert_same_metrics(read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(basic_dir, run_dir)
    samples = read_jsonl(run_dir / "samples.jsonl")
    assert [s["step"] for s in samples] == [0] * 3 + [16] * 3 + [32] * 3 + [40] * 3
    assert all(isinstance(s["policy"], str) and isinstance(s["reference"], str) for s in samples)
    # The export is a from_pretrained directory, whatever the trainer.
    assert AutoModelForCausalLM.from_pretrained(run_dir / "LATEST").config.architectures == ["LlamaForCausalLM"]


def test_fsdp_and_tensor_parallel_on_a_2d_mesh_match_basic_trainer_and_reshard_onto_any_mesh(
    basic_run, tmp_path, launch
):
    # 4 processes as 2 data-parallel groups x 2 tensor-parallel ranks: FSDP shards over dp what TP split over tp.
    # Each rank runs 2 accumulation micro-batches of 2 pairs; samples come from both dp groups.
    basic_dir, pairs_file = basic_run
    expected = read_jsonl(basic_dir / "metrics.jsonl")
    mesh = tmp_path / "mesh"
    levers = ("gradient_accumulation_steps=2", *SAMPLING)
    result = launch(mesh, pairs_file, "trainer=FSDPTrainer", "tensor_parallel_size=2", *levers, nproc=4)
    assert "FSDPTrainer x4 (dp 2 x tp 2)" in result.stdout
    assert_same_metrics(expected, read_jsonl(mesh / "metrics.jsonl"))
    assert_same_weights(basic_dir, mesh)
    assert [s["step"] for s in read_jsonl(mesh / "samples.jsonl")] == [0] * 3 + [16] * 3 + [32] * 3 + [40] * 3
    # Every rank writes its shards of the weights and the optimizer state; a run on another mesh reads the slices
    # of them its own shards cover, and ends where the uninterrupted run did: the 2 x 2 run's step-16 resharded onto
    # 4 x 1 (FSDP over all 4 ranks), whose step-32 then resumes on 2 ranks and on one process.
    four = tmp_path / "four"
    launch(four, pairs_file, "trainer=FSDPTrainer", f"resume_from={mesh / 'step-16'}", nproc=4)
    assert_same_metrics([r for r in expected if r["step"] > 16], read_jsonl(four / "metrics.jsonl"))
    assert_same_weights(basic_dir, four)
    assert {p.name for p in (four / "step-32" / "policy").iterdir()} == {
        f"shard-0000{rank}-model-00001-of-00001.safetensors" for rank in (1, 2, 3, 4)
    }
    for name, trainer in (("two", "trainer=FSDPTrainer"), ("one", "trainer=BasicTrainer")):
        launch(tmp_path / name, pairs_file, trainer, f"resume_from={four / 'step-32'}")
        assert_same_metrics([r for r in expected if r["step"] > 32], read_jsonl(tmp_path / name / "metrics.jsonl"))
        assert_same_weights(basic_dir, tmp_path / name)


@pytest.mark.cuda
def test_cpu_offload_on_a_gpu_equals_fsdp_without_it_and_resumes_from_its_host_state(tmp_path, pairs_file, launch):
    # FSDPTrainer on one GPU, its parameters, gradients and AdamW state in pinned host memory: gathered onto the GPU
    # unit by unit, gradients clipped (max_grad_norm=1.5) and AdamW stepping on the host. Every logged number and the
    # final weights equal the same run without offload; its step-16 checkpoint, written from host-resident DTensors,
    # resumed offloaded and on the GPU alone, ends where it did.
    common = ("trainer=FSDPTrainer", "gradient_accumulation_steps=2", "activation_checkpointing=true")
    launch(tmp_path / "gpu", pairs_file, *common, nproc=1)
    result = launch(tmp_path / "offloaded", pairs_file, *common, "fsdp_cpu_offload=true", nproc=1)
    step_16 = tmp_path / "offloaded" / "step-16"
    for name, offload in (("resumed offloaded", "true"), ("resumed on the GPU", "false")):
        launch(tmp_path / name, pairs_file, *common, f"fsdp_cpu_offload={offload}", f"resume_from={step_16}", nproc=1)
    placed = re.search(
        r"fsdp_cpu_offload: (\d+) of (\d+) parameter shards in host memory \((\S+) GiB pinned\)", result.stdout
    )
    assert placed[1] == placed[2] and float(placed[3]) > 0, result.stdout[-2000:]
    expected = read_jsonl(tmp_path / "gpu" / "metrics.jsonl")
    assert_same_metrics(expected, read_jsonl(tmp_path / "offloaded" / "metrics.jsonl"))
    assert_same_weights(tmp_path / "gpu", tmp_path / "offloaded")
    for name in ("resumed offloaded", "resumed on the GPU"):
        assert_same_metrics([r for r in expected if r["step"] > 16], read_jsonl(tmp_path / name / "metrics.jsonl"))
        assert_same_weights(tmp_path / "gpu", tmp_path / name)


def test_a_2d_mesh_resumes_a_basic_trainer_checkpoint(basic_run, tmp_path, launch):
    # BasicTrainer's step-16 checkpoint, broadcast onto 2-D DTensors, ends where the uninterrupted run did.
    basic_dir, pairs_file = basic_run
    resumed = tmp_path / "resumed"
    overrides = ("trainer=FSDPTrainer", "tensor_parallel_size=2", f"resume_from={basic_dir / 'step-16'}")
    launch(resumed, pairs_file, *overrides, nproc=4)
    after_16 = [r for r in read_jsonl(basic_dir / "metrics.jsonl") if r["step"] > 16]
    assert_same_metrics(after_16, read_jsonl(resumed / "metrics.jsonl"))
    assert_same_weights(basic_dir, resumed)


@pytest.mark.parametrize(
    "save_async", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["synchronous", "in-the-background"]
)
def test_a_rank_killed_mid_save_leaves_the_last_checkpoint_whole(
    basic_run, tmp_path, run_main, monkeypatch, save_async
):
    # Rank 1 is killed (SIGKILL) right after writing its weight shards of step-32, before the optimizer state: the
    # half-written directory is never taken for a checkpoint, and the run resumes from step-16 to the same end.
    # The workers load the fault hooks at start-up (tests/faults/sitecustomize.py), from the environment they inherit.
    # With save_async=true rank 1 is killed in its thread that writes, while its training goes on.
    basic_dir, pairs_file = basic_run
    run_dir = tmp_path / "run"
    args = run_args(
        run_dir, pairs_file, "trainer=FSDPTrainer", "resume_from=auto", f"save_async={str(save_async).lower()}"
    )
    fault = {"PYTHONPATH": str(Path(__file__).parent / "faults"), "FAULT": "shards:3", "FAULT_RANK": "1"}
    with monkeypatch.context() as environment:
        for name, value in fault.items():
            environment.setenv(name, value)
        killed = run_main(*args)
    assert killed.returncode != 0 and "rank 1 was killed" in killed.stderr, killed.stderr[-2000:]
    assert checkpoint.describe(run_dir / "step-16") is not None and checkpoint.newest(run_dir) == run_dir / "step-16"
    assert not (run_dir / "step-32").exists() and (run_dir / "step-32.tmp" / "policy").is_dir()
    resumed = run_main(*args)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"resume_from=auto: continuing from {run_dir / 'step-16'}" in resumed.stdout
    assert not (run_dir / "step-32.tmp").exists()
    assert_same_metrics(read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(basic_dir, run_dir)


@pytest.mark.slow  # three runs on 2 processes: ~2 min
def test_checkpoints_written_in_the_background_equal_synchronous_ones_across_processes(basic_run, tmp_path, launch):
    # FSDP on 2 processes, a checkpoint after each step, written synchronously and with save_async=true: the same
    # records and checkpoints, bit for bit (the records without what is measured). The async step-16, resumed by
    # tensor parallelism on 2 processes (its AdamW unfused still: checkpoint.own_implementation), writing in the
    # background too, ends where BasicTrainer did.
    basic_dir, pairs_file = basic_run
    synchronous, in_background, tensor_parallel = tmp_path / "sync", tmp_path / "async", tmp_path / "tp"
    launch(synchronous, pairs_file, "trainer=FSDPTrainer", "save_every=8")
    launch(in_background, pairs_file, "trainer=FSDPTrainer", "save_every=8", "save_async=true")
    assert_same_run(synchronous, in_background, tmp_path)
    resume = (f"resume_from={in_background / 'step-16'}", "save_every=8", "save_async=true")
    launch(tensor_parallel, pairs_file, "trainer=TensorParallelTrainer", *resume)
    expected = [r for r in read_jsonl(basic_dir / "metrics.jsonl") if r["step"] > 16]
    assert_same_metrics(expected, read_jsonl(tensor_parallel / "metrics.jsonl"))
    assert_same_weights(basic_dir, tensor_parallel)
    assert checkpoint.describe(tensor_parallel / "step-32")["step"] == 32


def test_two_machines_train_save_and_resume(basic_run, tmp_path):
    # Two torchrun "nodes" on this machine (--nnodes 2, c10d rendezvous on localhost, one process each, gloo),
    # writing to one shared directory: a run, then a resume of its step-16 checkpoint, both ending where one process
    # did.
    basic_dir, pairs_file = basic_run
    expected = read_jsonl(basic_dir / "metrics.jsonl")
    first, second = tmp_path / "first", tmp_path / "second"
    two_nodes(first, pairs_file)
    assert_same_metrics(expected, read_jsonl(first / "metrics.jsonl"))
    assert_same_weights(basic_dir, first)
    two_nodes(second, pairs_file, f"resume_from={first / 'step-16'}")
    assert_same_metrics([r for r in expected if r["step"] > 16], read_jsonl(second / "metrics.jsonl"))
    assert_same_weights(basic_dir, second)


def two_nodes(run_dir: Path, pairs_file: Path, *overrides: str) -> None:
    """train.py on two torchrun nodes of one process each, rendezvousing on localhost."""
    args = run_args(run_dir, pairs_file, "trainer=FSDPTrainer", *overrides, nproc=None)
    endpoint = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(
            [
                str(Path(sys.executable).with_name("torchrun")),
                "--nnodes",
                "2",
                "--nproc_per_node",
                "1",
                "--node_rank",
                str(node),
                "--rdzv_backend",
                "c10d",
                "--rdzv_endpoint",
                endpoint,
                "--rdzv_id",
                run_dir.name,
                str(REPO_ROOT / "train.py"),
                *args,
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-3000:]
    assert "FSDPTrainer x2 (dp 2 x tp 1)" in outputs[0][0]


def test_fsdp_bfloat16_trains_close_to_float32(basic_run, tmp_path, launch):
    basic_dir, pairs_file = basic_run
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", "model.fsdp_policy_mp=bfloat16")
    float32, bfloat16 = read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    differences = [
        abs(b[name] - f[name]) for f, b in zip(float32, bfloat16) for name in ("loss/train", "loss/eval") if name in f
    ]
    assert all(map(math.isfinite, differences)) and max(differences) < 5e-3
    assert max(differences) > 1e-5  # beyond float32 rounding: the policy really computed in bfloat16
    evals = [r for r in bfloat16 if "loss/eval" in r]
    assert (
        evals[-1]["rewards_eval/accuracies"] > evals[0]["rewards_eval/accuracies"]
        and evals[-1]["rewards_eval/accuracies"] >= 0.75
    )


def fsdp_rank(local_rank: int, port: int, config, check, out_file: Path) -> None:
    """One of 2 FSDPTrainer ranks, built in-process: runs check(trainer, rank) and writes rank 0's result."""
    os.environ.update(rank_environment(local_rank, 2, port))
    torch.set_num_threads(1)
    init_process_group(timeout_secs=60)  # a rank left waiting fails the test within a minute instead of hanging it
    try:
        result = check(build_trainer(config, run_dir=Path(config.local_run_dir)), local_rank)
        if local_rank == 0:
            out_file.write_text(json.dumps(result))
        torch.distributed.barrier()
    finally:
        leave_process_group()


def run_fsdp_ranks(config, check, tmp_path):
    Path(config.local_run_dir).mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.spawn(fsdp_rank, args=(free_port(), config, check, tmp_path / "result.json"), nprocs=2)
    return json.loads((tmp_path / "result.json").read_text())


def sample_unevenly_then_step(trainer, rank: int) -> dict:
    """What one FSDP rank sees: greedy samples of the initial policy with rank 0 generating 8 tokens and rank 1 one
    (rank 1 must keep joining rank 0's sharded forward passes), then one training step recorded micro-batch by
    micro-batch (record_micro_batches)."""
    trainer.config.generation.max_new_tokens = 8 if rank == 0 else 1
    samples = trainer.evaluator.sample(trainer.policy, trainer.reference_model, trainer.example_counter)
    return {"samples": samples, "micro_batches": record_micro_batches(trainer)}


def record_micro_batches(trainer) -> list[tuple[int, bool]]:
    """(pairs in the micro-batch, whether every gradient exists, as this rank's shard) before each micro-batch of one
    step, and after the step's last backward."""
    from torch.distributed.tensor import DTensor

    seen = []

    def record(pairs: int) -> None:
        grads = [p.grad for p in trainer.policy.parameters()]
        sharded = all(isinstance(g, DTensor) and g.to_local().numel() < g.numel() for g in grads if g is not None)
        seen.append((pairs, all(g is not None for g in grads) and sharded))

    recording = lambda examples, *result: (record(len(examples)), result)[1]  # noqa: E731
    trainer.batch_loss = wrapped_batch_loss(trainer.batch_loss, recording)
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda: (record(0), step())[1]
    metrics = trainer.train_step([trainer.data.train_examples[i] for i in trainer.data.schedule[0]])
    assert len(metrics["loss/train"]) == 8  # gathered from both ranks
    return seen


def test_fsdp_samples_uneven_lengths_and_reduces_every_micro_batch_into_sharded_gradients(make_config, tmp_path):
    # Two FSDP ranks built in-process check two things in one launch.
    # Sampling: rank 0 generates 8 tokens and rank 1 one, greedily from the same weights as one process.
    # Accumulation: 8 pairs, 2 ranks, 4 accumulation steps: each rank runs 4 micro-batches of 1 pair. Each backward
    # reduce-scatters at once, so from the second micro-batch on every gradient is this rank's shard (deferring the
    # reduction to the last micro-batch would hold each whole gradient, unsharded, on every rank meanwhile).
    sampling = ("sample_during_eval=true", "n_eval_model_samples=4", "generation.do_sample=false")
    config = make_config("trainer=FSDPTrainer", "gradient_accumulation_steps=4", *sampling)
    seen = run_fsdp_ranks(config, sample_unevenly_then_step, tmp_path)
    assert seen["micro_batches"] == [[1, False]] + [[1, True]] * 3 + [[0, True]]
    single = build_trainer(make_config(*sampling), run_dir=tmp_path / "run")
    examples = [ex for batch in single.data.eval_batches for ex in batch][:4]
    single.config.generation.max_new_tokens = 8
    long = single.evaluator.sample_texts(single.policy, examples)
    single.config.generation.max_new_tokens = 1
    short = single.evaluator.sample_texts(single.policy, examples)
    # Greedy decoding from the same weights: rank 0 had pairs 0-1, rank 1 pairs 2-3.
    assert [s["policy"] for s in seen["samples"]] == long[:2] + short[2:]
    assert [s["reference"] for s in seen["samples"]] == long[:2] + short[2:]


def test_a_stopped_run_lets_go_of_what_it_held():
    # A stop or an error leaves through SystemExit, whose context holds the run's frames: they are cleared, so that
    # run_rank frees the trainer (models, process-group handles) before destroying the process groups.
    import gc
    import weakref

    from modeling.distributed import reported_errors
    from utils import Interrupted

    class Trainer:
        pass

    held = []

    def run():
        trainer = Trainer()
        held.append(weakref.ref(trainer))
        raise Interrupted("stopped", 2)

    with pytest.raises(SystemExit) as exit:
        with reported_errors():
            run()
    gc.collect()
    assert exit.value.code == 130 and held[0]() is None


def test_mesh_shape_of_each_trainer_name():
    assert mesh_shape("BasicTrainer", 1, None) == (1, 1, 1)
    assert mesh_shape("FSDPTrainer", 4, None) == (4, 1, 1)
    assert mesh_shape("FSDPTrainer", 4, 2) == (2, 1, 2)
    assert mesh_shape("FSDPTrainer", 4, 4) == (1, 1, 4)
    assert mesh_shape("TensorParallelTrainer", 4, None) == (1, 1, 4)
    assert mesh_shape("FSDPTrainer", 8, 2, 2) == (2, 2, 2)
    assert mesh_shape("FSDPTrainer", 4, None, 4) == (1, 4, 1)


def test_shards_pad_short_shares_and_micro_batches_cut_them():
    items = list(range(5))
    first, second = Topology(dp_rank=0, dp_size=2), Topology(dp_rank=1, dp_size=2)
    assert first.shard(items) == ([0, 1, 2], 3)
    assert second.shard(items) == ([3, 4, 0], 2)  # padded with items[0]: every rank runs the same forward passes
    assert second.micro_batches(items, batch_size=8, accumulation=2) == ([[3, 4], [0]], 2)
    assert Topology().gather({"x": [1, 2]}) == {"x": [1, 2]} and Topology().broadcast("a") == "a"


@pytest.mark.slow  # 5 two-process runs; the default suite keeps their one-process equivalences (GA == full batch)
@pytest.mark.parametrize(
    "trainer,loss",
    [
        ("FSDPTrainer", "bco_pair"),
        ("TensorParallelTrainer", "simpo"),
        ("FSDPTrainer", "wpo"),
        ("FSDPTrainer", "aot"),
        ("FSDPTrainer", "kto"),
    ],
)
def test_other_losses_match_basic_trainer_across_processes(tmp_path, pairs_file, launch, trainer, loss):
    # bco_pair's running reward mean is folded from the gathered batch: the same on every rank as on one process.
    # simpo reads no reference. wpo reads a second output of the fused head, inside FSDP's root forward. aot sorts
    # the whole batch: each rank's micro-batches see the other rank's pairs, in training and in evals; so does kto's
    # KL estimate, over mismatched examples that cross the ranks' shares.
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", f"loss={loss}")
    launch(tmp_path / "run", pairs_file, f"trainer={trainer}", f"loss={loss}")
    assert_same_metrics(
        read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    )
    assert_same_weights(tmp_path / "basic", tmp_path / "run")


@pytest.mark.slow  # two two-process runs
@pytest.mark.parametrize("trainer", ["FSDPTrainer", "TensorParallelTrainer"])
def test_kto_on_labelled_completions_matches_basic_trainer_across_processes(
    tmp_path, pairs_file, labelled_file, launch, trainer
):
    # unpaired data: each rank's labels, and the KL estimate over mismatched completions of both ranks' shares
    data = (f"datasets=[{labelled_file}]", "loss=kto")
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", *data)
    launch(tmp_path / "run", pairs_file, f"trainer={trainer}", *data)
    basic, run = read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert any(r.get("kl/train", 0) > 0 for r in basic) and "rewards_eval/chosen" in basic[-1]
    assert_same_metrics(basic, run)
    assert_same_weights(tmp_path / "basic", tmp_path / "run")


@pytest.mark.parametrize("trainer", ["FSDPTrainer", pytest.param("TensorParallelTrainer", marks=pytest.mark.slow)])
def test_a_reward_model_matches_basic_trainer_across_processes(tmp_path, pairs_file, launch, trainer):
    # The scalar head reads hidden states inside the root's forward and hands its rewards out as the model's output
    # (heads.head_returns_rewards), where FSDP gathers the root again for the backward; tensor parallelism leaves
    # the head whole. Packed rows, every eval, the final weights and the sequence-classifier export.
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", "loss=reward")
    launch(tmp_path / "run", pairs_file, f"trainer={trainer}", "loss=reward")
    basic, run = read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert basic[-1]["rewards_eval/accuracies"] == 1.0 and "rewards_eval/chosen_std" in basic[-1]
    assert_same_metrics(basic, run)
    assert_same_weights(tmp_path / "basic", tmp_path / "run")
    export = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "LATEST")
    assert export.config.architectures == ["LlamaForSequenceClassification"] and export.config.num_labels == 1


@pytest.mark.slow  # two two-process runs
def test_a_lora_reward_model_matches_basic_trainer_across_processes(tmp_path, pairs_file, launch):
    # peft's trainable copy of the head (modules_to_save) beside the adapters, sharded by FSDP with the root
    lora = ("loss=reward", "lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.dropout=0")
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", *lora)
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", *lora)
    assert_same_metrics(
        read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    )
    assert_same_weights(tmp_path / "basic", tmp_path / "run")


def test_fsdp_lora_matches_basic_trainer_lora(tmp_path, pairs_file, launch):
    # FSDP2 over a peft model (frozen base, trainable adapters in the same blocks), with activation checkpointing.
    lora = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.dropout=0")
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", *lora)
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", "activation_checkpointing=true", *lora)
    assert_same_metrics(
        read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    )
    assert_same_weights(tmp_path / "basic", tmp_path / "run")  # the adapters
    merged = [AutoModelForCausalLM.from_pretrained(tmp_path / name / "LATEST") for name in ("basic", "run")]
    for (name, a), b in zip(merged[0].state_dict().items(), merged[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize(
    "trainer",
    ["FSDPTrainer", pytest.param("TensorParallelTrainer", marks=pytest.mark.slow)],  # slow: two runs more
)
def test_rounds_match_basic_trainer_across_processes(tmp_path, pairs_file, launch, trainer):
    # Iterative rounds (rounds.py) under a sharded policy: each rank samples its share of the prompts (FSDP) or the
    # same rows as its tensor-parallel peer, from seeds of their own, and the reward and the round's file are rank 0's:
    # the same completions, pairs, records and weights as one process.
    rounds = (
        "rounds.n=2",
        "rounds.reward=tests.round_rewards:lowercase_letters",
        "generation.max_new_tokens=8",
        "generation.temperature=1.0",
    )
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", *rounds)
    launch(tmp_path / "run", pairs_file, f"trainer={trainer}", *rounds)
    for index in range(2):
        name = f"round-{index}.jsonl"
        assert read_jsonl(tmp_path / "run" / "rounds" / name) == read_jsonl(tmp_path / "basic" / "rounds" / name)
    basic, run = read_jsonl(tmp_path / "basic" / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["rounds/round"] for r in basic if "rounds/round" in r] == [0, 1, 2]
    assert_same_metrics(basic, run)
    assert_same_weights(tmp_path / "basic", tmp_path / "run")


def test_fsdp_trains_a_mixture_of_experts_with_its_router_loss_as_one_process(tmp_path, pairs_file, launch):
    # The router loss's batch is the whole step over both ranks (core/router_loss.py): each rank's counts are
    # summed before the loss, so 2 ranks reproduce one process step by step and weight by weight, aux_loss included.
    model_dir = save_tiny_lm(tmp_path / "mixtral", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    model = ("model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null", "n_examples=16")
    launch(tmp_path / "basic", pairs_file, *model, "trainer=BasicTrainer")
    launch(tmp_path / "fsdp", pairs_file, *model, "trainer=FSDPTrainer")
    basic = read_jsonl(tmp_path / "basic" / "metrics.jsonl")
    assert sum("aux_loss/train" in r for r in basic) == 2
    assert_same_metrics(basic, read_jsonl(tmp_path / "fsdp" / "metrics.jsonl"))
    assert_same_weights(tmp_path / "basic", tmp_path / "fsdp")


@pytest.mark.slow
def test_a_sliding_window_model_packs_alike_on_one_rank_and_across_processes(tmp_path, pairs_file, launch):
    # A Qwen2 with a 4-token window on its second layer (full attention on its first): packed rows with a mask per
    # layer type, under FSDP and tensor parallelism on 2 ranks, reproduce BasicTrainer's padded run (transformers'
    # own windowed masks, all logits) step by step and weight by weight.
    window = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model_dir = save_tiny_lm(tmp_path / "qwen2-window", "qwen2", **window)
    assert AutoConfig.from_pretrained(model_dir).layer_types == ["full_attention", "sliding_attention"]
    model = ("model=blank_model", f"model.name_or_path={model_dir}", "model.fsdp_policy_mp=null")
    padded = tmp_path / "padded"
    launch(padded, pairs_file, *model, "trainer=BasicTrainer", *PADDED_BASELINE)
    for trainer in ("FSDPTrainer", "TensorParallelTrainer"):
        run_dir = tmp_path / trainer
        result = launch(run_dir, pairs_file, *model, f"trainer={trainer}")
        packed = "scoring: packed layout (dense attention; full_attention full, sliding_attention window 4)"
        assert packed in result.stdout
        assert_same_metrics(read_jsonl(padded / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
        assert_same_weights(padded, run_dir)


@pytest.mark.slow  # three runs, two of them on 2 processes
@pytest.mark.parametrize(
    "adapters", [(), ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lora.dropout=0")], ids=["full", "lora"]
)
def test_a_moving_reference_matches_basic_trainer_across_processes(tmp_path, pairs_file, launch, adapters):
    # TR-DPO (reference_sync_steps): updates after steps 2 and 4 of 5, each FSDP rank mixing its own shards of the
    # reference (a reference model, or LoRA's reference adapter) with the policy's; every logged number, the final
    # policy and the final reference equal one process's. The 2-rank checkpoint after step 3 (the reference moved
    # once) resumes on one process, its reference read from the shards, and ends there too.
    from modeling import weights

    sync = ("reference_sync_steps=2", "reference_mixup_alpha=0.6", "save_every=24", *adapters)
    launch(tmp_path / "basic", pairs_file, "trainer=BasicTrainer", *sync)
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", *sync)
    basic = read_jsonl(tmp_path / "basic" / "metrics.jsonl")
    assert [r["reference/updates"] for r in basic if "reference/updates" in r] == [1, 2]
    assert_same_metrics(basic, read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert_same_weights(tmp_path / "basic", tmp_path / "run")
    references = [weights.full_state(tmp_path / name / "LATEST" / "reference") for name in ("basic", "run")]
    assert references[0] and references[0].keys() == references[1].keys()
    for name, value in references[0].items():
        torch.testing.assert_close(references[1][name], value, rtol=0, atol=PARAMETER_ATOL, msg=name)
    resumed = tmp_path / "resumed"
    launch(resumed, pairs_file, "trainer=BasicTrainer", f"resume_from={tmp_path / 'run' / 'step-24'}", *sync)
    assert_same_metrics([r for r in basic if r["step"] > 24], read_jsonl(resumed / "metrics.jsonl"))
    assert_same_weights(tmp_path / "basic", resumed)


def overflow_on_rank_1_at_step_2(trainer, rank: int) -> dict:
    """Three float16 steps on one FSDP rank, an inf put into one of rank 1's gradient shards at step 2 before the
    scale comes off; the dtypes a normalisation layer's and a linear layer's weights compute in; whether step 2
    left this rank's shards bit-unchanged; the scales after each step."""
    shards = lambda: [p.to_local().detach().clone() for p in trainer.policy.parameters()]  # noqa: E731
    seen, unscale = {"dtypes": set(), "scales": []}, trainer.loss_scale.unscale

    def injecting(optimizer):
        if trainer.batch_counter + 1 == 2:
            seen["before"] = shards()
            if rank == 1:
                next(p for p in trainer.policy.parameters() if p.grad is not None).grad.to_local().view(-1)[0] = (
                    math.inf
                )
        unscale(optimizer)

    trainer.loss_scale.unscale = injecting
    for name, module in trainer.policy.named_modules():
        if name.endswith(("input_layernorm", "self_attn.q_proj")):
            module.register_forward_hook(
                lambda m, args, out: seen["dtypes"].add((type(m).__name__, str(m.weight.dtype)))
            )
    for indices in trainer.data.schedule[:3]:
        trainer.train_step(trainer.data.train_examples.take(indices))
        trainer.batch_counter += 1
        seen["scales"].append(trainer.loss_scale.value)
        if trainer.batch_counter == 2:
            seen["unchanged"] = all(torch.equal(a, b) for a, b in zip(seen.pop("before"), shards()))
    return {"dtypes": sorted(seen["dtypes"]), "scales": seen["scales"], "unchanged": seen["unchanged"]}


def test_fsdp_float16_skips_a_step_that_overflowed_on_one_rank_on_every_rank(make_config, tmp_path):
    # The sharded scaler all-reduces "found inf": an inf in one of rank 1's gradient shards skips step 2 on both
    # ranks (rank 0's shards bit-unchanged too) and halves the scale on both. Normalisation layers gather and compute
    # in float32 (their own FSDP units), linear layers in float16.
    config = make_config("trainer=FSDPTrainer", "model.fsdp_policy_mp=float16", "loss_scale.init=1024")
    seen = run_fsdp_ranks(config, overflow_on_rank_1_at_step_2, tmp_path)
    assert seen["unchanged"] and seen["scales"] == [1024, 512, 512]
    assert seen["dtypes"] == [["FSDPLlamaRMSNorm", "torch.float32"], ["Linear", "torch.float16"]]


@pytest.mark.parametrize("trainer", ["FSDPTrainer", "TensorParallelTrainer"])
def test_float16_on_two_ranks_trains_close_to_float32(basic_run, tmp_path, launch, trainer):
    # FSDP's float16 mixed precision and tensor parallelism's float16 autocast, each with the sharded scaler
    basic_dir, pairs_file = basic_run
    launch(tmp_path / "run", pairs_file, f"trainer={trainer}", "model.fsdp_policy_mp=float16")
    float32, float16 = read_jsonl(basic_dir / "metrics.jsonl"), read_jsonl(tmp_path / "run" / "metrics.jsonl")
    differences = [
        abs(h[name] - f[name]) for f, h in zip(float32, float16) for name in ("loss/train", "loss/eval") if name in f
    ]
    assert all(map(math.isfinite, differences)) and 1e-6 < max(differences) < 1e-3, differences
    assert [r["loss_scale"] for r in float16 if "loss_scale" in r] == [65536.0] * 5  # no overflow, window 1000


def test_fsdp_float8_starts_at_ln_2_and_trains(basic_run, tmp_path, launch):
    # FSDP2 over the emulated float8 layers (their weights gathered in float32 here: gloo has no float8), the cached
    # reference the converted initial policy's own: step one at ln 2, and the run learns.
    pytest.importorskip("torchao.float8", reason="torchao (requirements-dev.txt) emulates float8 on a CPU")
    _, pairs_file = basic_run
    launch(tmp_path / "run", pairs_file, "trainer=FSDPTrainer", "model.fp8=rowwise")
    train = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss/train" in r]
    assert train[0]["loss/train"] == pytest.approx(math.log(2), abs=1e-6) and train[-1]["loss/train"] < 0.5
