"""Vision-language DPO against TRL's DPOTrainer (--vision [--rounds N]): a random LLaVA (LlavaForConditionalGeneration)
of real families' shapes, CLIP ViT-B/16's vision tower (224 px images in 16 px patches: 196 image tokens; frozen in
both trainers, as model.freeze_vision keeps it) and a Llama of SmolLM2-135M's width, heads and 49152-token vocabulary
with 10 of its 30 layers, ~150M parameters in all; pairs of a coloured square (a 224 px PNG) and the question what
colour it is, chosen the right colour and rejected another, their text padded with words to HH-like token lengths
(prompt median 94, chosen 27, rejected 37 beside the image's tokens), none truncated at max_length 512 (prompts 384);
4 pairs a step, DPO beta 0.1, AdamW lr 1e-6, float32. Each configuration runs in a fresh process, ours and TRL's
alternating, 2 rounds unless told: pairs/s, peak RSS, and the images each step's vision towers encode per pair (a
forward hook on the policy's tower and on a live reference's), counted over the warm-up and timed steps.

- ours, packed, cached reference (our default): each pair's prompt and its image once in the packed row, so the
  policy encodes 1 image per pair; the reference's log-probs are computed once before training (setup, not timed).
- ours, packed, live reference (reference_cache=false): a frozen reference model scores each step's batch, as TRL's
  must: 1 + 1 images per pair.
- TRL DPOTrainer, padded, live reference: its collator repeats each prompt and its images for the chosen and the
  rejected row (2 per pair in the policy, 2 in the reference); TRL 1.16 refuses precompute_ref_log_probs for vision
  datasets, so its reference runs on every step. Its timer (bench/trl.py's StepTimer) leaves out the collator, which
  decodes and resizes the images; ours decodes them inside the step: ~15 ms for 8 images here, against seconds a
  step.

The output (numbers in angle brackets; the model line as the full size prints it, wrapped here):

    CPU: <name>, <n> cores, flags <flags>, oneDNN ISA limit <limit>; torch <v>, transformers <v>, trl <v>, <n> threads
    model: random LLaVA of 150.3M parameters: vision CLIP ViT-like {'hidden_size': 768, 'intermediate_size': 3072,
    'num_hidden_layers': 12, 'num_attention_heads': 12, 'image_size': 224, 'patch_size': 16} 85.8M (frozen),
    projector 0.7753M, text Llama {'hidden_size': 576, 'intermediate_size': 1536, 'num_hidden_layers': 10,
    'num_attention_heads': 9, 'num_key_value_heads': 3, 'max_position_embeddings': 2048, 'rope_theta': 100000.0,
    'tie_word_embeddings': True, 'vocab_size': 49153} 63.71M; SmolLM2 tokenizer + <image>
    pairs: 32 coloured squares (224 px PNG, 196 image tokens) with HH-like text lengths, max_length 512 (prompt 384),
    4 pairs a step, DPO beta 0.1, AdamW lr 1e-6, float32; 2 warm-up + 6 timed steps; alternating, 2 rounds, each run
    in a fresh process
    configuration                               pairs/s  peak RSS  images/pair (policy + reference)
    ours (packed, cached reference)               <p/s>  <GiB> GiB  1 + 0
    ours (packed, live reference)                 <p/s>  <GiB> GiB  1 + 1
    TRL DPOTrainer (padded, live reference)       <p/s>  <GiB> GiB  2 + 2
    (the three rows again for each further round)
    ours (packed, cached reference): <ratio>x TRL DPOTrainer's pairs/s
    ours (packed, live reference): <ratio>x TRL DPOTrainer's pairs/s

pairs/s: %8.3f; peak RSS: the process's high-water mark (setup included), %5.2f GiB; images per pair: %g each.

--smoke: one round of one warm-up and one timed step of 4 pairs on a tiny LLaVA (a 2-layer CLIP-like tower on 32 px
images, 16 image tokens; a 2-layer Llama over the tiny byte-level tokenizer) at max_length 256, as the test suite
runs it."""

import json
import math
import os
import random
import tempfile
from pathlib import Path

import torch
import transformers

