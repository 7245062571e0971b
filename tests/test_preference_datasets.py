import gzip
import json

import pyarrow
import pyarrow.parquet
import pytest

from conftest import HH_TEST_FILE, arithmetic_pairs, labelled_completions, write_jsonl
from pairs.formats import LabelledCompletion, split_hh_dialogue, strip_html
from preference_datasets import batch_schedule, get_dataset
from utils import UserError


def load(path, tokenizer, n_eval=2, seed=0):
    return get_dataset(str(path), tokenizer, seed, n_eval, cache_dir=path.parent)


def hh_row(question: str, chosen: str, rejected: str) -> dict:
    prompt = f"\n\nHuman: {question}\n\nAssistant:"
    return {"chosen": prompt + chosen, "rejected": prompt + rejected}


# --- formats -------------------------------------------------------------------------------------------


def test_explicit_jsonl(tmp_path, tiny_tokenizer):
    data = load(write_jsonl(tmp_path / "d.jsonl", arithmetic_pairs(10)), tiny_tokenizer)
    assert len(data["train"]) + len(data["test"]) == 10
    pair = (data["train"] + data["test"])[0]
    assert pair.truncation_mode == "keep_start" and pair.sft_target == pair.chosen


def test_hh_dialogues_gz(tmp_path, tiny_tokenizer):
    rows = [hh_row(f"question {i}?", f" good answer {i}", f" bad answer {i}") for i in range(6)]
    rows[0]["chosen"] = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: question 0?\n\nAssistant: good answer 0"
    rows[0]["rejected"] = "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: question 0?\n\nAssistant: bad answer 0"
    path = tmp_path / "hh.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    pairs = {p.chosen: p for split in load(path, tiny_tokenizer).values() for p in split}
    first = pairs[" good answer 0"]
    assert first.prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: question 0?\n\nAssistant:"
    assert first.rejected == " bad answer 0" and first.truncation_mode == "keep_end"


BOM = "\ufeff".encode()  # UTF-8's byte-order mark, which Windows editors and spreadsheet exports write first


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".json"])
def test_a_file_opening_with_a_byte_order_mark_reads_like_one_without(tmp_path, tiny_tokenizer, suffix):
    rows = arithmetic_pairs(6)
    text = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(row) + "\n" for row in rows)
    data = BOM + text.encode()
    plain, marked = tmp_path / f"plain{suffix}", tmp_path / f"marked{suffix}"
    plain.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    marked.write_bytes(gzip.compress(data) if suffix.endswith(".gz") else data)
    assert load(marked, tiny_tokenizer) == load(plain, tiny_tokenizer)
    # only the file's first bytes may be a mark: one inside a line is part of the JSON, and wrong there
    inside = tmp_path / f"inside{suffix}"
    inside_text = text.encode().replace(b"{", BOM + b"{", 2)  # the second line's (in a .json, row's) mark
    inside.write_bytes(gzip.compress(inside_text) if suffix.endswith(".gz") else inside_text)
    with pytest.raises(UserError, match=rf"{inside}:\d+: malformed JSON"):
        load(inside, tiny_tokenizer)


def test_conversational_json_uses_chat_template(tmp_path, tiny_tokenizer):
    rows = [
        {
            "chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"yes {i}"}],
            "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"no {i}"}],
        }
        for i in range(4)
    ] + [
        {
            "prompt": [{"role": "user", "content": "q9"}],
            "chosen": [{"role": "assistant", "content": "yes 9"}],
            "rejected": [{"role": "assistant", "content": "no 9"}],
        }
    ]
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(rows))
    # each response is the rest of the prompt's conversation rendered with it, end of turn included (as in TRL)
    pairs = {p.chosen: p for split in load(path, tiny_tokenizer).values() for p in split}
    assert pairs["yes 0<|im_end|>\n"].prompt == "<|im_start|>user\nq0<|im_end|>\n<|im_start|>assistant\n"
    assert pairs["yes 9<|im_end|>\n"].prompt == "<|im_start|>user\nq9<|im_end|>\n<|im_start|>assistant\n"
    assert pairs["yes 9<|im_end|>\n"].rejected == "no 9<|im_end|>\n"
    assert not pairs["yes 9<|im_end|>\n"].append_eos  # the template ended the responses


