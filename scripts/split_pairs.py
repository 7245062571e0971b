"""python -m scripts.split_pairs PAIRS_FILE OUT_DIR NAME/SPLIT=COUNT ...: disjoint parts of a pairs file, whole
prompts each, for recipes that must not train a judge, a policy and their evaluation on the same prompts.

Rows are grouped by prompt (pairs.formats' parsing: an HH dialogue's prompt is the text its two responses
share), the prompts shuffled by --seed (default 0), and each part takes the next COUNT prompts' rows into
OUT_DIR/NAME/SPLIT.jsonl, a file train.py reads (a directory's test* file is its held-out split). Example:
python -m scripts.split_pairs hh.jsonl.gz data judge/train=640 judge/test=128 policy/train=768 policy/test=128"""

import gzip
import json
import sys
from pathlib import Path

import numpy as np

from pairs.formats import split_hh_dialogue


def prompt_of(row: dict) -> str:
    return row["prompt"] if "prompt" in row else split_hh_dialogue(row["chosen"])[0]


def main(args: list[str]) -> None:
    seed = int(next((a.split("=", 1)[1] for a in args if a.startswith("--seed=")), 0))
    args = [a for a in args if not a.startswith("--seed=")]
    if len(args) < 3 or any("=" not in part for part in args[2:]):
        sys.exit(__doc__)
    source, out = Path(args[0]), Path(args[1])
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(prompt_of(row), []).append(row)
    prompts = [list(groups)[i] for i in np.random.default_rng(seed).permutation(len(groups))]
    start = 0
    for part in args[2:]:
        name, count = part.split("=")
        if start + int(count) > len(prompts):
            sys.exit(f"{source} has {len(prompts)} distinct prompts: too few for {' '.join(args[2:])}")
        chosen = prompts[start : start + int(count)]
        start += int(count)
        path = out / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for prompt in chosen for row in groups[prompt]))
        print(f"{path}: {sum(len(groups[p]) for p in chosen)} pairs of {len(chosen)} prompts")


if __name__ == "__main__":
    main(sys.argv[1:])
