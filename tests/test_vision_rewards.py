"""Reward models that see images (Gemma 3's sequence classifier) and iterative rounds on prompts with images: the
rewards read in a batch, packed or padded, equal transformers' own forward of each prompt, image and response alone,
gradients too; a tiny one learns what the images show and its export scores as trained; a round samples with the
images, scores with them and keeps them in its files and pairs; what would read the text alone stops with one line."""

import base64
import re
import shutil

import pytest
import torch
import transformers

import config as configuration
import train
from conftest import (
    COLOURS,
    TINY_DIR,
    assert_same_metrics,
    build_trainer,
    colour_rows,
    png,
    policy_state,
    read_jsonl,
    records,
    save_tiny_vlm,
    tiny_vlm,
    vlm_overrides,
    write_jsonl,
)
from core.scoring import Scorer, ScoringSettings
from judging.rewards import ModelReward
from modeling.distributed import Topology
from modeling.reward_head import init_reward_head
from modeling.vision import Vision, decode, pack_images, unpack_images, vision_tower
from pairs.sources import read_file_rows
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import parse_rows
from rounds import Rounds
from utils import UserError


def tiny_gemma3_reward_model():
    """(Gemma3ForSequenceClassification, its processor): the tiny Gemma 3 (conftest.tiny_vlm) with one output, its
    body's weights, its head from seed 0 as a run initialises it."""
    policy, processor = tiny_vlm("gemma3")
    policy.config.num_labels = 1
    model = transformers.AutoModelForSequenceClassification.from_config(policy.config)
    missing, unexpected = model.load_state_dict(policy.state_dict(), strict=False)
    assert missing == ["score.weight"] and unexpected == ["lm_head.weight"]
    init_reward_head(model, 0)
    return model, processor


def plain_reward(model, processor, prompt: str, image: bytes, response_ids: list[int]) -> torch.Tensor:
    """transformers' own reward of one prompt, its image (an encoded file) and a response (ids, no EOS) alone: the
    processor's inputs of the prompt and its image, the response's tokens after them (text: type 0), pooled at the
    last token."""
    inputs = processor(text=[prompt], images=[decode(image)], add_special_tokens=False, return_tensors="pt")
    answer = torch.tensor([response_ids])
    inputs = {name: value for name, value in inputs.items() if name != "attention_mask"}
    inputs["input_ids"] = torch.cat([inputs["input_ids"], answer], dim=1)
    inputs["token_type_ids"] = torch.cat([inputs["token_type_ids"], 0 * answer], dim=1)
    return model(**inputs).logits[0, 0]