from bench.common import (
    HH_LOG_SPREAD,
    HH_MEDIANS,
    bench_tokenizer,
    images_encoded,
    peak_memory_gib,
    with_machine_rates,
    worker_subprocess,
)
from bench.step import lever_subprocess
from bench.trl import train_timed
from modeling.precision import cpu_flags, cpu_name
from modeling.vision import freeze_vision_tower
from utils import REPO_ROOT

# Sizes of the LLaVA: CLIP ViT-B/16's tower (openai/clip-vit-base-patch16), and SmolLM2-135M's Llama with 10 of its
# 30 layers (~150M in all, a step in seconds on 2 CPU cores); --smoke: the tests' tiny VLM (conftest.save_tiny_vlm).
VLM_SIZES = {
    "full": {
        "vision": dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12, image_size=224,
            patch_size=16,
        ),
        "text": dict(
            hidden_size=576, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=2048, rope_theta=100000.0, tie_word_embeddings=True,
        ),
    },
    "smoke": {
        "vision": dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
            patch_size=8,
        ),
        "text": dict(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512,
        ),
    },
}  # fmt: skip
# (max_length, max_prompt_length, pairs per step)
VLM_WORKLOADS = {"full": (512, 384, 4), "smoke": (256, 192, 4)}
IMAGE_TOKEN = "<image>"
# ChatML, as SmolLM2's template, its image parts the image token (which the processor expands into the image's)
CHATML_WITH_IMAGES = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% else %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "yellow": (230, 220, 20)}
QUESTION = "What colour is the square?"
# filler words (each one token under SmolLM2's tokenizer) that pad the text to HH-like lengths
FILLER = (
    "the of and to in is it that for on with as was be this by at from or an have not are but what all were when we "
    "there can more if will one about up out so some would time them people just could like into than only other"
).split()
CONFIGURATIONS = {
    "ours (packed, cached reference)": ["reference_cache=true"],
    "ours (packed, live reference)": ["reference_cache=false"],
    "TRL DPOTrainer (padded, live reference)": None,
}


def save_vlm(directory: Path, size: str) -> str:
    """A random LLaVA of VLM_SIZES[size] (weights from seed 0; both trainers load them), saved with its processor:
    the tokenizer (SmolLM2's where ../shared has it, for the full size; the tiny byte-level one for the smoke) with
    an added image token, CLIP's image processor at the tower's size, the ChatML template. The tokenizer's name."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if size == "full":
        tokenizer, tokenizer_name = bench_tokenizer()
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(REPO_ROOT / "assets" / "tiny-llama")
        tokenizer_name = "tiny byte-level"
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # both trainers fall back to it: set once, read alike
    vision, text = (VLM_SIZES[size][part] for part in ("vision", "text"))
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**vision),
        text_config=transformers.LlamaConfig(
            **text, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        ),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(directory)
    side = vision["image_size"]
    processor = transformers.LlavaProcessor(
        image_processor=CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side}),
        tokenizer=tokenizer, patch_size=vision["patch_size"], vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=CHATML_WITH_IMAGES,
    )  # fmt: skip
    processor.save_pretrained(directory)
    return tokenizer_name


def describe_vlm(model_dir: str, size: str) -> str:
    """The model's parameters, by part, and its sizes (built on the meta device: nothing allocated)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = transformers.LlavaForConditionalGeneration(config)
    count = lambda module: sum(p.numel() for p in module.parameters()) / 1e6  # noqa: E731
    inner, text = model.model, {**VLM_SIZES[size]["text"], "vocab_size": config.text_config.vocab_size}
    head = 0 if config.text_config.tie_word_embeddings else count(model.lm_head)
    return (
        f"random LLaVA of {count(model):.4g}M parameters: vision CLIP ViT-like {VLM_SIZES[size]['vision']} "
        f"{count(inner.vision_tower):.4g}M (frozen), projector {count(inner.multi_modal_projector):.4g}M, text Llama "
        f"{text} {count(inner.language_model) + head:.4g}M"
    )


