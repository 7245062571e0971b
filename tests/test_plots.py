"""plots.png (plots.py)."""

import matplotlib.image

import train
from conftest import read_jsonl
from reporting.plots import panel_points


def test_each_eval_draws_plots_png(make_config):
    config = make_config("n_examples=16", "eval_every=8", "plots=true")
    train.run(config)
    path = train.Path(config.local_run_dir) / "plots.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (1500, 1050)
    assert not list(path.parent.glob("plots.*.tmp.png"))  # written whole
    panels = panel_points(read_jsonl(path.parent / "metrics.jsonl"))
    assert [len(points) for points in panels["loss"].values()] == [2, 3]  # train at 8, 16; eval at 0, 8, 16
    throughput = panels["tokens per second"]
    assert all(len(points) == 2 and all(value > 0 for _, value in points) for points in throughput.values())
    assert [step for step, _ in panels["MFU (useful FLOPs / peak)"][("perf/mfu", "train")]] == [8, 16]


def test_plots_of_a_loss_without_rewards(make_config):
    config = make_config("loss=sft", "n_examples=8", "plots=true")
    train.run(config)
    assert (train.Path(config.local_run_dir) / "plots.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_false_draws_nothing(make_config):
    config = make_config("n_examples=8", "plots=false")
    train.run(config)
    assert not (train.Path(config.local_run_dir) / "plots.png").exists()
