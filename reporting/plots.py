"""plots.png in the run directory: the run's curves against examples seen, for a person to look at instead of
reading metrics.jsonl."""

import json
import math
from pathlib import Path

import storage

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
    (
        "reward mean and spread (loss=reward)",
        [
            ("rewards_train/mean", "mean, train"),
            ("rewards_eval/mean", "mean, eval"),
            ("rewards_eval/chosen_std", "chosen's std, eval"),
            ("rewards_eval/rejected_std", "rejected's std, eval"),
        ],
    ),
    (
        "tokens per second",
        [
            ("perf/real_tokens_per_second", "real"),
            ("perf/computed_tokens_per_second", "computed"),
            ("perf/scored_tokens_per_second", "scored"),
        ],
    ),
    ("MFU (useful FLOPs / peak)", [("perf/mfu", "train")]),
    ("win rate against the reference (eval_winrate_prompts)", [("winrate/eval", "eval, ties half")]),
    (
        "reward per round (rounds.n > 0)",
        [
            ("rounds/heldout_reward", "held-out, greedy"),
            ("rounds/sampled_reward", "sampled"),
            ("rounds/chosen_reward", "pairs' chosen"),
            ("rounds/rejected_reward", "pairs' rejected"),
        ],
    ),
)
COLUMNS = 3


def panel_points(records: list[dict]) -> dict[str, dict[tuple[str, str], list[tuple[int, float]]]]:
    """{panel title: {(metric, label): [(examples seen, value)]}} of the finite values in the records, for the
    panels that have any: a loss without rewards (SFT) or a run without rounds draws no empty panel."""
    panels = {
        title: {
            (metric, label): [(r["step"], r[metric]) for r in records if metric in r and math.isfinite(r[metric])]
            for metric, label in series
        }
        for title, series in PANELS
    }
    return {title: series for title, series in panels.items() if any(series.values())}


def write_plots(run_dir: Path) -> Path | None:
    """Draw run_dir/metrics.jsonl into run_dir/plots.png (written whole: a crash leaves the previous picture), one
    panel for each group of metrics the run has logged; None while it has logged none."""
    import matplotlib  # on use: ~1 s to import, and only plots.png needs it

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    panels = panel_points(records)
    if not panels:
        return None
    rows = -(-len(panels) // COLUMNS)
    figure, axes = plt.subplots(rows, COLUMNS, figsize=(15, 3.5 * rows), constrained_layout=True, squeeze=False)
    for ax, (title, series) in zip(axes.flat, panels.items()):
        for (metric, label), points in series.items():
            if points:
                style = "-o" if "eval" in metric or metric.startswith("rounds/") else ":"
                ax.plot(*zip(*points), style, label=label, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("examples seen")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle(run_dir.name)
    path = run_dir / "plots.png"
    try:
        with storage.replaced(path) as tmp:
            figure.savefig(tmp, dpi=100, format="png")
    finally:
        plt.close(figure)
    return path
