"""plots.png in the run directory: the run's curves against examples seen, for a person to look at instead of
reading metrics.jsonl."""

import json
import math
import os
from pathlib import Path

PANELS = (  # (title, [(metric, label)]): train metrics dotted, eval metrics solid
    ("loss", [("loss/train", "train"), ("loss/eval", "eval")]),
    ("reward accuracy", [("rewards_train/accuracies", "train"), ("rewards_eval/accuracies", "eval")]),
    ("reward margin", [("rewards_train/margins", "train"), ("rewards_eval/margins", "eval")]),
    (
        "rewards",
        [
            ("rewards_train/chosen", "chosen, train"),
            ("rewards_train/rejected", "rejected, train"),
            ("rewards_eval/chosen", "chosen, eval"),
            ("rewards_eval/rejected", "rejected, eval"),
        ],
    ),
)


def write_plots(run_dir: Path) -> Path:
    """Draw run_dir/metrics.jsonl into run_dir/plots.png (written whole: a crash leaves the previous picture).
    Metrics a loss does not log (SFT has no rewards) leave their panel empty."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    figure, axes = plt.subplots(2, 2, figsize=(11, 7), constrained_layout=True)
    for ax, (title, series) in zip(axes.flat, PANELS):
        for metric, label in series:
            points = [(r["step"], r[metric]) for r in records if metric in r and math.isfinite(r[metric])]
            if points:
                style = "-o" if "eval" in metric else ":"
                ax.plot(*zip(*points), style, label=label, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("examples seen")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    figure.suptitle(run_dir.name)
    path = run_dir / "plots.png"
    tmp = path.with_name(f"plots.{os.getpid()}.tmp.png")
    figure.savefig(tmp, dpi=100)
    plt.close(figure)
    tmp.replace(path)
    return path
