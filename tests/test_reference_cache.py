import numpy as np
import pytest
import torch

from build import build
from conftest import build_trainer
from modeling import precision
from modeling.distributed import Topology
from persistence import reference_cache
from preference_datasets import get_dataset


def table(keys: list[bytes], logps: list[list[float]]) -> reference_cache.ReferenceTable:
    return reference_cache.ReferenceTable.of(np.array(keys, dtype="S16"), np.array(logps, dtype=np.float32))


def test_entries_round_trip_and_a_foreign_file_is_refused(tmp_path):
    path = reference_cache.cache_path(tmp_path, "ab" * 32, "float32")
    entries = table([b"k2" + b"\0" * 14, b"k1"], [[-3.0, -0.5], [-1.5, -2.25]])
    reference_cache.save(path, "ab" * 32, "float32", entries)
    loaded, why = reference_cache.load(path, "ab" * 32, "float32")
    assert why is None and loaded.keys.tolist() == entries.keys.tolist() == [b"k1", b"k2"]
    assert loaded.lookup([b"k2" + b"\0" * 14]).tolist() == [[-3.0, -0.5]]
    assert not list(path.parent.glob("*.tmp"))  # written atomically
    found, why = reference_cache.load(path, "cd" * 32, "float32")
    assert len(found) == 0 and "was made for another reference (weights" in why
    found, why = reference_cache.load(path, "ab" * 32, "bfloat16")
    assert len(found) == 0 and "computation 'float32', expected 'bfloat16'" in why
    absent, why = reference_cache.load(tmp_path / "absent.pt", "ab" * 32, "float32")
    assert len(absent) == 0 and why is None


def test_the_table_looks_up_merges_and_keeps_the_last_of_a_repeated_key():
    entries = table([b"b", b"a", b"b"], [[1, 2], [3, 4], [5, 6]])
    assert entries.keys.tolist() == [b"a", b"b"] and entries.lookup([b"b", b"a"]).tolist() == [[5, 6], [3, 4]]
    assert entries.missing([b"a", b"c", b""]).tolist() == [False, True, True]
    with pytest.raises(KeyError):
        entries.lookup([b"c"])
    merged = entries.merged(np.array([b"c", b"a"], dtype="S16"), np.array([[7, 8], [9, 10]], dtype=np.float32))
    assert merged.keys.tolist() == [b"a", b"b", b"c"] and merged.lookup([b"a", b"c"]).tolist() == [[9, 10], [7, 8]]


def test_a_million_pairs_load_mapped_and_look_up_exactly(tmp_path):
    # A million synthetic entries: the file maps (24 bytes a pair, no per-entry objects), and every key finds its
    # own log-probs by binary search. `python -m bench --data` times it.
    rng = np.random.default_rng(0)
    n = 1_000_000
    keys = rng.integers(0, 256, size=(n, 16), dtype=np.uint8).view("S16").reshape(-1)
    logps = -rng.random((n, 2), dtype=np.float32)
    path = tmp_path / "million.pt"
    reference_cache.save(path, "w", "c", reference_cache.ReferenceTable.of(keys, logps))
    loaded, why = reference_cache.load(path, "w", "c")
    assert why is None and len(loaded) == n
    assert loaded.keys.nbytes + loaded.logps.nbytes == n * (16 + 2 * 4)
    sample = rng.permutation(n)[:100_000]
    np.testing.assert_array_equal(loaded.lookup(keys[sample]), logps[sample])


def test_weights_digest_sees_any_change():
    model, one = torch.nn.Linear(4, 3), Topology()
    before = reference_cache.weights_digest(model, one)
    assert reference_cache.weights_digest(model, one) == before
    with torch.no_grad():
        model.weight[1, 2] += 1e-6
    assert reference_cache.weights_digest(model, one) != before
    bfloat16 = reference_cache.weights_digest(model.to(torch.bfloat16), one)
    assert bfloat16 != reference_cache.weights_digest(model.float(), one)