def square_rows(directory: Path, n: int, processor, max_length: int, max_prompt_length: int, seed: int) -> list[dict]:
    """n pairs as tests/test_vision.py's: a square of one of four colours (its shade varied; a PNG at the tower's
    size, written under directory/img and named relative to the data file), the question what colour, chosen the
    right colour and rejected another, every colour as often chosen as rejected; then filler words to HH-like token
    lengths, scaled to max_length, kept within max_prompt_length and max_length (the image's tokens, the template's
    and an EOS counted) so that neither trainer truncates."""
    from PIL import Image

    rng, names, tokenizer = random.Random(seed), list(COLOURS), processor.tokenizer
    side = processor.image_processor.crop_size["height"]
    image_tokens = (side // processor.patch_size) ** 2  # the default strategy drops CLIP's class token
    length = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731

    def rendered(messages: list[dict], generation: bool) -> int:  # tokens, each image placeholder as its tokens
        text = processor.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        return length(text.replace(IMAGE_TOKEN, "")) + image_tokens * text.count(IMAGE_TOKEN)

    def filler(median: float, limit: int) -> str:  # a log-normal draw of tokens, as words cut at the last one
        tokens = min(limit, max(1, round(rng.lognormvariate(math.log(median * max_length / 512), HH_LOG_SPREAD))))
        words = "".join(" " + rng.choice(FILLER) for _ in range(tokens))
        offsets = tokenizer(words, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return words[: offsets[tokens - 1][1]]

    user = lambda text: [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]  # noqa: E731
    prompt_tokens = rendered(user(QUESTION), generation=True)
    answer = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    longest_answer = "It is yellow."
    answer_tokens = rendered(user(QUESTION) + answer(longest_answer), False) - prompt_tokens + 1  # + EOS
    margin = 4  # words joined across a boundary may tokenize a little longer than apart
    (directory / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        right, wrong = names[i % 4], names[(i + 1 + (i // 4) % 3) % 4]
        shade = tuple(min(255, max(0, c + rng.randint(-20, 20))) for c in COLOURS[right])
        Image.new("RGB", (side, side), shade).save(directory / "img" / f"{i}.png")
        prompt = filler(HH_MEDIANS["prompt"], max_prompt_length - prompt_tokens - margin)
        room = max_length - prompt_tokens - length(prompt) - answer_tokens - margin
        row = {"prompt": user(QUESTION + prompt), "images": [f"img/{i}.png"]}
        for response, colour in (("chosen", right), ("rejected", wrong)):
            row[response] = answer(f"It is {colour}." + filler(HH_MEDIANS[response], room))
        rows.append(row)
    return rows


def trl_vision_worker(
    result_file: str, model_dir: str, data_file: str, max_length: int, pairs: int, warmup: int, steps: int
) -> None:
    """TRL's DPOTrainer on the VLM and the pairs of data_file (their images loaded into an `images` column), with the
    processor as its processing_class and a live reference (TRL 1.16 precomputes none for images), the policy's
    vision tower frozen as ours keeps it, float32: pairs/s, peak RSS and the images each tower encodes per pair."""
    import datasets
    from transformers.image_utils import load_image

    transformers.logging.set_verbosity_error()  # its load report: this process's output is a result
    datasets.disable_progress_bars()
    data = Path(data_file)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    for row in rows:
        row["images"] = [load_image(str(data.parent / path)) for path in row["images"]]
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    policy, reference = (
        transformers.LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32) for _ in range(2)
    )
    freeze_vision_tower(policy)
    with images_encoded(policy, reference) as encoded:
        times = train_timed(policy, processor, rows, False, pairs, max_length, False, warmup + steps, reference)
    seen = pairs * (warmup + steps)
    result = {
        "pairs_per_second": pairs * steps / sum(times[warmup:]),
        "peak_memory_gib": peak_memory_gib(False),
        "images_per_pair": {"policy": encoded[0] / seen, "reference": encoded[1] / seen},
    }
    Path(result_file).write_text(json.dumps(result))


def ours_overrides(model_dir: str, data_file: Path, cache_dir: str, size: str) -> list[str]:
    """Our trainer on the VLM and the pairs, float32 (TRL's recipe on a CPU), TRL's settings."""
    max_length, max_prompt_length, pairs = VLM_WORKLOADS[size]
    return [
        "model=blank_model",
        f"model.name_or_path={model_dir}",
        "model.fsdp_policy_mp=null",
        f"datasets=[{data_file}]",
        f"local_dirs=[{cache_dir}]",
        "loss.beta=0.1",
        "lr=1e-6",
        f"max_length={max_length}",
        f"max_prompt_length={max_prompt_length}",
        f"batch_size={pairs}",
        f"eval_batch_size={pairs}",
        "activation_checkpointing=false",
        "wandb.enabled=false",
        "debug=true",
    ]


def measure(name: str, model_dir: str, data_file: Path, size: str, warmup: int, steps: int) -> dict:
    """One configuration in a fresh process: ours through bench.step's worker, TRL's through trl_vision_worker."""
    max_length, _, pairs = VLM_WORKLOADS[size]
    with tempfile.TemporaryDirectory() as tmp:
        result_file = str(Path(tmp) / "result.json")
        if CONFIGURATIONS[name] is None:
            kwargs = dict(model_dir=model_dir, data_file=str(data_file), max_length=max_length, pairs=pairs)
            return worker_subprocess(trl_vision_worker, result_file, **kwargs, warmup=warmup, steps=steps)
        overrides = [*ours_overrides(model_dir, data_file, with_machine_rates(tmp), size), *CONFIGURATIONS[name]]
        return lever_subprocess(overrides, warmup, steps, result_file, data_file=str(data_file), n_rows=None)


def bench_vision(warmup: int, steps: int, smoke: bool, rounds: int) -> None:
    size = "smoke" if smoke else "full"
    rounds, warmup, steps = (1, 1, 1) if smoke else (rounds, warmup, steps)
    max_length, max_prompt_length, pairs = VLM_WORKLOADS[size]
    import trl

    print(
        f"CPU: {cpu_name()}, {os.cpu_count()} cores, flags {' '.join(cpu_flags()) or 'none'}, oneDNN ISA limit "
        f"{os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}, {torch.get_num_threads()} threads",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        tokenizer_name = save_vlm(Path(model_dir), size)
        print(f"model: {describe_vlm(model_dir, size)}; {tokenizer_name} tokenizer + {IMAGE_TOKEN}", flush=True)
        processor = transformers.AutoProcessor.from_pretrained(model_dir)
        n_rows = pairs * (warmup + steps)
        data_file = Path(tmp) / "data" / "pairs.jsonl"
        rows = square_rows(data_file.parent, n_rows, processor, max_length, max_prompt_length, seed=0)
        data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
        side, patch = (VLM_SIZES[size]["vision"][key] for key in ("image_size", "patch_size"))
        print(
            f"pairs: {n_rows} coloured squares ({side} px PNG, {(side // patch) ** 2} image tokens) with HH-like text "
            f"lengths, max_length {max_length} (prompt {max_prompt_length}), {pairs} pairs a step, DPO beta 0.1, "
            f"AdamW lr 1e-6, float32; {warmup} warm-up + {steps} timed steps; alternating, {rounds} rounds, each run "
            "in a fresh process"
        )
        print(f"{'configuration':42s} {'pairs/s':>8s} {'peak RSS':>9s}  images/pair (policy + reference)", flush=True)
        speeds = {name: [] for name in CONFIGURATIONS}
        for _ in range(rounds):
            for name in CONFIGURATIONS:
                result = measure(name, model_dir, data_file, size, warmup, steps)
                speeds[name].append(result["pairs_per_second"])
                images = result["images_per_pair"]
                print(
                    f"{name:42s} {result['pairs_per_second']:8.3f} {result['peak_memory_gib']:5.2f} GiB  "
                    f"{images['policy']:g} + {images['reference']:g}",
                    flush=True,
                )
    trl_name = next(name for name, overrides in CONFIGURATIONS.items() if overrides is None)
    for name in CONFIGURATIONS:
        if name != trl_name:
            print(f"{name}: {sum(speeds[name]) / sum(speeds[trl_name]):.2f}x TRL DPOTrainer's pairs/s")
