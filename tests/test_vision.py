"""Vision-language pairs: images in the prompt, read from the data, encoded once per pair in the packed layout,
equal to a plain forward of each (prompt + images + response) alone, learnt from (a preference a text model cannot
learn), and bad image input stopped with one line."""

import dataclasses
import math
import re

import pytest
import torch
import transformers

import config as configuration
import train
from conftest import (
    PADDED_BASELINE,
    QUESTION,
    assert_same_metrics,
    assert_same_weights,
    colour_rows,
    png,
    read_jsonl,
    records,
    save_tiny_vlm,
    tiny_vlm,
    vlm_overrides,
    write_jsonl,
)
from core.scoring import Scorer, ScoringSettings
from modeling.distributed import Topology
from modeling.vision import Vision, pack_images, vision_tower
from pairs.sources import read_file_rows
from persistence.tokenized import Tokenization, tokenize_pairs
from preference_datasets import parse_rows


def images_at(directory, row: dict) -> list:
    return [transformers.image_utils.load_image(str(directory / name)) for name in row["images"]]


def with_two_images(rows: list[dict]) -> list[dict]:
    """The rows, every other one's prompt asking about its own image and the next row's: a batch that mixes prompts
    of one image and of two."""
    two = [{"type": "image"}, {"type": "text", "text": "Compare it with"}, *QUESTION]
    return [
        row | {"prompt": [{"role": "user", "content": two}], "images": row["images"] + rows[i + 1]["images"]}
        if i % 2 == 0 else row
        for i, row in enumerate(rows)
    ]  # fmt: skip


# The path each family takes by default, as the probes decide on the placed model with an image in a prompt: LLaVA
# and Idefics3 give image tokens plain positions and causal attention; Gemma 3 lets an image's tokens see each other
# and PaliGemma its whole prefix (image, BOS, prompt), which the packed mask expresses (bidirectional_blocks);
# Qwen2-VL gives image tokens 3-D rotary positions, which packed rows take from its own get_rope_index per sequence;
# LLaVA-OneVision encodes an image in tiles of the grid it fits (anyres): all of them pack. SmolVLM is Idefics3's
# architecture, LLaVA-NeXT LLaVA's with anyres; Aya Vision and InternVL tile as their processors (not their image
# processors) ask; Qwen3-VL's positions interleave over the rotary frequencies, and its tower's deepstack features join
# the first decoder layers at the image tokens; Qwen2.5-Omni's thinker computes them with a get_rope_index that takes
# no token marks; Qwen3.5's gated delta-rule layers take no packed mask: it falls back to padded rows.
VISION_ZOO = {
    "llava": ("packed", 32),
    "gemma3": ("packed", 32),
    "idefics3": ("packed", 48),
    "qwen2_vl": ("packed", 32),
    "qwen2_5_vl": ("packed", 32),
    "llava_onevision": ("packed", 48),
    "paligemma": ("packed", 32),
    "qwen3_vl": ("packed", 32),
    "smolvlm": ("packed", 48),
    "llava_next": ("packed", 48),
    "aya_vision": ("packed", 48),
    "internvl": ("packed", 48),
    "qwen3_5": ("padded", 32),
    "qwen2_5_omni_thinker": ("packed", 32),
}
# A prompt with several images: LLaVA-OneVision gives each of them its base features and a newline, no tiles
SEVERAL_IMAGES = ("llava_onevision",)


