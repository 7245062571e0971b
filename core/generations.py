"""Completions of prompts sampled from a model, each drawn from a seed of its own, their tempered log-probs, and the
judges that compare two completions of one prompt. Iterative rounds (rounds.py) sample and score with it;
evaluate.py and the trainer's win rate (eval_winrate_prompts) sample, judge and compare with it.

A completion drawn from its seed is the same whatever completions share its batch and however many ranks share the
prompts (SeededSampling), so a result does not depend on batching or ranks. A judge answers, for each prompt and two
completions of it, which is better: a reward (a reward model's, or a function's) by comparing the two rewards; a
pairwise LLM judge by asking an instruct model, in both orders, and reading its next-token probabilities of "A" and
"B" (a verdict that flips with the order is a tie: Zheng et al. 2023, arXiv:2306.05685)."""

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from core.decoding import decode, own_loop_problem
from core.layouts import left_padded_prompts, to_device
from core.prompt_groups import prompt_scorer, scores_by_prompt
from core.rewards import ModelReward, check_reward, load_reward
from core.seeded_draw import drawn_log_probs, probs_draw, seeded_draw, tempered_probs
from modeling.model_dirs import resolve_model_dir
from modeling.placement import root_gathered
from modeling.vision import unpack_images
from utils import REPO_ROOT, UserError, first_line

DEFAULT_TEMPLATE = REPO_ROOT / "assets" / "judge_template.txt"
PLACEHOLDERS = ("{prompt}", "{response_a}", "{response_b}")
HUB_NAME = re.compile(r"^[\w.-]+/[\w.-]+$")  # a Hub model: org/name (module:function has a colon)


