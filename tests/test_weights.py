"""Reading weights sharded (weights.py, models.prepare_model): an empty model placed on each mesh, every rank reading
only its own shards of the safetensors files, ends up with exactly the weights and buffers from_pretrained loads;
files that cannot be read so fall back to from_pretrained, with one line."""

import json
import os
from pathlib import Path

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from conftest import TINY_DIR, tiny_vlm
from modeling import weights
from modeling.adapters import LoraSettings, apply_lora
from modeling.distributed import Topology, free_port, init_process_group, leave_process_group, rank_environment
from modeling.models import load_model, prepare_model, stored_names
from modeling.placement import Placement, place


def model_config(directory: Path, block_name: str | None = "LlamaDecoderLayer") -> dict:
    return dict(
        name_or_path=str(directory),
        tokenizer_name_or_path=str(TINY_DIR),
        archive=None,
        block_name=block_name,
        policy_dtype="float32",
        fsdp_policy_mp=None,
        reference_dtype="auto",
        fsdp_reduce_dtype="float32",
        random_init=False,
        trust_remote_code=False,
    )


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """name -> (a from_pretrained directory, its block class): an untied Llama of 257 rows (uneven over 2 and 4
    ranks); a tied one saved in bfloat16, read into float32; GPT-2 with its Hub files' names (no "transformer.");
    a tiny LLaVA with llava-hf's names, which transformers renames while loading (its blocks: _no_split_modules')."""
    root = tmp_path_factory.mktemp("models")
    base = transformers.AutoConfig.from_pretrained(TINY_DIR)
    base.vocab_size = 257
    torch.manual_seed(1)
    transformers.AutoModelForCausalLM.from_config(base).save_pretrained(root / "llama")
    tied = transformers.AutoConfig.from_pretrained(TINY_DIR, tie_word_embeddings=True)
    torch.manual_seed(2)
    transformers.AutoModelForCausalLM.from_config(tied, dtype=torch.bfloat16).save_pretrained(root / "tied-bf16")
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=259, n_positions=64)
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(gpt2).save_pretrained(root / "gpt2")
    files = root / "gpt2" / "model.safetensors"
    save_file({k.removeprefix("transformer."): v for k, v in load_file(files).items()}, files, {"format": "pt"})
    llava, _ = tiny_vlm("llava")
    llava.save_pretrained(root / "llava-hf")
    hub_names = {hub_name(name): value.contiguous() for name, value in llava.state_dict().items()}
    save_file(hub_names, root / "llava-hf" / "model.safetensors", {"format": "pt"})
    return {"llama": (root / "llama", "LlamaDecoderLayer"), "tied-bf16": (root / "tied-bf16", "LlamaDecoderLayer"),
            "gpt2": (root / "gpt2", "GPT2Block"), "llava-hf": (root / "llava-hf", None)}  # fmt: skip


# llava-hf's checkpoints (transformers 4's names), by the prefix transformers 5 gives each part instead
LLAVA_HF_PREFIXES = {
    "model.language_model.": "language_model.model.",
    "lm_head.": "language_model.lm_head.",
    "model.vision_tower.": "vision_tower.vision_model.",
    "model.multi_modal_projector.": "multi_modal_projector.",
}


def hub_name(name: str) -> str:
    """A LlavaForConditionalGeneration tensor's name in llava-hf's files (llava-1.5-7b-hf's index, for one)."""
    prefix = next(prefix for prefix in LLAVA_HF_PREFIXES if name.startswith(prefix))
    return LLAVA_HF_PREFIXES[prefix] + name.removeprefix(prefix)


def read_on(topology: Topology, directory: Path, block_name: str, cache_dir: Path) -> dict[str, torch.Tensor]:
    """The model of `directory` read sharded onto the topology; its whole weights and buffers on rank 0."""
    config = OmegaConf.create({"activation_checkpointing": False, "model": model_config(directory, block_name)})
    model, initial = prepare_model(config.model, torch.float32, cache_dir, seed=0)
    assert initial.sharded and all(p.is_meta for p in model.parameters())
    placed = place(model, Placement(block_name=block_name), topology, None, initial)
    state = get_model_state_dict(placed, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {**state, **{f"buffer:{n}": b.detach().cpu() for n, b in placed.named_buffers()}}


def mesh_rank(rank: int, world: int, port: int, trainer: str, tp: int, dirs: dict, cache_dir: Path, out: Path):
    os.environ.update(rank_environment(rank, world, port))
    torch.set_num_threads(1)
    init_process_group(timeout_secs=60)
    try:
        topology = Topology.create(trainer, tp)
        for name, (directory, block_name) in dirs.items():
            state = read_on(topology, directory, block_name, cache_dir)
            if rank == 0:
                torch.save(state, out / f"{name}.pt")
    finally:
        leave_process_group()


MESHES = {
    "one process": ("BasicTrainer", 1, 1),
    "FSDP on 2": ("FSDPTrainer", 2, 1),
    "tensor parallel on 2": ("TensorParallelTrainer", 2, 2),
    "FSDP x TP, 2 x 2": ("FSDPTrainer", 4, 2),
}


@pytest.mark.xdist_group("processes")  # see pyproject.toml
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_reading_gives_exactly_the_weights_from_pretrained_loads(model_dirs, tmp_path, mesh):
    trainer, world, tp = MESHES[mesh]
    dirs = {name: d for name, d in model_dirs.items() if tp == 1 or name != "gpt2"}  # GPT-2 has no tensor-parallel plan
    if world == 1:
        for name, (directory, block_name) in dirs.items():
            torch.save(read_on(Topology(), directory, block_name, tmp_path), tmp_path / f"{name}.pt")
    else:
        args = (world, free_port(), trainer, tp, dirs, tmp_path, tmp_path)
        torch.multiprocessing.spawn(mesh_rank, args=args, nprocs=world)
    for name, (directory, _) in dirs.items():
        model_class = weights.model_class(False, transformers.AutoConfig.from_pretrained(directory))
        expected = model_class.from_pretrained(directory, dtype=torch.float32)
        expected = {**expected.state_dict(), **{f"buffer:{n}": b for n, b in expected.named_buffers()}}
        actual = torch.load(tmp_path / f"{name}.pt")
        assert actual.keys() == expected.keys(), name
        for key, value in expected.items():
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), (mesh, name, key)