@pytest.mark.parametrize(
    "family, images", [(family, 1) for family in sorted(VISION_ZOO)] + [(family, 2) for family in SEVERAL_IMAGES]
)
def test_vision_zoo_default_path_equals_a_plain_forward_of_each_sequence(family, images, tmp_path):
    # Every sequence's summed log-prob and every trainable parameter's gradient, on the path the family takes by
    # default and in padded rows, equal a plain forward of that prompt, its images and the response alone, as
    # transformers computes it from the processor's own inputs (PaliGemma's given the response as its suffix, which
    # marks the prefix). The packed layout holds each prompt, image tokens included, once per pair: the vision tower
    # encodes each image once there, twice in padded rows (TRL's layout).
    expected_path, image_size = VISION_ZOO[family]
    model, processor = tiny_vlm(family)
    tokenizer = processor.tokenizer
    tokenizer.vision = Vision.of(processor)
    rows = colour_rows(tmp_path, 4, image_size=image_size)
    rows = with_two_images(rows) if images == 2 else rows
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    pairs = parse_rows(read_file_rows(data), "t", tokenizer)
    for row, pair in zip(rows, pairs):  # the images read from the files the rows name
        assert pair.images == tuple((tmp_path / name).read_bytes() for name in row["images"])
    examples = tokenize_pairs(pairs, tokenizer, Tokenization(256, 192, sft=False)).take(range(4))
    encoded = []  # the images (Idefics3: tiles) each forward of the vision tower encodes

    def count(module, args, kwargs):
        encoded.append((args[0] if args else kwargs["pixel_values"]).shape[0])

    vision_tower(model).register_forward_pre_hook(count, with_kwargs=True)

    def tiles(row: dict, pair) -> int:
        # what the tower takes for a prompt's images, as the processor gives them: each image (LLaVA, Gemma 3), its
        # tiles (Idefics3: 4 and a global one), or its patches (Qwen2-VL: 16, flattened)
        pixels = processor(text=[pair.prompt], images=[images_at(tmp_path, row)], return_tensors="pt")["pixel_values"]
        return pixels.shape[0] * (pixels.shape[1] if pixels.dim() == 5 else 1)

    per_pair = sum(tiles(row, pair) for row, pair in zip(rows, pairs))
    topology, results = Topology.create("BasicTrainer"), {}
    for layout in ("packed", "padded"):
        settings = configuration.load(vlm_overrides(tmp_path, tmp_path, data, f"layout={layout}", "max_length=256"))
        scoring = ScoringSettings.of_run(settings)
        scorer = Scorer.create(model, scoring, tokenizer.pad_token_id, topology, False, None, vision=tokenizer.vision)
        model.zero_grad()
        encoded.clear()
        logps = scorer(model, scorer.batch(examples), None)
        logps.sum().backward()
        results[scorer.layout] = (
            logps.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        )
        if layout == "packed":
            assert scorer.layout == expected_path, scorer.fallbacks
        times = {"packed": 1, "padded": 2}[scorer.layout]  # each image, per pair
        assert encoded == [per_pair * times], (scorer.layout, encoded)
    model.zero_grad()
    plain = []
    for response in ("chosen", "rejected"):
        for row, pair in zip(rows, pairs):
            text, images = [pair.prompt], [images_at(tmp_path, row)]
            prompt = processor(text=text, images=images, add_special_tokens=False, return_tensors="pt")
            answer = tokenizer(getattr(pair, response), add_special_tokens=False, return_tensors="pt").input_ids
            if family == "paligemma":  # the suffix: the answer and the EOS the processor ends it with (causal: no
                # earlier token sees it), marked 1 where the prefix is 0
                own = processor(
                    text=text, images=images, suffix=[getattr(pair, response)], add_special_tokens=False,
                    return_tensors="pt",
                )  # fmt: skip
                inputs = {name: own[name] for name in ("input_ids", "token_type_ids", "pixel_values")}
                prefix, suffix = prompt.input_ids[0].tolist(), answer[0].tolist() + [tokenizer.eos_token_id]
                assert inputs["input_ids"][0].tolist() == prefix + suffix
                assert inputs["token_type_ids"][0].tolist() == [0] * len(prefix) + [1] * len(suffix)
            else:
                inputs = dict(prompt)  # per token: the answer's are text, attended (Qwen2.5-Omni's 3-D positions ask)
                extended = {"input_ids": answer, "attention_mask": torch.ones_like(answer)}
                for name in ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"):
                    if name in inputs:
                        inputs[name] = torch.cat([inputs[name], extended.get(name, 0 * answer)], dim=1)
            ids = inputs["input_ids"]
            logits = model(**inputs).logits[0, :-1].float()
            token_logps = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
            start = prompt.input_ids.shape[1] - 1
            plain.append(token_logps[start : start + answer.shape[1]].sum())
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


