"""Vision-language pairs: images in the prompt, read from the data, encoded once per pair in the packed layout,
equal to a plain forward of each (prompt + images + response) alone, learnt from (a preference a text model cannot
learn), and bad image input stopped with one line."""

import math
import re

import pytest
import torch
import transformers

import config as configuration
import train
from conftest import colour_rows, png, records, vlm_overrides, write_jsonl
from core.scoring import Scorer
from modeling.distributed import Topology
from modeling.vision import Vision, pack_images, vision_tower
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import parse_rows, read_file_rows


def test_each_image_is_encoded_once_per_pair_and_the_log_probs_equal_a_plain_forward(vlm_dir, tmp_path):
    # The packed layout (the default) holds each prompt, its image tokens included, once per pair: the vision tower
    # encodes each image once, where padded rows (TRL's layout) encode it for the chosen and the rejected row. Every
    # sequence's summed log-prob and every trainable parameter's gradient equal a plain forward of that prompt, its
    # image and the response alone, as transformers computes it with the processor's own inputs.
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    processor = transformers.AutoProcessor.from_pretrained(vlm_dir)
    tokenizer.vision = Vision.of(processor)
    data = write_jsonl(tmp_path / "pairs.jsonl", colour_rows(tmp_path, 4))
    pairs = parse_rows(read_file_rows(data), "t", tokenizer)
    for row, pair in zip(colour_rows(tmp_path, 4), pairs):  # the images read from the files the rows name
        assert pair.images == ((tmp_path / row["images"][0]).read_bytes(),)
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(96, 64, sft=False)).take(range(4))
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    encoded = []
    vision_tower(model).register_forward_hook(lambda module, args, out: encoded.append(args[0].shape[0]))
    results = {}
    for layout in ("packed", "padded"):
        settings = configuration.load(vlm_overrides(tmp_path, vlm_dir, data, f"layout={layout}"))
        scorer = Scorer.create(model, settings, tokenizer.pad_token_id, Topology.create("BasicTrainer"), False, None)
        scorer.vision = tokenizer.vision
        model.zero_grad()
        encoded.clear()
        logps = scorer(model, scorer.batch(examples), None)
        logps.sum().backward()
        results[layout] = logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert sum(encoded) == (4 if layout == "packed" else 8), (layout, encoded)  # images through the tower
    model.zero_grad()
    plain = []
    for response in ("chosen", "rejected"):
        for row, pair in zip(colour_rows(tmp_path, 4), pairs):
            image = transformers.image_utils.load_image(str(tmp_path / row["images"][0]))
            prompt = processor(text=[pair.prompt], images=[image], add_special_tokens=False, return_tensors="pt")
            answer = tokenizer(getattr(pair, response), add_special_tokens=False, return_tensors="pt").input_ids
            ids = torch.cat([prompt.input_ids, answer], dim=1)
            logits = model(input_ids=ids, pixel_values=prompt.pixel_values).logits[0, :-1].float()
            token_logps = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            plain.append(token_logps[prompt.input_ids.shape[1] - 1 :].sum())
    plain = torch.stack(plain)
    plain.sum().backward()
    trainable = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    floor = 1e-5 * max(grad.norm() for grad in trainable.values())  # as the text zoo: relative to each norm
    for layout, (logps, grads) in results.items():
        error = (logps - plain.detach()).abs().max()
        assert error <= 1e-5 + 1e-6 * plain.abs().max(), f"{layout}: log-probs differ by {error:.2g}"
        assert grads.keys() == trainable.keys()
        for name, grad in trainable.items():
            error = (grads[name] - grad).norm() / grad.norm().clamp_min(floor)
            assert error < 1e-4, f"{layout} {name}: relative gradient error {error:.2g}"


def test_a_changed_image_changes_the_example_key(vlm_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.vision = Vision.of(transformers.AutoProcessor.from_pretrained(vlm_dir))
    pair = parse_rows(
        [("row 1", {"prompt": "<image> colour?", "chosen": " red", "rejected": " blue", "image": png((200, 0, 0))})],
        "t",
        tokenizer,
    )[0]
    other = type(pair)(**{**vars(pair), "images": (png((0, 0, 200)),)})
    settings = Tokenization(96, 64, sft=False)
    first, second = (tokenize_pairs([p], tokenizer, settings) for p in (pair, other))
    assert first.take([0])[0]["prompt"] == second.take([0])[0]["prompt"]  # the same ids
    assert first.keys[0] != second.keys[0] and first.take([0])[0]["images"] == pack_images(pair.images)


def test_a_tiny_vlm_learns_what_the_images_show_and_not_without_them(vlm_dir, tmp_path):
    # Right against wrong colour, every colour as often chosen as rejected: held-out reward accuracy >= 0.9 with the
    # images; with the same pairs and the images withheld, the text alone cannot tell, and accuracy stays near 0.5.
    # Step 0 is exactly ln 2 (policy = reference).
    accuracy = {}
    for with_images in (True, False):
        directory = tmp_path / str(with_images)
        rows = colour_rows(directory / "data", 240, with_images=with_images)  # without images all one prompt:
        write_jsonl(directory / "data" / "train.jsonl", rows[:200])  # so the held-out pairs are a file of their own
        write_jsonl(directory / "data" / "test.jsonl", rows[200:])
        overrides = vlm_overrides(directory, vlm_dir, directory / "data", "n_epochs=3", "lr=1e-3")
        train.run(configuration.load([*overrides, "eval_every=1000"]))
        evals = records(directory / "run", "eval")
        assert evals[0]["loss/eval"] == torch.tensor(math.log(2)).item()
        accuracy[with_images] = evals[-1]["rewards_eval/accuracies"]
    assert accuracy[True] >= 0.9 and 0.3 <= accuracy[False] <= 0.7, accuracy


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda row, d: row | {"images": ["img/missing.png"]}, r"pairs.jsonl:1: image '.*missing.png' cannot be read"),
        (lambda row, d: row | {"images": ["img/0.png", "img/0.png"]}, r"pairs.jsonl:1: the prompt has 1 image "
         r"placeholder \('<image>'\) and the row 2 images"),
        (lambda row, d: (d / "img" / "bad.png").write_bytes(b"not a png") and row | {"images": ["img/bad.png"]},
         r"pairs.jsonl:1: .*bad.png is not an image that can be decoded"),
    ],
)  # fmt: skip
def test_bad_images_stop_with_one_line_naming_the_row(vlm_dir, tmp_path, run_main, change, message):
    rows = colour_rows(tmp_path, 4)
    rows[0] = change(rows[0], tmp_path)
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    result = run_main(*vlm_overrides(tmp_path, vlm_dir, data))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode == 2 and len(errors) == 1 and re.search(message, errors[0]), result.stderr[-2000:]


def test_image_rows_for_a_text_model_stop_with_one_line(make_config, tmp_path):
    rows = colour_rows(tmp_path, 4)
    for row in rows:  # plain text, as a text model's template takes
        row["prompt"][0]["content"] = "What colour is the square?"
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    from utils import UserError

    with pytest.raises(UserError, match=r"pairs.jsonl:1: column 'images' holds images, and this model takes text only"):
        train.run(make_config(f"datasets=[{data}]"))
