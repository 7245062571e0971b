"""Vision-language pairs train as text pairs do: FSDP on 2 ranks and tensor parallelism equal one process (FSDP's
units the vision tower's layers and the decoder layers, the tower frozen or trained), a resumed run equals the
uninterrupted one, LoRA adapts the language model unless told otherwise, every export loads with from_pretrained and
AutoProcessor, KTO, SFT and samples see the images; what cannot see them (a reward model of a family without an
image classifier: tests/test_vision_rewards.py has Gemma 3's) or cannot be split (tensor parallelism over too few
heads) stops with one line."""

import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from peft import PeftModel
from safetensors import safe_open

import config as configuration
import train
from conftest import (
    PADDED_BASELINE,
    assert_resume_matches_uninterrupted,
    assert_same_metrics,
    assert_same_weights,
    colour_rows,
    policy_state,
    read_jsonl,
    records,
    save_tiny_vlm,
    vlm_overrides,
    write_jsonl,
)
from core.step import mismatched
from generation.sampling import Sampler
from judging.held_out import Evaluator
from modeling.distributed import Topology
from modeling.placement import find_blocks, language_blocks, tensor_parallel_plan
from modeling.tokenizers import load_tokenizer
from modeling.vision import Vision, decode, vision_tower
from pairs.sources import read_file_rows
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import parse_rows
from utils import UserError

# As tests/test_distributed.py's runs: gradient clipping that acts on some steps, and AdamW's eps at 1e-6, so that
# summation order alone cannot move a weight by a fraction of lr.
STEPS = (
    "eval_every=16",
    "n_eval_examples=8",
    "lr=1e-3",
    "warmup_steps=0",
    "minimum_log_interval_secs=0",
    "plots=false",
    "max_grad_norm=1.5",
    "+optimizer_kwargs.eps=1e-6",
)
# Greedy samples at each eval, from the policy and a live reference (whose FSDP root never ran a forward before)
SAMPLING = (
    "sample_during_eval=true",
    "n_eval_model_samples=3",
    "generation.max_new_tokens=3",
    "generation.do_sample=false",
)
LORA = ("lora.enabled=true", "lora.rank=4", "lora.alpha=8", "lr=1e-2")


@pytest.fixture(scope="module")
def colour_data(tmp_path_factory) -> Path:
    """48 colour pairs (conftest.colour_rows): 40 to train on in 5 steps of 8, 8 held out."""
    directory = tmp_path_factory.mktemp("colours")
    return write_jsonl(directory / "pairs.jsonl", colour_rows(directory, 48))