# Families refused by the inputs probe, and the line that says why
REFUSED = {
    "mllama": "MllamaForConditionalGeneration's processor gives cross_attention_mask with an image, which this trainer "
    "does not build: this model cannot train on pairs with images here (docs/vision.md)",
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_a_family_whose_processor_gives_inputs_this_trainer_does_not_build_is_refused_in_one_line(family, tmp_path):
    from utils import UserError

    model, processor = tiny_vlm(family)
    settings = configuration.load(vlm_overrides(tmp_path, tmp_path, tmp_path / "pairs.jsonl"))
    with pytest.raises(UserError) as refused:
        Scorer.create(model, ScoringSettings.of_run(settings), 0, Topology.create("BasicTrainer"), False, None,
                      vision=Vision.of(processor))  # fmt: skip
    assert str(refused.value) == REFUSED[family]


def test_the_packed_mask_lets_an_images_tokens_see_each_other_and_nothing_else_changes():
    # Written out token by token: a prompt [t, i, i, t, i, i, t] (two images of two tokens) and one response [r, r]
    # in a packed row. With image blocks, a token of an image also sees the later tokens of the same image, never
    # those of the other image, and nothing else changes; without them the mask is the causal one.
    from core.layouts import dense_mask, image_runs, pack

    image = 9
    example = {"prompt": [1, image, image, 2, image, image, 3], "responses": [[4, 5]]}
    batch = pack([example], 0)
    causal = dense_mask(batch)[0, 0]
    batch.bidirectional_blocks = image_runs(batch.input_ids == image)
    assert batch.bidirectional_blocks[0].tolist() == [-1, 0, 0, -1, 1, 1, -1, -1, -1]
    bidirectional = dense_mask(batch)[0, 0]
    added = {(q, k) for q in range(9) for k in range(9) if bidirectional[q, k] and not causal[q, k]}
    assert added == {(1, 2), (4, 5)}
    assert not (causal & ~bidirectional).any()


def test_the_packed_mask_lets_a_prompt_see_all_of_itself_and_its_responses_stay_causal():
    # PaliGemma's prefix written out token by token: a prompt [t, i, i, t] and responses [r, r] and [r] in a packed
    # row, the prompt one block. Every prompt token sees every other, later ones too, and nothing else changes: a
    # response sees its prompt and itself causally, never the other response. In a sliding layer (window 2) the
    # prompt still sees all of itself, as PaliGemma 2 composes it (blocks beyond the window), and the responses are
    # windowed as without the block; Gemma 3's composition (blocks within the window) would hide the prompt's first
    # tokens from its last ones.
    from core.layouts import AttentionSpan, dense_mask, pack, prompt_blocks

    batch = pack([{"prompt": [1, 9, 9, 2], "responses": [[4, 5], [6]]}], 0)
    window = AttentionSpan(window=2)
    causal, causal_windowed = dense_mask(batch)[0, 0], dense_mask(batch, window)[0, 0]
    batch.bidirectional_blocks, batch.blocks_within_span = prompt_blocks(batch), False
    assert batch.bidirectional_blocks[0].tolist() == [0, 0, 0, 0, -1, -1, -1]
    prefix = dense_mask(batch)[0, 0]
    added = {(q, k) for q in range(7) for k in range(7) if prefix[q, k] and not causal[q, k]}
    assert added == {(q, k) for q in range(4) for k in range(4) if k > q}
    assert not (causal & ~prefix).any()
    windowed = dense_mask(batch, window)[0, 0]
    assert windowed[:4, :4].all() and torch.equal(windowed[4:], causal_windowed[4:])
    batch.blocks_within_span = True
    bounded = dense_mask(batch, window)[0, 0]
    assert {(q, k) for q in range(4) for k in range(4) if not bounded[q, k]} == {(2, 0), (3, 0), (3, 1)}


def test_the_inputs_probe_refuses_paligemma_marked_as_gemma_3_marks_images():
    # PaliGemma's token_type_ids say which tokens are its prefix (0) and which its suffix (1). Marked as Gemma 3 marks
    # images (1 on image tokens, 0 on text and the response), the model attends otherwise than from its processor's
    # inputs, and the inputs probe refuses it; marked as its processor marks them, the probe passes.
    from core.probes import vision_problem
    from modeling.vision import BIDIRECTIONAL_BLOCKS

    model, processor = tiny_vlm("paligemma")
    own = Vision.of(processor).for_model(model)
    assert vision_problem(model, own, torch.float32, torch.device("cpu")) is None
    as_images = dataclasses.replace(own, bidirectional=BIDIRECTIONAL_BLOCKS["gemma3"])
    problem = vision_problem(model, as_images, torch.float32, torch.device("cpu"))
    assert problem and problem.startswith("PaliGemmaForConditionalGeneration computes other log-probs"), problem


def test_paligemma_scores_alike_in_train_and_eval_mode_and_causally_without_its_marks():
    # transformers 5.24 makes PaliGemma's prefix bidirectional whenever token_type_ids are given, whatever the mode:
    # the policy (train mode) and the reference (eval mode) score alike, in padded rows (the prefix marked) and packed
    # ones (the prompts as blocks of the mask). Without the marks every token is causal, and the log-probs move.
    from core.attention import attention_spans
    from core.heads import sequence_logps
    from core.image_inputs import with_image_inputs
    from core.layouts import pack, pad
    from core.probes import probe_examples

    model, processor = tiny_vlm("paligemma")
    vision = Vision.of(processor).for_model(model)
    examples, spans = probe_examples(vision), attention_spans(model)
    scores = {}
    for layout in (pad, pack):
        batch = with_image_inputs(layout(examples, 0), examples, vision)
        for training in (True, False):
            model.train(training)
            with torch.no_grad():
                scores[layout, training] = sequence_logps(model, batch, None, torch.float32, False, spans=spans)
        assert torch.equal(scores[layout, True], scores[layout, False])
    torch.testing.assert_close(scores[pack, False], scores[pad, False], rtol=1e-6, atol=1e-5)
    unmarked = with_image_inputs(pad(examples, 0), examples, vision)
    del unmarked.image_inputs["token_type_ids"]
    with torch.no_grad():
        causal = sequence_logps(model, unmarked, None, torch.float32, False)
    assert (causal - scores[pad, False]).abs().max() > 1e-2


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
        (lambda row, d: row | {"images": ["http://127.0.0.1:9/0.png"]}, r"pairs.jsonl:1: image http://127.0.0.1:9/0.png"
         r" is a URL, and HF_HUB_OFFLINE is set: nothing is fetched offline; download it and give its path"),
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


def test_a_hub_models_processor_is_found_as_its_config_is(vlm_dir, tmp_path, monkeypatch):
    # A Hub id has no local directory to look for a processor's files in: the config says whether the model sees
    # images, and the processor comes from where the config came from (here the Hub is played by a local copy).
    from omegaconf import OmegaConf

    from modeling import tokenizers as models
    from utils import REPO_ROOT

    hub = {
        "org/tiny-llava": str(vlm_dir),
        "org/tiny-llama": str(REPO_ROOT / "assets" / "tiny-llama"),
    }
    monkeypatch.setattr(models, "resolve_model_dir", lambda name, cache_dir: name)
    for auto in (transformers.AutoConfig, transformers.AutoProcessor, transformers.AutoTokenizer):
        original = auto.from_pretrained.__func__
        monkeypatch.setattr(
            auto,
            "from_pretrained",
            classmethod(lambda cls, name, *a, _o=original, **k: _o(cls, hub.get(name, name), *a, **k)),
        )
    found = {}
    for name in hub:
        settings = OmegaConf.create({"name_or_path": name, "tokenizer_name_or_path": None, "trust_remote_code": False})
        found[name] = models.load_tokenizer(settings, tmp_path).vision
    assert found["org/tiny-llava"].placeholder == "<image>" and found["org/tiny-llama"] is None


def test_a_changed_image_file_rebuilds_the_tokenized_cache(vlm_dir, tmp_path, capsys):
    # The data file is the same; one image it names changes: the cached examples are not reused, and the example
    # holds the new image (its key with it). Untouched, the cache is read back.
    from persistence.tokenized import load_examples

    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.vision = Vision.of(transformers.AutoProcessor.from_pretrained(vlm_dir))
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_rows(tmp_path / "data", 8))
    settings = Tokenization(96, 64, sft=False)
    load = lambda: load_examples([str(data)], tokenizer, settings, 0, 0, tmp_path / "cache")["train"]  # noqa: E731
    before = load()
    assert "tokenized earlier" not in capsys.readouterr().out
    load()
    assert "tokenized earlier" in capsys.readouterr().out
    (tmp_path / "data" / "img" / "0.png").write_bytes(png((0, 0, 0), 40))
    after = load()
    assert "tokenized earlier" not in capsys.readouterr().out
    assert after.take([0])[0]["images"] == pack_images((png((0, 0, 0), 40),)) and after.keys[0] != before.keys[0]