def test_labelled_completions_in_text_and_conversational_rows(tmp_path, tiny_tokenizer, capsys):
    # KTO's unpaired data: prompt, completion, label; messages rendered with the chat template; empty ones skipped
    rows = labelled_completions(3) + [
        {
            "prompt": [{"role": "user", "content": "q9"}],
            "completion": [{"role": "assistant", "content": "yes 9"}],
            "label": False,
        },
        {"prompt": "Q", "completion": " ", "label": True},
    ]
    data = load(write_jsonl(tmp_path / "kto.jsonl", rows), tiny_tokenizer, n_eval=0)
    completions = {c.completion: c for c in data["train"]}
    assert all(isinstance(c, LabelledCompletion) for c in completions.values()) and len(completions) == 7
    first = rows[0]
    assert completions[first["completion"]] == LabelledCompletion(
        first["prompt"], first["completion"], True, "keep_start"
    )
    assert completions["yes 9<|im_end|>\n"].prompt == "<|im_start|>user\nq9<|im_end|>\n<|im_start|>assistant\n"
    assert completions["yes 9<|im_end|>\n"].label is False
    assert "7 labelled completions from 8 rows; skipped 1 rows: 1 empty response" in capsys.readouterr().out
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "completion": " a", "label": "yes"}])
    with pytest.raises(UserError, match=r"bad.jsonl:1: label is 'yes', expected true or false"):
        load(path, tiny_tokenizer, n_eval=0)


def test_shp_parquet_keeps_pairs_with_score_ratio_at_least_2(tmp_path, tiny_tokenizer):
    rows = [
        {"history": "h1", "human_ref_A": "a1", "human_ref_B": "b1", "labels": 1, "score_A": 10, "score_B": 5},
        {"history": "h2", "human_ref_A": "a2", "human_ref_B": "b2", "labels": 0, "score_A": 2, "score_B": 9},
        {"history": "h3", "human_ref_A": "a3", "human_ref_B": "b3", "labels": 1, "score_A": 6, "score_B": 4},
        {"history": "h4", "human_ref_A": "a4", "human_ref_B": "b4", "labels": 1, "score_A": 30, "score_B": 1},
    ]
    path = tmp_path / "shp.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    pairs = {p.prompt: p for split in load(path, tiny_tokenizer, n_eval=1).values() for p in split}
    assert set(pairs) == {"\n\nHuman: h1\n\nAssistant:", "\n\nHuman: h2\n\nAssistant:", "\n\nHuman: h4\n\nAssistant:"}
    assert (pairs["\n\nHuman: h2\n\nAssistant:"].chosen, pairs["\n\nHuman: h2\n\nAssistant:"].rejected) == (
        " b2",
        " a2",
    )


def test_se_pairs_ordered_by_pm_score_html_stripped_ties_skipped(tmp_path, tiny_tokenizer):
    row = {
        "question": "<p>How to <b>sort</b>?</p>",
        "answers": [
            {"text": "<p>use sorted()</p>", "pm_score": 5},
            {"text": "<p>bubble</p>", "pm_score": 1},
            {"text": "<p>ask</p>", "pm_score": 1},
        ],
    }
    other = {"question": "q2", "answers": [{"text": "x", "pm_score": 2}, {"text": "y", "pm_score": 3}]}
    data = load(write_jsonl(tmp_path / "se.jsonl", [row, other]), tiny_tokenizer, n_eval=1)
    pairs = [p for split in data.values() for p in split if "sort" in p.prompt]
    assert {(p.chosen, p.rejected) for p in pairs} == {(" use sorted()", " bubble"), (" use sorted()", " ask")}
    assert all(p.prompt == "\n\nHuman: How to sort?\n\nAssistant:" and p.sft_target == " use sorted()" for p in pairs)
    assert strip_html("<pre><code>a &lt; b</code></pre>") == "a < b"


