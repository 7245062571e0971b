"""What evaluate.py reports: the table it prints, evaluation.json (the summary), samples.jsonl (every judged pair),
winrate.png (the DPO paper's two figures: win rate against temperature, reward against KL), a wandb table, and the
results in each candidate's model card (its README.md's model-index), where it has one."""

import json
import math
from pathlib import Path

import numpy as np
from omegaconf import DictConfig, OmegaConf

import storage
from reporting import frontier
from reporting.model_card import add_results
from reporting.wandb_run import init_wandb

SUMMARY, SAMPLES, FIGURE = "evaluation.json", "samples.jsonl", "winrate.png"


def sample_lines(
    name, temperature, samples, prompts, candidate, baseline, judgement, candidate_lengths, baseline_lengths, log_ratios
) -> list[dict]:
    """One line per judged pair: the prompt, both responses and their lengths in tokens, the verdicts in both orders
    and the outcome (1: the candidate wins, 0: a tie, -1: it loses; from the candidate's side), the judge's rewards
    or probabilities, and the candidate's log-ratio to the reference (the sampled KL's term)."""
    lines = []
    for row, (prompt, ours, theirs) in enumerate(zip(prompts, candidate, baseline)):
        p, s = divmod(row, samples)
        line = {
            "candidate": name,
            "temperature": temperature,
            "prompt_index": p,
            "sample": s,
            "prompt": prompt,
            "candidate_response": ours,
            "baseline_response": theirs,
            "candidate_length": int(candidate_lengths[p, s]),
            "baseline_length": int(baseline_lengths[p, s]),
            "verdict_candidate_first": judgement.first_shown_first[row],
            "verdict_baseline_first": judgement.second_shown_first[row],
            "outcome": judgement.outcomes[row],
        }
        if judgement.rewards is not None:
            line["candidate_reward"], line["baseline_reward"] = (r[row] for r in judgement.rewards)
        if judgement.p_first is not None:
            first, second = judgement.p_first
            line["p_candidate_candidate_first"], line["p_candidate_baseline_first"] = first[row], second[row]
        if log_ratios is not None:
            line["log_ratio"] = float(log_ratios[p, s])
        lines.append(line)
    return lines


def table(results: dict, names: dict[str, str] | None = None) -> str:
    """The results as a fixed-width table: percentages with their 95% intervals; each candidate under its name in
    `names` (a sweep's job by its keys), else its path."""
    rows = [
        ("candidate", "T", "win rate % (ties half)", "LC win rate %", "win/tie/loss %", "length", "KL (nats)", "reward")
    ]
    for name, by_temperature in results.items():
        for temperature, s in by_temperature.items():
            wtl = "/".join(f"{s[key]['value'] * 100:.0f}" for key in ("win", "tie", "loss"))
            kl = described(s["kl"], digits=2) if "kl" in s else "-"
            reward = "-"
            if "reward" in s:
                reward = f"{s['reward']['candidate']['value']:.3g} vs {s['reward']['baseline']['value']:.3g}"
            lengths = f"{s['length']['candidate']:.0f} vs {s['length']['baseline']:.0f}"
            win, lc = described(s["win_rate"], 100), described(s["lc_win_rate"], 100)
            rows.append(((names or {}).get(name, name), f"{temperature:g}", win, lc, wtl, lengths, kl, reward))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)


def described(estimate: dict, scale: float = 1.0, digits: int = 1) -> str:
    value, low, high = (estimate[key] * scale for key in ("value", "low", "high"))
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def write(output: Path, config: DictConfig, results: dict, lines: list[dict], speed: dict, labels: dict) -> None:
    """Every output of an evaluation in `output` (rank 0), the table printed, the model cards updated. `labels`:
    the keys that set a sweep's jobs apart, by candidate (empty without a sweep): the frontier across them."""
    summary = {
        "config": OmegaConf.to_container(config, resolve=True),
        "results": {name: {str(t): s for t, s in by_t.items()} for name, by_t in results.items()},
        "generation": speed,
    }
    points = frontier.points(results, labels) if labels else None
    if points is not None:
        summary["frontier"] = points
    with storage.writing(output):
        output.mkdir(parents=True, exist_ok=True)
    storage.write_text(output / SUMMARY, json.dumps(summary, indent=1) + "\n")
    storage.write_text(output / SAMPLES, "".join(json.dumps(line) + "\n" for line in lines))
    names = {name: frontier.label(keys) or name for name, keys in labels.items()}
    print(f"{len(lines)} judged pairs, judge={config.judge}, baseline={config.baseline}\n{table(results, names)}")
    if config.plots:
        write_figure(output / FIGURE, results, points)
    if config.wandb.enabled:
        log_to_wandb(output, config, results, lines)
    for name in results:  # an export's model card (model_card.py)
        if add_results(Path(name), card_results(config, results[name])):
            print(f"model card: {Path(name) / 'README.md'} holds these results")
    print(f"evaluation: {output / SUMMARY}, {output / SAMPLES}" + (f", {output / FIGURE}" if config.plots else ""))