@pytest.fixture
def image_server(tmp_path, monkeypatch):
    """(the base URL of an HTTP server on the loopback address serving tmp_path/served, that directory), online: the
    offline settings the suite sets are taken away for this test."""
    import functools
    import http.server
    import threading

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    served = tmp_path / "served"
    served.mkdir()

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(served)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", served
    server.shutdown()
    server.server_close()


def test_image_urls_are_fetched_once_and_cached_with_the_tokenized_data(vlm_dir, tmp_path, image_server, capsys):
    # A row's images given as URLs (never joined to the data file's directory) are fetched while the data is
    # tokenized; the cache keeps their bytes, so a rerun offline, the server gone, reads them back.
    import os

    from persistence.tokenized import load_examples

    base, served = image_server
    rows = colour_rows(served, 8)
    for row in rows:
        row["images"] = [f"{base}/{name}" for name in row["images"]]
    (tmp_path / "data").mkdir()
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.vision = Vision.of(transformers.AutoProcessor.from_pretrained(vlm_dir))
    settings = Tokenization(96, 64, sft=False)
    load = lambda: load_examples([str(data)], tokenizer, settings, 0, 0, tmp_path / "cache")["train"]  # noqa: E731
    fetched = load()
    served_bytes = [(served / "img" / f"{i}.png").read_bytes() for i in range(8)]
    assert sorted(fetched.take([i])[0]["images"] for i in range(8)) == sorted(pack_images((b,)) for b in served_bytes)
    assert "tokenized earlier" not in capsys.readouterr().out
    for name in os.listdir(served / "img"):
        os.remove(served / "img" / name)
    os.environ["HF_HUB_OFFLINE"] = "1"  # monkeypatch's delenv puts the suite's value back after the test
    cached = load()
    assert "tokenized earlier" in capsys.readouterr().out
    assert [cached.take([i])[0]["images"] for i in range(8)] == [fetched.take([i])[0]["images"] for i in range(8)]