def test_rewards_in_a_batch_equal_transformers_forward_of_each_sequence_alone(tmp_path):
    # Each sequence's reward and every parameter's gradient, in packed rows (each prompt and its image once per pair,
    # an image's tokens seeing each other through the packed mask) and in padded rows, equal Gemma 3's sequence
    # classifier on that prompt, its image and the response alone, read where its own pooling reads a text without
    # its EOS (the response's last token), from the processor's own inputs.
    model, processor = tiny_gemma3_reward_model()
    tokenizer = processor.tokenizer
    tokenizer.vision = Vision.of(processor)
    rows = colour_rows(tmp_path, 4)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs = parse_rows(read_file_rows(data), "t", tokenizer)
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(96, 64, sft=False)).take(range(4))
    weights = torch.linspace(-1, 1, 8)  # every sequence's gradient counts, each its own way
    topology, results = Topology.create("BasicTrainer"), {}
    for layout in ("packed", "padded"):
        settings = configuration.load(vlm_overrides(tmp_path, tmp_path, data, f"layout={layout}", "loss=reward"))
        scorer = Scorer.create(
            model, ScoringSettings.of_run(settings), tokenizer.pad_token_id, topology, False, None,
            reward_eos=tokenizer.eos_token_id,
            vision=tokenizer.vision,
        )  # fmt: skip
        assert scorer.layout == layout, scorer.fallbacks
        model.zero_grad()
        rewards = scorer(model, scorer.batch(examples), None)
        (rewards * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results[layout] = rewards.detach(), grads
    model.zero_grad()
    plain = []
    for response in (0, 1):
        for pair, example in zip(pairs, examples):
            ids = example["responses"][response]  # the chat template's end: no EOS appended to read before
            plain.append(plain_reward(model, processor, pair.prompt, pair.images[0], ids))
    plain = torch.stack(plain)
    (plain * weights).sum().backward()
    trainable = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any(".vision_tower." in name for name in trainable) and "score.weight" in trainable
    floor = 1e-5 * max(grad.norm() for grad in trainable.values())
    assert len(set(plain.tolist())) == 8  # the sequences score apart: a mix-up could not pass unnoticed
    for layout, (rewards, grads) in results.items():
        torch.testing.assert_close(rewards, plain.detach(), rtol=0, atol=1e-5, msg=layout)
        assert grads.keys() == trainable.keys()
        for name, grad in trainable.items():
            error = (grads[name] - grad).norm() / grad.norm().clamp_min(floor)
            assert error < 1e-4, f"{layout} {name}: relative gradient error {error:.2g}"


@pytest.fixture(scope="module")
def gemma3_dirs(tmp_path_factory):
    """(policy, reward model): the tiny Gemma 3 as a policy and as a reward model (tiny_gemma3_reward_model), each
    saved with its processor."""
    directory = tmp_path_factory.mktemp("gemma3")
    model, processor = tiny_gemma3_reward_model()
    model.save_pretrained(directory / "reward")
    processor.save_pretrained(directory / "reward")
    return save_tiny_vlm(directory / "policy", "gemma3"), directory / "reward"


def test_a_round_on_image_prompts_samples_and_scores_with_the_images(gemma3_dirs, tmp_path):
    # One round of 4 prompts with their images, 2 completions each: the policy samples with the images, the reward
    # model scores each prompt, its image and a completion as transformers does alone, the round's file keeps each
    # prompt's image and its pairs hold them (as a resume reads them back); the held-out greedy reward is logged.
    policy_dir, reward_dir = gemma3_dirs
    rows = colour_rows(tmp_path, 12)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    settings = (
        "rounds.n=1", f"rounds.reward={reward_dir}", "rounds.prompts=4", "rounds.completions=2",
        "rounds.eval_prompts=2", "generation.max_new_tokens=4", "n_eval_examples=4", "batch_size=2",
        "eval_batch_size=4", "eval_every=1000",
    )  # fmt: skip
    config = configuration.load(vlm_overrides(tmp_path, policy_dir, data, *settings))
    trainer = train.build_trainer(config, Topology.create(config.trainer), train.prepare_run_dir(config))
    rounds = Rounds(trainer)
    rounds.run()
    lines = read_jsonl(trainer.run_dir / "rounds" / "round-0.jsonl")
    tokenizer = trainer.tokenizer
    pairs = parse_rows(read_file_rows(data), "t", tokenizer)
    prompts = {pair.images: pair.prompt for pair in pairs}  # each colour's shade is an image of its own
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    processor = transformers.AutoProcessor.from_pretrained(reward_dir)
    assert len(lines) == 4 and len({text for line in lines for text in line["completions"]}) > 4
    for line in lines:
        images = tuple(map(base64.b64decode, line["images"]))
        assert len(images) == 1 and images in prompts
        with torch.no_grad():
            alone = [
                plain_reward(
                    model, processor, prompts[images], images[0], tokenizer(text, add_special_tokens=False).input_ids
                ).item()
                for text in line["completions"]
            ]
        assert line["rewards"] == pytest.approx(alone, abs=1e-5)
    data = rounds.round_data(0, lines)
    assert len(data.train_examples) == sum(line["chosen"] is not None for line in lines) > 0
    paired = [line for line in lines if line["chosen"] is not None]
    for i, line in enumerate(paired):
        assert data.train_examples[i]["images"] == pack_images(tuple(map(base64.b64decode, line["images"])))
    records = [r for r in read_jsonl(trainer.run_dir / "metrics.jsonl") if "rounds/round" in r]
    assert [r["rounds/round"] for r in records] == [0, 1]
    # the policy completes a prompt as transformers generates from the processor's inputs of it and its image, which
    # its vision tower encodes
    own = tokenizer.vision.processor(
        text=[pairs[0].prompt], images=[decode(pairs[0].images[0])], add_special_tokens=False, return_tensors="pt"
    )
    inputs = {name: own[name] for name in ("input_ids", "attention_mask", "pixel_values", "token_type_ids")}
    with torch.no_grad():
        ends = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        generated = trainer.policy.generate(**inputs, max_new_tokens=4, do_sample=False, **ends)
    encoded = []  # the images the policy's vision tower encodes
    count = lambda module, args, kwargs: encoded.append(kwargs["pixel_values"].shape[0])  # noqa: E731
    vision_tower(trainer.policy).register_forward_pre_hook(count, with_kwargs=True)
    completion = trainer.sample([own["input_ids"][0].tolist()], [pack_images(pairs[0].images)], None)[0]
    assert completion == generated[0, own["input_ids"].shape[1] :].tolist() and encoded == [1]


def expanded_prompt(processor, image: bytes) -> str:
    """A colour question's prompt text with its image's tokens, as a policy's processor expands the placeholder
    (the text a round's prompt decodes to)."""
    text = "user: <start_of_image>What colour is the square?\nassistant:"
    ids = processor(text=[text], images=[decode(image)], add_special_tokens=False)["input_ids"][0]
    return processor.tokenizer.decode(ids)


def test_the_reward_model_sees_the_images(gemma3_dirs):
    # The same prompt text and completion with a red and a blue square: two rewards, each the reward model's on that
    # prompt, image and completion alone. A prompt whose image tokens are not what this model's processor makes of
    # its images is one line.
    _, reward_dir = gemma3_dirs
    reward = ModelReward(reward_dir, torch.device("cpu"), batch_size=2, max_length=96)
    processor = transformers.AutoProcessor.from_pretrained(reward_dir)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(reward_dir).eval()
    images = [png(COLOURS["red"]), png(COLOURS["blue"])]
    prompt, completion = expanded_prompt(processor, images[0]), " It is red."
    rewards = reward([prompt] * 2, [completion] * 2, [pack_images((image,)) for image in images])
    answer = reward.tokenizer(completion, add_special_tokens=False).input_ids
    text = "user: <start_of_image>What colour is the square?\nassistant:"
    with torch.no_grad():
        alone = [plain_reward(model, processor, text, image, answer).item() for image in images]
    assert rewards == pytest.approx(alone, abs=1e-5) and abs(rewards[0] - rewards[1]) > 1e-3
    short = prompt.replace("<image_soft_token>", "", 1)
    message = "a prompt with 1 image holds 3 image tokens as the policy's processor made them, and this model's"
    with pytest.raises(UserError, match=f"^rounds.reward={reward_dir}: {message} processor makes 4$"):
        reward([short], [completion], [pack_images(images[:1])])


def trained_reward_model(policy_dir, tmp_path, n_rows: int, *overrides: str):
    """The trainer of a whole loss=reward run from the tiny Gemma 3 on n_rows colour pairs, a sixth held out (a file
    of their own), after its end (LATEST written)."""
    rows = colour_rows(tmp_path / "data", n_rows)
    write_jsonl(tmp_path / "data" / "train.jsonl", rows[: n_rows * 5 // 6])
    write_jsonl(tmp_path / "data" / "test.jsonl", rows[n_rows * 5 // 6 :])
    overrides = vlm_overrides(tmp_path, policy_dir, tmp_path / "data", "loss=reward", "eval_every=1000", *overrides)
    trainer = build_trainer(configuration.load(overrides))
    trainer.train()
    trainer.finish()
    return trainer


def test_the_export_loads_with_its_processor_and_scores_as_trained(gemma3_dirs, tmp_path):
    # LATEST is Gemma 3's sequence classifier, every weight read from it, with the processor beside it: transformers
    # scores a held-out prompt, its image and a response alone as the trained model did in a batch, and so does
    # rounds.reward=LATEST on the prompts' text (their image tokens expanded) and their images.
    trainer = trained_reward_model(gemma3_dirs[0], tmp_path, 24, "lr=1e-3")
    export = trainer.run_dir / "LATEST"
    model, loading = transformers.AutoModelForSequenceClassification.from_pretrained(export, output_loading_info=True)
    assert type(model).__name__ == "Gemma3ForSequenceClassification" and not any(loading.values()), loading
    processor = transformers.AutoProcessor.from_pretrained(export)
    examples = [ex for batch in trainer.data.eval_batches for ex in batch]
    with torch.no_grad():
        expected = trainer.scorer(trainer.policy, trainer.scorer.batch(examples), None)
    pairs = parse_rows(read_file_rows(tmp_path / "data" / "test.jsonl"), "t", trainer.tokenizer)
    prompts = {pack_images(pair.images): pair.prompt for pair in pairs}
    model.eval()
    with torch.no_grad():
        alone = [
            plain_reward(model, processor, prompts[ex["images"]], unpack_images(ex["images"])[0], ex["responses"][r])
            for r in (0, 1) for ex in examples
        ]  # fmt: skip
    assert torch.stack(alone).tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    decode = trainer.tokenizer.decode
    texts = (
        [decode(ex["prompt"]) for ex in examples] * 2,
        [decode(ex["responses"][r]) for r in (0, 1) for ex in examples],
    )
    scored = ModelReward(export, torch.device("cpu"), 3, 96)(*texts, [ex["images"] for ex in examples] * 2)
    assert scored == pytest.approx(expected.tolist(), abs=1e-5) and len(set(scored)) == len(scored)


@pytest.mark.slow
def test_a_tiny_gemma3_reward_model_learns_what_the_images_show(gemma3_dirs, tmp_path):
    # Right against wrong colour, every colour as often chosen as rejected, so that the text alone cannot tell:
    # held-out accuracy from chance to >= 0.9.
    trainer = trained_reward_model(gemma3_dirs[0], tmp_path, 240, "n_epochs=3", "lr=1e-3")
    evals = records(trainer.run_dir, "eval")
    assert 0.3 <= evals[0]["rewards_eval/accuracies"] <= 0.7 and evals[-1]["rewards_eval/accuracies"] >= 0.9, evals


def test_rounds_that_would_lose_the_images_are_one_line(gemma3_dirs, tmp_path):
    # A text reward model would score the prompts' text alone (refused before the run starts, and by the reward
    # itself); a prompt of 52 tokens (its image's included) over
    # max_prompt_length=48, with a completion of 64 tokens over max_length=96, would be cut, and its image tokens; a
    # generation server would be sent the prompts without their images.
    policy_dir, reward_dir = gemma3_dirs
    text_reward = tmp_path / "text_reward"
    torch.manual_seed(0)
    text_config = transformers.AutoConfig.from_pretrained(TINY_DIR, num_labels=1)
    transformers.AutoModelForSequenceClassification.from_config(text_config).save_pretrained(text_reward)
    transformers.AutoTokenizer.from_pretrained(TINY_DIR).save_pretrained(text_reward)
    data = write_jsonl(tmp_path / "pairs.jsonl", colour_rows(tmp_path, 12))
    rounds = ("rounds.n=1", "n_eval_examples=4")
    cases = [
        (
            (f"rounds.reward={text_reward}",),
            f"rounds.n=1: rounds.reward={text_reward} is a text model and the prompts have images: it would score "
            "their text alone; train a reward model that sees them (loss=reward from Gemma 3: docs/reward_models.md)",
        ),
        (
            (f"rounds.reward={reward_dir}", "max_prompt_length=48", "generation.max_new_tokens=64"),
            "rounds.n=1: a prompt with images is 52 tokens, its images' included, and with a completion of "
            "generation.max_new_tokens=64 exceeds max_length=96, which would cut it to max_prompt_length=48: raise "
            "max_length to 116 or max_prompt_length to 52",
        ),
        (  # a generation server is sent token ids alone
            (f"rounds.reward={reward_dir}", "rounds.server='serve {model} {port}'"),
            "rounds.server samples a vision-language policy (it is sent token ids alone): set rounds.server=null to "
            "sample with our loop",
        ),
    ]
    for overrides, message in cases:
        config = configuration.load(vlm_overrides(tmp_path, policy_dir, data, *rounds, *overrides))
        with pytest.raises(UserError, match=f"^{re.escape(message)}$"):
            train.run(config)
    message = (
        f"rounds.reward={text_reward} is a text model and the prompts have images: it would score their text alone"
    )
    with pytest.raises(UserError, match=f"^{re.escape(message)}$"):  # the reward itself, as rounds call it
        ModelReward(text_reward, torch.device("cpu"), 2, 96)(["<image>"], [" red"], [pack_images((png((0, 0, 0)),))])


@pytest.mark.slow
def test_a_round_on_image_prompts_resumed_inside_it_equals_the_uninterrupted_one(gemma3_dirs, tmp_path):
    # A checkpoint after the round's first step: resumed from it, the round's pairs (their images read back from the
    # round's file) train to the uninterrupted run's weights, records and round file, bit for bit.
    policy_dir, reward_dir = gemma3_dirs
    data = write_jsonl(tmp_path / "pairs.jsonl", colour_rows(tmp_path, 12))
    settings = (
        "rounds.n=1", f"rounds.reward={reward_dir}", "rounds.prompts=8", "rounds.completions=2",
        "rounds.eval_prompts=2", "generation.max_new_tokens=4", "n_eval_examples=4", "batch_size=2",
        "eval_batch_size=4", "eval_every=1000", "save_every=2", "lr=1e-3",
    )  # fmt: skip
    whole = tmp_path / "whole"
    train.run(configuration.load(vlm_overrides(tmp_path, policy_dir, data, *settings, f"local_run_dir={whole}")))
    steps = sorted(int(path.name.split("-")[1]) for path in whole.glob("step-*"))
    assert len(steps) >= 2, steps  # one inside the round, one at its end
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(whole / "metrics.jsonl", resumed / "metrics.jsonl")
    shutil.copytree(whole / "rounds", resumed / "rounds")
    shutil.copytree(whole / f"step-{steps[0]}", resumed / f"step-{steps[0]}")
    overrides = (*settings, f"local_run_dir={resumed}", "resume_from=auto")
    train.run(configuration.load(vlm_overrides(tmp_path, policy_dir, data, *overrides)))
    assert_same_metrics(read_jsonl(whole / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl"))
    assert read_jsonl(resumed / "rounds" / "round-0.jsonl") == read_jsonl(whole / "rounds" / "round-0.jsonl")
    a, b = policy_state(whole / "LATEST"), policy_state(resumed / "LATEST")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
