"""The DPO paper's Figure 2 across the jobs of a sweep (Rafailov et al. 2023): each job's reward against its sampled
KL to the reference, one point per job and temperature, labelled by the keys that set the jobs apart
(`loss.beta=0.05`); the frontier is the points that no other point beats with as little KL or less. The reward is
the judge's mean reward of the job's completions, or its win rate where the judge gives no rewards."""

from reporting.sweep_report import label


def points(results: dict, labels: dict[str, dict]) -> list[dict]:
    """One point per candidate and temperature that has a KL: {candidate, label, keys, temperature, kl, reward,
    win_rate and its interval, y (what is drawn: reward, or win rate), on_frontier}."""
    found = []
    for name, by_temperature in results.items():
        for temperature, summary in by_temperature.items():
            if "kl" not in summary:
                continue
            reward = summary["reward"]["candidate"]["value"] if "reward" in summary else None
            found.append(
                {
                    "candidate": name,
                    "label": label(labels.get(name, {})) or name,
                    "keys": labels.get(name, {}),
                    "temperature": float(temperature),
                    "kl": summary["kl"]["value"],
                    "reward": reward,
                    "win_rate": {key: summary["win_rate"][key] for key in ("value", "low", "high")},
                }
            )
    rewarded = all(point["reward"] is not None for point in found)
    for point in found:
        point["y"] = point["reward"] if rewarded else point["win_rate"]["value"]
    for point in found:
        point["on_frontier"] = not any(beats(other, point) for other in found)
    return found


def beats(other: dict, point: dict) -> bool:
    """`other` is as good for less KL, or better for as little."""
    same = (other["kl"], other["y"]) == (point["kl"], point["y"])
    return other["kl"] <= point["kl"] and other["y"] >= point["y"] and not same


def draw(axis, found: list[dict]) -> None:
    """The points on `axis`, one colour per temperature, each labelled; the frontier dashed through them."""
    for temperature in sorted({point["temperature"] for point in found}):
        at = [point for point in found if point["temperature"] == temperature]
        axis.scatter([p["kl"] for p in at], [p["y"] for p in at], label=f"T={temperature:g}", zorder=3)
        for point in at:
            xy = (point["kl"], point["y"])
            axis.annotate(point["label"], xy, textcoords="offset points", xytext=(4, 4), fontsize=7)
    frontier = sorted((p["kl"], p["y"]) for p in found if p["on_frontier"])
    if len(frontier) > 1:
        axis.plot(*zip(*frontier), linestyle="--", color="grey", linewidth=1, label="frontier")
    rewarded = all(point["reward"] is not None for point in found)
    axis.set_ylabel("judge's mean reward" if rewarded else "win rate (ties half)")
    axis.set(xlabel="sampled KL(policy || reference), nats", title="reward against KL, one point per job")