def run_args(vlm_dir: Path, run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [*vlm_overrides(run_dir.parent, vlm_dir, data, f"local_run_dir={run_dir}"), *STEPS, *extra]


@pytest.fixture(scope="module")
def basic_run(tmp_path_factory, vlm_dir, colour_data):
    """basic_run(freeze) -> the run directory of BasicTrainer's padded, float32, live-reference run (the computation
    every other one must reproduce), with the vision tower frozen or not; each run once per module."""
    runs = {}

    def run(freeze: bool) -> Path:
        if freeze not in runs:
            run_dir = tmp_path_factory.mktemp("basic") / "run"
            levers = (*PADDED_BASELINE, *SAMPLING, f"model.freeze_vision={freeze}")
            train.main(run_args(vlm_dir, run_dir, colour_data, *levers))
            runs[freeze] = run_dir
        return runs[freeze]

    return run


def weights_file(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files (an export's, or peft's adapter file)."""
    tensors = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as file:
            tensors |= {name: file.get_tensor(name) for name in file.keys()}
    return tensors


def load_export(export: Path) -> tuple[torch.nn.Module, Vision]:
    """The export (or checkpoint) as transformers loads it, every weight read from it (none initialised), and its
    processor."""
    model, loading = transformers.AutoModelForImageTextToText.from_pretrained(export, output_loading_info=True)
    assert not loading["missing_keys"] and not loading["unexpected_keys"], loading
    vision = Vision.of(transformers.AutoProcessor.from_pretrained(export))
    assert vision is not None and vision.placeholder == "<image>"
    return model, vision


def changed(model: torch.nn.Module, initial: torch.nn.Module, part: str) -> bool:
    """Whether any weight whose name holds `part` differs between the two models."""
    before = dict(initial.named_parameters())
    return any(not torch.equal(p, before[name]) for name, p in model.named_parameters() if part in name)


def image_inputs(vision: Vision, colour: str = "img/0.png", directory: Path | None = None) -> dict:
    """The processor's inputs of one prompt with one image, as a user of the export would make them."""
    image = decode((directory / colour).read_bytes())
    text = "user: <image>What colour is the square?\nassistant:"
    return dict(vision.processor(text=[text], images=[image], return_tensors="pt"))


def test_fsdp_units_are_the_vision_towers_layers_and_the_decoder_layers(vlm_dir):
    # LLaVA declares its tower's layers and embeddings and the Llama decoder layers in _no_split_modules: FSDP shards
    # each as a unit (and activation checkpointing recomputes each); FLOPs and memory count the decoder layers only.
    config = transformers.AutoConfig.from_pretrained(vlm_dir)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    units = Counter(type(block).__name__ for block in find_blocks(model, None))
    assert units == {"CLIPVisionEmbeddings": 1, "CLIPEncoderLayer": 2, "LlamaDecoderLayer": 2}
    assert [type(block).__name__ for block in language_blocks(model, None)] == ["LlamaDecoderLayer"] * 2


@pytest.mark.xdist_group("processes")
@pytest.mark.parametrize("freeze", [True, False], ids=["frozen_tower", "trained_tower"])
def test_fsdp_on_two_ranks_equals_one_process(basic_run, vlm_dir, colour_data, tmp_path, run_main, monkeypatch, freeze):
    # Every logged number to 1e-5, the final weights to 5e-6 and the greedy samples (of the prompts and their images)
    # exactly, with 2 accumulation micro-batches a rank and activation checkpointing; the frozen tower's units hold
    # parameters that never get a gradient. The export is the whole model, the tower as loaded where it was frozen,
    # with the processor beside it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # one thread per process
    expected, run_dir = basic_run(freeze), tmp_path / "fsdp"
    levers = (
        "gradient_accumulation_steps=2",
        "activation_checkpointing=true",
        *SAMPLING,
        f"model.freeze_vision={freeze}",
    )
    result = run_main(*run_args(vlm_dir, run_dir, colour_data, "trainer=FSDPTrainer", "nproc=2", *levers))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "view tensor" not in result.stderr  # FSDP2's warning about LLaVA's image features, silenced (placement)
    assert_same_metrics(read_jsonl(expected / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(expected, run_dir)  # the frozen tower's among them
    assert read_jsonl(run_dir / "samples.jsonl") == read_jsonl(expected / "samples.jsonl")
    assert any(".vision_tower." in name for name in policy_state(run_dir / "LATEST"))
    model, _ = load_export(run_dir / "LATEST")
    assert Vision.of(transformers.AutoProcessor.from_pretrained(run_dir / "step-16"))  # export.py reads it there
    initial = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert changed(model, initial, "vision_tower") == (not freeze)
    assert changed(model, initial, "multi_modal_projector") and changed(model, initial, "language_model")
    if freeze:  # the checkpoint's shards, the frozen tower's among them, read back on another trainer and mesh
        resumed = tmp_path / "resumed"
        args = run_args(
            vlm_dir, resumed, colour_data, "trainer=FSDPTrainer", "nproc=2", f"resume_from={expected}/step-16"
        )
        assert run_main(*args).returncode == 0
        after_16 = [record for record in read_jsonl(expected / "metrics.jsonl") if record["step"] > 16]
        assert_same_metrics(after_16, read_jsonl(resumed / "metrics.jsonl"))
        assert_same_weights(expected, resumed)


@pytest.mark.xdist_group("processes")
def test_tensor_parallel_on_two_ranks_equals_one_process(
    basic_run, vlm_dir, colour_data, tmp_path, run_main, monkeypatch
):
    # LLaVA's language model split by its text config's plan (Llama's attention and MLP projections), the tower and
    # the projector whole on both ranks: every logged number, the final weights and the greedy samples as one
    # process has them.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    expected, run_dir = basic_run(True), tmp_path / "tp"
    result = run_main(*run_args(vlm_dir, run_dir, colour_data, "trainer=TensorParallelTrainer", "nproc=2", *SAMPLING))
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_metrics(read_jsonl(expected / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl"))
    assert_same_weights(expected, run_dir)
    assert read_jsonl(run_dir / "samples.jsonl") == read_jsonl(expected / "samples.jsonl")


@pytest.mark.xdist_group("processes")
def test_tensor_parallel_over_heads_it_cannot_split_is_one_line(tmp_path, colour_data, run_main, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model_dir = save_tiny_vlm(tmp_path / "one_kv_head", num_key_value_heads=1)
    result = run_main(*run_args(model_dir, tmp_path / "run", colour_data, "trainer=TensorParallelTrainer", "nproc=2"))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and errors == [
        "error: TensorParallelTrainer splits attention heads over ranks, but LlavaForConditionalGeneration has "
        "num_key_value_heads=1, not a multiple of the world size 2"
    ], result.stderr[-2000:]


def test_a_vlm_whose_language_model_has_no_plan_is_one_line(vlm_dir):
    config = transformers.AutoConfig.from_pretrained(vlm_dir)
    config.text_config.base_model_tp_plan = None
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    message = (
        "LlavaForConditionalGeneration has no tensor-parallel plan (its language model's config (text_config) has no "
        "base_model_tp_plan); use trainer=FSDPTrainer"
    )
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        tensor_parallel_plan(model, 2, 2, "TensorParallelTrainer")


def test_a_resumed_run_equals_the_uninterrupted_one(vlm_dir, colour_data, tmp_path):
    def make_config(*overrides: str):
        return configuration.load(run_args(vlm_dir, tmp_path / "run", colour_data, *overrides))

    assert_resume_matches_uninterrupted(make_config, tmp_path)


@pytest.mark.parametrize("targets", [None, "[q_proj,fc1,fc2]"], ids=["default", "vision_modules_named"])
def test_lora_adapts_the_language_model_unless_vision_modules_are_named(
    vlm_dir, colour_data, tmp_path, run_main, targets
):
    # Step 0 at exactly ln 2. By default adapters go on the language model's linear layers only: the tower and the
    # projector stay as loaded. lora.target_modules may name the tower's modules (CLIP's fc1, fc2; q_proj is in both
    # models): their adapters train and merge into the export. The merged export, loaded with from_pretrained, gives
    # the logits of the base with peft's adapter; the processor loads from it, and from export.py's export too.
    run_dir = tmp_path / "run"
    named = [f"lora.target_modules={targets}"] if targets else []
    result = run_main(*run_args(vlm_dir, run_dir, colour_data, *LORA, *named))
    assert result.returncode == 0, result.stderr[-3000:]
    evals = records(run_dir, "eval")
    assert evals[0]["loss/eval"] == torch.tensor(math.log(2)).item() and evals[-1]["loss/eval"] < evals[0]["loss/eval"]
    adapted = {name.split(".lora_")[0] for name in weights_file(run_dir / "LATEST" / "adapter")}
    in_tower = {name for name in adapted if ".vision_tower." in name}
    assert not any(".multi_modal_projector." in name for name in adapted)
    if targets is None:
        assert not in_tower and len(adapted) == 14  # 7 projections in each of 2 decoder layers
    else:
        assert {name.rsplit(".", 1)[-1] for name in in_tower} == {"q_proj", "fc1", "fc2"} and len(adapted) == 8
    merged, vision = load_export(run_dir / "LATEST")
    initial = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert changed(merged, initial, "vision_tower") == (targets is not None)
    assert not changed(merged, initial, "multi_modal_projector") and changed(merged, initial, "language_model")
    peft_model = PeftModel.from_pretrained(initial, run_dir / "LATEST" / "adapter")
    inputs = image_inputs(vision, directory=colour_data.parent)
    with torch.no_grad():
        torch.testing.assert_close(merged(**inputs).logits, peft_model(**inputs).logits, rtol=0, atol=1e-5)
    exported = tmp_path / "exported"
    assert run_main(str(run_dir / "step-16"), str(exported), script="export.py").returncode == 0
    assert load_export(exported)[1].image_token_id == vision.image_token_id


def labelled_colour_rows(directory: Path, n_pairs: int) -> list[dict]:
    """conftest.colour_rows unpaired (KTO's data): each pair's right colour desirable, its wrong one not."""
    rows = []
    for row in colour_rows(directory, n_pairs):
        for response, label in (("chosen", True), ("rejected", False)):
            rows.append({"prompt": row["prompt"], "completion": row[response], "label": label, "images": row["images"]})
    return rows


def test_kto_learns_labelled_completions_with_images(vlm_dir, tmp_path):
    # KTO's mismatched examples (each prompt with the next example's completion) keep their prompt's images. Step 0
    # is KTO's closed form, (lambda_D + lambda_U) / 4 = 0.5; training separates desirable from undesirable rewards.
    data = write_jsonl(tmp_path / "labelled.jsonl", labelled_colour_rows(tmp_path, 32))
    tokenizer = load_tokenizer(configuration.load(run_args(vlm_dir, tmp_path / "run", data)).model, tmp_path)
    examples = tokenize_pairs(parse_rows(read_file_rows(data), "t", tokenizer), tokenizer, Tokenization(96, 64, False))
    batch = examples.take(range(8))
    made = mismatched(batch, 96, 64)
    assert [example["images"] for example in made] == [example["images"] for example in batch]
    assert made[0]["prompt"] == batch[0]["prompt"] and made[0]["responses"] == batch[1]["responses"]
    run_dir = tmp_path / "run"
    train.run(configuration.load(run_args(vlm_dir, run_dir, data, "loss=kto", "n_epochs=2", "lr=3e-3")))
    evals = records(run_dir, "eval")
    assert evals[0]["loss/eval"] == 0.5 and evals[-1]["loss/eval"] < 0.5
    assert evals[-1]["rewards_eval/chosen"] > evals[-1]["rewards_eval/rejected"]


def test_kto_on_a_prompt_with_images_longer_than_max_prompt_length_is_one_line(vlm_dir, tmp_path):
    # The pair itself fits (prompt + completion within max_length), but a mismatched completion could cut the
    # prompt, and its image tokens with it.
    data = write_jsonl(tmp_path / "labelled.jsonl", labelled_colour_rows(tmp_path, 8))
    config = configuration.load(run_args(vlm_dir, tmp_path / "run", data, "loss=kto", "max_prompt_length=20"))
    message = (
        r"^loss=kto pairs each prompt with another example's completion for its KL estimate, which cuts a prompt to "
        r"max_prompt_length=20 where the two exceed max_length; a prompt with images is (\d+) tokens, its images' "
        r"included, and must stay whole: raise max_prompt_length to \1$"
    )
    with pytest.raises(UserError, match=message):
        train.run(config)


def test_sft_on_image_prompts_trains_through_the_projector(vlm_dir, colour_data, tmp_path):
    # SFT's loss on the chosen responses falls; the projector, which only image tokens pass through, trains, and the
    # frozen tower stays as loaded.
    run_dir = tmp_path / "run"
    train.run(configuration.load(run_args(vlm_dir, run_dir, colour_data, "loss=sft")))
    evals = records(run_dir, "eval")
    assert evals[-1]["loss/eval"] < evals[0]["loss/eval"] - 5
    model, _ = load_export(run_dir / "LATEST")
    initial = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir)
    assert changed(model, initial, "multi_modal_projector") and not changed(model, initial, "vision_tower")


def test_samples_see_the_images(vlm_dir, colour_data, tmp_path):
    # The eval's samples (sample_during_eval) are what transformers generates from the processor's own inputs of
    # each prompt and its image; each image goes through the tower.
    settings = ("generation.do_sample=false", "generation.max_new_tokens=6")
    config = configuration.load(run_args(vlm_dir, tmp_path / "run", colour_data, *settings))
    tokenizer = load_tokenizer(config.model, tmp_path)
    pairs = parse_rows(read_file_rows(colour_data), "t", tokenizer)[:3]
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(96, 64, False)).take(range(3))
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir)
    encoded = []
    vision_tower(model).register_forward_hook(lambda module, args, out: encoded.append(args[0].shape[0]))
    topology = Topology.create("BasicTrainer")
    sampler = Sampler(tokenizer, topology, config.generation.max_new_tokens, config.eval_batch_size)
    evaluator = Evaluator(config, topology, tokenizer, [], None, 1, sampler)
    samples = [evaluator.sample_texts(model, [example])[0] for example in examples]
    assert encoded == [1, 1, 1]
    for pair, sample in zip(pairs, samples):
        inputs = tokenizer.vision.processor(
            text=[pair.prompt], images=[decode(pair.images[0])], add_special_tokens=False, return_tensors="pt"
        )
        ids = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert sample == tokenizer.decode(ids[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)


def test_a_reward_model_of_a_family_without_an_image_classifier_is_one_line(vlm_dir, colour_data, tmp_path):
    config = configuration.load(run_args(vlm_dir, tmp_path / "run", colour_data, "loss=reward"))
    message = (
        "loss=reward: llava is a vision-language model for which transformers has no sequence classifier "
        "(AutoModelForSequenceClassification) that reads images; train the reward model from Gemma 3 (or a text "
        "model), or this one with a preference loss"
    )
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
        train.run(config)
