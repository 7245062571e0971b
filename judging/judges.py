"""Judges: which of two completions of a prompt is better. A judge answers, for each prompt and two completions of
it, in both orders: a reward (a reward model's, or a function's: judging/rewards.py) by comparing the two rewards; a
pairwise LLM judge by asking an instruct model and reading its next-token probabilities of "A" and "B" (a verdict that
flips with the order is a tie: Zheng et al. 2023, arXiv:2306.05685). Every judge is a `Judge`; `load_judge` makes
one of `judge=`, `check_judge` checks it before a run starts. evaluate.py, the trainer's win rate (judging/held_out.py)
and the benchmarks judge with them."""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import tqdm

from core.layouts import left_padded_prompts
from judging.rewards import ModelReward, check_reward, load_reward
from modeling.model_dirs import is_reward_model_dir, resolve_model_dir
from utils import REPO_ROOT, UserError, first_line

DEFAULT_TEMPLATE = REPO_ROOT / "assets" / "judge_template.txt"
PLACEHOLDERS = ("{prompt}", "{response_a}", "{response_b}")
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # a Hub model: org/name (module:function has a colon)


@dataclass
class Judgement:
    """A judge's verdicts on pairs (first, second) of completions, each in both orders, from the first's side: 1 the
    first is better, -1 the second, 0 neither. `first_shown_first`: with the first shown as A; `second_shown_first`:
    with the second shown as A (a reward judges each completion alone: the same). rewards: each side's, where the
    judge gives rewards; p_first: the judge's probability that the first is better, in each order (a pairwise
    judge's)."""

    first_shown_first: list[int]
    second_shown_first: list[int]
    rewards: tuple[list[float], list[float]] | None = None
    p_first: tuple[list[float], list[float]] | None = None

    @property
    def outcomes(self) -> list[int]:
        """1 (a win of the first), -1 (a loss) where both orders agree; else 0, a tie: the position bias removed."""
        return [a if a == b else 0 for a, b in zip(self.first_shown_first, self.second_shown_first)]


class Judge(Protocol):
    """What evaluate.py, rounds' tests and the trainer's win rate ask of a judge: the Judgement of the completions
    `first` against `second` of the same prompts (their texts; images: each prompt's packed images, or None), and
    of several such pairs at once (a judge that rewards each completion alone reads a completion shared by two pairs
    once). kind: "reward" or "pairwise", for the report."""

    kind: str

    def judge(self, prompts: list[str], first: list[str], second: list[str], images=None) -> Judgement: ...

    def judge_all(self, prompts: list[str], pairs: list[tuple[list[str], list[str]]], images=None,
                  progress: tqdm.tqdm | None = None) -> list[Judgement]: ...  # fmt: skip


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


class RewardJudge:
    """A reward (judging.rewards: a reward model's directory, or module:function) as a judge: the completion with the
    higher reward is better, equal rewards tie."""

    kind = "reward"

    def __init__(self, reward):
        self.reward = reward

    def judge(self, prompts: list[str], first: list[str], second: list[str], images=None) -> Judgement:
        return self.judge_all(prompts, [(first, second)], images)[0]

    def judge_all(self, prompts: list[str], pairs: list[tuple[list[str], list[str]]], images=None,
                  progress: tqdm.tqdm | None = None) -> list[Judgement]:  # fmt: skip
        """The Judgement of each pair (first, second) of lists of completions of the prompts. Each distinct
        completion of a prompt is rewarded once, and all of a prompt's together: a reward model reads each prompt
        once for all of them (generation.prompt_groups), and a baseline judged against several candidates or at several
        temperatures is read once. progress: a bar of judged pairs of completions, advanced as their prompts are
        rewarded."""
        distinct = [list(dict.fromkeys(side[j] for pair in pairs for side in pair)) for j in range(len(prompts))]
        rewards: list[dict[str, float]] = [{} for _ in prompts]
        for start in range(0, len(prompts), PROMPTS_PER_CALL):
            chunk = range(start, min(start + PROMPTS_PER_CALL, len(prompts)))
            rows = [(j, text) for j in chunk for text in distinct[j]]
            values = self.reward([prompts[j] for j, _ in rows], [text for _, text in rows],
                                 images and [images[j] for j, _ in rows])  # fmt: skip
            for (j, text), value in zip(rows, values):
                rewards[j][text] = value
            if progress is not None:
                progress.update(len(chunk) * len(pairs))
        judgements = []
        for first, second in pairs:
            first_rewards = [rewards[j][text] for j, text in enumerate(first)]
            second_rewards = [rewards[j][text] for j, text in enumerate(second)]
            verdicts = [sign(a - b) for a, b in zip(first_rewards, second_rewards)]
            judgements.append(Judgement(verdicts, list(verdicts), (first_rewards, second_rewards)))
        return judgements


# Prompts whose completions a reward judge rewards in one call: enough for a reward model's batches, few enough for
# the progress bar to move.
PROMPTS_PER_CALL = 32