def test_directory_with_test_split(tmp_path, tiny_tokenizer):
    write_jsonl(tmp_path / "train.jsonl", arithmetic_pairs(6))
    write_jsonl(tmp_path / "test.jsonl", arithmetic_pairs(3))
    data = get_dataset(str(tmp_path), tiny_tokenizer, 0, n_eval_examples=None, cache_dir=tmp_path)
    assert (len(data["train"]), len(data["test"])) == (6, 3)


def test_a_directory_of_test_files_alone_names_them(tmp_path, tiny_tokenizer):
    (tmp_path / "data" / "more").mkdir(parents=True)
    write_jsonl(tmp_path / "data" / "test.jsonl", arithmetic_pairs(3))
    write_jsonl(tmp_path / "data" / "more" / "validation.jsonl", arithmetic_pairs(3))
    line = (
        f"{tmp_path / 'data'}: nothing to train on, only test files (more/validation.jsonl, test.jsonl; files named "
        "test*, eval*, validation*, valid*, dev* are held out for eval). Add the training pairs beside them, e.g. "
        f"{tmp_path / 'data' / 'train.jsonl'}"
    )
    with pytest.raises(UserError) as raised:
        get_dataset(str(tmp_path / "data"), tiny_tokenizer, 0, n_eval_examples=None, cache_dir=tmp_path)
    assert str(raised.value) == line


def test_demo_dataset_has_held_out_split(tiny_tokenizer):
    data = get_dataset("demo", tiny_tokenizer, 0, None, cache_dir=None)
    assert len(data["train"]) >= 200 and len(data["test"]) >= 40
    assert not {p.prompt for p in data["train"]} & {p.prompt for p in data["test"]}


def test_real_hh_file_parses(tiny_tokenizer, capsys):
    if not HH_TEST_FILE.exists():
        pytest.skip(f"{HH_TEST_FILE} is not present")
    data = get_dataset(str(HH_TEST_FILE), tiny_tokenizer, 0, 256, cache_dir=None)
    pairs = data["train"] + data["test"]
    rows = [json.loads(line) for line in gzip.open(HH_TEST_FILE, "rt")]
    assert len(rows) == 2312
    # 4 rows with an empty response and 4 whose rejected dialogue diverges before the last turn are skipped
    out = capsys.readouterr().out
    assert "skipped 8 rows: 4 empty response" in out and "4 rejected does not continue chosen's prompt" in out
    assert len(pairs) == 2304 and len(data["test"]) >= 256
    originals = {row["chosen"] for row in rows}
    for pair in pairs:
        assert pair.prompt.startswith("\n\nHuman:") and pair.prompt.endswith("\n\nAssistant:")
        assert "\n\nAssistant:" not in pair.chosen  # rejected may run on for more turns, as in the reference
        assert pair.prompt + pair.chosen in originals


def test_split_hh_dialogue():
    assert split_hh_dialogue("\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant: d") == (
        "\n\nHuman: a\n\nAssistant: b\n\nHuman: c\n\nAssistant:",
        " d",
    )


# --- bad input -------------------------------------------------------------------------------------------


def test_unknown_dataset_lists_valid_names(tiny_tokenizer):
    with pytest.raises(UserError, match=r"unknown dataset 'nope.jsonl': expected one of hh, shp, se, demo"):
        get_dataset("nope.jsonl", tiny_tokenizer, 0, 8, cache_dir=None)


def test_malformed_line_names_file_and_line(tmp_path, tiny_tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(arithmetic_pairs(1)[0]) + "\n{not json\n")
    with pytest.raises(UserError, match=rf"{path}:2: malformed JSON line"):
        load(path, tiny_tokenizer)


