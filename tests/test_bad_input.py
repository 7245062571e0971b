"""A corpus of malformed inputs: each ends in one `error:` line on stderr that names the culprit (file and line, or
key and value), exit code 2 and no traceback, before any work starts; or, where the input is usable, a normal run
that counts what it left out. Each case runs train.py's main in this process. Ctrl-C mid-run is in
test_crash_resume.py (the `interrupt` fault): a checkpoint, one line and a clean exit, then an exact resume."""

import codecs
import gzip
import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from safetensors.torch import save_file

import train
from conftest import TINY_DIR, arithmetic_pairs, png, read_jsonl, save_tiny_vlm, tiny_run_overrides, write_jsonl
from persistence import checkpoint

GOOD = {"prompt": "Q: 1 + 1?\nA:", "chosen": " 2", "rejected": " 3"}


def write_corpus(d):
    """The malformed files, in directory d."""
    (d / "empty.jsonl").write_text("")
    (d / "latin1.jsonl").write_bytes(json.dumps(GOOD).encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1"))
    good_gz = gzip.compress("".join(json.dumps(GOOD) + "\n" for _ in range(200)).encode())
    (d / "truncated.jsonl.gz").write_bytes(good_gz[: len(good_gz) // 2])
    (d / "fake.parquet").write_text("prompt,chosen,rejected\n")
    (d / "pairs.csv").write_text("prompt,chosen,rejected\n")
    (d / "malformed.jsonl").write_text(json.dumps(GOOD) + '\n{"prompt": "Q", "chosen": \n')
    (d / "array.jsonl").write_text('["Q", " 2", " 3"]\n')
    (d / "null.jsonl").write_text("null\n")
    (d / "object.json").write_text(json.dumps(GOOD))
    (d / "broken.json").write_text('[{"prompt": "Q",')
    write_jsonl(d / "number.jsonl", [{**GOOD, "chosen": 2}])
    write_jsonl(d / "missing-column.jsonl", [{"prompt": "Q", "chosen": " 2"}])
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    write_jsonl(d / "chat-ends-with-user.jsonl", [{"prompt": chat[:1], "chosen": chat[:1], "rejected": chat[1:]}])
    write_jsonl(d / "chat-of-strings.jsonl", [{"chosen": ["Hi", "Hello"], "rejected": ["Hi", "Bye"]}])
    ask = {"prompt": chat[:1], "chosen": chat[1:], "rejected": [{"role": "assistant", "content": "Bye"}]}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    write_jsonl(d / "tools-unrendered.jsonl", [{**ask, "tools": [weather]}])  # tiny's template never reads tools
    write_jsonl(d / "tools-not-a-list.jsonl", [{**ask, "tools": weather}])
    write_jsonl(d / "tools-bad-json.jsonl", [{**ask, "tools": "[{'name': 'get_weather'}]"}])
    write_jsonl(d / "tools-on-strings.jsonl", [{**GOOD, "tools": [weather]}])
    write_jsonl(d / "kwargs-string.jsonl", [{**ask, "chat_template_kwargs": "enable_thinking=false"}])
    write_jsonl(d / "kwargs-reserved.jsonl", [{**ask, "chat_template_kwargs": {"add_generation_prompt": False}}])
    write_jsonl(d / "images.jsonl", [GOOD, {**GOOD, "images": ["cat.png"]}])
    save_tiny_vlm(d / "vlm")  # a vision-language model, and image rows it cannot take
    (d / "red.png").write_bytes(png((200, 0, 0)))
    (d / "garbage-image.png").write_bytes(b"GIF89a, or so it says")
    seen = {**GOOD, "prompt": "<image> Q: what colour?\nA:"}
    write_jsonl(d / "vlm-missing.jsonl", [{**seen, "images": ["nowhere.png"]}])
    write_jsonl(d / "vlm-garbage.jsonl", [{**seen, "images": ["garbage-image.png"]}])
    write_jsonl(d / "vlm-two-images.jsonl", [{**seen, "images": ["red.png", "red.png"]}])
    write_jsonl(d / "vlm-no-placeholder.jsonl", [{**GOOD, "image": "red.png"}])
    write_jsonl(d / "vlm-image-not-a-path.jsonl", [{**seen, "images": [3]}])
    write_jsonl(d / "vlm-pairs.jsonl", [{**seen, "images": ["red.png"]}] * 8)
    write_jsonl(d / "hh-no-assistant.jsonl", [{"chosen": "\n\nHuman: Hi\n\nBot: Hello", "rejected": "\n\nHuman: Hi"}])
    write_jsonl(d / "all-identical.jsonl", [{**GOOD, "rejected": GOOD["chosen"]}] * 3)
    (d / "no-data-files").mkdir()
    (d / "no-data-files" / "readme.txt").write_text("nothing here")
    (d / "test-files-only").mkdir()
    write_jsonl(d / "test-files-only" / "eval.jsonl", [GOOD] * 8)
    (d / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save({"step_idx": 8, "state": {"model.embed_tokens.weight": torch.zeros(3, 3)}}, d / "wrong-shape.pt")
    (d / "archive-not-checkpoint").mkdir()
    torch.save({"state": {}}, d / "archive-not-checkpoint" / "policy.pt")
    for name, policy in (("garbage-checkpoint", b"garbage"), ("incomplete-checkpoint", None)):
        (d / name).mkdir()
        if policy:
            (d / name / "policy.pt").write_bytes(policy)
    (d / "incomplete-checkpoint" / "policy.pt").write_bytes((d / "wrong-shape.pt").read_bytes())
    (d / "wrong-shape-checkpoint").mkdir()
    for name in ("policy", "optimizer", "scheduler"):
        (d / "wrong-shape-checkpoint" / f"{name}.pt").write_bytes((d / "wrong-shape.pt").read_bytes())
    sharded = {name: d / f"sharded-{name}" for name in ("no-marker", "garbage", "wrong-shape")}
    for name, directory in sharded.items():
        (directory / "policy").mkdir(parents=True)
        if name != "no-marker":
            (directory / "checkpoint.json").write_text(json.dumps({"step": 8, "metrics": {}, "final": False}))
    (sharded["garbage"] / "policy" / "shard-00001-model-00001-of-00001.safetensors").write_bytes(b"garbage")
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, sharded["wrong-shape"] / "policy" / "a.safetensors")
    dcp.save(
        {"state": {"model.embed_tokens.weight": {"step": torch.zeros(())}}},
        checkpoint_id=str(sharded["wrong-shape"] / "optimizer"),
        no_dist=True,
    )
    (d / "a-file").write_text("")
    utf16 = codecs.BOM_UTF16_LE + (json.dumps(GOOD) + "\n").encode("utf-16-le")
    (d / "broken-utf16.jsonl").write_bytes(utf16 + "\ud800 half a pair\n".encode("utf-16-le", "surrogatepass"))


# (arguments after the tiny run's, with {d} the corpus directory; what the one error line must contain)
ERRORS = [
    # data files
    ("datasets={d}/missing.jsonl", "unknown dataset '{d}/missing.jsonl'"),
    ("datasets={d}/empty.jsonl", "{d}/empty.jsonl: no usable preference pairs in 0 rows"),
    ("datasets={d}/latin1.jsonl", "{d}/latin1.jsonl:2: not UTF-8 text"),
    ("datasets={d}/truncated.jsonl.gz", "{d}/truncated.jsonl.gz: a truncated or corrupt gzip file"),
    ("datasets={d}/fake.parquet", "{d}/fake.parquet: not a readable Parquet file"),
    ("datasets={d}/pairs.csv", "{d}/pairs.csv: unsupported file type; expected one of .jsonl"),
    ("datasets={d}/malformed.jsonl", "{d}/malformed.jsonl:2: malformed JSON line"),
    ("datasets={d}/array.jsonl", "{d}/array.jsonl:1: expected a JSON object, got list"),
    ("datasets={d}/null.jsonl", "{d}/null.jsonl:1: expected a JSON object, got NoneType"),
    ("datasets={d}/object.json", "{d}/object.json: expected a JSON list of rows"),
    ("datasets={d}/broken.json", "{d}/broken.json:1: malformed JSON"),
    ("datasets={d}/number.jsonl", "{d}/number.jsonl:1: chosen is a int, expected a string"),
    ("datasets={d}/missing-column.jsonl", "{d}/missing-column.jsonl:1: unrecognised columns ['chosen', 'prompt']"),
    ("datasets={d}/chat-ends-with-user.jsonl", "chat-ends-with-user.jsonl:1: the last message of chosen is not an"),
    ("datasets={d}/chat-of-strings.jsonl", "{d}/chat-of-strings.jsonl:1: a message is a str, expected"),
    ("datasets={d}/images.jsonl", "{d}/images.jsonl:2: column 'images' holds images, and this model takes text only"),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-missing.jsonl",
        "{d}/vlm-missing.jsonl:1: image '{d}/nowhere.png' cannot be read (No such file or directory)",
    ),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-garbage.jsonl",
        "{d}/vlm-garbage.jsonl:1: {d}/garbage-image.png is not an image that can be decoded",
    ),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-two-images.jsonl",
        "{d}/vlm-two-images.jsonl:1: the prompt has 1 image placeholder ('<image>') and the row 2 images",
    ),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-no-placeholder.jsonl",
        "{d}/vlm-no-placeholder.jsonl:1: the prompt has 0 image placeholders ('<image>') and the row 1 image",
    ),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-image-not-a-path.jsonl",
        "vlm-image-not-a-path.jsonl:1: an image is a int, expected a path, bytes or {{'bytes': ...}}",
    ),
    (
        "model.name_or_path={d}/vlm datasets={d}/vlm-pairs.jsonl max_length=16 max_prompt_length=8",
        "a prompt with images "
        "is 35 tokens, its images' included, and max_length 16 / max_prompt_length 8 would cut it: raise them",
    ),
    ("datasets={d}/tools-unrendered.jsonl", "{d}/tools-unrendered.jsonl:1: the row has tools, but the tokenizer's"),
    ("datasets={d}/tools-not-a-list.jsonl", "{d}/tools-not-a-list.jsonl:1: tools is a dict, expected a list of tool"),
    ("datasets={d}/tools-bad-json.jsonl", "{d}/tools-bad-json.jsonl:1: tools is a string but not JSON (Expecting"),
    ("datasets={d}/tools-on-strings.jsonl", "{d}/tools-on-strings.jsonl:1: the row has tools, but its texts are str"),
    ("datasets={d}/kwargs-string.jsonl", "{d}/kwargs-string.jsonl:1: chat_template_kwargs is a str, expected an"),
    ("datasets={d}/kwargs-reserved.jsonl", "kwargs-reserved.jsonl:1: chat_template_kwargs sets add_generation_prompt,"),
    ("+chat_template_kwargs.tokenize=true", "chat_template_kwargs={{tokenize:true}} sets tokenize, which the render"),
    ("datasets={d}/hh-no-assistant.jsonl", "{d}/hh-no-assistant.jsonl:1: no '\\n\\nAssistant:' marker"),
    (
        "datasets={d}/all-identical.jsonl",
        "all-identical.jsonl: no usable preference pairs in 3 rows (skipped: 3 chosen",
    ),
    ("datasets={d}/no-data-files", "{d}/no-data-files: no .jsonl, .jsonl.gz, .json, .parquet files"),
    ("datasets={d}/test-files-only", "{d}/test-files-only: nothing to train on, only test files (eval.jsonl;"),
    ("n_eval_examples=1000", "holding out n_eval_examples=1000 pairs for eval leaves none of its 48 pairs"),
    ("batch_size=64 eval_batch_size=64 eval_every=64", "the training data has 40 examples, fewer than batch_size=64"),
    ("datasets=[]", "datasets=[] names no dataset"),
    ("datasets={d}/broken-utf16.jsonl", "{d}/broken-utf16.jsonl:2: not UTF-16 text (illegal UTF-16 surrogate)"),
    ("datasets=[{d}/empty.jsonl,null]", "datasets[1]=None must be a string"),
    # numeric keys out of range, wrong types
    ("lr=-1e-5", "lr=-1e-05 must be positive"),
    ("lr=fast", "lr=fast must be a number"),
    ("lr=nan", "lr=nan must be positive"),
    ("seed=-1", "seed=-1 must be in [0, 4294967295]"),
    ("seed=4294967296", "seed=4294967296 must be in [0, 4294967295]"),
    ("seed=0,1", "seed=0,1 must be an integer"),
    ("distributed_timeout_secs=1e10", "distributed_timeout_secs=10000000000.0 must be in (0, 1000000000]"),
    ("+optimizer_kwargs.weight_decay=-1", "+optimizer_kwargs.weight_decay=-1: torch.optim.AdamW refuses it (Invalid"),
    ("+optimizer_kwargs.betas=[0.9,1.5]", "+optimizer_kwargs.betas=[0.9,1.5]: torch.optim.AdamW refuses it (Invalid"),
    ("warmup_steps=-1", "warmup_steps=-1 must be zero or more"),
    ("max_length=0", "max_length=0 must be positive"),
    ("max_prompt_length=600", "max_prompt_length=600 must be positive and below max_length=512"),
    ("n_epochs=0", "n_epochs=0 must be positive, or null to train by n_examples"),
    ("n_examples=-5", "n_examples=-5 must be positive"),
    ("loss.beta=0", "loss.beta=0.0 must be positive"),
    ("loss.label_smoothing=0.6", "loss.label_smoothing=0.6 must be in [0, 0.5]"),
    ("loss=f_dpo loss.f_divergence=alpha", "loss.f_divergence=alpha needs loss.alpha in (0, 1)"),
    ("loss=f_dpo loss.alpha=0.3", "loss.alpha=0.3 is read only with loss.f_divergence=alpha (here js)"),
    ("batch_size=7 gradient_accumulation_steps=2", "batch_size=7 must be a positive multiple of"),
    ("compute_weight_copies=true", "compute_weight_copies=true with model.fsdp_policy_mp=null: the policy computes"),
    (
        "compute_weight_copies=true trainer=FSDPTrainer model.fsdp_policy_mp=bfloat16",
        "compute_weight_copies=true replaces autocast's weight casts on one process; FSDPTrainer is not tested with",
    ),
    (
        "compute_weight_copies=true compile_blocks=true model.fsdp_policy_mp=bfloat16",
        "compute_weight_copies=true with compile_blocks=true: the copies' bookkeeping",
    ),
    ("micro_batch_memory=lots", "micro_batch_memory=lots must be auto, a positive number of GiB, or null"),
    ("micro_batch_memory=-2", "micro_batch_memory=-2 must be auto, a positive number of GiB, or null"),
    ("micro_batch_memory=0.0001", "micro_batch_memory=0.0001: the smallest micro-batches (gradient_accumulation_s"),
    ("loss=kto batch_size=1", "batch_size=1: loss=kto estimates its reference point from each batch's mismatched"),
    ("eval_every=12", "eval_every=12 must be a positive multiple of batch_size=8"),
    ("save_every=12", "save_every=12 must be a positive multiple of batch_size=8, or null"),
    ("keep_last=0", "keep_last=0 must be positive, or null to keep every checkpoint"),
    ("debug=maybe", "debug=maybe must be true or false"),
    ("wandb.enabled=1", "wandb.enabled=1 must be true or false"),
    ("model.policy_dtype=float33", "model.policy_dtype=float33 is not a dtype"),
    # unknown names
    ("learning_rate=1e-5", "unknown key 'learning_rate' in the config; valid: seed, exp_name,"),
    ("loss.betta=0.1", "unknown key 'loss.betta' in loss=dpo (did you mean 'beta'?"),
    ("loss=dpoo", "unknown loss 'dpoo' (did you mean 'dpo'?"),
    ("model=smollm", "unknown model 'smollm'"),
    ("trainer=FSDPtrainer", "unknown trainer 'FSDPtrainer' (did you mean 'FSDPTrainer'?"),
    ("optimizer=Adamw", "unknown optimizer 'Adamw'"),
    ("layout=pack", "layout=pack is not a layout (did you mean 'packed'?"),
    ("packed_attention=blok", "packed_attention=blok is not an attention path (did you mean 'block'?"),
    # settings that would be accepted and ignored, or would train wrongly
    ("layout=padded pack_row_tokens=512", "pack_row_tokens=512 sets the rows of layout=packed"),
    ("layout=padded packed_attention=dense", "packed_attention=dense sets the attention of layout=packed"),
    ("save_async=true debug=true", "save_async=true writes checkpoints in the background, but debug=true writes"),
    ("pack_row_tokens=0", "pack_row_tokens=0 must be a positive number of tokens, or null"),
    ("model.policy_dtype=float16", "model.policy_dtype=float16 would keep the trained weights in float16"),
    ("loss_scale.min_scale=0", "loss_scale.min_scale=0.0 must be 1 or more"),
    ("loss_scale.growth_interval=0", "loss_scale.growth_interval=0 must be positive"),
    ("model.fsdp_reduce_dtype=fp8", "model.fsdp_reduce_dtype=fp8 is not a dtype"),
    ("model.fsdp_reduce_dtype=bfloat16", "model.fsdp_reduce_dtype=bfloat16 sets how FSDPTrainer reduces gradients"),
    # dry_run=true planning for other machines (plan.*)
    ("plan.gpus_per_node=8 plan.gpu_memory_gib=80", "plan.gpus_per_node=8 describes machines for dry_run=true to plan"),
    ("dry_run=true plan.gpus_per_node=8", "plan.gpu_memory_gib=null: planning for other machines takes"),
    ("dry_run=true plan.nodes=0", "plan.nodes=0 must be positive"),
    ("dry_run=true plan.gpus_per_node=8 plan.gpu_memory_gib=80 nproc=2", "nproc=2 with plan.*: the planned world is"),
    # models, archives, checkpoints, run directories
    ("model.name_or_path={d}/no-model model.random_init=false", "could not load model '{d}/no-model'"),
    ("model.archive={d}/garbage.pt", "model.archive: {d}/garbage.pt is not a readable checkpoint"),
    ("model.archive={d}/wrong-shape.pt", "model.archive: {d}/wrong-shape.pt does not fit this LlamaForCausalLM"),
    ("resume_from={d}/garbage-checkpoint", "resume_from={d}/garbage-checkpoint: {d}/garbage-checkpoint/policy.pt is"),
    ("resume_from={d}/incomplete-checkpoint", "{d}/incomplete-checkpoint/optimizer.pt does not exist"),
    ("resume_from={d}/wrong-shape-checkpoint", "wrong-shape-checkpoint/policy.pt does not fit this LlamaForCausalLM"),
    ("resume_from={d}/archive-not-checkpoint", "archive-not-checkpoint/policy.pt has no step_idx: not a training"),
    ("resume_from={d}/nowhere", "resume_from={d}/nowhere: {d}/nowhere does not exist"),
    ("resume_from={d}/sharded-no-marker", "sharded-no-marker has no checkpoint.json: not a complete checkpoint"),
    ("resume_from={d}/sharded-garbage", "sharded-garbage/policy holds no readable safetensors files (Error while"),
    (
        "resume_from={d}/sharded-wrong-shape",
        "sharded-wrong-shape/policy does not fit this LlamaForCausalLM (lm_head.weight is missing)",
    ),
    ("model.archive={d}/no-data-files", "model.archive: {d}/no-data-files is a directory but not a checkpoint"),
    ("resume_from=auto local_run_dir=null", "resume_from=auto continues the run in local_run_dir"),
    ("local_run_dir={d}/a-file/run", "local_run_dir={d}/a-file/run must be a directory, but {d}/a-file is a file"),
    ("local_run_dir=/proc/dpo-run", "could not write /proc/dpo-run (No such file or directory); choose a writable"),
    # a value with spaces the shell split, not having been quoted (these cases split at spaces, as a shell does)
    ("local_run_dir={d}/my run", "run is not an override (key=value); a value with spaces is one argument only quoted"),
    ("local_run_dir={d}/my run", 'quoted for the shell: "local_run_dir={d}/my run"'),
    ("exp_name", "the command line: exp_name has no value; give exp_name=VALUE"),
    ("exp_name=null", "exp_name=null must be a string"),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    write_corpus(d)
    return d


