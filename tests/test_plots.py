"""plots.png (plots.py)."""

import matplotlib.image

import train
from conftest import read_jsonl
from reporting.plots import PANELS, panel_points


def test_each_eval_draws_plots_png(make_config):
    config = make_config("n_examples=16", "eval_every=8", "plots=true")
    train.run(config)
    path = train.Path(config.local_run_dir) / "plots.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(path.parent.glob("plots.*.tmp.png"))  # written whole
    panels = panel_points(read_jsonl(path.parent / "metrics.jsonl"))
    # no rounds, no reward model
    assert list(panels) == [
        title for title, _ in PANELS if not title.startswith(("reward per round", "reward mean", "win rate"))
    ]
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (1500, 700)  # its 6 panels in 2 rows of 3, nothing drawn empty
    assert [len(points) for points in panels["loss"].values()] == [2, 3]  # train at 8, 16; eval at 0, 8, 16
    throughput = panels["tokens per second"]
    assert all(len(points) == 2 and all(value > 0 for _, value in points) for points in throughput.values())
    assert [step for step, _ in panels["MFU (useful FLOPs / peak)"][("perf/mfu", "train")]] == [8, 16]


def test_plots_of_a_loss_without_rewards(make_config):
    config = make_config("loss=sft", "n_examples=8", "plots=true")
    train.run(config)
    path = train.Path(config.local_run_dir) / "plots.png"
    assert list(panel_points(read_jsonl(path.parent / "metrics.jsonl"))) == [
        "loss",
        "tokens per second",
        "MFU (useful FLOPs / peak)",
    ]
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (1500, 350)  # one row: no empty reward panels


def test_a_panel_is_drawn_only_with_data():
    records = [{"step": 0, "loss/eval": 0.69}, {"step": 8, "loss/train": 0.6, "rounds/heldout_reward": float("nan")}]
    assert list(panel_points(records)) == ["loss"]  # a non-finite value is no data
    assert panel_points([]) == {}


def test_plots_false_draws_nothing(make_config):
    config = make_config("n_examples=8", "plots=false")
    train.run(config)
    assert not (train.Path(config.local_run_dir) / "plots.png").exists()


def test_a_reward_models_plots_show_its_rewards_spread(make_config):
    config = make_config("loss=reward", "n_examples=16", "eval_every=8", "plots=true")
    train.run(config)
    panels = panel_points(read_jsonl(train.Path(config.local_run_dir) / "metrics.jsonl"))
    assert list(panels)[:5] == [
        "loss",
        "reward accuracy",
        "reward margin",
        "rewards",
        "reward mean and spread (loss=reward)",
    ]
    assert [len(points) for points in panels["reward mean and spread (loss=reward)"].values()] == [2, 3, 3, 3]