def test_missing_column_names_file_line_and_column(tmp_path, tiny_tokenizer):
    rows = arithmetic_pairs(3)
    del rows[2]["rejected"]
    with pytest.raises(UserError, match=r"d.jsonl:3: missing column rejected"):
        load(write_jsonl(tmp_path / "d.jsonl", rows), tiny_tokenizer)


def test_unrecognised_columns(tmp_path, tiny_tokenizer):
    with pytest.raises(UserError, match=r"d.jsonl:1: unrecognised columns \['text'\]; expected chosen\+rejected"):
        load(write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}]), tiny_tokenizer)


def test_empty_and_identical_responses_are_skipped_and_counted(tmp_path, tiny_tokenizer, capsys):
    rows = arithmetic_pairs(6)
    rows[1]["chosen"] = "  "
    rows[4]["rejected"] = rows[4]["chosen"]
    data = load(write_jsonl(tmp_path / "d.jsonl", rows), tiny_tokenizer)
    assert len(data["train"]) + len(data["test"]) == 4
    out = capsys.readouterr().out
    assert (
        "skipped 2 rows" in out
        and "1 empty response (first: " in out
        and "d.jsonl:2)" in out
        and "1 chosen == rejected" in out
    )


def test_unsupported_file_type(tmp_path, tiny_tokenizer):
    path = tmp_path / "d.csv"
    path.write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported file type"):
        load(path, tiny_tokenizer)


# --- held-out split --------------------------------------------------------------------------------------