def test_cached_reference_equals_live_reference_and_is_reused(make_config, tmp_path, capsys, monkeypatch):
    live = build_trainer(make_config(f"local_run_dir={tmp_path / 'live'}", "reference_cache=false"))
    cached = build_trainer(make_config(f"local_run_dir={tmp_path / 'cached'}"))
    assert live.reference_model is not None and cached.reference_model is None  # the cache needs no reference model
    train = live.data.train_examples
    examples = train.take(range(len(train))) + [ex for batch in live.data.eval_batches for ex in batch]
    with torch.no_grad():
        expected = live.scorer(live.reference_model, live.scorer.batch(examples), None).view(2, -1).T
    computed = torch.from_numpy(cached.batch_loss.reference.table.lookup([ex["key"] for ex in examples]))
    torch.testing.assert_close(computed, expected, rtol=0, atol=1e-6)
    assert "computing 35 of 35 pairs" in capsys.readouterr().out

    # Built again on the same pairs (given, not loaded): every pair comes from the file, no forward pass.
    config = make_config(f"local_run_dir={tmp_path / 'again'}")
    pairs = get_dataset(config.datasets[0], cached.tokenizer, config.seed, config.n_eval_examples, tmp_path)
    again = build(config, Topology(), pairs)
    assert "reference log-probs: all 35 pairs from" in capsys.readouterr().out
    assert_same_table(again.reference.table, cached.batch_loss.reference.table)

    # A damaged file is recomputed, with a line that says why; another precision is another file.
    [path] = (tmp_path / "reference_logps").glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])
    rebuilt = build_trainer(make_config(f"local_run_dir={tmp_path / 'rebuilt'}"))
    assert f"reference log-probs: recomputing, since {path} is unreadable" in capsys.readouterr().out
    assert_same_table(rebuilt.batch_loss.reference.table, cached.batch_loss.reference.table)
    build_trainer(make_config(f"local_run_dir={tmp_path / 'bf16'}", "model.fsdp_policy_mp=bfloat16"))
    assert "computing 35 of 35 pairs" in capsys.readouterr().out
    assert len(list((tmp_path / "reference_logps").glob("*.pt"))) == 2
    # Another CPU sharing the cache directory (here: the same one, reporting one bf16 flag more or less) rounds with
    # other kernels: it computes its own numbers, into a file of its own.
    flags = precision.cpu_flags()
    other = [flag for flag in flags if flag != "avx512_bf16"] if "avx512_bf16" in flags else [*flags, "avx512_bf16"]
    monkeypatch.setattr(precision, "cpu_flags", lambda: other)
    build_trainer(make_config(f"local_run_dir={tmp_path / 'other-cpu'}"))
    assert "computing 35 of 35 pairs" in capsys.readouterr().out
    assert len(list((tmp_path / "reference_logps").glob("*.pt"))) == 3


def test_length_desensitized_reference_is_cached_under_its_own_key(make_config, tmp_path, capsys):
    # LD-DPO sums the reference like the policy (tails weighed by ld_alpha): the cached numbers equal the live
    # reference's, in a file of their own, apart from DPO's plain sums.
    ld = ("loss=ld_dpo", "loss.ld_alpha=0.25")
    plain = build_trainer(make_config(f"local_run_dir={tmp_path / 'dpo'}"))
    cached = build_trainer(make_config(f"local_run_dir={tmp_path / 'cached'}", *ld))
    assert capsys.readouterr().out.count("computing 35 of 35 pairs") == 2
    assert len(list((tmp_path / "reference_logps").glob("*.pt"))) == 2
    live = build_trainer(make_config(f"local_run_dir={tmp_path / 'live'}", "reference_cache=false", *ld))
    train = live.data.train_examples
    examples = train.take(range(len(train)))
    with torch.no_grad():
        expected = live.scorer(live.reference_model, live.scorer.batch(examples), None).view(2, -1).T
    keys = [ex["key"] for ex in examples]
    torch.testing.assert_close(
        torch.from_numpy(cached.batch_loss.reference.table.lookup(keys)), expected, rtol=0, atol=1e-6
    )
    unequal = np.array([len(ex["responses"][0]) != len(ex["responses"][1]) for ex in examples])
    differs = (cached.batch_loss.reference.table.lookup(keys) != plain.batch_loss.reference.table.lookup(keys)).any(1)
    assert unequal.any() and (differs == unequal).all()  # only pairs of unequal lengths have a tail


def test_pairs_and_labelled_completions_keep_reference_files_of_their_own(make_config, tmp_path, labelled_file, capsys):
    # A table holds one width (2 responses an example, or 1): a kto run on labelled completions after a dpo run on
    # pairs, same model and settings, writes a file of its own instead of merging 1 column into 2
    build_trainer(make_config(f"local_run_dir={tmp_path / 'pairs'}"))
    kto = build_trainer(make_config(f"local_run_dir={tmp_path / 'kto'}", "loss=kto", f"datasets=[{labelled_file}]"))
    assert kto.batch_loss.reference.table.logps.shape[1] == 1
    assert len(list((tmp_path / "reference_logps").glob("*.pt"))) == 2
    assert "recomputing" not in capsys.readouterr().out


def assert_same_table(a: reference_cache.ReferenceTable, b: reference_cache.ReferenceTable) -> None:
    np.testing.assert_array_equal(a.keys, b.keys)
    np.testing.assert_array_equal(a.logps, b.logps)


def test_a_cache_file_that_cannot_be_written_is_one_line_and_nothing_else(tmp_path, read_only, capsys):
    (tmp_path / "cache").mkdir()
    path = read_only(tmp_path / "cache") / "reference_logps" / "x.pt"
    table = reference_cache.ReferenceTable.of(np.array([b"k" * 16], dtype="S16"), np.zeros((1, 2), np.float32))
    reference_cache.save(path, "weights", "computation", table)
    assert capsys.readouterr().out == (
        f"reference log-probs: not cached (could not write {path} (Read-only file system); make it writable or write "
        "elsewhere); this run goes on with them in memory\n"
    )
