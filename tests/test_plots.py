"""plots.png (plots.py)."""

import matplotlib.image

import train


def test_each_eval_draws_plots_png(make_config):
    config = make_config("n_examples=16", "eval_every=8", "plots=true")
    train.run(config)
    path = train.Path(config.local_run_dir) / "plots.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = matplotlib.image.imread(path).shape
    assert (width, height) == (1100, 700)
    assert not list(path.parent.glob("plots.*.tmp.png"))  # written whole


def test_plots_of_a_loss_without_rewards(make_config):
    config = make_config("loss=sft", "n_examples=8", "plots=true")
    train.run(config)
    assert (train.Path(config.local_run_dir) / "plots.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_false_draws_nothing(make_config):
    config = make_config("n_examples=8", "plots=false")
    train.run(config)
    assert not (train.Path(config.local_run_dir) / "plots.png").exists()
