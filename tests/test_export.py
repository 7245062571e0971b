"""export.py: any checkpoint as a from_pretrained directory, its weights consolidated from the ranks' shards (on one
process or several), equal to the trained ones; LoRA checkpoints merged into their base; one line for bad input."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import train
from conftest import policy_state, run_cli, tiny_run_overrides

TORCHRUN = (str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2")


@pytest.fixture
def run_export(run_main):
    """run_export(*args): `python export.py args`, in this process (one process reads every shard)."""
    return lambda *args: run_main(*args, script="export.py")


def torchrun_export(*args: str):
    """export.py on 2 torchrun ranks, each reading its shards."""
    return run_cli(*args, launcher=TORCHRUN, script="export.py", env_extra={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """A 2-rank FSDP run of the tiny model: every checkpoint is 2 ranks' shards."""
    root = tmp_path_factory.mktemp("fsdp")
    from conftest import arithmetic_pairs, write_jsonl

    pairs = write_jsonl(root / "pairs.jsonl", arithmetic_pairs(48))
    train.main([*tiny_run_overrides(root, pairs), "trainer=FSDPTrainer", "nproc=2"])
    return root / "run"


@pytest.mark.xdist_group("processes")  # see pyproject.toml
@pytest.mark.parametrize("launcher", ["one process", "torchrun, 2 processes"])
def test_a_checkpoint_exports_to_exactly_its_weights(fsdp_run, tmp_path, run_export, launcher):
    out = tmp_path / "exported"
    result = (torchrun_export if "torchrun" in launcher else run_export)(str(fsdp_run / "step-16"), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported {fsdp_run / 'step-16'} to {out}" in result.stdout
    model = AutoModelForCausalLM.from_pretrained(out)
    trained = policy_state(fsdp_run / "step-16")
    assert model.state_dict().keys() == trained.keys()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in trained.items())
    assert AutoTokenizer.from_pretrained(out).eos_token == "<|im_end|>"
    assert not (tmp_path / "exported.tmp").exists()


@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_the_runs_own_export_is_the_same(fsdp_run, tmp_path, run_export):
    # LATEST holds the run's export (the ranks consolidated it); export.py of LATEST writes the same tensors.
    result = run_export(str(fsdp_run / "LATEST"), str(tmp_path / "again"))
    assert result.returncode == 0, result.stderr[-3000:]
    ours, again = (
        AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (fsdp_run / "LATEST", tmp_path / "again")
    )
    assert ours.keys() == again.keys() and all(torch.equal(ours[k], again[k]) for k in ours)
    assert all(torch.equal(ours[k], v) for k, v in policy_state(fsdp_run / "LATEST").items())


@pytest.mark.parametrize("loss", ["dpo", pytest.param("reward", marks=pytest.mark.slow)])
def test_a_lora_checkpoint_exports_its_base_with_the_adapters_merged(tmp_path, pairs_file, run_export, loss):
    # a reward model's base is a sequence classifier, its trained head merged in beside the adapters
    lora = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lr=1e-2", f"loss={loss}")
    train.main([*tiny_run_overrides(tmp_path, pairs_file), *lora])
    run_dir = tmp_path / "run"
    result = run_export(str(run_dir / "LATEST"), str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr[-3000:]
    auto = AutoModelForSequenceClassification if loss == "reward" else AutoModelForCausalLM
    ours, merged = (auto.from_pretrained(d).state_dict() for d in (run_dir / "LATEST", tmp_path / "merged"))
    assert ours.keys() == merged.keys() and all(torch.equal(ours[k], merged[k]) for k in ours)
    assert (tmp_path / "merged" / "adapter" / "adapter_config.json").exists()


def test_a_reference_format_checkpoint_exports_too(make_config, tmp_path, run_export):
    # Written by commit 419e2f5 (a whole policy.pt); its run's config names the model.
    legacy = tmp_path / "run" / "step-16"
    shutil.copytree(Path(__file__).parent / "assets" / "checkpoint-419e2f5" / "step-16", legacy)
    train.prepare_run_dir(make_config(f"local_run_dir={tmp_path / 'run'}"))  # its config.yaml
    result = run_export(str(legacy), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr[-3000:]
    expected = torch.load(legacy / "policy.pt", weights_only=True)["state"]
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert all(torch.equal(exported[name], value) for name, value in expected.items())


@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_bad_exports_are_one_line(fsdp_run, tmp_path, run_export):
    cases = [
        (
            (str(tmp_path / "nowhere"), str(tmp_path / "out")),
            f"error: {tmp_path / 'nowhere'} is not a complete checkpoint",
        ),
        ((str(fsdp_run / "step-16"), str(fsdp_run)), f"error: {fsdp_run} exists already; choose a new directory"),
        ((str(fsdp_run / "step-16"),), "python export.py CHECKPOINT_DIR OUT_DIR"),
    ]
    for args, message in cases:
        result = run_export(*args)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
