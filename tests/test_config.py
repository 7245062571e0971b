"""The typed config (config.py): every bad value is one line naming the key."""

import copy
import dataclasses
import re
import types
import typing
from pathlib import Path

import pytest

import train
from persistence import checkpoint
from utils import UserError


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            ["batch_size=6", "gradient_accumulation_steps=4"],
            "batch_size=6 must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = 4",
        ),
        (["eval_batch_size=6", "gradient_accumulation_steps=4"], "eval_batch_size=6 must be a positive multiple"),
        (["eval_every=12"], "eval_every=12 must be a positive multiple of batch_size=8"),
        (["gradient_accumulation_steps=0"], "gradient_accumulation_steps=0 must be positive"),
        (["batch_size=abc"], "batch_size=abc must be an integer"),
        (["loss.beta=abc"], "loss.beta=abc must be a number"),
        (["trainer=Foo"], "unknown trainer 'Foo'; valid: BasicTrainer, FSDPTrainer, TensorParallelTrainer"),
        (
            ["nproc=2"],
            "BasicTrainer runs on one process; for 2 use trainer=FSDPTrainer or trainer=TensorParallelTrainer",
        ),
        (["n_epochs=null"], "set n_epochs or n_examples"),
        (["n_eval_examples=0"], "n_eval_examples=0 must be positive"),
        (["optimizer=Adamm"], "unknown optimizer 'Adamm'; torch.optim has: "),
        (
            ["model.policy_dtype=float64"],
            "model.policy_dtype=float64 is not a dtype; expected one of float32, bfloat16, float16",
        ),
        (
            ["model.policy_dtype=auto"],
            "model.policy_dtype=auto is not a dtype; expected one of float32, bfloat16, float16$",
        ),
        (
            ["model.fsdp_policy_mp=fp8"],
            "model.fsdp_policy_mp=fp8 is not a dtype; expected one of float32, bfloat16, float16, auto",
        ),
        (["layout=ragged"], "layout=ragged is not a layout; expected one of packed, padded"),
        (["reference_cache=maybe"], "reference_cache=maybe must be true or false"),
        (["scored_logits_only=1"], "scored_logits_only=1 must be true or false"),
        (["model=blank_model"], "model.name_or_path must be set"),
        # Silently accepted or a traceback before the typed config:
        (["warmup_steps=-1"], "warmup_steps=-1 must be zero or more"),
        (["lr=-1e-5"], "lr=-1e-05 must be positive"),
        (["n_epochs=0"], "n_epochs=0 must be positive, or null to train by n_examples"),
        (["wandb.enabled=maybe"], "wandb.enabled=maybe must be true or false"),
        (["datasets=[]"], "datasets=[] names no dataset; give at least one, e.g. datasets=[demo]"),
        (["lrr=1e-5"], "unknown key 'lrr' in the config (did you mean 'lr'?); valid: seed, exp_name, batch_size"),
        (
            ["generation.top_k=5"],
            "unknown key 'generation.top_k' in the config (did you mean 'top_p'?); valid: max_new_tokens",
        ),
        (
            ["loss=ipo", "loss.label_smoothing=0.1"],
            "unknown key 'loss.label_smoothing' in loss=ipo; valid: name, router_aux_loss_coef, beta, nll_weight, "
            "length_normalized, reference_free",
        ),
        (["loss.label_smoothing=0.6"], "loss.label_smoothing=0.6 must be in [0, 0.5]"),
        (["loss=robust", "loss.label_smoothing=0.5"], "loss.label_smoothing=0.5 must be in (0, 0.5)"),
        (["loss=simpo", "loss.length_normalized=true"], "unknown key 'loss.length_normalized' in loss=simpo"),
        (["loss=dpop", "loss.dpop_lambda=-1"], "loss.dpop_lambda=-1.0 must be zero or more"),
        (["loss=cpo", "loss.beta=0"], "loss.beta=0.0 must be positive"),
        (["loss=mpo", "loss.terms.dpo.beta=-1"], "loss.terms.dpo: loss.beta=-1.0 must be positive"),
        (["loss=mpo", "loss.terms.dpo.weight=0"], "loss.terms.dpo.weight=0 must be a positive number"),
        (["loss=mpo", "+loss.terms.sft={weight:1}"], "loss.terms.sft is not a pair loss; valid: dpo, dpo_norm, ipo"),
        (["loss=mpo", "+loss.terms.dpo.gamma=1"], "loss.terms.dpo: Key 'gamma' not in 'DPOConfig'"),
        (["trainer=FSDPtrainer"], "unknown trainer 'FSDPtrainer' (did you mean 'FSDPTrainer'?); valid: BasicTrainer"),
        (["layout=pack"], "layout=pack is not a layout (did you mean 'packed'?); expected one of packed, padded"),
        (
            ["trainer=FSDPTrainer", "nproc=4", "tensor_parallel_size=3"],
            "tensor_parallel_size=3 must be a positive divisor of the world size 4",
        ),
        (
            ["trainer=TensorParallelTrainer", "nproc=4", "tensor_parallel_size=2"],
            "use trainer=FSDPTrainer for data parallel x tensor parallel",
        ),
        (
            ["trainer=FSDPTrainer", "nproc=4", "tensor_parallel_size=2", "batch_size=9"],
            "batch_size=9 must be a positive multiple of gradient_accumulation_steps x data-parallel ranks = 2",
        ),
        (["seed=[1"], "the command line: no viable alternative at input '[1'"),
        (["optimizer_kwargs=3"], "optimizer_kwargs=3 must be a mapping, e.g. {key: value}"),
        (["loss.name=ipo"], "loss.name=ipo names another loss than its keys; choose it with loss=ipo"),
        (
            ["activation_checkpointing=true", "model.block_name=GPT2Block"],
            "model.block_name=GPT2Block matches no module of LlamaForCausalLM; its blocks: LlamaDecoderLayer",
        ),
    ],
)
def test_config_errors(make_config, overrides, message):
    # A trailing $ anchors the message's end; the rest is literal text.
    with pytest.raises(UserError, match=re.escape(message.removesuffix("$")) + ("$" if message.endswith("$") else "")):
        train.run(make_config(*overrides))


