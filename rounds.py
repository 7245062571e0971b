"""Iterative on-policy DPO (`rounds.n` > 0): each round samples `rounds.completions` completions of each of its
prompts from the current policy, scores them with the reward (rewards.py), pairs each prompt's best completion with
its worst (a prompt whose completions all score alike is a tie: dropped and counted), and trains on those pairs
against the policy that started the round, whose log-probs are computed once and cached under its weights' digest.
The recipe of iterative DPO (Xu et al. 2023, arXiv:2312.16682; Yuan et al. 2024, arXiv:2401.10020; Dong et al.
2024, arXiv:2405.07863). The datasets give the prompts (their distinct training prompts, shuffled by seed) and the
held-out pairs of the evals; the mean reward of greedy completions of the first `rounds.eval_prompts` held-out
prompts is logged at the start of each round and at the end.

The run directory's rounds/ holds, per round, round-R.jsonl (one line per prompt: the prompt, the completions, their
rewards, the pair formed, the token ids training reads back, and the prompt's images, which the policy samples and
the reward scores with) and the round's reference log-probs (the reference
cache's format; named by the weights' digest). metrics.jsonl gets a record per round (`rounds/*`), plots.png a panel.

A kill anywhere resumes to the same result: a round's completions depend only on the weights that start it and on
seeds of (seed, round, prompt, completion), not on batching or ranks; its file and its reference are written before
its first step, and every checkpoint holds the rounds' progress (RoundProgress, a checkpoint part of its own:
rounds.pt). A resume inside a round reads them back; a resume from the checkpoint that ends a round starts the next
one afresh. Rounds run beside the Trainer, through what it offers a round: sampling from the policy, a reference
swapped for the round's cached one, training on the round's data, and logging."""

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import storage
from core.examples import Examples, from_ids
from core.step import Data
from generation.sampling import distinct_prompts, sample_seed
from judging.rewards import load_reward
from modeling.vision import pack_images, unpack_images
from persistence.tokenized import first_of_each_group
from preference_datasets import batch_schedule
from reporting.data_report import data_report
from trainers import Trainer
from training.policy_server import sample_served
from utils import UserError

DIRECTORY = "rounds"
PART = "rounds"  # the checkpoint part (rounds.pt) of a run of rounds' progress


@dataclass
class RoundProgress:
    """Where a run of rounds is, saved with every checkpoint and resumed like its other parts: the round under way
    (None: none yet), the step its schedule starts at, and the digest of the weights that started it (its cached
    reference's name; None for a loss without a reference)."""

    round: int | None = None
    start: int = 0
    reference: str | None = None

    def state_dict(self) -> dict:
        return {"round": self.round, "start": self.start, "reference": self.reference}

    def load_state_dict(self, state: dict) -> None:
        self.round, self.start, self.reference = state["round"], state["start"], state["reference"]