@pytest.mark.parametrize("args, message", ERRORS, ids=[args for args, _ in ERRORS])
def test_bad_input_is_one_error_line(corpus, tmp_path, pairs_file, capsys, args, message):
    command = [*tiny_run_overrides(tmp_path, pairs_file), *args.format(d=corpus).split()]
    with pytest.raises(SystemExit) as exit:
        train.main(command)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err  # before any progress bar: nothing else on stderr
    assert message.format(d=corpus) in err[0]


def test_the_corpus_has_at_least_40_cases():
    assert len(ERRORS) >= 40


def test_usable_input_runs_and_counts_what_it_left_out(tmp_path, capsys):
    # 2 unusable rows among 50 are skipped and counted; prompts far over max_length are cut and counted.
    rows = arithmetic_pairs(48) + [{**GOOD, "chosen": "  "}, {**GOOD, "rejected": GOOD["chosen"]}]
    rows[0]["prompt"] = "Tell me a long story. " * 100
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    train.main([*tiny_run_overrides(tmp_path, data), "max_length=64", "max_prompt_length=32"])
    out = capsys.readouterr().out
    assert f"data: {data}: 48 pairs from 50 rows; skipped 2 rows: 1 empty response (first: {data}:49), " in out
    assert "1 chosen == rejected" in out
    assert "truncated: 1 of 48 examples" in out
    assert checkpoint.describe(tmp_path / "run" / "LATEST") is not None