def test_hold_out_is_deterministic_by_seed_and_disjoint(tmp_path, tiny_tokenizer):
    rows = [{"prompt": f"p{i // 2}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(40)]  # 2 pairs per prompt
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    first, again, other = (load(path, tiny_tokenizer, n_eval=6, seed=s) for s in (1, 1, 2))
    assert first == again and first["test"] != other["test"]
    assert len(first["test"]) == 6 and len(first["train"]) == 34
    assert not {p.prompt for p in first["train"]} & {p.prompt for p in first["test"]}


def test_hold_out_needs_n_eval_examples(tmp_path, tiny_tokenizer):
    with pytest.raises(UserError, match="has no test split: set n_eval_examples"):
        load(write_jsonl(tmp_path / "d.jsonl", arithmetic_pairs(4)), tiny_tokenizer, n_eval=None)


# --- batches ---------------------------------------------------------------------------------------------


def test_batch_schedule_seeded_epochs_and_limits():
    schedule = batch_schedule(10, 4, seed=0, n_epochs=3, n_examples=None)
    assert len(schedule) == 6 and all(len(b) == 4 for b in schedule)  # 2 full batches per epoch
    assert len(set(sum(schedule[:2], []))) == 8  # no repeats within an epoch
    assert schedule == batch_schedule(10, 4, seed=0, n_epochs=3, n_examples=None)
    assert schedule != batch_schedule(10, 4, seed=1, n_epochs=3, n_examples=None)
    assert schedule[:2] != schedule[2:4]  # a fresh permutation each epoch
    assert len(batch_schedule(10, 4, seed=0, n_epochs=None, n_examples=12)) == 3
    assert len(batch_schedule(10, 4, seed=0, n_epochs=1, n_examples=100)) == 2
    with pytest.raises(UserError, match="fewer than batch_size"):
        batch_schedule(3, 4, seed=0, n_epochs=1, n_examples=None)


# --- Hub datasets, with the Hub replaced by local rows --------------------------------------------------


def test_hub_loaders_parse_rows_and_split_se(monkeypatch, tiny_tokenizer):
    import datasets

    se_rows = [
        {"question": f"<p>q{i}</p>", "answers": [{"text": f"a{i}", "pm_score": 2}, {"text": f"b{i}", "pm_score": 1}]}
        for i in range(300)
    ]
    hh_rows = [hh_row(f"q{i}?", f" yes {i}", f" no {i}") for i in range(5)]
    asked = []

    def fake_load_dataset(name, cache_dir=None, split=None):
        asked.append((name, split))
        return datasets.Dataset.from_list(se_rows if name == "HuggingFaceH4/stack-exchange-preferences" else hh_rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    hh = get_dataset("hh", tiny_tokenizer, 0, None, cache_dir="unused")
    assert asked == [("Anthropic/hh-rlhf", "train"), ("Anthropic/hh-rlhf", "test")]
    assert hh["train"][0].prompt == "\n\nHuman: q0?\n\nAssistant:" and hh["train"][0].truncation_mode == "keep_end"
    se = get_dataset("se", tiny_tokenizer, 0, None, cache_dir="unused")
    # the reference's split: the first 1% after a fixed shuffle is test, the rest train
    assert (len(se["test"]), len(se["train"])) == (3, 297)
    assert not {p.prompt for p in se["test"]} & {p.prompt for p in se["train"]}


def test_unreachable_hub_dataset_is_one_clear_line(tiny_tokenizer, tmp_path):
    with pytest.raises(
        UserError,
        match=r"could not load dataset 'shp' \(stanfordnlp/SHP\) from the Hugging Face Hub .*give a local copy",
    ):
        get_dataset("shp", tiny_tokenizer, 0, 8, cache_dir=tmp_path)


def test_any_hub_dataset_goes_through_column_detection(monkeypatch, tiny_tokenizer):
    import datasets

    explicit = [{"prompt": f"q{i}?", "chosen": f" yes {i}", "rejected": f" no {i}"} for i in range(6)]
    conversational = [
        {
            "chosen": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"yes {i}"}],
            "rejected": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"no {i}"}],
        }
        for i in range(6)
    ]
    hub = {
        "org/pairs": datasets.DatasetDict(
            train=datasets.Dataset.from_list(explicit[:4]), test=datasets.Dataset.from_list(explicit[4:])
        ),
        "org/chat": datasets.DatasetDict(
            train_prefs=datasets.Dataset.from_list(conversational), test_prefs=datasets.Dataset.from_list([])
        ),
    }
    asked = []

    def fake_load_dataset(name, cache_dir=None, split=None):
        asked.append((name, split))
        return hub[name] if split is None else hub[name][split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    pairs = get_dataset("org/pairs", tiny_tokenizer, 0, None, cache_dir="unused")
    assert [p.chosen for p in pairs["train"]] == [" yes 0", " yes 1", " yes 2", " yes 3"]
    assert [p.prompt for p in pairs["test"]] == ["q4?", "q5?"]
    # A named split, conversational rows: the chat template makes the prompts; 2 pairs are held out for eval.
    chat = get_dataset("org/chat:train_prefs", tiny_tokenizer, 0, 2, cache_dir="unused")
    assert (len(chat["train"]), len(chat["test"])) == (4, 2)
    assert chat["train"][0].prompt.startswith("<|im_start|>user\nq") and chat["train"][0].chosen.startswith("yes ")
    assert asked == [("org/pairs", None), ("org/chat", "train_prefs")]
    with pytest.raises(
        UserError, match=r"^org/chat has no 'train' split; choose one of train_prefs, test_prefs with org/chat:SPLIT$"
    ):
        get_dataset("org/chat", tiny_tokenizer, 0, 2, cache_dir="unused")


def test_an_unreachable_hub_dataset_is_one_clear_line(tiny_tokenizer, tmp_path):
    # conftest sets HF_DATASETS_OFFLINE=1: the real loader fails without waiting for the network.
    with pytest.raises(
        UserError,
        match=r"^could not load dataset 'trl-lib/ultrafeedback_binarized' from the Hugging Face Hub \(.*\); "
        r"give a local copy",
    ):
        get_dataset("trl-lib/ultrafeedback_binarized", tiny_tokenizer, 0, 8, cache_dir=tmp_path)
    with pytest.raises(UserError, match=r"unknown dataset 'data/missing.jsonl'"):  # a file name is never a Hub id
        get_dataset("data/missing.jsonl", tiny_tokenizer, 0, 8, cache_dir=tmp_path)