class Rounds:
    """The rounds of a run, beside its Trainer (every rank runs them; the reward runs on rank 0); their progress is
    the Trainer's checkpoint part PART (train.build_trainer gives it one)."""

    def __init__(self, trainer: Trainer):
        self.trainer, self.config, self.topology = trainer, trainer.config, trainer.topology
        self.progress = trainer.more_parts[PART]
        old = trainer.resumed_loop.get("round")  # a checkpoint of an earlier version noted its round in its marker
        if self.progress.round is None and old is not None:
            self.progress.load_state_dict(old)
        self.settings, self.directory = trainer.config.rounds, trainer.run_dir / DIRECTORY
        prompts = first_of_each_group(trainer.data.train_examples)
        self.prompts = prompts.select(np.random.default_rng(self.config.seed).permutation(len(prompts)))
        self.eval_batches = trainer.data.eval_batches
        held_out = distinct_prompts(self.eval_batches, self.settings.eval_prompts)
        self.eval_prompts, self.eval_images, self.eval_keep_end = (
            [ex["prompt"] for ex in held_out],
            [ex.get("images", b"") for ex in held_out],
            [ex["keep_end"] for ex in held_out],  # a prompt cut as training cuts it
        )
        c = self.config
        if self.settings.server and getattr(trainer.tokenizer, "vision", None) is not None:
            raise UserError(
                "rounds.server samples a vision-language policy (it is sent token ids alone): set rounds.server=null "
                "to sample with our loop"
            )
        self.reward = self.topology.run_on_main(
            lambda: load_reward(self.settings.reward, self.topology.device, c.eval_batch_size, c.max_length)
        )

    def run(self) -> None:
        """Every round not done yet: a resumed one goes on from its checkpoint, then the others from their start;
        nothing where the run resumed from its final checkpoint and asks for no more rounds."""
        trainer, progress = self.trainer, self.progress
        first = 0 if progress.round is None else progress.round + 1
        if trainer.resumed_final and first >= self.settings.n:
            return
        if progress.round is not None:  # resumed: within round progress.round, or at its end
            data = self.round_data(progress.round, self.read(progress.round))
            if trainer.batch_counter < progress.start + len(data.schedule):
                trainer.use_cached_reference(data, self.directory, progress.reference)
                trainer.train(data, round_start=progress.start)
                self.end_round(progress.round)
        for round_index in range(first, self.settings.n):
            self.train_round(round_index)
        reward = self.heldout_reward()
        trainer.report({"rounds/round": self.settings.n, "rounds/heldout_reward": reward})
        print(f"after round {self.settings.n - 1}: held-out greedy reward {reward:.4g}")

    def train_round(self, round_index: int) -> None:
        """Sample, score, pair, and train; a checkpoint at its end."""
        trainer = self.trainer
        heldout = self.heldout_reward()
        lines = self.sample_round(round_index)
        data = self.round_data(round_index, lines)
        digest = trainer.use_cached_reference(data, self.directory)
        self.progress.load_state_dict({"round": round_index, "start": trainer.batch_counter, "reference": digest})
        record = round_record(round_index, lines, heldout)
        trainer.report(record)
        self.report(round_index, record, data, len(lines))
        trainer.train(data)
        self.end_round(round_index)

    def report(self, round_index: int, record: dict, data: Data, n_prompts: int) -> None:
        """(rank 0) The round's rewards, pairs and steps, and the data report of its pairs."""
        if not self.topology.is_main:
            return
        line = (
            f"round {round_index}: {n_prompts} prompts x {self.settings.completions} completions, mean reward "
            f"{record['rounds/sampled_reward']:.4g}; {record['rounds/pairs']} pairs (mean reward "
            f"{record['rounds/chosen_reward']:.4g} chosen, {record['rounds/rejected_reward']:.4g} rejected), "
            f"{record['rounds/ties']} ties dropped; held-out greedy reward {record['rounds/heldout_reward']:.4g}; "
            f"{len(data.schedule)} steps; {round_path(self.directory, round_index)}"
        )
        if len(data.train_examples):
            c, examples = self.config, data.train_examples
            line = data_report(
                examples, Examples.empty(2), self.trainer.tokenizer, c.max_length, c.max_prompt_length, line
            )
        print(line)

    def end_round(self, round_index: int) -> None:
        """An eval against the round's reference (the last round's is the run's final eval) and a checkpoint."""
        if round_index + 1 < self.settings.n:
            self.trainer.evaluate_unless_done()
        self.trainer.checkpoint_now()

    def round_prompts(self, round_index: int) -> Examples:
        """The round's prompts: `rounds.prompts` of them in turn from the shuffled training prompts (all: null)."""
        n = len(self.prompts)
        per_round = min(self.settings.prompts or n, n)
        return self.prompts.select((np.arange(per_round) + round_index * per_round) % n)

    def sample_round(self, round_index: int) -> list[dict]:
        """The round's lines (see `score`), sampled from the policy, scored, and written to its file."""
        examples, k = self.round_prompts(round_index), self.settings.completions
        prompts = [examples[i]["prompt"] for i in range(len(examples))]
        images = [examples[i].get("images", b"") for i in range(len(examples))]
        seeds = [
            sample_seed(examples.keys[i].tobytes(), self.config.seed, round_index, j)
            for i in range(len(examples))
            for j in range(k)
        ]
        repeated = [prompt for prompt in prompts for _ in range(k)], [packed for packed in images for _ in range(k)]
        if self.settings.server:  # an engine's draws, not our seeds' (docs/rounds.md#sampling-by-a-server)
            g, trainer = self.config.generation, self.trainer
            rows = repeated[0], [g.temperature] * len(seeds), g.top_p
            completions = sample_served(self.settings, self.directory, round_index, trainer.policy, trainer.tokenizer,
                                        self.topology, rows, g.max_new_tokens)  # fmt: skip
        else:
            keep_end = [bool(end) for end in examples.keep_end for _ in range(k)]  # each prompt cut as training cuts it
            completions = self.trainer.sample(*repeated, seeds, keep_end)
        groups = examples.groups.tolist()
        return self.topology.broadcast(
            self.topology.run_on_main(lambda: self.score(round_index, prompts, images, groups, completions))
        )

    def score(self, round_index: int, prompts: list[list[int]], images: list[bytes], groups: list[int], completions):
        """(rank 0) The round's lines (`round_lines`), written to rounds/round-R.jsonl whole; the reward sees each
        prompt's images (pack_images; b"": none)."""
        k = self.settings.completions
        repeated = [p for p in prompts for _ in range(k)]
        prompt_texts, completion_texts = reward_texts(self.trainer.tokenizer, repeated, completions)
        rewards = self.reward(prompt_texts, completion_texts, [packed for packed in images for _ in range(k)])
        line_texts = (prompt_texts[::k], completion_texts)
        lines = round_lines(round_index, prompts, groups, *line_texts, completions, rewards, images)
        write_round(self.directory, round_index, lines)
        return lines

    def read(self, round_index: int) -> list[dict]:
        """The lines of a round's file (a resume inside the round), on every rank."""
        return self.topology.broadcast(self.topology.run_on_main(lambda: read_round(self.directory, round_index)))

    def round_data(self, round_index: int, lines: list[dict]) -> Data:
        """The round's pairs as examples, their schedule (n_epochs or n_examples of them, as the datasets' pairs
        would take; none if fewer pairs than batch_size) and the run's eval batches."""
        paired = [line for line in lines if line["chosen"] is not None]
        responses = [[line["completion_ids"][line[side]] for side in ("chosen", "rejected")] for line in paired]
        groups = np.array([line["group"] for line in paired], np.int64)
        images = [pack_images(tuple(map(base64.b64decode, line.get("images", ())))) for line in paired]
        c = self.config
        examples = from_ids(
            [line["prompt_ids"] for line in paired], responses, groups, c.max_length, c.max_prompt_length, images
        )
        schedule = []
        if len(examples) >= c.batch_size:
            schedule = batch_schedule(len(examples), c.batch_size, c.seed + round_index, c.n_epochs, c.n_examples)
        else:
            print(f"round {round_index}: {len(examples)} pairs, fewer than batch_size={c.batch_size}: no step")
        return Data(examples, self.eval_batches, schedule)

    def heldout_reward(self) -> float:
        """The mean reward of the policy's greedy completions of the held-out prompts."""
        completions = self.trainer.sample(self.eval_prompts, self.eval_images, None, self.eval_keep_end)

        def mean_reward() -> float:
            prompt_texts, completion_texts = reward_texts(self.trainer.tokenizer, self.eval_prompts, completions)
            return float(np.mean(self.reward(prompt_texts, completion_texts, self.eval_images)))

        return self.topology.broadcast(self.topology.run_on_main(mean_reward))


