import torch

import reference_cache


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
