from utils import get_local_dir, get_local_run_dir


def test_local_dirs_first_existing_wins_else_last_is_created(tmp_path):
    existing = tmp_path / "b"
    existing.mkdir()
    assert get_local_dir([str(tmp_path / "a"), str(existing)]) == existing
    created = get_local_dir([str(tmp_path / "x"), str(tmp_path / "y")])
    assert created == tmp_path / "y" and created.is_dir()
    assert get_local_run_dir("dpo", [str(existing)]).name.startswith("dpo_")