def test_the_files_names_are_found_under_the_models_own(model_dirs):
    # GPT-2's Hub names lack the base model's prefix; a LoRA policy's add peft's; a tied weight needs one name only.
    directory, _ = model_dirs["gpt2"]
    config = OmegaConf.create(model_config(directory, "GPT2Block"))
    model, _ = prepare_model(config, torch.float32, directory, seed=0)
    names, problems = stored_names(model, weights.stored_shapes(directory), set())
    assert not problems and names["transformer.h.0.attn.c_attn.weight"] == "h.0.attn.c_attn.weight"
    assert "lm_head.weight" not in names  # tied to transformer.wte.weight: the files hold it under that name
    assert stored_names(model, {}, set())[1][0] == "transformer.wte.weight is missing"
    wrong = {**weights.stored_shapes(directory), "h.0.ln_1.weight": torch.Size([3])}
    assert "h.0.ln_1.weight has shape [3], expected [32]" in stored_names(model, wrong, set())[1]
    lora = apply_lora(model, LoraSettings(True, 4, 8, 0.0, None, None))
    adapters = {name for name, p in lora.named_parameters() if p.requires_grad}
    names, problems = stored_names(lora, weights.stored_shapes(directory), adapters)
    assert (
        not problems
        and names["base_model.model.transformer.h.0.attn.c_attn.base_layer.weight"] == "h.0.attn.c_attn.weight"
    )
    assert stored_names(lora, weights.stored_shapes(directory), set())[1][0].endswith(
        "lora_A.default.weight is missing"
    )


def test_names_transformers_renames_while_loading_are_read_sharded(model_dirs, tmp_path, capsys):
    # llava-hf's files name the language model language_model.model.* and the tower vision_tower.vision_model.*:
    # transformers' own rules for LlavaForConditionalGeneration rename them while loading, and the sharded reader reads
    # each under its file's name (the weights equal from_pretrained's on every mesh: the test above), with no fallback.
    directory, _ = model_dirs["llava-hf"]
    model, initial = prepare_model(OmegaConf.create(model_config(directory, None)), torch.float32, tmp_path, seed=0)
    assert initial.sharded and "from_pretrained" not in capsys.readouterr().out
    names, problems = stored_names(model, weights.stored_shapes(directory), set(), initial.conversions)
    assert not problems and names == {name: hub_name(name) for name in model.state_dict()}
    without_rules = stored_names(model, weights.stored_shapes(directory), set())[1]
    assert without_rules[0] == "model.vision_tower.embeddings.class_embedding is missing"


def test_files_that_cannot_be_read_sharded_fall_back_to_from_pretrained_with_one_line(model_dirs, tmp_path, capsys):
    directory, _ = model_dirs["llama"]
    expected = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    # pickled weights only (pytorch_model.bin)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((directory / "config.json").read_text())
    torch.save(expected, tmp_path / "bin" / "pytorch_model.bin")
    config = OmegaConf.create(model_config(tmp_path / "bin"))
    model = load_model(config, torch.float32, tmp_path, seed=0)
    assert (
        "no safetensors files (its files, for LlamaForCausalLM): every process loads the whole model"
        in capsys.readouterr().out
    )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
    # a weight named otherwise than the model names it (transformers' loaders rename such, e.g. fused experts)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(directory / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, renamed / "model.safetensors", {"format": "pt"})
    _, initial = prepare_model(OmegaConf.create(model_config(renamed)), torch.float32, tmp_path, seed=0)
    assert not initial.sharded
    assert "model.norm.weight is missing (its files, for LlamaForCausalLM)" in capsys.readouterr().out


def test_a_hub_index_lists_the_names_before_any_weight_is_downloaded(model_dirs, tmp_path):
    # A Hub model's JSON files come first (its index names every tensor); its safetensors come once the run fits.
    directory, _ = model_dirs["llama"]
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text((directory / "config.json").read_text())
    names = list(load_file(directory / "model.safetensors"))
    (listed / weights.INDEX).write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    _, initial = prepare_model(OmegaConf.create(model_config(listed)), torch.float32, tmp_path, seed=0)
    assert initial.sharded
