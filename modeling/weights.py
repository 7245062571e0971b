"""Model weights between safetensors files and a placed model, without any rank holding the whole model.

A model is built on the meta device (no memory), placed on the mesh (placement.py), and only then given memory:
each rank allocates its own shards and reads just those from the files, a Hub model's, an export's or a checkpoint's.
Each rank writes its shards of a checkpoint in parallel, each tagged with its offsets in the whole tensor, so that a
checkpoint written by N ranks is read back on M ranks or on another mesh; the from_pretrained export is consolidated
from those shards one tensor at a time, its files shared out over the ranks. torch.distributed.checkpoint (DCP) plans
every read and write, with PyTorch's Hugging Face storage reader and writer: safetensors throughout, never pickle.
Without a process group (BasicTrainer) the same calls run on the one process."""

import hashlib
import inspect
import json
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import transformers
from accelerate import init_empty_weights
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import _consolidate_safetensors_files
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, distribute_tensor

import storage
from modeling.distributed import Topology
from utils import UserError, first_line

# DCP says so at every call without a process group, which is how BasicTrainer runs it
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# DCP serialises each safetensors file in memory before writing it, so a rank's files are kept to an eighth of its share
# of the weights (a save then adds about 3% to a rank's weights, gradients and AdamW state), between 16 MiB and 512 MiB:
# the default job's 0.5 GiB of weights make 8 files, a 70B model's on 16 ranks ~35 files a rank.
RANK_FILE_BYTES = (16 * 2**20, 512 * 2**20)
EXPORT_FILE_BYTES = 4 * 2**30  # the export's files (from_pretrained reads any number); written one tensor at a time
INDEX = "model.safetensors.index.json"  # which export file holds each tensor


def model_class(reward: bool, config: transformers.PretrainedConfig | None = None):
    """transformers' auto class of the model a run trains: a causal LM, a vision-language model (a config with a
    vision tower that transformers maps to an image-text-to-text model), or a reward model (a sequence classifier
    with one output: the causal LM's body and a scalar head; a vision-language model's reads the images too, where
    transformers has one: reads_images)."""
    if reward and is_vision_language(config) and not reads_images(config):
        raise UserError(reward_refusal(config))
    if reward:
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForImageTextToText if is_vision_language(config) else transformers.AutoModelForCausalLM


def is_vision_language(config: transformers.PretrainedConfig | None) -> bool:
    # on use: transformers' auto model tables cost ~0.7 s of every start to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return hasattr(config, "vision_config") and config.model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def reads_images(config: transformers.PretrainedConfig) -> bool:
    """Whether transformers has a sequence classifier of this vision-language model that takes the images
    (pixel_values) with the text: Gemma 3's and Qwen3.5's, each the model's body and a scalar head `score`."""
    # on use: transformers' auto model tables cost ~0.7 s of every start to import
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    classifier = getattr(transformers, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type, ""), None)
    return classifier is not None and "pixel_values" in inspect.signature(classifier.forward).parameters


def reward_refusal(config: transformers.PretrainedConfig) -> str:
    """Why a vision-language model is not trained as a reward model: transformers has no sequence classifier of its
    family that reads images (LLaVA, Idefics3, Qwen2-VL, ...)."""
    return (
        f"loss=reward: {config.model_type} is a vision-language model for which transformers has no sequence "
        "classifier (AutoModelForSequenceClassification) that reads images; train the reward model from Gemma 3 (or "
        "a text model), or this one with a preference loss"
    )


def is_reward_model(model: nn.Module) -> bool:
    """Whether the model (or a LoRA policy's base) is a reward model: one of transformers' sequence classifiers."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return class_name(inner).endswith("ForSequenceClassification")


def empty_model(
    config: transformers.PretrainedConfig, dtype: torch.dtype, trust_remote_code: bool, reward: bool = False
) -> nn.Module:
    """The causal LM (or reward model) of `config` with its parameters on the meta device, which holds no memory,
    and its buffers computed on the CPU: rotary frequencies and the like are in no weights file, and they are
    small."""
    with init_empty_weights(include_buffers=False):
        model = model_class(reward, config).from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()  # init_empty_weights gives each tied name a meta parameter of its own: tie them again
    return model


def is_empty(model: nn.Module) -> bool:
    """Whether the model's parameters are still on the meta device (built by empty_model, not yet materialized)."""
    return any(parameter.is_meta for parameter in model.parameters())


