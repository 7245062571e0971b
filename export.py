"""python export.py CHECKPOINT_DIR OUT_DIR: a run's checkpoint (step-N or LATEST) as a from_pretrained directory, with
no process holding the whole model.

A checkpoint's weights are every rank's shards (checkpoint.py); the export consolidates them into safetensors files
and their index, one whole tensor in memory at a time, beside the model's config and tokenizer, which the checkpoint
holds. Under torchrun (torchrun --nproc_per_node N export.py ...) each process writes its share of the files. A LoRA
checkpoint holds the adapters only: the base is loaded as the run loaded it (its config.yaml, beside the checkpoint),
sharded over export.py's processes, and the adapters merged in; the adapter also goes to OUT_DIR/adapter in peft's
format. A checkpoint in the reference format (a whole policy.pt) is exported likewise. OUT_DIR must not exist yet: it
is written under a temporary name and renamed into place once whole."""

import sys
from pathlib import Path

import transformers

import storage
from modeling import weights
from modeling.distributed import (
    Topology,
    init_process_group,
    launched_by_torchrun,
    leave_process_group,
    reported_errors,
)
from modeling.vision import has_processor
from persistence import checkpoint
from persistence.checkpoint_loading import is_legacy
from trained import checkpoint_policy, run_config
from training.model_card import write_cards
from utils import UserError


def export_checkpoint(checkpoint_dir: Path, out_dir: Path, topology: Topology) -> None:
    marker = checkpoint.describe(checkpoint_dir)
    legacy = is_legacy(checkpoint_dir)
    if marker is None and not legacy:
        raise UserError(f"{checkpoint_dir} is not a complete checkpoint (no {checkpoint.MARKER})")
    if out_dir.exists():
        raise UserError(f"{out_dir} exists already; choose a new directory to export to")
    tmp_dir = out_dir.with_name(out_dir.name + ".tmp")

    def on_main(write) -> None:
        def written() -> None:
            with storage.writing(out_dir):
                write()

        topology.run_on_main(written)

    try:
        on_main(lambda: start(checkpoint_dir, tmp_dir, out_dir, legacy))
        with storage.writing(out_dir):  # DCP's writes, on every rank
            write(checkpoint_dir, tmp_dir, legacy, topology)
        on_main(lambda: describe(checkpoint_dir, tmp_dir, out_dir))
    except UserError as error:
        checkpoint.remove(tmp_dir, topology)
        raise storage.as_final(error, tmp_dir, out_dir) from None
    print(f"exported {checkpoint_dir} to {out_dir}")


def start(checkpoint_dir: Path, tmp_dir: Path, out_dir: Path, legacy: bool) -> None:
    """An empty temporary directory beside out_dir, once out_dir's filesystem has room for the weights (rank 0)."""
    source = checkpoint_dir / ("policy.pt" if legacy else "policy")
    storage.require_space(out_dir.parent, int(storage.tree_bytes(source) * 1.02), f"the export {out_dir.name}")
    storage.new_dir(tmp_dir)


def write(checkpoint_dir: Path, directory: Path, legacy: bool, topology: Topology) -> None:
    """The export's weights in `directory`: consolidated from the checkpoint's shards, or, for a LoRA checkpoint, the
    run's base with the adapters merged in. Collective."""
    if legacy:
        state = weights.read_reference_format(checkpoint_dir / "policy.pt", "export", mmap=True)["state"]
    names = set(state) if legacy else set(weights.stored_shapes(checkpoint_dir / "policy"))
    if any(".lora_" in name for name in names):
        checkpoint.export(directory, checkpoint_policy(checkpoint_dir, topology), topology, None)
    elif legacy:
        weights.export_weights(state, directory, topology)
    else:
        weights.consolidate(checkpoint_dir / "policy", directory, topology)


def describe(checkpoint_dir: Path, tmp_dir: Path, out_dir: Path) -> None:
    """The model's config, generation config and tokenizer (or processor) beside the weights (rank 0), then the
    directory renamed into place."""
    source = (
        checkpoint_dir if (checkpoint_dir / "config.json").exists() else run_config(checkpoint_dir).model.name_or_path
    )
    transformers.AutoConfig.from_pretrained(source).save_pretrained(tmp_dir)
    try:
        transformers.GenerationConfig.from_pretrained(source).save_pretrained(tmp_dir)
    except OSError:  # a model that does not generate has none
        pass
    reader = transformers.AutoProcessor if has_processor(Path(source)) else transformers.AutoTokenizer
    reader.from_pretrained(source).save_pretrained(tmp_dir)  # a processor holds the tokenizer too
    marker = checkpoint.describe(checkpoint_dir) or {}  # a legacy checkpoint has none: its card leaves it out
    write_cards(tmp_dir, checkpoint_dir.parent, marker.get("step"), marker.get("metrics", {}), out_dir.name)
    storage.sync(tmp_dir)
    storage.publish(tmp_dir, out_dir, "config.json")


def main(args: list[str]) -> None:
    if len(args) != 2 or args[0] in ("-h", "--help"):
        print(__doc__, file=sys.stderr if len(args) != 2 and args[:1] != ["--help"] else sys.stdout)
        sys.exit(0 if args[:1] in (["-h"], ["--help"]) else 2)
    distributed = launched_by_torchrun()
    if distributed:
        init_process_group(timeout_secs=1800)
    try:
        with reported_errors():
            topology = Topology.create("FSDPTrainer" if distributed else "BasicTrainer")
            export_checkpoint(Path(args[0]), Path(args[1]), topology)
    finally:
        if distributed:
            leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