def round_path(directory: Path, round_index: int) -> Path:
    return directory / f"round-{round_index}.jsonl"


def write_round(directory: Path, round_index: int, lines: list[dict]) -> None:
    """A round's lines to rounds/round-R.jsonl, whole."""
    path = round_path(directory, round_index)
    with storage.writing(path):
        directory.mkdir(parents=True, exist_ok=True)
    storage.write_text(path, "".join(json.dumps(line) + "\n" for line in lines))


def read_round(directory: Path, round_index: int) -> list[dict]:
    """A round's lines from its file, or one line saying which checkpoint to resume from instead."""
    path = round_path(directory, round_index)
    try:
        return [json.loads(line) for line in path.read_text().splitlines()]
    except (OSError, ValueError) as error:
        raise UserError(
            f"{path}: the pairs of the round this checkpoint is in cannot be read ({error}); resume from the "
            "checkpoint that ends the round before"
        ) from None


def reward_texts(tokenizer, prompts: list[list[int]], completions: list[list[int]]) -> tuple[list[str], list[str]]:
    """The reward's inputs: the prompt as the policy read it (a prompt's images as the tokens they expand into),
    the completion without its EOS."""
    return [tokenizer.decode(p) for p in prompts], [tokenizer.decode(c, skip_special_tokens=True) for c in completions]


def round_lines(
    round_index, prompts, groups, prompt_texts, completion_texts, completions, rewards, images=None
) -> list[dict]:
    """Per prompt: its text, its completions' texts and rewards, the indices of its chosen (highest reward, the first
    of equals) and rejected (lowest, the last of equals) completions, or null for both where all tie, its group, and
    the ids; and its images where it has any (images: each prompt's, pack_images), each image's file in base64. The
    completions, texts and rewards come prompt after prompt, k of each."""
    k = len(completions) // len(prompts)
    lines = []
    for i, prompt in enumerate(prompts):
        own = rewards[i * k : (i + 1) * k]
        tie = max(own) == min(own)
        lines.append(
            {
                "round": round_index,
                "prompt": prompt_texts[i],
                "completions": completion_texts[i * k : (i + 1) * k],
                "rewards": own,
                "chosen": None if tie else own.index(max(own)),
                "rejected": None if tie else k - 1 - own[::-1].index(min(own)),
                "group": groups[i],
                "prompt_ids": prompt,
                "completion_ids": completions[i * k : (i + 1) * k],
            }
        )
        if images and images[i]:
            lines[-1]["images"] = [base64.b64encode(image).decode() for image in unpack_images(images[i])]
    return lines


def round_record(round_index: int, lines: list[dict], heldout: float) -> dict:
    """The round's metrics: rewards of the held-out greedy completions and of the sampled ones, of the pairs' chosen
    and rejected completions, and the pairs and ties."""
    paired = [line for line in lines if line["chosen"] is not None]
    mean = lambda values: float(np.mean(values)) if values else float("nan")  # noqa: E731
    return {
        "rounds/round": round_index,
        "rounds/heldout_reward": heldout,
        "rounds/sampled_reward": mean([r for line in lines for r in line["rewards"]]),
        "rounds/chosen_reward": mean([line["rewards"][line["chosen"]] for line in paired]),
        "rounds/rejected_reward": mean([line["rewards"][line["rejected"]] for line in paired]),
        "rounds/pairs": len(paired),
        "rounds/ties": len(lines) - len(paired),
    }