def sample_seed(prompt_key: bytes, *parts) -> int:
    """The seed of one sampled completion: of the parts that name it (the run's seed, a round or a temperature,
    which of the prompt's samples) and the prompt (its example key)."""
    text = "".join(f"{part}:" for part in parts)
    digest = hashlib.blake2b(text.encode() + prompt_key, digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # torch seeds are below 2^63 here


def distinct_prompts(batches: list[list[dict]], n: int) -> list[dict]:
    """The first example of each of the first n distinct prompts of the batches' examples: a prompt is its ids and
    its images (pack_images), so that one question asked of two images is two prompts."""
    first = {}
    for example in (ex for batch in batches for ex in batch):
        first.setdefault((tuple(example["prompt"]), example.get("images", b"")), example)
    return list(first.values())[:n]


class Sampler:
    """Completions by a model of tokenized prompts, up to max_new_tokens each, and their log-probs, on this
    process's share of a topology: every data-parallel rank computes its share in batches of batch_size and the
    results are gathered in order on every rank. A vision-language model (the tokenizer's `vision`, as
    modeling.tokenizers.load_tokenizer sets it) sees each prompt's images (pack_images; b"": none)."""

    def __init__(self, tokenizer, topology, max_new_tokens: int, batch_size: int):
        self.tokenizer, self.topology = tokenizer, topology
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.cut_said = False  # the line on prompts cut to the model's positions, said once

    def fitted(self, model, prompts: list[list[int]], completions: list[list[int]] | None = None) -> list[list[int]]:
        """The prompts cut to the room the model's positions leave before max_new_tokens (or a longer completion
        being scored), each keeping its last tokens, as training keeps a prompt's end (nearest the response); one
        line says so, once. Uncut, a model with learned positions would index past its table (an IndexError in the
        prefill), a rotary one would read positions it never trained on."""
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        after = [max(self.max_new_tokens, len(c)) for c in completions] if completions else [self.max_new_tokens]
        if limit is None or max(map(len, prompts), default=0) + max(after) <= limit:
            return prompts
        if max(after) >= limit:
            what = f"max_new_tokens={self.max_new_tokens}" if max(after) == self.max_new_tokens else "a completion"
            raise UserError(f"{what} leaves no room for a prompt in the model's {limit} positions")
        rooms = [limit - tokens for tokens in (after if completions else after * len(prompts))]
        cut = len({tuple(prompt) for prompt, room in zip(prompts, rooms) if len(prompt) > room})  # distinct ones
        if cut and getattr(self.tokenizer, "vision", None) is not None:
            raise UserError(
                f"{cut} prompts with images do not fit the model's {limit} positions with max_new_tokens="
                f"{self.max_new_tokens}, and cutting one would cut its images' tokens: lower max_new_tokens"
            )
        if cut and not self.cut_said and self.topology.is_main:
            print(
                f"sampling: {cut} of {len(set(map(tuple, prompts)))} prompts do not fit the model's {limit} positions "
                f"with max_new_tokens={self.max_new_tokens}: each keeps its last {min(rooms)} tokens, as training "
                "keeps a prompt's end"
            )
        self.cut_said = self.cut_said or bool(cut)
        return [prompt[max(len(prompt) - room, 0) :] for prompt, room in zip(prompts, rooms)]

    def sample(self, model, prompts, images, seeds: list[int] | None, temperature=1.0, top_p=1.0) -> list[list[int]]:
        """Completions of every prompt (token ids; images: each prompt's, or None), sampled at `temperature` from the
        nucleus `top_p`, row i from seeds[i] (greedy where seeds is None); sharded over the ranks and gathered."""
        if seeds is None:
            model.eval()
            images = images or [b""] * len(prompts)
            greedy = lambda rows: self.complete(  # noqa: E731
                model, [prompts[i] for i in rows], [images[i] for i in rows], do_sample=False
            )
            return self.sharded(prompts, greedy)
        return self.sample_rows(model, prompts, images, seeds, [temperature] * len(prompts), top_p)

    def sample_rows(self, model, prompts, images, seeds: list[int], temperatures: list[float], top_p=1.0):
        """Completions of rows of prompts, row i from seeds[i] at temperatures[i] (a row is a function of its
        prompt, seed and temperature alone: the same in any batch, on any number of ranks), sharded over the ranks
        and gathered. Where core.decoding's own loop serves the model, rows of one prompt share its prefill and
        finished rows leave the batch; else model.generate completes one temperature's rows at a time."""
        return [completion for completion, _ in self.drawn(model, prompts, images, seeds, temperatures, top_p, False)]

    def sample_scored(self, model, prompts, images, seeds: list[int], temperatures: list[float], top_p=1.0):
        """sample_rows' completions and each one's log-prob under `model` at its temperature, as `logps` gives it
        (the sampled KL's first term): summed while drawing where the own loop serves (the logits each token was
        drawn from are the ones it is scored by), else by `logps` after drawing."""
        drawn = self.drawn(model, prompts, images, seeds, temperatures, top_p, True)
        completions, logps = [completion for completion, _ in drawn], [logp for _, logp in drawn]
        if None in logps:
            logps = self.logps(model, prompts, completions, images, temperatures)
        return completions, logps

    def drawn(self, model, prompts, images, seeds, temperatures, top_p, scored: bool) -> list[tuple]:
        """(completion, log-prob or None) of every row: the log-prob where scored and the own loop serves."""
        images = images or [b""] * len(prompts)
        prompts = self.fitted(model, prompts)
        vision = getattr(self.tokenizer, "vision", None)
        problem = own_loop_problem(model, vision, self.topology.world_size)

        def batch(rows: list[int]) -> list[tuple]:
            if problem is None:
                return self.decode_seeded(model, [prompts[i] for i in rows], [seeds[i] for i in rows],
                                          [temperatures[i] for i in rows], top_p, scored)  # fmt: skip
            completions: dict[int, list[int]] = {}
            for temperature in dict.fromkeys(temperatures[i] for i in rows):
                same = [i for i in rows if temperatures[i] == temperature]
                drawn = self.complete_seeded(model, [prompts[i] for i in same], [seeds[i] for i in same],
                                             [images[i] for i in same], temperature, top_p)  # fmt: skip
                completions.update(zip(same, drawn))
            return [(completions[i], None) for i in rows]

        model.eval()
        return self.sharded(prompts, batch, by_prompt=problem is None)

    def sharded(self, prompts: list, batch, by_prompt: bool = False) -> list:
        """batch(rows) (one result a row) over this rank's share of the rows, gathered in order: in batches of
        batch_size rows, or (by_prompt) of the rows of batch_size distinct prompts, prompts of similar lengths
        together."""
        local, n_real = self.topology.shard(list(range(len(prompts))))
        batches = prompt_batches(local, prompts, self.batch_size) if by_prompt else [
            local[start : start + self.batch_size] for start in range(0, len(local), self.batch_size)
        ]  # fmt: skip
        results: dict[int, object] = {}
        with self.progress(len(local), "sampling") as bar:
            for rows in batches:
                results.update(zip(rows, batch(rows)))
                bar.update(len(rows))
        return self.topology.gather({"results": [results[i] for i in local[:n_real]]})["results"]

    def progress(self, total: int, what: str) -> tqdm.tqdm:
        """A progress bar of this rank's rows, with its ETA (rank 0's alone)."""
        return tqdm.tqdm(total=total, desc=what, unit="row", leave=False, dynamic_ncols=True,
                         disable=not self.topology.is_main)  # fmt: skip

    def uniforms(self, seeds: list[int]) -> torch.Tensor:
        """[rows, max_new_tokens]: each row's uniforms, from its seed alone."""
        generators = (torch.Generator().manual_seed(seed) for seed in seeds)
        return torch.stack([torch.rand(self.max_new_tokens, generator=generator) for generator in generators])

    def decode_seeded(self, model, prompts, seeds: list[int], temperatures: list[float], top_p: float, scored: bool):
        """One batch's (completion, log-prob or None) by core.decoding's own loop, each token drawn as SeededSampling
        draws it; where scored, each completion's float32 log-prob at its temperature, summed as it is drawn."""
        uniforms = self.uniforms(seeds)
        one = len(set(temperatures)) == 1  # a number, as SeededSampling divides by it
        temperature = torch.tensor(temperatures, dtype=torch.float32)[:, None]
        logps = torch.zeros(len(prompts), dtype=torch.float64)

        def draw(logits: torch.Tensor, step: int, live: torch.Tensor) -> torch.Tensor:
            rows = live.cpu()
            row_temperature = temperatures[0] if one else temperature[rows].to(logits.device)
            probs = tempered_probs(logits, row_temperature)
            tokens, sums = probs_draw(probs, uniforms[rows, step].to(logits.device), top_p)
            if scored:
                logps[rows] += drawn_log_probs(probs, tokens, sums).cpu()
            return tokens

        pad_token_id, eos_token_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        with root_gathered(model):
            completions = decode(model, prompts, draw, self.max_new_tokens, pad_token_id, eos_token_id,
                                 self.topology.device)  # fmt: skip
        return list(zip(completions, logps.tolist() if scored else [None] * len(prompts)))

    def logps(self, model, prompts: list[list[int]], completions: list[list[int]], images: list[bytes] | None,
              temperatures: float | list[float]) -> list[float]:  # fmt: skip
        """Each completion's float32 log-probability under `model` sampling at its temperature (one per completion,
        or one for all): its logits divided by it, the distribution a completion sampled at that temperature, with
        top_p 1, was drawn from. Each prompt is computed once for all its completions (core/prompt_groups.py);
        sharded over the ranks and gathered."""
        model.eval()
        n = len(prompts)
        prompts = self.fitted(model, prompts, completions)
        temperatures = [float(t) for t in temperatures] if isinstance(temperatures, list) else [temperatures] * n
        images = images or [b""] * n
        vision = getattr(self.tokenizer, "vision", None)
        scorer = prompt_scorer(model, self.topology, self.tokenizer.pad_token_id, vision)
        progress = lambda total: self.progress(total, "log-probs")  # noqa: E731
        return scores_by_prompt(scorer, model, self.topology, prompts, completions, images, self.batch_size,
                                progress, temperatures)  # fmt: skip

    @torch.no_grad()
    def complete(
        self, model: torch.nn.Module, prompts: list[list[int]], images: list[bytes] | None = None, **settings
    ) -> list[list[int]]:
        """The generated ids of one batch of prompts, ending with the EOS where a completion stopped; settings:
        model.generate's (do_sample, temperature, top_p, logits_processor). Every rank calls it with as many prompts
        (synced_gpus: ranks done early join the sharded forward passes of the others)."""
        pad_token_id, eos_token_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts = self.fitted(model, prompts)
        prompt_ids, attention_mask = left_padded_prompts([{"prompt": p} for p in prompts], pad_token_id)
        vision = getattr(self.tokenizer, "vision", None)
        if vision is not None:  # the prompts' images, and their tokens marked where the model reads marks
            vision = vision.for_model(model)
            settings |= vision.pixel_inputs([unpack_images(packed) for packed in images or ()])
            # images (Qwen-VL, Gemma 3) or the prefix (PaliGemma)
            settings |= vision.marks(prompt_ids, attention_mask.bool())
            # never an image's token in a completion: a round's pair holding one would ask for an image it lacks
            settings["suppress_tokens"] = [vision.image_token_id]
        device = self.topology.device
        settings = {name: to_device(v, device) if torch.is_tensor(v) else v for name, v in settings.items()}
        with root_gathered(model):
            output = model.generate(
                prompt_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=self.max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
                synced_gpus=self.topology.world_size > 1,
                **settings,
            )
        completions = []
        for row in output[:, prompt_ids.shape[1] :].tolist():
            end = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
            completions.append(row[:end])
        return completions

    def complete_seeded(
        self, model, prompts: list[list[int]], seeds: list[int], images=None, temperature=1.0, top_p=1.0
    ) -> list[list[int]]:
        """One batch's completions sampled at `temperature` from the nucleus `top_p`, row i from its own seeds[i]
        alone: the same whatever rows share its batch and however many ranks there are (see SeededSampling)."""
        uniforms = self.uniforms(seeds)
        width = max(map(len, prompts))
        sampler = SeededSampling(uniforms.to(self.topology.device), width, temperature, top_p)
        return self.complete(model, prompts, images, do_sample=False, logits_processor=LogitsProcessorList([sampler]))


class SeededSampling(LogitsProcessor):
    """Sampling at a temperature from the nucleus (the most likely tokens whose mass reaches top_p; Holtzman et al.
    2020), each row driven by uniforms of its own: row i's token at step t is the nucleus distribution's inverse
    CDF at uniforms[i, t]. transformers' sampler draws every row from one generator, so that a row's tokens would
    depend on the rows batched with it; here they depend on its seed. It returns scores that leave the drawn token
    the only finite one, for greedy decoding (do_sample=False) to pick.

    uniforms: [B, max_new_tokens] in [0, 1); prompt_width: the padded prompts' length (where step 0 starts)."""

    def __init__(self, uniforms: torch.Tensor, prompt_width: int, temperature: float, top_p: float):
        self.uniforms, self.prompt_width, self.temperature, self.top_p = uniforms, prompt_width, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        drawn = self.draw(scores, input_ids.shape[1] - self.prompt_width)
        return torch.full_like(scores, -torch.inf).scatter_(-1, drawn[:, None].to(scores.device), 0.0)

    def draw(self, scores: torch.Tensor, step: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[B] the token each row draws at `step` from its scores [B, V] (rows: which rows of the uniforms these
        are; None: all)."""
        uniforms = self.uniforms[:, step] if rows is None else self.uniforms[rows, step]
        return seeded_draw(scores, self.temperature, uniforms, self.top_p)


def prompt_batches(rows: list[int], prompts: list[list[int]], n_prompts: int) -> list[list[int]]:
    """The rows in batches of the rows of n_prompts distinct prompts each, the prompts in order of length: each
    prompt is prefilled once for all its rows (core.decoding), and prompts of similar lengths pad little. A row's
    completion does not depend on its batch, so any grouping draws the same completions. (A batch of a prompt
    sampled at 4 temperatures holds 4 rows: more rows per weight read, which bounds a CPU's decode step.)"""
    by_prompt: dict[tuple, list[int]] = {}
    for row in rows:
        by_prompt.setdefault(tuple(prompts[row]), []).append(row)
    groups = sorted(by_prompt.values(), key=lambda group: len(prompts[group[0]]))
    return [sum(groups[start : start + n_prompts], []) for start in range(0, len(groups), n_prompts)]


# -------------------------------------------------------------------------------------------------------------
# Judges: which of two completions of a prompt is better


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


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


class RewardJudge:
    """A reward (core.rewards: a reward model's directory, or module:function) as a judge: the completion with the
    higher reward is better, equal rewards tie."""

    kind = "reward"

    def __init__(self, reward):
        self.reward = reward

    def __call__(self, prompts: list[str], first: list[str], second: list[str], images=None) -> Judgement:
        return self.judge_all(prompts, [(first, second)], images)[0]

    def judge_all(self, prompts: list[str], pairs: list[tuple[list[str], list[str]]], images=None,
                  progress: tqdm.tqdm | None = None) -> list[Judgement]:  # fmt: skip
        """The Judgement of each pair (first, second) of lists of completions of the prompts. Each distinct
        completion of a prompt is rewarded once, and all of a prompt's together: a reward model reads each prompt
        once for all of them (core.prompt_groups), and a baseline judged against several candidates or at several
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

    def __init__(self, directory: Path, template: Path | None, device: torch.device, batch_size: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # on use: the auto classes cost ~0.7 s to import

        self.setting = f"judge={directory}"
        self.template = read_template(template or DEFAULT_TEMPLATE)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(directory)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        except (OSError, ValueError, RuntimeError) as error:
            raise UserError(f"{self.setting}: cannot load a causal language model ({first_line(error)})") from None
        self.model, self.device, self.batch_size = model.to(device).eval(), device, batch_size
        self.letters = [letter_tokens(self.tokenizer, letter) for letter in "AB"]
        if not all(self.letters) or set(self.letters[0]) & set(self.letters[1]):
            raise UserError(f"{self.setting}: its tokenizer has no single token for each of the letters A and B")
        pad_id = self.tokenizer.pad_token_id
        self.pad_token_id = pad_id if pad_id is not None else self.tokenizer.eos_token_id

    def __call__(self, prompts: list[str], first: list[str], second: list[str], images=None) -> Judgement:
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
            judgements.append(self(prompts, first, second, images))
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


def is_reward_model(source: str) -> bool:
    """Whether a judge's model (a directory, or a Hub name) is a sequence classifier (a reward model), not a causal
    LM."""
    from transformers import AutoConfig  # on use: the auto classes cost ~0.7 s of every start to import

    architectures = AutoConfig.from_pretrained(source).architectures or []
    return any(name.endswith("ForSequenceClassification") for name in architectures)


def check_judge(spec: str, template: str | None) -> None:
    """A one-line error unless judge=`spec` names a model directory with a config, a Hub model (org/name, resolved
    when it is loaded) or an importable function; and its template, where given, is readable and complete (the
    configs check it before anything starts)."""
    if Path(spec).is_dir() or not HUB_NAME.match(spec):
        check_reward(spec, "judge")
    if template is not None:
        read_template(Path(template))


def load_judge(spec: str, template: str | None, device, batch_size: int, max_length: int, cache_dir: Path):
    """The judge judge=`spec` names: a function (module:function) or a reward model (RewardJudge), or a causal LM
    (PairwiseJudge, asking in the words of `template`); a model from its directory, or a Hub name from the Hub (the
    copy an earlier run downloaded, offline; modeling.model_dirs.resolve_model_dir)."""
    if not Path(spec).is_dir() and not HUB_NAME.match(spec):
        if template is not None:
            raise UserError(f"judge_template={template} is for an LLM judge; judge={spec} is a function")
        return RewardJudge(load_reward(spec, device, batch_size, max_length, "judge"))
    source = resolve_model_dir(spec, cache_dir)
    if not is_reward_model(source):
        return PairwiseJudge(Path(source), Path(template) if template else None, device, batch_size)
    if template is not None:
        raise UserError(f"judge_template={template} is for an LLM judge; judge={spec} is a reward model")
    return RewardJudge(ModelReward(Path(source), device, batch_size, max_length, "judge"))