def class_name(model: nn.Module) -> str:
    """The model's own class name: FSDP2 places a model by giving it a class of its own, FSDP<name>."""
    return next(cls.__name__ for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter (each tied one once) and buffer of the model, persistent or not, by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def real_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the tensors of an empty model that hold values already (its buffers, LoRA adapters initialised on
    the CPU): placement keeps their shapes but materialize() allocates them anew."""
    return {name: t.detach().clone() for name, t in tensors(model).items() if not t.is_meta}


def materialize(
    model: nn.Module, device: torch.device, values: dict[str, torch.Tensor], host_parameters: bool = False
) -> None:
    """Give a placed empty model memory on `device`, each rank for its own shards, and put back `values`
    (real_tensors before placement); the rest is uninitialised until read from files. host_parameters: the
    parameters' shards go to host memory instead (FSDP's CPU offload, which copies them to `device` itself), the
    buffers (rotary frequencies: computed beside the activations, which FSDP does not move) to `device`."""
    tied = [names for names in parameter_names(model).values() if len(names) > 1]
    model.to_empty(device=torch.device("cpu") if host_parameters else device)
    if host_parameters:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))  # a registered buffer's name: it stays one, as it was
    for first, *others in tied:  # to_empty gives each module its own new parameter, where one was shared
        parameter = model.get_parameter(first)
        for name in others:
            module, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(module), attribute, parameter)
    assign_full(model, values)


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter, by the parameter's identity: a tied weight has several."""
    names = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def assign_full(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy whole tensors into the model's tensors of those names; a sharded one (a DTensor) takes only its own shard
    of the value, which every rank has whole: no communication, whatever the mesh."""
    targets = tensors(model)
    with torch.no_grad():
        for name, value in values.items():
            target = targets[name]
            if isinstance(target, DTensor):
                value = value.to(target.device)
                value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
                target = target.to_local()
            target.copy_(value)


def stored_shapes(directory: Path) -> dict[str, torch.Size]:
    """The whole shape of each tensor in a directory's safetensors files (a checkpoint's shards add up to it),
    read from their headers alone."""
    try:
        metadata = HuggingFaceStorageReader(str(directory)).read_metadata()
    except (OSError, SafetensorError) as error:
        raise UserError(f"{directory} holds no readable safetensors files ({first_line(error)})") from None
    return {name: entry.size for name, entry in metadata.state_dict_metadata.items()}


def has_safetensors(directory: Path) -> bool:
    return directory.is_dir() and any(directory.glob("*.safetensors"))


def read_files(model: nn.Module, directory: Path, names: dict[str, str]) -> None:
    """Read the model's tensors from the safetensors files in `directory`: names maps a model tensor's name to its
    name in the files. Each rank reads only the slices of its own shards; values are cast to the model's dtypes."""
    targets = tensors(model)
    state = {stored: targets[name] for name, stored in names.items()}
    try:
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=one_process())
    except CheckpointException as error:
        raise UserError(f"could not read the weights in {directory} ({failure(error)})") from None


def write_shards(state: dict[str, torch.Tensor], directory: Path, world_size: int, process_group=None) -> None:
    """Write each rank's shards of `state` (tensors or DTensors, on any device) as safetensors files in `directory`,
    every rank its own files, each shard tagged with its offsets in the whole tensor. Collective, over
    `process_group` (None: the default group)."""
    sizes = {name: value.numel() * value.element_size() for name, value in state.items()}  # a DTensor's: whole
    groups = file_groups(sizes, rank_file_bytes(sum(sizes.values()) / world_size) * world_size)
    writer = HuggingFaceStorageWriter(str(directory), save_distributed=True, fqn_to_index_mapping=groups)
    dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=one_process())


def staged(state: dict) -> dict:
    """A copy of a state dict (tensors, DTensors, optimizer state) in host memory that training can no longer change,
    each rank copying its own shards (DTensors stay DTensors, placed as they were): the staging DCP's async_save
    does with the writers of write_shards and of an optimizer's state, which are BlockingAsyncStagers."""
    return BlockingAsyncStager().stage(state)


def rank_file_bytes(share: float) -> float:
    """The most a rank's checkpoint file holds, for a rank's share of `share` bytes of weights (RANK_FILE_BYTES)."""
    smallest, largest = RANK_FILE_BYTES
    return min(largest, max(smallest, share / 8))


def file_groups(sizes: dict[str, int], file_bytes: float) -> dict[str, int]:
    """Tensor name -> file number (from 1): consecutive tensors, about file_bytes of whole tensors to a file."""
    groups, index, size = {}, 1, 0
    for name, nbytes in sizes.items():
        if size and size + nbytes > file_bytes:
            index, size = index + 1, 0
        groups[name], size = index, size + nbytes
    return groups