BOM_TEXTS = ["utf-8-sig", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"]  # each with its byte-order mark


def encoded(text: str, encoding: str) -> bytes:
    return ("\ufeff" + text).encode(encoding.removesuffix("-sig"))


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json"])
@pytest.mark.parametrize("encoding", BOM_TEXTS)
def test_a_byte_order_mark_names_the_encoding_in_every_text_format(tmp_path, tiny_tokenizer, suffix, encoding):
    # Windows editors and spreadsheet exports open UTF-8 with a mark (EF BB BF: "Unexpected UTF-8 BOM" once);
    # PowerShell's `>` writes UTF-16 with one. Every text format reads the same rows as from plain UTF-8.
    from preference_datasets import get_dataset

    rows = arithmetic_pairs(10)
    rows[0]["prompt"] = "Q: é 日本 \u2028 1 + 1?\nA:"  # non-ASCII, and a line separator only "\n" must not split at
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\r\n" for row in rows)  # Windows line ends
    text = json.dumps(rows, ensure_ascii=False) if suffix == ".json" else lines
    compress = gzip.compress if suffix.endswith(".gz") else bytes
    (tmp_path / "plain").mkdir()
    (tmp_path / "marked").mkdir()
    plain, marked = tmp_path / "plain" / f"pairs{suffix}", tmp_path / "marked" / f"pairs{suffix}"
    plain.write_bytes(compress(text.encode()))
    marked.write_bytes(compress(encoded(text, encoding)))
    expected = get_dataset(str(plain), tiny_tokenizer, 0, 2, cache_dir=tmp_path)
    assert get_dataset(str(marked), tiny_tokenizer, 0, 2, cache_dir=tmp_path) == expected
    assert any(pair.prompt.startswith("Q: é 日本 \u2028") for split in expected.values() for pair in split)


def test_a_byte_order_marked_file_trains(tmp_path, capsys):
    data = tmp_path / "exported.jsonl"
    data.write_bytes(encoded("".join(json.dumps(row) + "\n" for row in arithmetic_pairs(48)), "utf-8-sig"))
    train.main(tiny_run_overrides(tmp_path, data))
    assert f"data: {data}: 48 pairs from 48 rows" in capsys.readouterr().out
    assert checkpoint.describe(tmp_path / "run" / "LATEST") is not None


def test_every_path_key_takes_spaces_and_non_ascii_letters(tmp_path, capsys):
    # Each path as the shell hands it over once quoted ("local_run_dir=/data/mes essais/é"): one argument, where
    # Hydra's grammar alone ends in "LexerNoViableAltException". A run with its model, data, caches and run directory
    # there; then a resume from its checkpoint, and a run from its weights (model.archive), each in such a directory.
    odd = tmp_path / "mes essais d'été 日本 (1)"  # no comma: a list given without brackets splits at commas
    model = shutil.copytree(TINY_DIR, odd / "modèle tiny")
    data = write_jsonl(odd / "paires à trier.jsonl", arithmetic_pairs(48))
    common = [a for a in tiny_run_overrides(tmp_path, data) if not a.startswith(("local_", "datasets="))]
    paths = [f"model.name_or_path={model}", f"datasets={data}", f"local_dirs={odd / 'caches é'}"]
    first = odd / "run, 1"  # a string key: one path
    train.main([*common, *paths, f"local_run_dir={first}"])
    assert checkpoint.describe(first / "LATEST") and checkpoint.describe(first / "step-16")
    assert (odd / "caches é" / "reference_logps").is_dir()
    saved = OmegaConf.load(first / "config.yaml")
    assert (saved.model.name_or_path, saved.datasets, saved.local_run_dir) == (str(model), [str(data)], str(first))

    resumed = odd / "reprise [2]"
    train.main([*common, *paths, f"local_run_dir={resumed}", f"resume_from={first / 'step-16'}"])
    assert OmegaConf.load(resumed / "config.yaml").resume_from == str(first / "step-16")
    assert [r["step"] for r in read_jsonl(resumed / "metrics.jsonl") if "loss/train" in r] == [24, 32, 40]

    archived = odd / "depuis l'archive 3"
    train.main([*common, *paths, f"local_run_dir={archived}", f"model.archive={first / 'LATEST'}"])
    assert checkpoint.describe(archived / "LATEST") is not None
    assert "Traceback" not in capsys.readouterr().err