class PairwiseJudge:
    """An instruct model (a causal LM's directory) asked which of two responses is better, in the words of a template
    file holding {prompt}, {response_a} and {response_b} (default: assets/judge_template.txt, after the DPO paper's
    GPT-4 prompts, Rafailov et al. 2023, Appendix C), rendered as a user turn with the judge's chat template where
    it has one. Its verdict is read from its next-token probabilities of "A" and "B" (each letter's tokens with and
    without a leading space), not from free text: no answer goes unparsed, and each verdict has a probability."""

    kind = "pairwise"

    def __init__(
        self, directory: Path, template: Path | None, device: torch.device, batch_size: int,
        dtype: torch.dtype = torch.float32,
    ):  # fmt: skip
        from transformers import AutoModelForCausalLM, AutoTokenizer  # on use: the auto classes cost ~0.7 s to import

        self.setting = f"judge={directory}"
        self.template = read_template(template or DEFAULT_TEMPLATE)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(f"{self.setting}: cannot load a causal language model ({first_line(error)})") from None
        self.model, self.device, self.batch_size = model.to(device).eval(), device, batch_size
        self.letters = [letter_tokens(self.tokenizer, letter) for letter in "AB"]
        if not all(self.letters) or set(self.letters[0]) & set(self.letters[1]):
            raise UserError(f"{self.setting}: its tokenizer has no single token for each of the letters A and B")
        pad_id = self.tokenizer.pad_token_id
        self.pad_token_id = pad_id if pad_id is not None else self.tokenizer.eos_token_id

    def judge(self, prompts: list[str], first: list[str], second: list[str], images=None) -> Judgement:
        if images and any(images):
            raise UserError(
                f"{self.setting} reads text alone and the prompts have images: judge them with a vision-language "
                "reward model (judge=DIR of a loss=reward run from Gemma 3, docs/reward_models.md)"
            )
        in_order = self.p_a(prompts, first, second)  # the first shown as A
        swapped = [1.0 - p for p in self.p_a(prompts, second, first)]  # the first shown as B
        verdicts = [[sign(p - 0.5) for p in ps] for ps in (in_order, swapped)]
        return Judgement(*verdicts, p_first=(in_order, swapped))

    def judge_all(self, prompts: list[str], pairs: list[tuple[list[str], list[str]]], images=None,
                  progress: tqdm.tqdm | None = None) -> list[Judgement]:  # fmt: skip
        """The Judgement of each pair (first, second) of lists of completions of the prompts, one pair at a time
        (a pairwise judge reads both completions together). progress: a bar of judged pairs of completions."""
        judgements = []
        for first, second in pairs:
            judgements.append(self.judge(prompts, first, second, images))
            if progress is not None:
                progress.update(len(prompts))
        return judgements

    def render(self, prompt: str, response_a: str, response_b: str) -> list[int]:
        text = self.template
        for placeholder, value in zip(PLACEHOLDERS, (prompt, response_a, response_b)):
            text = text.replace(placeholder, value.strip())
        if self.tokenizer.chat_template:  # the template's text holds its special tokens
            messages = [{"role": "user", "content": text}]
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer(rendered, add_special_tokens=False)["input_ids"]
        return self.tokenizer(text, add_special_tokens=True)["input_ids"]

    @torch.no_grad()
    def p_a(self, prompts: list[str], responses_a: list[str], responses_b: list[str]) -> list[float]:
        """The judge's probability of "A" against "B" as its next token, for each prompt and pair of responses."""
        encoded = [self.render(*texts) for texts in zip(prompts, responses_a, responses_b)]
        probabilities = []
        for start in range(0, len(encoded), self.batch_size):
            rows = [{"prompt": ids} for ids in encoded[start : start + self.batch_size]]
            input_ids, mask = left_padded_prompts(rows, self.pad_token_id)
            logits = self.model(input_ids.to(self.device), attention_mask=mask.to(self.device), logits_to_keep=1)
            logps = torch.log_softmax(logits.logits[:, -1].float(), dim=-1)
            a, b = (logps[:, tokens].logsumexp(dim=-1) for tokens in self.letters)
            probabilities += torch.sigmoid(a - b).cpu().tolist()
        return probabilities


def letter_tokens(tokenizer, letter: str) -> list[int]:
    """The ids that spell `letter` alone as one token, with and without a leading space."""
    found = {tuple(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in (letter, " " + letter)}
    return sorted(ids[0] for ids in found if len(ids) == 1)


def read_template(path: Path) -> str:
    """A judging template's text, with each of its placeholders, or one line saying what is wrong."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"judge_template={path} cannot be read ({error.strerror or error})") from None
    missing = [placeholder for placeholder in PLACEHOLDERS if placeholder not in text]
    if missing:
        raise UserError(f"judge_template={path} lacks {', '.join(missing)}: the judge would not see what it compares")
    return text


def check_judge(spec: str, template: str | None) -> None:
    """A one-line error unless judge=`spec` names a model directory with a config, a Hub model (org/name, resolved
    when it is loaded) or an importable function; and its template, where given, is readable and complete (the
    configs check it before anything starts)."""
    if Path(spec).is_dir() or not HUB_NAME.match(spec):
        check_reward(spec, "judge")
    if template is not None:
        read_template(Path(template))


def load_judge(
    spec: str, template: str | None, device, batch_size: int, max_length: int, cache_dir: Path,
    dtype: torch.dtype = torch.float32,
):  # fmt: skip
    """The judge judge=`spec` names: a function (module:function) or a reward model (RewardJudge), or a causal LM
    (PairwiseJudge, asking in the words of `template`); a model from its directory, or a Hub name from the Hub (the
    copy an earlier run downloaded, offline; modeling.model_dirs.resolve_model_dir), loaded in `dtype` (evaluate.py's:
    the evaluation's; a verdict is read from float32 logits either way)."""
    if not Path(spec).is_dir() and not HUB_NAME.match(spec):
        if template is not None:
            raise UserError(f"judge_template={template} is for an LLM judge; judge={spec} is a function")
        return RewardJudge(load_reward(spec, device, batch_size, max_length, "judge"))
    source = resolve_model_dir(spec, cache_dir)
    if not is_reward_model_dir(source):
        return PairwiseJudge(Path(source), Path(template) if template else None, device, batch_size, dtype)
    if template is not None:
        raise UserError(f"judge_template={template} is for an LLM judge; judge={spec} is a reward model")
    return RewardJudge(ModelReward(Path(source), device, batch_size, max_length, "judge", dtype))