def missing_shards(directory: Path, expected: dict[str, torch.Size]) -> str | None:
    """Why the shards in `directory` are not every tensor of `expected` (name -> whole shape) whole: a rank's files
    missing, say, in a run directory the machines do not share; or None."""
    try:
        stored = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    except (OSError, SafetensorError) as error:
        return f"its files cannot be read ({first_line(error)})"
    for name, shape in expected.items():
        entry = stored.get(name)
        covered = 0 if entry is None else sum(chunk.sizes.numel() for chunk in entry.chunks)
        if entry is None or covered != shape.numel() or entry.size != shape:
            return f"its files hold {covered} of the {shape.numel()} values of {name}"
    return None


def consolidate(shards: Path, directory: Path, topology: Topology) -> None:
    """A from_pretrained weights directory (model-0000i-of-0000n.safetensors and model.safetensors.index.json) from a
    directory of shards (write_shards): the files are shared out over the ranks, each written one whole tensor in
    memory at a time. Collective; a failure to write on any rank is a UserError on every rank."""
    entries = HuggingFaceStorageReader(str(shards)).read_metadata().state_dict_metadata
    sizes = {name: entry.properties.dtype.itemsize * entry.size.numel() for name, entry in entries.items()}
    groups = file_groups(sizes, EXPORT_FILE_BYTES)
    count = max(groups.values())
    files = {name: f"model-{index:05d}-of-{count:05d}.safetensors" for name, index in groups.items()}
    mine = {name: file for name, file in files.items() if (groups[name] - 1) % topology.world_size == topology.rank}

    def write_mine() -> None:
        with storage.writing(directory, sum(sizes[name] for name in mine)):
            if mine:
                _consolidate_safetensors_files(str(shards), str(directory), mine, num_threads=1)

    def write_index() -> None:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": files}
        storage.write_text(directory / INDEX, json.dumps(index, indent=2))

    topology.run_everywhere(write_mine)
    topology.run_on_main(write_index)  # once every rank has written its files


def export_weights(state: dict[str, torch.Tensor], directory: Path, topology: Topology) -> None:
    """The from_pretrained weights of `state` (whole names, sharded values) in `directory`: shards written by every
    rank to a scratch directory, consolidated, and the scratch removed. Collective."""
    scratch = directory / ".shards"
    with storage.writing(directory):
        write_shards(state, scratch, topology.world_size)
    consolidate(scratch, directory, topology)
    topology.run_on_main(lambda: shutil.rmtree(scratch))


def full_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory of safetensors files or shards, whole, on this process's CPU: to inspect a small
    checkpoint (the tests compare checkpoints with it)."""
    shapes = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    state = {name: torch.empty(entry.size, dtype=entry.properties.dtype) for name, entry in shapes.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=True)
    return state


def local_digest(model: nn.Module) -> str:
    """sha256 of this rank's share of the model's weights: each tensor's name, whole shape, dtype and local values."""
    digest = hashlib.sha256()
    for name, value in tensors(model).items():
        local = (value.to_local() if isinstance(value, DTensor) else value).detach().cpu().contiguous()
        digest.update(f"{name}:{value.dtype}:{tuple(value.shape)}:{tuple(local.shape)}".encode())
        digest.update(local.view(-1).view(torch.uint8).numpy())  # the tensor's own buffer: no copy
    return digest.hexdigest()


def whole_bytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes whole: a DTensor's over every rank."""
    return tensor.numel() * tensor.element_size()


def one_process() -> bool:
    """Whether DCP runs without a process group (BasicTrainer, export.py on one process)."""
    return not torch.distributed.is_initialized()


def failure(error: CheckpointException) -> str:
    """The first rank's reason in DCP's collective error, in a few words: the file and what went wrong."""
    for wrapped in error.failures.values():
        cause = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, its traceback)
        if isinstance(cause, CheckpointException):
            return failure(cause)
        if isinstance(cause, OSError):
            return f"{cause.strerror or first_line(cause)}: {cause.filename}"
        return first_line(cause)
    return first_line(error)


def read_reference_format(path: Path, setting: str, mmap: bool = False) -> dict:
    """A file in the reference format, read with weights_only (mmap: its tensors mapped, not read). Anything else
    raises a UserError that names the `setting` it came from."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise UserError(f"{setting}: {path} does not exist") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError) as error:
        raise UserError(f"{setting}: {path} is not a readable checkpoint ({first_line(error)})") from None
    if not isinstance(checkpoint, dict) or "state" not in checkpoint:
        raise UserError(f"{setting}: {path} is not a checkpoint in the reference format (no 'state')")
    return checkpoint
