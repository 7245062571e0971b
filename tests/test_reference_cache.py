import torch

import precision
import reference_cache
from build import build
from conftest import build_trainer
from distributed import Topology
from preference_datasets import get_dataset


def test_entries_round_trip_and_a_foreign_file_is_refused(tmp_path):
    path = reference_cache.cache_path(tmp_path, "ab" * 32, "float32")
    entries = {"k1": [-1.5, -2.25], "k2": [-3.0, -0.5]}
    reference_cache.save(path, "ab" * 32, "float32", entries)
    assert reference_cache.load(path, "ab" * 32, "float32") == (entries, None)
    assert not list(path.parent.glob("*.tmp"))  # written atomically
    found, why = reference_cache.load(path, "cd" * 32, "float32")
    assert found == {} and "was made for another reference (weights" in why
    found, why = reference_cache.load(path, "ab" * 32, "bfloat16")
    assert found == {} and "computation 'float32', expected 'bfloat16'" in why
    assert reference_cache.load(tmp_path / "absent.pt", "ab" * 32, "float32") == ({}, None)


def test_pair_key_depends_on_every_token():
    example = {"prompt": [1, 2], "responses": [[3], [4, 5]]}
    keys = {
        reference_cache.pair_key(example),
        reference_cache.pair_key({**example, "prompt": [1, 2, 3], "responses": [[], [4, 5]]}),
        reference_cache.pair_key({**example, "responses": [[4, 5], [3]]}),
        reference_cache.pair_key({**example, "prompt": [2]}),
    }
    assert len(keys) == 4


def test_weights_digest_sees_any_change():
    model = torch.nn.Linear(4, 3)
    before = reference_cache.weights_digest(model)
    assert reference_cache.weights_digest(model) == before
    with torch.no_grad():
        model.weight[1, 2] += 1e-6
    assert reference_cache.weights_digest(model) != before
    assert reference_cache.weights_digest(model.to(torch.bfloat16)) != reference_cache.weights_digest(model.float())


def test_cached_reference_equals_live_reference_and_is_reused(make_config, tmp_path, capsys, monkeypatch):
    live = build_trainer(make_config(f"local_run_dir={tmp_path / 'live'}", "reference_cache=false"))
    cached = build_trainer(make_config(f"local_run_dir={tmp_path / 'cached'}"))
    assert live.reference_model is not None and cached.reference_model is None  # the cache needs no reference model
    examples = live.data.train_examples + [ex for batch in live.data.eval_batches for ex in batch]
    with torch.no_grad():
        expected = live.scorer(live.reference_model, live.scorer.batch(examples), None).view(2, -1).T
    computed = torch.tensor([cached.batch_loss.reference.entries[ex["key"]] for ex in examples])
    torch.testing.assert_close(computed, expected, rtol=0, atol=1e-6)
    assert "computing 35 of 35 pairs" in capsys.readouterr().out

    # Built again on the same pairs (given, not loaded): every pair comes from the file, no forward pass.
    config = make_config(f"local_run_dir={tmp_path / 'again'}")
    pairs = get_dataset(config.datasets[0], cached.tokenizer, config.seed, config.n_eval_examples, tmp_path)
    again = build(config, Topology(), pairs)
    assert "reference log-probs: all 35 pairs from" in capsys.readouterr().out
    assert again.reference.entries == cached.batch_loss.reference.entries

    # A damaged file is recomputed, with a line that says why; another precision is another file.
    [path] = (tmp_path / "reference_logps").glob("*.pt")
    path.write_bytes(path.read_bytes()[:100])
    rebuilt = build_trainer(make_config(f"local_run_dir={tmp_path / 'rebuilt'}"))
    assert f"reference log-probs: recomputing, since {path} is unreadable" in capsys.readouterr().out
    assert rebuilt.batch_loss.reference.entries == cached.batch_loss.reference.entries
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
