"""A vision-language model's image inputs on a batch: what its processor gives each prompt's images, in the order
the rows hold them, and for packed rows what the model's own forward would derive from each sequence alone: the
blocks of tokens that see each other both ways (an image's, or a prompt's) and the 3-D rotary positions of Qwen-VL
models. The scorer's batches, the probes', and those of sampling and of a round's reward (sampling, rewards) take
them here.
"""

import torch

from core.layouts import ModelBatch, image_runs, prompt_blocks, prompt_tokens
from modeling.vision import Vision, unpack_images


def with_image_inputs(batch: ModelBatch, examples: list[dict], vision: Vision | None) -> ModelBatch:
    """The batch with a vision-language model's image inputs: the images of each prompt its rows hold, in the order
    the rows hold them (ModelBatch.prompt_examples: in the packed layout each pair's images once)."""
    if vision is not None:
        images = [unpack_images(examples[i].get("images", b"")) for i in batch.prompt_examples]
        batch.image_inputs = vision.image_inputs(batch.input_ids, prompt_tokens(batch), images)
        if batch.segment_ids is not None and vision.bidirectional is not None:  # packed rows: the mask says it
            batch.bidirectional_blocks = bidirectional_blocks(batch, vision)
            batch.blocks_within_span = vision.bidirectional.within_window
        if vision.rope_index is not None and batch.segment_ids is not None:
            batch.image_inputs["position_ids"] = packed_rope_positions(batch, examples, vision)
        elif vision.first_position and batch.segment_ids is not None:  # the model's own positions; the mask's
            batch.image_inputs["position_ids"] = batch.position_ids + vision.first_position  # windows keep theirs
    return batch


def bidirectional_blocks(batch: ModelBatch, vision: Vision) -> torch.Tensor:
    """The blocks of packed rows whose tokens the model lets see each other both ways (Vision.bidirectional): each
    image's tokens (Gemma 3), or each prompt (PaliGemma's prefix)."""
    if vision.bidirectional.tokens == "images":
        return image_runs(batch.input_ids == vision.image_token_id)
    return prompt_blocks(batch)


def packed_rope_positions(batch: ModelBatch, examples: list[dict], vision: Vision) -> torch.Tensor:
    """[3, R, T] 3-D rotary positions of packed rows (Qwen-VL): each sequence's own, as the model gives them to
    prompt + response alone, laid out where the row holds it: the shared prompt's once (a causal prefix, they are
    the same in every sequence), then each response's, which continue from the prompt's. The 1-D positions of the
    batch stay for its mask's windows."""
    per_image = {  # the rows of each image, in the order the batch holds the images
        name: iter(batch.image_inputs[name].split(1)) for name in vision.rope_image_inputs if name in batch.image_inputs
    }
    positions = torch.zeros((3, *batch.input_ids.shape), dtype=torch.long)
    starts = (batch.segment_ids != torch.nn.functional.pad(batch.segment_ids, (1, 0), value=-2)[:, :-1]).nonzero()
    for row, start in starts.tolist():
        index = int(batch.segment_ids[row, start])
        if index < 0:
            continue
        example = examples[index]
        images = len(unpack_images(example.get("images", b"")))
        own = {name: torch.cat([next(rows) for _ in range(images)]) for name, rows in per_image.items() if images}
        prompt, offset = example["prompt"], start + len(example["prompt"])
        for response in example["responses"]:
            sequence = vision.sequence_positions(prompt + response, own)
            positions[:, row, start : start + len(prompt)] = sequence[:, : len(prompt)]
            positions[:, row, offset : offset + len(response)] = sequence[:, len(prompt) :]
            offset += len(response)
    return positions
