import copy
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

# No test may reach the Hub: a stray lookup costs ~25 s of retries before failing.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "disabled"  # tests that exercise wandb set their own mode
# torch 2.13 reads a kernel it compiled (FlexAttention's, on the CPU) back from its on-disk cache under another
# ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA, and computes wrong values with it (log-probs off by 0.48): the suite
# keeps one cache per setting, so that runs limited to AVX2 (docs/testing.md) and unlimited ones on one machine agree.
limits = "-".join(os.environ.get(name, "none") for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", f"/tmp/torchinductor_{os.getuid()}/{limits}")

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(1, str(Path(__file__).parent / "faults"))  # ballast.fill

import pytest
import torch

# The cores shared out between pytest-xdist's workers (at most 2 threads each: the tiny models gain nothing more)
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))

TINY_DIR = REPO_ROOT / "assets" / "tiny-llama"
# A tiny causal LM of any architecture (tiny_lm_config): 2 layers of width 64 over 300 token ids.
TINY_LM_SIZES = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
HH_TEST_FILE = REPO_ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base" / "test.jsonl.gz"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def arithmetic_pairs(n: int) -> list[dict]:
    """A learnable preference set: the chosen answer is right and polite, the rejected one wrong and rude."""
    return [
        {"prompt": f"Q: {a} + {b}?\nA:", "chosen": f" {a + b}, glad to help.", "rejected": f" {a + b + 3}, go away."}
        for a, b in ((i % 7 + 1, i % 5 + 2) for i in range(n))
    ]


def labelled_completions(n_pairs: int) -> list[dict]:
    """arithmetic_pairs unpaired: each pair's chosen answer desirable, its rejected one not (KTO's data)."""
    rows = []
    for pair in arithmetic_pairs(n_pairs):
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen"], "label": True})
        rows.append({"prompt": pair["prompt"], "completion": pair["rejected"], "label": False})
    return rows


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


@pytest.fixture
def tiny_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY_DIR)


@pytest.fixture
def pairs_file(tmp_path) -> Path:
    return write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(48))


@pytest.fixture
def labelled_file(tmp_path) -> Path:
    """48 labelled completions: 24 pairs unpaired."""
    return write_jsonl(tmp_path / "labelled.jsonl", labelled_completions(24))


def tiny_run_overrides(tmp_path: Path, pairs_file: Path) -> list[str]:
    """A fast tiny-model run in tmp_path: 40 training pairs in 5 steps of 8, evals on 8 held-out pairs."""
    return [
        "model=tiny",
        f"datasets=[{pairs_file}]",
        "wandb.enabled=false",
        f"local_run_dir={tmp_path / 'run'}",
        f"local_dirs=[{tmp_path}]",
        "batch_size=8",
        "eval_batch_size=8",
        "eval_every=16",
        "n_eval_examples=8",
        "n_epochs=1",
        "lr=1e-3",
        "warmup_steps=0",
        "minimum_log_interval_secs=0",
        "plots=false",  # drawing costs ~0.5 s an eval; tests/test_plots.py draws
    ]


@pytest.fixture
def make_config(tmp_path, pairs_file):
    """A checked config (config.load) for a fast tiny-model run in tmp_path; extra Hydra overrides go last."""
    import config

    def make(*overrides: str):
        return config.load(tiny_run_overrides(tmp_path, pairs_file) + list(overrides))

    return make


def build_trainer(config, run_dir=None):
    """A trainer as train.run builds it, without training."""
    import train
    from modeling.distributed import Topology

    run_dir = run_dir or train.prepare_run_dir(config)
    return train.build_trainer(
        config, Topology.create(config.trainer, config.tensor_parallel_size, config.sequence_parallel_size), run_dir
    )