def test_a_directory_below_a_regular_file_is_one_line(make_config, tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file, not a directory")
    with pytest.raises(UserError, match=f"local_run_dir={blocker}/run must be a directory, but {blocker} is a file"):
        make_config(f"local_run_dir={blocker / 'run'}")
    with pytest.raises(
        UserError, match=rf"local_dirs\[0\]={blocker}/cache must be a directory, but {blocker} is a file"
    ):
        make_config(f"local_dirs=[{blocker / 'cache'}]")


def test_a_list_key_given_one_value_is_a_one_element_list(make_config, pairs_file):
    assert make_config(f"datasets={pairs_file}").datasets == [str(pairs_file)]
    assert make_config(f"datasets={pairs_file},demo").datasets == [str(pairs_file), "demo"]
    assert make_config(f"datasets=[{pairs_file},demo]").datasets == [str(pairs_file), "demo"]


def test_every_key_of_config_yaml_has_a_type_and_the_schema_no_other(make_config):
    # The schema and config.yaml name the same keys, in the same order (the order "valid:" lists them in).
    from omegaconf import OmegaConf

    from config import Config
    from configuration.composition import CONFIG_DIR

    yaml_keys = [key for key in OmegaConf.load(CONFIG_DIR / "config.yaml") if key != "defaults"]
    assert yaml_keys + ["model", "loss"] == [f.name for f in dataclasses.fields(Config)]


def test_block_attention_without_cuda_is_one_line(make_config):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(UserError, match=r"^packed_attention=block needs a CUDA GPU: FlexAttention has no backward"):
        make_config("packed_attention=block")


NUMBERS = (int, float)


def unwrapped(kind):
    """X for Optional[X] or X | None (typing.Union and types.UnionType), else kind."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(kind) if arg is not type(None))
    return kind


def numeric_fields(schema, prefix: str = ""):
    """(dotted key, field, int or float) of every numeric field of a schema dataclass, nested ones included; a field
    holding numbers in a container (list[int], dict[str, float]) comes with kind "container": no range covers its
    items."""
    hints = typing.get_type_hints(schema)  # string annotations resolved too
    for field in dataclasses.fields(schema):
        kind = unwrapped(hints[field.name])
        if dataclasses.is_dataclass(kind):
            yield from numeric_fields(kind, f"{prefix}{field.name}.")
        elif kind in NUMBERS:
            yield f"{prefix}{field.name}", field, kind
        elif any(unwrapped(arg) in NUMBERS for arg in typing.get_args(kind)):
            yield f"{prefix}{field.name}", field, "container"


def out_of_range(accepted, kind) -> list[str]:
    """Values just outside the range at each bounded end, and for floats the non-finite ones."""
    values = []
    if accepted.low is not None:
        values.append(accepted.low if accepted.low_open else accepted.low - 1)
    if accepted.high is not None:
        values.append(accepted.high if accepted.high_open else accepted.high + 1)
    non_finite = ["nan", "-inf"] + ([] if accepted.infinite else ["inf"])
    return [str(value) for value in values] + (non_finite if kind is float else [])


def schemas_by_option():
    """(the command line that selects it, schema): the config, and each loss option's schema."""
    from omegaconf import OmegaConf

    from config import Config
    from configuration.composition import CONFIG_DIR
    from core.losses import LOSSES

    yield [], Config, ""
    for path in sorted((CONFIG_DIR / "loss").glob("*.yaml")):
        yield [f"loss={path.stem}"], LOSSES[OmegaConf.load(path).name].schema, "loss."


def test_every_numeric_key_declares_its_range_and_out_of_range_values_are_one_line(make_config):
    # Walks the schemas rather than a list: a numeric key added without a range fails here, and so does a range
    # that is declared but not enforced (seed=-1 once ended in numpy's traceback). Each option's command line is
    # composed once (Hydra's composition is the same whatever the number); each value is then applied to it as
    # compose applies an override, and checked as config.load checks (~300 values: 3 s instead of 35).
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from config import check

    parser = OverridesParser.create()
    undeclared, checked = [], 0
    for selection, schema, prefix in schemas_by_option():
        composed = make_config(*selection)
        for key, field, kind in numeric_fields(schema, prefix):
            accepted = field.metadata.get("range")
            if accepted is None or kind == "container":
                undeclared.append(f"{key} ({selection or 'config'})")
                continue
            for value in out_of_range(accepted, kind):
                candidate = copy.deepcopy(composed)
                OmegaConf.update(candidate, key, parser.parse_override(f"{key}={value}").value(), merge=True)
                with pytest.raises(UserError) as error:
                    check(candidate)
                message = str(error.value)
                assert re.fullmatch(rf"{re.escape(key)}=\S+ must be [^\n]+", message), (key, value, message)
                checked += 1
    assert not undeclared, undeclared
    assert checked > 100  # the walk reached the config, its nested schemas and every loss


def test_infinity_turns_clipping_and_timed_logging_off(make_config):
    config = make_config("max_grad_norm=inf", "minimum_log_interval_secs=inf")
    assert config.max_grad_norm == config.minimum_log_interval_secs == float("inf")
    with pytest.raises(UserError, match=r"^lr=inf must be positive$"):
        make_config("lr=inf")


def test_seed_range_is_numpys():
    with pytest.raises(UserError, match=r"^seed=-1 must be in \[0, 4294967295\]$"):
        train.configuration.load(["seed=-1", "model=tiny"])
    assert train.configuration.load(["seed=4294967295", "model=tiny"]).seed == 2**32 - 1


@pytest.mark.parametrize("value", ["a'b", "a\\'b", "trailing\\", "é/日本 x", "x(1),y=[z]", "${oc.env:HOME}", ""])
def test_a_value_quoted_for_hydra_reads_back_exactly(value):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from configuration.composition import hydra_quoted

    assert OverridesParser.create().parse_override(f"key={hydra_quoted(value)}").value() == value


def test_paths_with_spaces_quotes_and_non_ascii_letters_run_as_given(tmp_path, run_main):
    # As the shell hands them over once quoted ("local_run_dir=/data/my runs/é"): one argument each, taken as is.
    from conftest import arithmetic_pairs, read_jsonl, tiny_run_overrides, write_jsonl

    odd = tmp_path / "my runs l'été (日本)"
    odd.mkdir()
    pairs_file = write_jsonl(odd / "paires à trier.jsonl", arithmetic_pairs(48))
    run_dir = odd / "run, [1]"  # a comma: one path for a string key
    args = [a for a in tiny_run_overrides(tmp_path, pairs_file) if not a.startswith(("datasets=", "local_"))]
    result = run_main(*args, f"datasets={pairs_file}", f"local_run_dir={run_dir}", f"local_dirs={odd / 'cache'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss/eval" in r] == [0, 16, 32, 40]
    assert checkpoint.describe(run_dir / "LATEST") is not None and (odd / "cache" / "reference_logps").is_dir()


def test_a_list_hydra_cannot_read_says_how_to_quote_it(make_config):
    with pytest.raises(UserError) as error:
        make_config("datasets=[/data/é.jsonl,demo]")
    assert str(error.value) == (
        "the command line: Hydra cannot read datasets=[/data/é.jsonl,demo]; quote each value for it in single quotes, "
        """inside the shell's double ones: "datasets=['a b','c']\""""
    )
    assert list(make_config("datasets=['/data/é.jsonl',demo]").datasets) == ["/data/é.jsonl", "demo"]
    # without brackets, commas separate a list's items whatever the items hold
    assert list(make_config("datasets=/data/é.jsonl,demo").datasets) == ["/data/é.jsonl", "demo"]
    assert list(make_config("datasets=/data/e.jsonl,demo").datasets) == ["/data/e.jsonl", "demo"]


def optimizer_knob_values(default) -> list:
    """Values no optimizer means for a numeric knob with this default: negative and nan, item by item for a tuple."""
    if isinstance(default, tuple):
        return [[value] * len(default) for value in (-1.0, float("nan"))]
    return [-1, float("nan")] if isinstance(default, (int, float)) and not isinstance(default, bool) else []


def test_every_torch_optimizer_knob_value_torch_refuses_is_one_line():
    # The knobs' ranges are torch's, checked when an optimizer is built (a negative weight_decay was a ValueError's
    # traceback): walked over every torch.optim class and numeric knob, each value is either taken or one line naming
    # the knob, never another exception.
    import inspect

    import torch

    from configuration.checks import check_optimizer

    refused = 0
    for name, optimizer in vars(torch.optim).items():
        if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
            continue
        if optimizer is torch.optim.Optimizer:
            continue
        for knob, parameter in inspect.signature(optimizer).parameters.items():
            for value in optimizer_knob_values(parameter.default) if knob != "lr" else []:
                try:
                    check_optimizer(name, {knob: value}, 1e-3)
                except UserError as error:
                    assert re.fullmatch(
                        rf"\+optimizer_kwargs\.{knob}=\S+: torch\.optim\.{name} refuses it \([^\n]+\)", str(error)
                    ), (name, knob, str(error))
                    refused += 1
    assert refused > 40  # eps, weight_decay, betas, momentum, ... of most optimizers


# Texts a shell hands over once quoted, which Hydra's grammar would refuse bare (spaces with non-ASCII letters,
# quotes, brackets, braces, =, #) or read as another value (an integer, a float, a boolean, trimmed spaces).
SHELL_TEXTS = [
    "/data/mes essais/été 日本",
    '/data/l\'été (1)/"x"',
    "/data/[1]/{a: b}/a=b#c",
    "2024_01_05",
    "1.50",
    "true",
    " leading and trailing ",
    "~/x",
    "trailing\\",
]


def string_fields(schema, prefix: str = ""):
    """(dotted key, is a list) of every string and list-of-strings field of a schema dataclass, nested ones too."""
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        kind = unwrapped(hints[field.name])
        if dataclasses.is_dataclass(kind):
            yield from string_fields(kind, f"{prefix}{field.name}.")
        elif kind is str or typing.get_origin(kind) is list and typing.get_args(kind) == (str,):
            yield f"{prefix}{field.name}", kind is not str


def test_every_string_key_takes_the_text_the_shell_gave():
    # Walks the schema: every string key (paths: local_run_dir, resume_from, model.name_or_path, model.archive, ...)
    # and list-of-strings key (datasets, local_dirs, ...) reads back exactly the text of one argument, whatever
    # Hydra's grammar would make of it (a LexerNoViableAltException, 20240105, 1.5, True, trimmed spaces).
    from omegaconf import OmegaConf

    from config import Config, composed

    keys = list(string_fields(Config))
    assert {"local_run_dir", "resume_from", "datasets", "local_dirs", "model.name_or_path", "model.archive"} <= {
        key for key, _ in keys
    }
    for text in SHELL_TEXTS:
        config = composed(["model=tiny", *(f"{key}={text}" for key, _ in keys)])
        for key, listed in keys:
            assert OmegaConf.select(config, key) == ([text] if listed else text), (key, text)


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("datasets=[a.jsonl,b.jsonl]", ["a.jsonl", "b.jsonl"]),
        ("datasets=a.jsonl,b.jsonl", ["a.jsonl", "b.jsonl"]),
        ("datasets=['é x.jsonl',b.jsonl]", ["é x.jsonl", "b.jsonl"]),
        ("datasets=a\\,b.jsonl", ["a,b.jsonl"]),
        ("datasets=${oc.env:DPO_TEST_DIR}/é x.jsonl", ["/data/a b/é x.jsonl"]),
        ("local_dirs=[${oc.env:DPO_TEST_DIR},/tmp]", ["/data/a b", "/tmp"]),
        ("local_run_dir=null", None),
        ("local_run_dir=NULL", None),
        ("local_run_dir='/data/my runs'", "/data/my runs"),
        ('local_run_dir="/data/my runs"', "/data/my runs"),
        ("local_run_dir=/data/a\\,b", "/data/a,b"),
        ("local_run_dir=${oc.env:DPO_TEST_DIR}/é 1", "/data/a b/é 1"),
        ("exp_name=${loss.name}_v2", "dpo_v2"),
        ("lora.target_modules=null", None),
        ("lora.target_modules=q_proj", ["q_proj"]),
        ("lora.target_modules=[q_proj,v_proj]", ["q_proj", "v_proj"]),
        ("seed=7", 7),
        ("lr=1e-4", 1e-4),
        ("+optimizer_kwargs.betas=[0.9,0.95]", [0.9, 0.95]),
    ],
)
def test_hydra_syntax_still_means_what_it_meant(monkeypatch, arg, expected):
    # Lists, escapes, quotes, interpolations and null are Hydra's syntax on purpose: taken as Hydra reads them.
    from omegaconf import OmegaConf

    from config import composed

    monkeypatch.setenv("DPO_TEST_DIR", "/data/a b")
    config = OmegaConf.to_container(composed(["model=tiny", arg]), resolve=True)
    value = config
    for part in arg.partition("=")[0].lstrip("+").split("."):
        value = value[part]
    assert value == expected


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["local_run_dir=/data/my", "big", "run", "seed=1"],
            "the command line: big is not an override (key=value); a value with spaces is one argument only quoted "
            'for the shell: "local_run_dir=/data/my big run"',
        ),
        (["--dry_run"], "the command line: --dry_run has no value; give dry_run=VALUE"),
        (["model.archive"], "the command line: model.archive has no value; give model.archive=VALUE"),
        (["lr=é"], "lr=é must be a number"),
        (["seed=1,2"], "seed=1,2 must be an integer"),
        (["exp_name=null"], "exp_name=null must be a string"),
        (["datasets=null"], "datasets=null must be a list, e.g. [a,b]"),
        (["datasets=[a.jsonl,null]"], "datasets[1]=None must be a string"),
        (["local_run_dirr=/data/é"], "unknown key 'local_run_dirr' in the config (did you mean 'local_run_dir'?)"),
        (["distributed_timeout_secs=1e10"], "distributed_timeout_secs=10000000000.0 must be in (0, 1000000000]"),
    ],
)
def test_what_hydra_cannot_take_is_one_line_naming_it(args, message):
    from config import load

    with pytest.raises(UserError) as error:
        load(["model=tiny", *args])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_cpu_offload_is_refused_where_it_has_nothing_to_offload(make_config, run_main, tmp_path, pairs_file):
    import torch

    from conftest import tiny_run_overrides

    for trainer in ("BasicTrainer", "TensorParallelTrainer"):
        with pytest.raises(UserError, match=f"^fsdp_cpu_offload=true offloads what FSDPTrainer shards to the host; "
                                            f"{trainer} shards nothing: use trainer=FSDPTrainer$"):  # fmt: skip
            make_config(f"trainer={trainer}", "fsdp_cpu_offload=true")
    planned = ("dry_run=true", "trainer=FSDPTrainer", "plan.gpus_per_node=8", "plan.gpu_memory_gib=80")
    with pytest.raises(UserError, match="^fsdp_cpu_offload=true with lora.enabled=true: LoRA trains small adapters"):
        make_config(*planned, "fsdp_cpu_offload=true", "lora.enabled=true")
    assert make_config(*planned, "fsdp_cpu_offload=true").fsdp_cpu_offload  # a plan for GPUs, from any machine
    # the DPO reference's checkpoints are broadcast whole from rank 0 over the GPUs, where offloaded shards are not
    legacy = Path(__file__).parent / "assets" / "checkpoint-419e2f5" / "step-16"
    overrides = (*tiny_run_overrides(tmp_path, pairs_file), *planned, f"resume_from={legacy}")
    result = run_main(*overrides, "fsdp_cpu_offload=true")
    assert result.returncode == 2 and result.stderr.splitlines()[-1].startswith(
        f"error: resume_from={legacy} is in the DPO reference's format (whole policy.pt and optimizer.pt), broadcast"
    )
    assert run_main(*overrides).returncode == 0  # without offload the plan takes it
    if torch.cuda.is_available():
        return
    result = run_main(*tiny_run_overrides(tmp_path, pairs_file), "trainer=FSDPTrainer", "fsdp_cpu_offload=true")
    assert result.returncode == 2 and result.stderr.splitlines() == [
        "error: fsdp_cpu_offload=true with no CUDA GPU here: there is nothing to offload to (CPU ranks keep their "
        "parameters, gradients and optimizer state in host memory already); set fsdp_cpu_offload=false"
    ]