def test_an_image_url_that_cannot_be_fetched_is_one_line_naming_the_url_and_the_row(vlm_dir, tmp_path, image_server):
    from utils import UserError

    base, _ = image_server
    row = colour_rows(tmp_path, 1)[0] | {"images": [f"{base}/gone.png"]}
    tokenizer = transformers.AutoTokenizer.from_pretrained(vlm_dir)
    tokenizer.vision = Vision.of(transformers.AutoProcessor.from_pretrained(vlm_dir))
    with pytest.raises(UserError) as raised:
        parse_rows([("pairs.jsonl:1", row)], "pairs.jsonl", tokenizer)
    assert str(raised.value) == (
        f"pairs.jsonl:1: image {base}/gone.png could not be fetched (HTTP 404 File not found); download it and give "
        "its path (relative to the data file) in its place"
    )


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["llava", "gemma3", "paligemma"])
def test_vision_block_mask_training_on_cuda_equals_the_padded_run(family, tmp_path, capsys):
    # The block mask's backward with images on the GPU: LLaVA's causal image tokens, Gemma 3's image blocks and
    # PaliGemma's prefix block, trained as a user runs them (packed_attention=auto takes FlexAttention), float32
    # without TF32: every metric and the final weights equal the padded, full-logits, live-reference run's.
    model_dir = save_tiny_vlm(tmp_path / family, family)
    data = write_jsonl(tmp_path / "data" / "pairs.jsonl", colour_rows(tmp_path / "data", 24))
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for name, extra in (("padded", PADDED_BASELINE), ("block", ())):
            overrides = vlm_overrides(
                tmp_path / name, model_dir, data, "n_eval_examples=8", "+optimizer_kwargs.eps=1e-6", *extra
            )
            train.run(configuration.load(overrides))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert "packed layout (block attention" in capsys.readouterr().out  # Gemma 3 names its spans after it
    padded, block = (read_jsonl(tmp_path / name / "run" / "metrics.jsonl") for name in ("padded", "block"))
    for record in (record for record in (*padded, *block) if record["step"] == 0):
        for name in ("rewards_eval/accuracies", "rewards_train/accuracies"):  # the sign of rounding at step 0
            record.pop(name, None)
    assert_same_metrics(padded, block)
    assert_same_weights(tmp_path / "padded" / "run", tmp_path / "block" / "run")