def planned_training_peaks(config, on_gpu: bool = False) -> dict[int, float]:
    """The memory plan's training peak (bytes) of a one-process run at 1, 2, 4 and 8 micro-batches a step, planned
    as build's check_fit plans it (the run's dtypes, data and model shapes) for a CPU or a GPU."""
    import build
    from core.objective import build_objective
    from modeling.distributed import Topology
    from modeling.tokenizers import load_tokenizer
    from reporting.memory_plan import Workload, memory_plan
    from reporting.micro_batches import with_accumulation

    cache_dir = Path(config.local_dirs[0])
    topology = Topology.create(config.trainer, None, 1)
    precision = build.run_precision(config, topology, cache_dir, autocast=True)
    objective = build_objective(config.loss)
    data = build.load_data(config, load_tokenizer(config.model, cache_dir), objective, cache_dir, report=False)
    work = Workload(
        config, build.meta_policy(config, precision, cache_dir), data.train_examples, data.schedule, precision, False
    )
    plans = {k: memory_plan(with_accumulation(work, k), config.trainer, (1, 1, 1), on_gpu) for k in (1, 2, 4, 8)}
    return {k: plan.device_peak() for k, plan in plans.items()}


def records(run_dir, split):
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if f"loss/{split}" in r]


def run_cli(
    *args: str,
    env_extra: dict | None = None,
    timeout: int = 300,
    launcher: tuple[str, ...] = (sys.executable,),
    script: str = "train.py",
) -> subprocess.CompletedProcess:
    """`script args` in a subprocess (with `launcher`, e.g. torchrun), offline; env_extra values of None unset."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", **(env_extra or {})}
    env = {k: v for k, v in env.items() if v is not None}
    return subprocess.run(
        [*launcher, str(REPO_ROOT / script), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def forked_main(args: list[str], env: dict[str, str | None], out: str, err: str) -> None:
    """In a process forked from the warm interpreter (warm_cli): become `python train.py args` started with `env`
    set: its output to the files out and err, and what the interpreter does at start-up that the tests steer (the
    thread count from OMP_NUM_THREADS; the sitecustomize of each PYTHONPATH directory: the fault hooks)."""
    import runpy

    import train

    for name, value in env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(REPO_ROOT)
    for stream, path in ((sys.stdout, out), (sys.stderr, err)):
        stream.flush()
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(file, stream.fileno())
        os.close(file)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    for directory in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        sys.path.insert(0, directory)
        if (Path(directory) / "sitecustomize.py").exists():
            runpy.run_path(str(Path(directory) / "sitecustomize.py"))
    train.main(args)


@pytest.fixture(scope="session")
def warm_cli(tmp_path_factory):
    """warm_cli(*args, env_extra=None) -> CompletedProcess: `python train.py args` (run_cli) in a fresh process,
    forked from an interpreter that has imported train.py and nothing more (multiprocessing's forkserver: it ran no
    torch operation, so a child's OpenMP starts clean). A real process, killed and started again as the crash tests
    need, without ~4 s of imports each time; its own thread count and fault hooks, as a new process would have."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["train", "conftest"])
    scratch = tmp_path_factory.mktemp("warm_cli")

    def run(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
        env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", **(env_extra or {})}
        out, err = scratch / "stdout", scratch / "stderr"
        process = context.Process(target=forked_main, args=(list(args), env, str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.exitcode is None:
            process.kill()
            process.join()
            raise TimeoutError(f"train.py {' '.join(args)} ran past {timeout} s")
        return subprocess.CompletedProcess(["train.py", *args], process.exitcode, out.read_text(), err.read_text())

    return run


@pytest.fixture
def run_main(capfd):
    """run_main(*args, script="train.py"): `python script args` as the script's own main(args) runs it, in this
    process: a CompletedProcess with its exit code and what it printed (workers it starts included). For a command
    line whose subprocess would add nothing but its imports (~4 s of torch and transformers) to what the test
    proves; crashes, signals and environment set before the imports keep their subprocess (run_cli)."""
    import importlib

    def run(*args: str, script: str = "train.py") -> subprocess.CompletedProcess:
        main = importlib.import_module(Path(script).stem).main
        capfd.readouterr()  # what the test printed before is not the command's
        try:
            main(list(args))
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess([script, *args], code, out, err)

    return run


def smollm2_two_steps(tmp_path: Path, *overrides: str, timeout: int) -> tuple[subprocess.CompletedProcess, Path]:
    """The default model (SmolLM2) and data through the CLI, cut to two steps of 8 and evals at 0 and 16 examples;
    (the finished process, the run directory)."""
    run_dir = tmp_path / "run"
    overrides = (f"local_run_dir={run_dir}", f"local_dirs=[{tmp_path}]", "wandb.enabled=false", *overrides)
    return run_cli(*overrides, "n_examples=16", "n_eval_examples=8", "eval_every=16", timeout=timeout), run_dir


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


PADDED_BASELINE = ("layout=padded", "scored_logits_only=false", "reference_cache=false")

MEASURED = "perf/"  # throughput and memory (telemetry.py): measured, not computed, so they differ between runs

# Summation order differs between layouts and ranks; with AdamW's eps at 1e-6 (see launch) the final weights of
# these runs agree to ~7e-7.
PARAMETER_ATOL = 5e-6


def policy_state(checkpoint_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights, whole: its policy/ shards (or a reference-format policy.pt)."""
    from modeling import weights

    if (checkpoint_dir / "policy").is_dir():
        return weights.full_state(checkpoint_dir / "policy")
    return torch.load(checkpoint_dir / "policy.pt", weights_only=True)["state"]


def optimizer_state(checkpoint_dir: Path, scratch: Path) -> dict:
    """A checkpoint's optimizer state, whole (DCP's converter to one torch.save file, in `scratch`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint_dir / "optimizer", scratch / "optimizer.pt")
    return torch.load(scratch / "optimizer.pt", weights_only=True)


def assert_same_weights(expected_dir, actual_dir):
    expected = policy_state(expected_dir / "LATEST")
    actual = policy_state(actual_dir / "LATEST")
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=PARAMETER_ATOL, msg=f"{actual_dir}: {name}")


def assert_same_metrics(expected: list[dict], actual: list[dict]):
    computed = lambda record: sorted(name for name in record if not name.startswith(MEASURED))  # noqa: E731
    assert [computed(r) for r in actual] == [computed(r) for r in expected]
    for e, a in zip(expected, actual):
        for name in computed(e):
            assert a[name] == pytest.approx(e[name], rel=1e-5, abs=1e-5), (e["step"], name)


def assert_resume_matches_uninterrupted(make_config, tmp_path: Path, *overrides: str) -> None:
    """Two epochs run whole (tmp_path/full), and again resumed from the whole run's step-32 checkpoint
    (tmp_path/resumed): every resumed step's loss and the final weights equal the whole run's."""
    import train

    common = ("eval_every=16", "n_epochs=2", *overrides)
    train.run(make_config(f"local_run_dir={tmp_path / 'full'}", *common))
    train.run(
        make_config(f"local_run_dir={tmp_path / 'resumed'}", f"resume_from={tmp_path / 'full' / 'step-32'}", *common)
    )
    full_losses = {r["step"]: r["loss/train"] for r in records(tmp_path / "full", "train")}
    resumed_losses = {r["step"]: r["loss/train"] for r in records(tmp_path / "resumed", "train")}
    assert sorted(resumed_losses) == [40, 48, 56, 64, 72, 80]
    for step, loss in resumed_losses.items():
        assert loss == pytest.approx(full_losses[step], abs=1e-6)
    a = policy_state(tmp_path / "full" / "LATEST")
    b = policy_state(tmp_path / "resumed" / "LATEST")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def tiny_lm_config(model_type: str, **overrides):
    """transformers' config of `model_type` at TINY_LM_SIZES, with `overrides` (head_dim=None: one the config derives
    itself)."""
    import transformers

    sizes = {**TINY_LM_SIZES, **overrides}
    if sizes["head_dim"] is None:
        del sizes["head_dim"]
    return transformers.AutoConfig.for_model(model_type, **sizes)


def save_tiny_lm(directory: Path, model_type: str, **overrides) -> Path:
    """A tiny causal LM of `model_type` (tiny_lm_config, over the tiny tokenizer's ids), random weights from seed 0,
    saved with the tiny tokenizer in `directory`, for runs of model=blank_model model.name_or_path=directory."""
    import transformers

    tiny = transformers.AutoConfig.from_pretrained(TINY_DIR)
    ids = dict(vocab_size=tiny.vocab_size, eos_token_id=tiny.eos_token_id, pad_token_id=tiny.pad_token_id)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_lm_config(model_type, **ids, **overrides)).save_pretrained(
        directory
    )
    transformers.AutoTokenizer.from_pretrained(TINY_DIR).save_pretrained(directory)
    return directory


# A chat template for the tiny vision-language models: each {"type": "image"} part of a message is the processor's
# image placeholder, each {"type": "text"} part its text.
TINY_VLM_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_vlm(directory: Path, family: str = "llava", **text_overrides) -> Path:
    """A tiny vision-language model of `family` (llava, gemma3, idefics3, paligemma) over the tiny tokenizer's ids
    and the family's image tokens: a 2-layer vision tower on 32 x 32 images in 8 x 8 patches and a 2-layer language
    model, random weights from seed 0, saved with its processor (tokenizer, image processor, TINY_VLM_TEMPLATE with
    the family's placeholder) in `directory`. Idefics3 splits each image into tiles of 32 x 32 (a 48 x 48 image: 4
    and a global one)."""
    model, processor = tiny_vlm(family, **text_overrides)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def tiny_vlm(family: str, **text_overrides):
    """(model, processor) of save_tiny_vlm's tiny `family`, in memory, its language model's config changed by
    text_overrides; also qwen2_vl, qwen2_5_vl and llava_onevision, whose processors AutoProcessor cannot load without
    torchvision (their video processors), so they are built here without one."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32)
    tower["patch_size"] = 8

    def text_config(cls, tokenizer, **extra):
        ids = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
        return cls(**{**TINY_LM_SIZES, "vocab_size": len(tokenizer), **ids, **extra, **text_overrides})

    if family == "llava":
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        images = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
        processor = transformers.LlavaProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=TINY_VLM_TEMPLATE,
        )  # fmt: skip
        config = transformers.LlavaConfig(
            vision_config=transformers.CLIPVisionConfig(**tower),
            text_config=text_config(transformers.LlamaConfig, tokenizer),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            vision_feature_select_strategy="default",
        )
    elif family == "gemma3":
        tokens = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR, extra_special_tokens=tokens)
        processor = transformers.Gemma3Processor(
            image_processor=Gemma3ImageProcessorPil(size={"height": 32, "width": 32}), tokenizer=tokenizer,
            image_seq_length=4, chat_template=TINY_VLM_TEMPLATE.replace("<image>", tokens["boi_token"]),
        )  # fmt: skip
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in tokens.items()}
        config = transformers.Gemma3Config(
            # a window that cuts a prompt, and a full layer after it: an image's own attention reaches the answer
            text_config=text_config(
                transformers.Gemma3TextConfig,
                tokenizer,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),  # fmt: skip
            vision_config=transformers.SiglipVisionConfig(**tower),
            mm_tokens_per_image=4,
            boi_token_index=ids["boi_token"],
            eoi_token_index=ids["eoi_token"],
            image_token_index=ids["image_token"],
        )
    elif family == "paligemma":  # PaliGemma 2: a Gemma 2 language model whose prefix (image, BOS, prompt, "\n")
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)  # sees itself both ways
        tokenizer.add_special_tokens({"bos_token": "<bos>"})  # the processor opens the prompt's text with it
        images = SiglipImageProcessorPil(size={"height": 32, "width": 32})
        images.image_seq_length = 16  # (32 / 8)^2 patches, as PaliGemma's preprocessor config states it
        processor = transformers.PaliGemmaProcessor(
            image_processor=images, tokenizer=tokenizer, chat_template=TINY_VLM_TEMPLATE
        )  # adds <image> and its 1152 location and segmentation tokens to the tokenizer
        config = transformers.PaliGemmaConfig(
            # as gemma3's: a window that cuts a prompt, and a full layer after it
            text_config=text_config(
                transformers.Gemma2Config,
                tokenizer,
                bos_token_id=tokenizer.bos_token_id,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            ),  # fmt: skip
            vision_config=transformers.SiglipVisionConfig(**tower),
            image_token_index=processor.image_token_id,
            projection_dim=TINY_LM_SIZES["hidden_size"],
        )
    elif family == "idefics3":
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        images = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
        processor = transformers.Idefics3Processor(
            image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=TINY_VLM_TEMPLATE
        )
        config = transformers.Idefics3Config(
            text_config=text_config(transformers.LlamaConfig, tokenizer),
            vision_config=transformers.Idefics3VisionConfig(**tower),
            image_token_id=processor.image_token_id,
            scale_factor=2,
        )
    elif family == "smolvlm":  # Idefics3's tiling and connector; its processor's __init__ needs num2words (videos)
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
        from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<fake_token_around_image>"]})
        tokenizer.add_special_tokens({"additional_special_tokens": ["<global-img>", "<end_of_utterance>"]})
        processor = object.__new__(transformers.SmolVLMProcessor)
        processor.tokenizer, processor.image_token, processor.video_token = tokenizer, "<image>", "<video>"
        processor.image_token_id = image = tokenizer.convert_tokens_to_ids("<image>")
        processor.fake_image_token, processor.global_image_token = "<fake_token_around_image>", "<global-img>"
        processor.end_of_utterance_token, processor.image_seq_len = "<end_of_utterance>", 4
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [], []
        processor.chat_template, processor.video_processor = TINY_VLM_TEMPLATE, SmolVLMVideoProcessor()
        processor.image_processor = SmolVLMImageProcessorPil(
            size={"longest_edge": 64}, max_image_size={"longest_edge": 32}
        )
        config = transformers.SmolVLMConfig(
            text_config=text_config(transformers.LlamaConfig, tokenizer),
            vision_config=transformers.SmolVLMVisionConfig(**tower),
            image_token_id=processor.image_token_id,
            scale_factor=2,
        )
    elif family in ("qwen2_vl", "qwen2_5_vl"):
        names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": names})
        start, image, end, video = (tokenizer.convert_tokens_to_ids(name) for name in names)
        qwen25 = family == "qwen2_5_vl"
        text_class = transformers.Qwen2_5_VLTextConfig if qwen25 else transformers.Qwen2VLTextConfig
        text = text_config(text_class, tokenizer)
        text.rope_parameters = {**text.rope_parameters, "rope_type": "default", "mrope_section": [2, 3, 3]}
        if qwen25:  # windowed attention in the tower but in its full-attention blocks, a gated MLP of its own width
            vision = dict(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=16)
            vision |= dict(fullatt_block_indexes=[1])
        else:
            vision = dict(embed_dim=32, hidden_size=64, mlp_ratio=2)
        vision |= dict(depth=2, num_heads=4, patch_size=8)
        config = (transformers.Qwen2_5_VLConfig if qwen25 else transformers.Qwen2VLConfig)(
            text_config=text.to_dict(), vision_config=vision, image_token_id=image, video_token_id=video,
            vision_start_token_id=start, vision_end_token_id=end,
        )  # fmt: skip
        processor_class = transformers.Qwen2_5_VLProcessor if qwen25 else transformers.Qwen2VLProcessor
        processor = object.__new__(processor_class)  # no video processor: torchvision is not here
        processor.tokenizer, processor.image_token, processor.video_token = tokenizer, names[1], names[3]
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [video], []
        processor.image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8)
        processor.chat_template = TINY_VLM_TEMPLATE.replace("<image>", "".join(names[:3]))
    elif family == "qwen3_vl":  # interleaved 3-D rotary positions; the tower's deepstack features join layers 0 and 1
        names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": names})
        start, image, end, video = (tokenizer.convert_tokens_to_ids(name) for name in names)
        text = text_config(transformers.Qwen3VLTextConfig, tokenizer)
        text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 2, 2]}
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, out_hidden_size=64)
        vision |= dict(num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
        config = transformers.Qwen3VLConfig(
            text_config=text.to_dict(), vision_config=vision, image_token_id=image, video_token_id=video,
            vision_start_token_id=start, vision_end_token_id=end,
        )  # fmt: skip
        processor = object.__new__(transformers.Qwen3VLProcessor)  # no video processor, as for qwen2_vl
        processor.tokenizer, processor.image_token, processor.video_token = tokenizer, names[1], names[3]
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [video], []
        processor.image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8)
        processor.chat_template = TINY_VLM_TEMPLATE.replace("<image>", "".join(names[:3]))
    elif family == "llava_onevision":  # anyres: an image in tiles of a grid it fits (48 x 48: 4 and a base one)
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>", "<video>"]})
        image, video = tokenizer.convert_tokens_to_ids("<image>"), tokenizer.convert_tokens_to_ids("<video>")
        grid = [[32, 32], [32, 64], [64, 32], [64, 64]]
        config = transformers.LlavaOnevisionConfig(
            vision_config=transformers.SiglipVisionConfig(**tower),
            text_config=text_config(transformers.Qwen2Config, tokenizer),
            image_token_id=image, video_token_id=video, vision_feature_select_strategy="full",
            vision_feature_layer=-1, image_grid_pinpoints=grid,
        )  # fmt: skip
        processor = object.__new__(transformers.LlavaOnevisionProcessor)  # no video processor, as for qwen2_vl
        processor.tokenizer, processor.image_token, processor.video_token = tokenizer, "<image>", "<video>"
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [video], []
        processor.num_image_tokens, processor.vision_feature_select_strategy = 16, "full"
        processor.vision_aspect_ratio, processor.chat_template = "anyres_max_9", TINY_VLM_TEMPLATE
        processor.image_processor = LlavaOnevisionImageProcessorPil(
            size={"height": 32, "width": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=grid
        )
    elif family == "llava_next":  # anyres as LLaVA-OneVision's, with LLaVA's CLIP tower and its CLS token dropped
        from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        grid = [[32, 32], [32, 64], [64, 32], [64, 64]]
        images = LlavaNextImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=grid
        )
        processor = transformers.LlavaNextProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=8, vision_feature_select_strategy="default",
            num_additional_image_tokens=1, chat_template=TINY_VLM_TEMPLATE,
        )  # fmt: skip
        config = transformers.LlavaNextConfig(
            vision_config=transformers.CLIPVisionConfig(**tower),
            text_config=text_config(transformers.LlamaConfig, tokenizer),
            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
            vision_feature_select_strategy="default", image_grid_pinpoints=grid,
        )  # fmt: skip
    elif family == "aya_vision":  # an image in tiles and a global view, which the processor, not its image one, asks
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        names = ["<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>", "<|IMG_LINE_BREAK|>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": [*names, "TILE", "TILE_GLOBAL"]})
        images = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
        processor = transformers.AyaVisionProcessor(
            image_processor=images, tokenizer=tokenizer, patch_size=8, img_size=32, downsample_factor=2,
            chat_template=TINY_VLM_TEMPLATE,
        )  # fmt: skip
        config = transformers.AyaVisionConfig(
            vision_config=transformers.SiglipVisionConfig(**tower),
            text_config=text_config(transformers.Cohere2Config, tokenizer),
            image_token_index=tokenizer.convert_tokens_to_ids("<|IMG_PATCH|>"), downsample_factor=2,
        )  # fmt: skip
    elif family == "internvl":  # tiles as Aya Vision's, and a processor that needs a text (built as qwen2_vl's)
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        names = ["<img>", "<IMG_CONTEXT>", "</img>", "<video>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": names})
        start, image, end, video = (tokenizer.convert_tokens_to_ids(name) for name in names)
        processor = object.__new__(transformers.InternVLProcessor)
        processor.tokenizer, processor.image_seq_length = tokenizer, 4
        processor.start_image_token, processor.image_token, processor.end_image_token, processor.video_token = names
        processor.start_image_token_id, processor.image_token_id, processor.end_image_token_id = start, image, end
        processor.multimodal_pattern = re.compile(f"(?P<image>{re.escape(names[1])})|(?P<video>{re.escape(names[3])})")
        processor.video_token_ids, processor.audio_token_ids = [video], []
        processor.chat_template = TINY_VLM_TEMPLATE.replace("<image>", names[1])
        processor.image_processor = GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, max_patches=4)
        vision = transformers.InternVLVisionConfig(**{**tower, "image_size": [32, 32], "patch_size": [8, 8]})
        config = transformers.InternVLConfig(
            vision_config=vision, text_config=text_config(transformers.Qwen2Config, tokenizer),
            image_token_id=image, image_seq_length=4, downsample_ratio=0.5,
        )  # fmt: skip
    elif (
        family == "qwen3_5"
    ):  # Qwen3-VL's tower and positions; a language model of gated delta-rule layers and full ones
        names = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": names})
        start, image, end, video = (tokenizer.convert_tokens_to_ids(name) for name in names)
        linear = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
        text = text_config(
            transformers.Qwen3_5TextConfig, tokenizer, layer_types=["linear_attention", "full_attention"], **linear
        )
        text.rope_parameters = {**text.rope_parameters, "mrope_section": [4, 2, 2]}
        text.rope_parameters["partial_rotary_factor"] = 1.0
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=8, out_hidden_size=64)
        config = transformers.Qwen3_5Config(
            text_config=text.to_dict(), vision_config=vision | dict(num_position_embeddings=16), image_token_id=image,
            video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        )  # fmt: skip
        processor = object.__new__(transformers.Qwen3VLProcessor)  # Qwen3.5's processor, built as qwen3_vl's
        processor.tokenizer, processor.image_token, processor.video_token = tokenizer, names[1], names[3]
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [video], []
        processor.image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8)
        processor.chat_template = TINY_VLM_TEMPLATE.replace("<image>", "".join(names[:3]))
    elif family == "qwen2_5_omni_thinker":  # Qwen2.5-VL's positions from a get_rope_index that takes no token marks
        names = ["<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>", "<|VIDEO|>", "<|AUDIO|>", "<|audio_bos|>"]
        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": [*names, "<|audio_eos|>"]})
        start, image, end, video, audio, audio_start = (tokenizer.convert_tokens_to_ids(name) for name in names)
        text = text_config(transformers.Qwen2_5OmniTextConfig, tokenizer)
        text.rope_parameters = {**text.rope_parameters, "rope_type": "default", "mrope_section": [2, 3, 3]}
        vision = dict(hidden_size=32, out_hidden_size=64, intermediate_size=64, window_size=16, depth=2, num_heads=4)
        vision |= dict(fullatt_block_indexes=[1], patch_size=8)
        sound = dict(d_model=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, output_dim=64)
        config = transformers.Qwen2_5OmniThinkerConfig(
            text_config=text.to_dict(), vision_config=vision, audio_config=sound | dict(num_mel_bins=16),
            image_token_index=image, video_token_index=video, audio_token_index=audio, vision_start_token_id=start,
            vision_end_token_id=end, audio_start_token_id=audio_start,
        )  # fmt: skip
        processor = object.__new__(transformers.Qwen2_5OmniProcessor)  # no video processor, as for qwen2_vl
        processor.tokenizer, processor.image_token, processor.image_token_id = tokenizer, names[1], image
        processor.video_token, processor.audio_token = names[3], names[4]
        processor.image_token_ids, processor.video_token_ids, processor.audio_token_ids = [image], [video], [audio]
        processor.image_processor = Qwen2VLImageProcessorPil(min_pixels=32 * 32, max_pixels=64 * 64, patch_size=8)
        processor.chat_template = TINY_VLM_TEMPLATE.replace("<image>", "".join(names[:3]))
    elif family == "mllama":  # images seen through cross-attention layers, masked by the processor's own input
        from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

        tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<|image|>", "<|python_tag|>"]})
        tokenizer.add_special_tokens({"bos_token": "<|begin_of_text|>"})  # its processor opens each prompt with one
        images = MllamaImageProcessorPil(size={"height": 32, "width": 32}, max_image_tiles=2)
        processor = transformers.MllamaProcessor(
            image_processor=images, tokenizer=tokenizer, chat_template=TINY_VLM_TEMPLATE.replace("<image>", "<|image|>")
        )
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, image_size=32)
        vision |= dict(attention_heads=4, patch_size=8, max_num_tiles=2, intermediate_layers_indices=[0])
        vision |= dict(vision_output_dim=64, supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
        text = text_config(
            transformers.MllamaTextConfig, tokenizer, cross_attention_layers=[1], bos_token_id=tokenizer.bos_token_id
        )
        config = transformers.MllamaConfig(
            vision_config=vision, text_config=text.to_dict(), image_token_index=processor.image_token_id
        )
    else:
        raise ValueError(family)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config)
    if family == "gemma3":  # transformers starts Gemma 3's projector at zero: the images would reach no token
        torch.nn.init.normal_(model.model.multi_modal_projector.mm_input_projection_weight, std=0.1)
    return model, processor


def png(colour: tuple[int, int, int], size: int = 32) -> bytes:
    """A square PNG of one colour."""
    import io

    from PIL import Image

    encoded = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(encoded, format="PNG")
    return encoded.getvalue()


COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "yellow": (230, 220, 20)}
QUESTION = [{"type": "image"}, {"type": "text", "text": "What colour is the square?"}]


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """A tiny LLaVA (save_tiny_vlm), saved once per test process."""
    return save_tiny_vlm(tmp_path_factory.mktemp("vlm") / "llava")


def colour_rows(directory, n: int, seed: int = 0, with_images: bool = True, image_size: int = 32) -> list[dict]:
    """Squares of four colours (shades vary), the question what colour: chosen the right colour, rejected another;
    every colour is chosen as often as it is rejected, so the text alone says nothing. Images written to
    directory/img as PNG files named relative to the data file."""
    rng, names = random.Random(seed), list(COLOURS)
    (directory / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        right, wrong = names[i % 4], names[(i + 1 + (i // 4) % 3) % 4]
        shade = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[right])
        (directory / "img" / f"{i}.png").write_bytes(png(shade, image_size))
        content = QUESTION if with_images else QUESTION[1:]
        row = {
            "prompt": [{"role": "user", "content": content}],
            "chosen": [{"role": "assistant", "content": f"It is {right}."}],
            "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
        }
        rows.append(row | ({"images": [f"img/{i}.png"]} if with_images else {}))
    return rows


def vlm_overrides(tmp_path, model_dir, data_file, *extra: str) -> list[str]:
    """A run of the tiny VLM at model_dir on data_file in tmp_path (steps of 8 pairs, prompts of 16 image tokens
    and their text); extra Hydra overrides go last."""
    return [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        "model.fsdp_policy_mp=null",
        f"datasets=[{data_file}]",
        "wandb.enabled=false",
        f"local_run_dir={tmp_path / 'run'}",
        f"local_dirs=[{tmp_path}]",
        "batch_size=8",
        "eval_batch_size=8",
        "max_length=96",
        "max_prompt_length=64",
        *extra,
    ]


# -------------------------------------------------------------------------------------------------------------
# Real storage faults: a filesystem of a given size, filled on demand, and a read-only view of a directory


@pytest.fixture
def small_disk(tmp_path):
    """mount(size, name="disk"): a real filesystem of `size` (a size-limited tmpfs, e.g. "16m") mounted at
    tmp_path/name, unmounted after the test. Skipped, with the reason, where this process may not mount one."""
    mounted = []

    def mount(size: str, name: str = "disk") -> Path:
        path = tmp_path / name
        path.mkdir()
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if result.returncode:
            pytest.skip(f"a size-limited tmpfs cannot be mounted here ({result.stderr.strip()}): needs root")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def read_only(tmp_path):
    """view(directory): a read-only bind mount of `directory` (writes there fail with EROFS, even for root),
    unmounted after the test. Skipped, with the reason, where this process may not mount."""
    mounted = []

    def view(directory: Path) -> Path:
        path = tmp_path / f"{directory.name}-read-only"
        path.mkdir()
        for options in (["--bind"], ["-o", "remount,ro,bind"]):
            result = subprocess.run(["mount", *options, str(directory), str(path)], capture_output=True, text=True)
            if result.returncode:
                pytest.skip(f"a read-only bind mount cannot be made here ({result.stderr.strip()}): needs root")
            if not mounted:
                mounted.append(path)
        return path

    yield view
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def wrapped_batch_loss(batch_loss, wrap):
    """A copy of a run's BatchLoss (core/step.py) whose every micro-batch's (loss, metrics) is what
    wrap(examples, loss, metrics) makes of it: the step's loop (BatchLoss.over_micro_batches) calls it as its own."""

    class Wrapped(type(batch_loss)):
        def __call__(self, examples, split, batch=None, coupled=None):
            return wrap(examples, *super().__call__(examples, split, batch, coupled))

    copied = copy.copy(batch_loss)
    copied.__class__ = Wrapped
    return copied
