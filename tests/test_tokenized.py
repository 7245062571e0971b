"""Tokenized examples (tokenized.py): batched tokenization and length-based truncation against one tokenizer call per
text and the DPO reference's truncation written out; the cache's hits, misses, damage and concurrent builders."""

import gzip
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow
import pyarrow.parquet
import pytest
import transformers
from ballast import fill

from conftest import REPO_ROOT, TINY_DIR, arithmetic_pairs, labelled_completions, write_jsonl
from core.examples import from_ids, truncated
from core.step import mismatched
from pairs.formats import PreferencePair
from persistence import tokenized
from persistence.tokenized import Tokenization, first_of_each_group, load_examples, tokenize_pairs
from preference_datasets import get_dataset
from utils import UserError

PAIRS = Tokenization(max_length=24, max_prompt_length=10, sft=False)


def pair(prompt="Hello there", chosen=" yes indeed", rejected=" no", mode="keep_start"):
    return PreferencePair(prompt, chosen, rejected, chosen, mode)


def one_call_per_text(pair: PreferencePair, tokenizer, settings: Tokenization) -> tuple[list, list]:
    """(prompt ids, response ids) as the DPO reference makes them: each text tokenized alone, EOS after each
    response given as text (a chat template ends those it renders); when prompt + the longest response exceed
    max_length the prompt is cut to max_prompt_length (its end kept for keep_end), and if they still do, each response
    to max_length - max_prompt_length."""
    texts = [pair.sft_target] if settings.sft else [pair.chosen, pair.rejected]
    prompt = tokenizer(pair.prompt, add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if pair.append_eos else []
    responses = [tokenizer(text, add_special_tokens=False)["input_ids"] + eos for text in texts]
    longest = max(map(len, responses))
    m, n = settings.max_prompt_length, settings.max_length
    if len(prompt) + longest > n:
        prompt = prompt[-m:] if pair.truncation_mode == "keep_end" else prompt[:m]
    if len(prompt) + longest > n:
        responses = [response[: n - m] for response in responses]
    return prompt, responses


def as_lists(examples) -> list[tuple]:
    return [(ex["prompt"], ex["responses"], ex["key"]) for ex in examples.take(range(len(examples)))]


# --- tokenizing ----------------------------------------------------------------------------------------------


def test_eos_ends_each_response_and_no_special_tokens_are_added(tiny_tokenizer):
    [example] = tokenize_pairs([pair()], tiny_tokenizer, Tokenization(100, 50, False)).take([0])
    assert example["prompt"] == tiny_tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    chosen, rejected = example["responses"]
    assert chosen[-1] == rejected[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(chosen[:-1]) == " yes indeed"


@pytest.mark.parametrize("mode,kept", [("keep_start", "abcde"), ("keep_end", "fghij")])
def test_truncation(tiny_tokenizer, mode, kept):
    settings = Tokenization(max_length=12, max_prompt_length=5, sft=False)
    examples = tokenize_pairs([pair("abcdefghij", " 0123456789", " x", mode)], tiny_tokenizer, settings)
    example = examples[0]
    assert tiny_tokenizer.decode(example["prompt"]) == kept
    # prompt (5) + longest response (11) still exceeds 12, so responses are cut to 12 - 5 = 7 tokens
    assert [len(r) for r in example["responses"]] == [7, 3]
    assert examples.full_lengths.tolist() == [[10, 12, 3]] and examples.lengths.tolist() == [[5, 7, 3]]


def test_the_batch_encoder_gives_the_ids_of_one_call_per_text(tiny_tokenizer):
    # The Rust backend is called on a copy of its own, set as transformers sets it for such a call: what an earlier
    # call left behind (truncation, padding) does not apply, and special tokens written in a text stay special.
    tiny_tokenizer(["a long text to cut"], truncation=True, max_length=3, padding="max_length")
    encode = tokenized.batch_encoder(tiny_tokenizer)
    texts = ["plain text", f"a {tiny_tokenizer.eos_token} inside", "", " é 日本 \u2028", "<|im_start|>user\nhi"]
    assert encode(texts) == [tiny_tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    assert tiny_tokenizer.eos_token_id in encode(texts)[1]


def test_truncation_on_lengths_follows_the_reference_rule():
    # max_length 10, max_prompt_length 4: (prompt, chosen, rejected) counts before -> after
    cases = [
        ([3, 4, 2], [3, 4, 2]),  # fits
        ([8, 2, 1], [8, 2, 1]),  # exactly max_length: fits
        ([9, 2, 1], [4, 2, 1]),  # the prompt is cut, then it fits
        ([2, 9, 3], [2, 6, 3]),  # a short prompt is not cut; the responses are, to 10 - 4
        ([9, 9, 1], [4, 6, 1]),  # both
        ([4, 7, 6], [4, 6, 6]),  # the prompt is at max_prompt_length already: the responses are cut
    ]
    before = np.array([case[0] for case in cases])
    assert truncated(before, 10, 4).tolist() == [case[1] for case in cases]


def test_one_example_per_prompt_for_sft(tiny_tokenizer):
    pairs = [pair("p1", " a", " b"), pair("p2", " c", " d"), pair("p1", " a", " e")]
    examples = first_of_each_group(tokenize_pairs(pairs, tiny_tokenizer, Tokenization(50, 20, sft=True)))
    assert [tiny_tokenizer.decode(ex["prompt"]) for ex in examples.take(range(len(examples)))] == ["p1", "p2"]
    assert examples.lengths.shape == (2, 2)  # prompt and the sft_target


def test_keys_depend_on_every_token_and_on_where_responses_split(tiny_tokenizer):
    settings = Tokenization(100, 50, False)
    pairs = [pair("ab", " c", " de"), pair("ab", " cd", " e"), pair("ab", " de", " c"), pair("b", " c", " de")]
    keys = tokenize_pairs(pairs + pairs[:1], tiny_tokenizer, settings).keys.tolist()
    assert len(set(keys[:4])) == 4 and keys[4] == keys[0]  # the same ids, the same key


def test_mismatched_examples_pair_each_prompt_with_the_next_responses(tiny_tokenizer):
    # KTO's KL examples: prompt i with the responses of i + 1 (the last with the first's), truncated with the
    # prompt's end kept, keyed as the tokenized example with the same ids would be.
    settings = Tokenization(max_length=20, max_prompt_length=8, sft=False)
    pairs = [PreferencePair("Same prompt:", f" chosen {i}", f" rejected {i}", "", "keep_start") for i in range(3)]
    examples = tokenize_pairs(pairs, tiny_tokenizer, settings).take(range(3))
    kl = mismatched(examples, settings.max_length, settings.max_prompt_length)
    for i, example in enumerate(kl):  # one prompt: each mismatched example is the next tokenized one, key and all,
        assert example == {**examples[(i + 1) % 3], "keep_end": True}  # but for the end it keeps, from_ids' own
    long = PreferencePair("Fifteen chars!!", " x", " y", "", "keep_start")
    short = PreferencePair("Q", " a response 12", " no", "", "keep_start")
    a, b = tokenize_pairs([long, short], tiny_tokenizer, settings).take(range(2))
    assert len(a["prompt"]) == 15 and [len(r) for r in b["responses"]] == [15, 4]  # EOS included; all kept
    first = mismatched([a, b], settings.max_length, settings.max_prompt_length)[0]
    # 15 + 15 > 20: the prompt's last 8 ids, then 8 + 15 > 20: the responses' first 12
    assert first["prompt"] == a["prompt"][-8:] and first["responses"] == [b["responses"][0][:12], b["responses"][1]]
    assert first["key"] != mismatched([a, b], 20, 7)[0]["key"]


def test_labelled_completions_are_one_response_and_their_label_cached(tmp_path, tiny_tokenizer):
    settings = Tokenization(max_length=64, max_prompt_length=32, sft=False)
    path = write_jsonl(tmp_path / "kto.jsonl", labelled_completions(6))
    for _ in range(2):  # built, then read from the cache
        splits = load_examples([str(path)], tiny_tokenizer, settings, 0, 2, tmp_path)
        train = splits["train"]
        assert train.labelled and train.lengths.shape[1] == 2 and len(train) + len(splits["test"]) == 12
        examples = train.take(range(len(train)))
        assert [ex["label"] for ex in examples] == (train.labels == 1).tolist() and 0 < train.labels.sum() < len(train)
        assert all(len(ex["responses"]) == 1 for ex in examples)
    [cached] = [d for d in (tmp_path / "tokenized").iterdir() if (d / "labels.npy").exists()]  # read back above
    pairs = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(6))
    with pytest.raises(UserError, match="the datasets mix preference pairs and labelled completions"):
        load_examples([str(path), str(pairs)], tiny_tokenizer, settings, 0, 2, tmp_path)
    (tmp_path / "mixed").mkdir()  # pairs to train on, labelled completions to evaluate on
    write_jsonl(tmp_path / "mixed" / "train.jsonl", arithmetic_pairs(6))
    write_jsonl(tmp_path / "mixed" / "test.jsonl", labelled_completions(2))
    with pytest.raises(UserError, match="the datasets mix preference pairs and labelled completions"):
        load_examples([str(tmp_path / "mixed")], tiny_tokenizer, settings, 0, 2, tmp_path)


def test_many_chunks_equal_one(tiny_tokenizer, monkeypatch):
    pairs = [pair(f"q{i % 7}", f" a{i}", f" b{i % 3}", "keep_end" if i % 2 else "keep_start") for i in range(50)]
    whole = tokenize_pairs(pairs, tiny_tokenizer, PAIRS)
    monkeypatch.setattr(tokenized, "CHUNK_PAIRS", 8)
    chunked = tokenize_pairs(pairs, tiny_tokenizer, PAIRS)
    assert len(chunked.token_parts) == 7 and as_lists(chunked) == as_lists(whole)
    np.testing.assert_array_equal(chunked.groups, whole.groups)


# --- every data format: cached == in memory == one call per text ----------------------------------------------


def hh_row(question: str, chosen: str, rejected: str) -> dict:
    prompt = f"\n\nHuman: {question}\n\nAssistant:"
    return {"chosen": prompt + chosen, "rejected": prompt + rejected}


def write_formats(directory) -> dict[str, str]:
    """A dataset of each format: {name: the datasets= entry}; long texts, so that truncation happens."""
    directory.mkdir()
    explicit = write_jsonl(directory / "explicit.jsonl", arithmetic_pairs(12))
    hh = directory / "hh.jsonl.gz"
    rows = [hh_row(f"question {i} " * (i % 4 + 1), f" good answer {i}" * (i % 3 + 1), f" bad {i}") for i in range(12)]
    with gzip.open(hh, "wt") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    chat = directory / "chat.json"
    chat.write_text(
        json.dumps(
            [
                {
                    "chosen": [{"role": "user", "content": f"q{i} " * i}, {"role": "assistant", "content": f"yes {i}"}],
                    "rejected": [{"role": "user", "content": f"q{i} " * i}, {"role": "assistant", "content": "no"}],
                }
                for i in range(12)
            ]
        )
    )
    shp = directory / "shp.parquet"
    shp_rows = [
        {"history": f"h{i}", "human_ref_A": f"a{i}", "human_ref_B": "b", "labels": i % 2, "score_A": 9, "score_B": 1}
        for i in range(12)
    ]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(shp_rows), shp)
    se = write_jsonl(
        directory / "se.jsonl",
        [
            {"question": f"<p>q{i}</p>", "answers": [{"text": f"x{i}", "pm_score": 2}, {"text": "y", "pm_score": 1}]}
            for i in range(12)
        ],  # fmt: skip
    )
    split = directory / "split"
    split.mkdir()
    write_jsonl(split / "train.jsonl", arithmetic_pairs(10))
    write_jsonl(split / "test.jsonl", arithmetic_pairs(4))
    return {"explicit": explicit, "hh": hh, "chat": chat, "shp": shp, "se": se, "split": split}


@pytest.mark.parametrize("sft", [False, True])
def test_cached_equals_uncached_equals_one_call_per_text_in_every_format(tmp_path, tiny_tokenizer, capsys, sft):
    settings = Tokenization(max_length=24, max_prompt_length=10, sft=sft)
    for name, path in write_formats(tmp_path / "data").items():
        pairs = get_dataset(str(path), tiny_tokenizer, 0, 4, cache_dir=tmp_path)
        built = load_examples([str(path)], tiny_tokenizer, settings, 0, 4, tmp_path / "cache")
        assert "(tokenized, cached in" in capsys.readouterr().out
        again = load_examples([str(path)], tiny_tokenizer, settings, 0, 4, tmp_path / "cache")
        assert "(tokenized earlier:" in capsys.readouterr().out
        for split in ("train", "test"):
            in_memory = tokenize_pairs(pairs[split], tiny_tokenizer, settings)
            expected = [one_call_per_text(p, tiny_tokenizer, settings) for p in pairs[split]]
            assert [(prompt, responses) for prompt, responses, _ in as_lists(built[split])] == expected, name
            assert as_lists(built[split]) == as_lists(again[split]) == as_lists(in_memory), name
            np.testing.assert_array_equal(built[split].full_lengths, in_memory.full_lengths)
        assert built["train"].lengths.sum() < built["train"].full_lengths.sum() or name in ("shp", "se"), name


def test_each_example_keeps_its_formats_prompt_end_through_the_cache(tmp_path, tiny_tokenizer, capsys):
    """keep_end, the end sampling keeps of a prompt too long for a model's positions, is the end training keeps:
    HH's dialogues their end, every other format its start; built, then mapped back from the cache, alike, and carried
    through concatenation and the held-out split. from_ids' pairs keep their end."""
    formats = write_formats(tmp_path / "data")
    names = [str(formats["hh"]), str(formats["explicit"]), str(formats["shp"])]
    for said in ("(tokenized, cached in", "(tokenized earlier:"):
        splits = load_examples(names, tiny_tokenizer, PAIRS, 0, 4, tmp_path / "cache")
        assert capsys.readouterr().out.count(said) == 3
        for split, n_hh in (("train", 8), ("test", 4)):  # 12 rows a format, 4 held out
            examples = splits[split]
            keep_end = [example["keep_end"] for example in examples.take(range(len(examples)))]
            assert keep_end == [True] * n_hh + [False] * (len(examples) - n_hh) and len(examples) > n_hh
            assert examples.keep_end.tolist() == keep_end
    made = from_ids([[1, 2, 3]], [[[4], [5]]], np.zeros(1, np.int64), max_length=8, max_prompt_length=4)
    assert made[0]["keep_end"] is True


def test_a_hub_dataset_is_cached_by_its_fingerprint(monkeypatch, tmp_path, tiny_tokenizer, capsys):
    import datasets

    rows = [{"prompt": f"q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(6)]

    def dataset_of(rows):
        train, test = datasets.Dataset.from_list(rows[:4]), datasets.Dataset.from_list(rows[4:])
        return datasets.DatasetDict(train=train, test=test)

    hub = {"org/pairs": dataset_of(rows)}
    monkeypatch.setattr(datasets, "load_dataset", lambda name, cache_dir=None, split=None: hub[name])
    first = load_examples(["org/pairs"], tiny_tokenizer, PAIRS, 0, None, tmp_path)
    assert capsys.readouterr().out.count("(tokenized, cached in") == 2  # train and test
    load_examples(["org/pairs"], tiny_tokenizer, PAIRS, 0, None, tmp_path)
    assert capsys.readouterr().out.count("(tokenized earlier:") == 2
    rows[0]["chosen"] = " changed"  # another dataset: another fingerprint
    hub["org/pairs"] = dataset_of(rows)
    changed = load_examples(["org/pairs"], tiny_tokenizer, PAIRS, 0, None, tmp_path)
    assert "(tokenized, cached in" in capsys.readouterr().out
    assert as_lists(changed["train"])[1:] == as_lists(first["train"])[1:] != as_lists(changed["train"])


# --- the cache ---------------------------------------------------------------------------------------------


def cache_dirs(cache) -> list:
    return sorted(path.name for path in (cache / "tokenized").iterdir())


def test_what_the_ids_depend_on_misses_the_cache_and_nothing_else_does(tmp_path, tiny_tokenizer, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(12))
    cache = tmp_path / "cache"

    def load(tokenizer=tiny_tokenizer, settings=PAIRS, seed=0, n_eval=4):
        examples = load_examples([str(path)], tokenizer, settings, seed, n_eval, cache)
        out = capsys.readouterr().out
        assert ("(tokenized earlier:" in out) != ("(tokenized, cached in" in out)
        return examples, "(tokenized earlier:" in out

    load()
    assert load()[1] and load(seed=1)[1] and load(n_eval=2)[1]  # the held-out split is made after the cache
    assert len(cache_dirs(cache)) == 1
    assert not load(settings=Tokenization(25, 10, False))[1]  # max_length
    assert not load(settings=Tokenization(24, 10, True))[1]  # SFT's targets
    assert not load(settings=Tokenization(24, 10, False, {"enable_thinking": False}))[1]  # the run's chat kwargs
    other_template = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    other_template.chat_template = "{{ messages }}"
    assert not load(tokenizer=other_template)[1]
    other_vocabulary = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    other_vocabulary.add_tokens(["<new>"])
    assert not load(tokenizer=other_vocabulary)[1]
    assert load(tokenizer=transformers.AutoTokenizer.from_pretrained(TINY_DIR))[1]  # the same tokenizer, loaded again
    write_jsonl(path, arithmetic_pairs(13))  # the file's content
    assert not load()[1]
    assert len(cache_dirs(cache)) == 7


@pytest.mark.parametrize("damage", ["truncate tokens", "flip a byte", "remove an array", "foreign key", "bad meta"])
def test_a_damaged_or_foreign_copy_is_rebuilt_with_a_line(tmp_path, tiny_tokenizer, capsys, damage):
    path = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(12))
    cache = tmp_path / "cache"
    expected = as_lists(load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, cache)["train"])
    [name] = cache_dirs(cache)
    directory = cache / "tokenized" / name
    tokens = directory / "tokens.bin"
    meta = json.loads((directory / "meta.json").read_text())
    if damage == "truncate tokens":
        tokens.write_bytes(tokens.read_bytes()[:-8])
    elif damage == "flip a byte":
        data = bytearray(tokens.read_bytes())
        data[len(data) // 2] ^= 1
        tokens.write_bytes(bytes(data))
    elif damage == "remove an array":
        (directory / "keys.npy").unlink()
    elif damage == "foreign key":
        (directory / "meta.json").write_text(json.dumps({**meta, "key": meta["key"] + " (another run's)"}))
    else:
        (directory / "meta.json").write_text("{not json")
    capsys.readouterr()
    rebuilt = load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, cache)
    out = capsys.readouterr().out
    why = {"foreign key": "made for other data or settings", "truncate tokens": "checksum", "flip a byte": "checksum"}
    assert f"tokenized data: rebuilding {directory}, since" in out and why.get(damage, "unreadable") in out, out
    assert as_lists(rebuilt["train"]) == expected
    assert cache_dirs(cache) == [name]  # the damaged copy is gone, the new one in its place
    load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, cache)
    assert "(tokenized earlier:" in capsys.readouterr().out


