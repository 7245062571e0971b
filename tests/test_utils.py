import math

from utils import get_local_dir, get_local_run_dir, metric_mean


def test_local_dirs_first_existing_wins_else_last_is_created(tmp_path):
    existing = tmp_path / "b"
    existing.mkdir()
    assert get_local_dir([str(tmp_path / "a"), str(existing)]) == existing
    created = get_local_dir([str(tmp_path / "x"), str(tmp_path / "y")])
    assert created == tmp_path / "y" and created.is_dir()
    assert get_local_run_dir("dpo", [str(existing)]).name.startswith("dpo_")


def test_only_the_labelled_reward_and_logp_columns_leave_out_nan():
    # KTO on labelled completions logs desirable examples under /chosen and the others under /rejected, NaN for the
    # rest: those columns average what is there; a NaN anywhere else (a loss) shows.
    assert metric_mean("rewards_eval/chosen", [1.0, math.nan, 3.0]) == 2.0
    assert metric_mean("logps_train/rejected", [math.nan, -4.0]) == -4.0
    assert math.isnan(metric_mean("rewards_eval/chosen", [math.nan]))
    assert math.isnan(metric_mean("loss/train", [1.0, math.nan]))
    assert math.isnan(metric_mean("rewards_train/margins", [1.0, math.nan]))