def card_results(config: DictConfig, by_temperature: dict) -> list[dict]:
    """The model-index entries of one candidate's results: its win rates at each temperature."""
    datasets = ", ".join(config.datasets) if config.datasets else "its run's held-out prompts"
    judge, baseline = Path(config.judge).name or config.judge, config.baseline
    return [
        {
            "task_type": "text-generation",
            "dataset_type": "preference-pairs",
            "dataset_name": datasets,
            "metric_type": metric,
            "metric_name": f"{label} against {baseline} at temperature {temperature:g} (judge: {judge})",
            "metric_value": round(summary[metric]["value"] * 100, 2),
            "metric_config": None,
        }
        for temperature, summary in by_temperature.items()
        for metric, label in (("win_rate", "win rate %"), ("lc_win_rate", "length-controlled win rate %"))
    ]


def write_figure(path: Path, results: dict, sweep_points: list[dict] | None = None) -> None:
    """Win rate (ties half) against temperature with its 95% interval, and the judge's reward (or, without rewards,
    the win rate) against the sampled KL, one point per temperature: the DPO paper's Figures 3 and 2; for a sweep's
    jobs, its Figure 2 across them (frontier.py's points)."""
    import matplotlib  # on use: ~1 s to import, and only the figure needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    job_labels = {point["candidate"]: point["label"] for point in sweep_points or []}
    for name, by_temperature in results.items():
        model = Path(name)  # a checkpoint by its run's name: dpo/LATEST
        label = str(Path(*model.parts[-2:])) if model.name == "LATEST" or model.name.startswith("step-") else model.name
        label = job_labels.get(name, label)
        temperatures = sorted(by_temperature)
        values = np.array([[by_temperature[t]["win_rate"][k] for k in ("value", "low", "high")] for t in temperatures])
        errors = [values[:, 0] - values[:, 1], values[:, 2] - values[:, 0]]
        left.errorbar(temperatures, values[:, 0] * 100, yerr=np.array(errors) * 100, marker="o", capsize=3, label=label)
        kl = [by_temperature[t]["kl"]["value"] for t in temperatures if "kl" in by_temperature[t]]
        if len(kl) == len(temperatures) and sweep_points is None:
            rewarded = all("reward" in by_temperature[t] for t in temperatures)
            point = (lambda s: s["reward"]["candidate"]) if rewarded else (lambda s: s["win_rate"])  # noqa: E731
            y = [point(by_temperature[t])["value"] for t in temperatures]
            right.plot(kl, y, marker="o", label=label)
            for x, value, t in zip(kl, y, temperatures):
                right.annotate(f"T={t:g}", (x, value), textcoords="offset points", xytext=(4, 4), fontsize=8)
            right.set_ylabel("judge's mean reward" if rewarded else "win rate (ties half)")
    left.axhline(50, color="grey", linewidth=0.8, linestyle=":")
    left.set(xlabel="sampling temperature", ylabel="win rate % (ties half), 95% interval", title="win rate")
    right.set(xlabel="sampled KL(candidate || reference), nats", title="reward against KL")
    if sweep_points is not None:
        frontier.draw(right, sweep_points)
    for axis in (left, right):
        if axis.lines:
            axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    try:
        with storage.replaced(path) as tmp:  # written whole
            figure.savefig(tmp, dpi=110, format="png")
    finally:
        plt.close(figure)


def log_to_wandb(output: Path, config: DictConfig, results: dict, lines: list[dict]) -> None:
    """The results and the judged pairs as wandb tables (offline without a login; never a crash)."""
    run = init_wandb(config, output)
    if run is None:
        return
    import wandb  # on use: ~1.3 s to import, and only evaluations that log to wandb need it

    columns = ["candidate", "temperature", "win_rate", "lc_win_rate", "win", "tie", "loss", "kl"]
    rows = [
        [name, t, s["win_rate"]["value"], s["lc_win_rate"]["value"], s["win"]["value"], s["tie"]["value"],
         s["loss"]["value"], s["kl"]["value"] if "kl" in s else math.nan]
        for name, by_t in results.items() for t, s in by_t.items()
    ]  # fmt: skip
    names = list(lines[0]) if lines else []
    run.log(
        {
            "winrate/results": wandb.Table(columns=columns, data=rows),
            "winrate/samples": wandb.Table(columns=names, data=[[line.get(k) for k in names] for line in lines]),
        }
    )
    run.finish()