@pytest.mark.parametrize("cache_kind", ["full", "read-only", "a file"])
def test_a_cache_that_cannot_be_written_is_one_line_and_the_run_goes_on(
    tmp_path, tiny_tokenizer, capsys, small_disk, read_only, cache_kind
):
    """A full disk mid-build, a read-only directory, a file in the way: the examples are tokenized in memory
    instead, alike, with one line naming the directory, and nothing is left in the cache."""
    path = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(400))
    expected = {
        split: as_lists(e)
        for split, e in load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, tmp_path / "ok").items()
    }
    if cache_kind == "full":
        cache = small_disk("64k")
        fill(cache, leave=16 << 10)  # room for the directories, not for the tokens
        reason = "No space left on device: "
    elif cache_kind == "read-only":
        (tmp_path / "ro").mkdir()
        cache = read_only(tmp_path / "ro")
        reason = "Read-only file system)"
    else:
        cache = tmp_path / "file"
        cache.write_text("")
        reason = "Not a directory)"
    capsys.readouterr()
    examples = load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, cache)
    assert {split: as_lists(e) for split, e in examples.items()} == expected
    line = next(line for line in capsys.readouterr().out.splitlines() if "pairs.jsonl: 400 pairs" in line)
    assert f"(tokenized in memory, not cached: could not write {cache}/tokenized/" in line and reason in line, line
    if cache.is_dir():
        assert [p.name for p in cache.rglob("*") if p.name != "ballast" and p.is_file()] == []


BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    import transformers

    import storage
    from persistence import tokenized
    data, cache, ready, n = sys.argv[1:5]
    publish = storage.publish

    def publish_together(temporary, directory, complete):  # both have built: they rename at the same moment
        Path(ready + sys.argv[5]).touch()
        while len(list(Path(ready).parent.glob(Path(ready).name + "*"))) < int(n):
            time.sleep(0.01)
        return publish(temporary, directory, complete)

    storage.publish = publish_together
    tokenizer = transformers.AutoTokenizer.from_pretrained({tiny!r})
    settings = tokenized.Tokenization(24, 10, False)
    examples = tokenized.load_examples([data], tokenizer, settings, 0, 4, Path(cache))
    print("keys", examples["train"].keys.tobytes().hex())
    """
)


def test_two_processes_building_at_once_leave_one_good_cache(tmp_path, tiny_tokenizer, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(300))
    script = tmp_path / "builder.py"
    script.write_text(BUILDER.format(repo=str(REPO_ROOT), tiny=str(TINY_DIR)))
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(script), str(path), str(cache), str(ready), "2"]
    builders = [subprocess.Popen([*command, str(i)], env=env, stdout=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [builder.communicate(timeout=120)[0] for builder in builders]
    assert [builder.returncode for builder in builders] == [0, 0]
    assert all("(tokenized, cached in" in out for out in outputs)  # both built, and both published at once
    keys = {line for out in outputs for line in out.splitlines() if line.startswith("keys")}
    assert len(keys) == 1
    assert len(cache_dirs(cache)) == 1  # one copy, no temporary left
    again = load_examples([str(path)], tiny_tokenizer, PAIRS, 0, 4, cache)
    assert "(tokenized earlier:" in capsys.readouterr().out
    assert f"keys {again['train'].keys.tobytes().hex()}" in keys


def prepare_on_rank(rank: int, world_size: int, port: int, data: str, cache: str, result: str) -> None:
    """One rank of a multi-process start, preparing the run's data as build.build does (build.rank_data)."""
    import torch.distributed as dist

    import build
    import config as configuration
    from core.objective import build_objective
    from modeling.distributed import Topology, leave_process_group, rank_environment

    os.environ.update(rank_environment(rank, world_size, port))
    dist.init_process_group("gloo")
    built = []
    build_cache = tokenized.build_cache
    tokenized.build_cache = lambda *args: built.append(rank) or build_cache(*args)
    overrides = ["model=tiny", f"datasets=[{data}]", "n_eval_examples=6", "trainer=FSDPTrainer"]
    config = configuration.load([*overrides, "batch_size=6", "eval_batch_size=6", "eval_every=12"])
    tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
    topology = Topology.create("FSDPTrainer")
    prepared = build.rank_data(config, topology, tokenizer, build_objective(config.loss), Path(cache))
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (built, prepared.train_examples.keys.tobytes()))
    if rank == 0:
        same = len({keys for _, keys in gathered}) == 1
        Path(result).write_text(json.dumps({"built": [r for b, _ in gathered for r in b], "same": same}))
    leave_process_group()


@pytest.mark.xdist_group("processes")  # see pyproject.toml
def test_the_first_rank_of_a_machine_tokenizes_and_the_others_map_its_cache(tmp_path):
    import torch.multiprocessing

    from modeling.distributed import free_port

    data = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(64))
    result = tmp_path / "result.json"
    args = (3, free_port(), str(data), str(tmp_path / "cache"), str(result))
    torch.multiprocessing.spawn(prepare_on_rank, args=args, nprocs=3)
    assert json.loads(result.read_text()) == {"built": [0], "same": True}
