from utils import get_local_dir, get_local_run_dir, replace_dir


def test_replace_dir_swaps_whole_directories(tmp_path):
    final = tmp_path / "LATEST"
    final.mkdir()
    (final / "policy.pt").write_text("old")
    (final / "only-in-old").write_text("x")
    new = tmp_path / "LATEST.tmp"
    new.mkdir()
    (new / "policy.pt").write_text("new")
    replace_dir(new, final)
    assert {p.name for p in final.iterdir()} == {"policy.pt"} and (final / "policy.pt").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_replace_dir_after_a_crash_between_renames(tmp_path):
    # A crash after moving the old directory aside leaves LATEST.old complete and no LATEST.
    (tmp_path / "LATEST.old").mkdir()
    new = tmp_path / "LATEST.tmp"
    new.mkdir()
    (new / "policy.pt").write_text("new")
    replace_dir(new, tmp_path / "LATEST")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_local_dirs_first_existing_wins_else_last_is_created(tmp_path):
    existing = tmp_path / "b"
    existing.mkdir()
    assert get_local_dir([str(tmp_path / "a"), str(existing)]) == existing
    created = get_local_dir([str(tmp_path / "x"), str(tmp_path / "y")])
    assert created == tmp_path / "y" and created.is_dir()
    assert get_local_run_dir("dpo", [str(existing)]).name.startswith("dpo_")
