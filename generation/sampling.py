"""Sampling: completions of prompts drawn from a model, each from a seed of its own, and their tempered log-probs.
Iterative rounds (rounds.py) sample with it, evaluate.py and the trainer's win rate sample and score with it; the
judges that compare two completions are judging/judges.py's.

The words, one per level (docs/architecture.md#the-words-of-generation): a token is *drawn* (generation/seeded_draw.py);
the loop over a batch's tokens *decodes* (generation/decoding.py's own loop, or transformers' generate); rows'
completions are *sampled*, sharded over the ranks (Sampler.sample, sample_scored); a sequence's log-prob is *scored*
(Sampler.score). A completion drawn from its seed is the same whatever completions share its batch and however many
ranks share the prompts (SeededSampling), so a result does not depend on batching or ranks."""

import contextlib
import hashlib

import torch
import tqdm
from transformers import LogitsProcessor, LogitsProcessorList

from core.layouts import left_padded_prompts, to_device
from generation.decoding import decode, is_sharded, own_loop_problem
from generation.prompt_groups import prompt_scorer, scores_by_prompt
from generation.seeded_draw import RowDraws, seeded_draw
from generation.static_decoding import graphs_problem, static_decode, static_loop_problem
from modeling.placement import root_gathered
from modeling.vision import unpack_images
from utils import UserError


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


class PositionFit:
    """Prompts cut to the room a model's positions leave (Sampler.fitted), the line saying so said once."""

    def __init__(self, tokenizer, max_new_tokens: int, is_main: bool):
        self.tokenizer, self.max_new_tokens, self.is_main = tokenizer, max_new_tokens, is_main
        self.said = False

    def __call__(
        self, model, prompts: list[list[int]], completions: list[list[int]] | None = None,
        keep_end: list[bool] | None = None,
    ) -> list[list[int]]:  # fmt: skip
        """The prompts cut to the room the model's positions leave before max_new_tokens (or a longer completion
        being scored), each as training cuts it (keep_end: each row's Examples.keep_end; None: every row keeps its
        end, nearest the response): its last tokens, or its first; one line says so, once. Uncut, a model with
        learned positions would index past its table (an IndexError in the prefill), a rotary one would read
        positions it never trained on."""
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        after = [max(self.max_new_tokens, len(c)) for c in completions] if completions else [self.max_new_tokens]
        if limit is None or max(map(len, prompts), default=0) + max(after) <= limit:
            return prompts
        if max(after) >= limit:
            what = f"max_new_tokens={self.max_new_tokens}" if max(after) == self.max_new_tokens else "a completion"
            raise UserError(f"{what} leaves no room for a prompt in the model's {limit} positions")
        rooms = [limit - tokens for tokens in (after if completions else after * len(prompts))]
        keep_end = [True] * len(prompts) if keep_end is None else keep_end
        cut: dict[tuple, int] = {}  # the distinct cut prompts, each by its end kept, and the least room it has
        for prompt, room, end in zip(prompts, rooms, keep_end):
            if len(prompt) > room:
                cut[tuple(prompt), end] = min(room, cut.get((tuple(prompt), end), room))
        if cut and getattr(self.tokenizer, "vision", None) is not None:
            raise UserError(
                f"{len(cut)} prompts with images do not fit the model's {limit} positions with max_new_tokens="
                f"{self.max_new_tokens}, and cutting one would cut its images' tokens: lower max_new_tokens"
            )
        if cut and not self.said and self.is_main:
            distinct = len(set(zip(map(tuple, prompts), keep_end)))
            print(
                f"sampling: {len(cut)} of {distinct} prompts do not fit the model's {limit} positions with "
                f"max_new_tokens={self.max_new_tokens}: {kept_ends(cut)}, as training cuts them"
            )
        self.said = self.said or bool(cut)
        return [prompt[max(len(prompt) - room, 0) :] if end else prompt[:room]
                for prompt, room, end in zip(prompts, rooms, keep_end)]  # fmt: skip


def kept_ends(cut: dict[tuple, int]) -> str:
    """What the cut prompts ({(prompt, keep_end): room}) keep, in words: how many their last tokens and how many
    their first, as training cuts HH's format and every other format, and at least how many tokens."""
    said = []
    for end, words in ((True, "keep their last {} tokens (keep_end: HH's format)"),
                       (False, "keep their first {} tokens (keep_start)")):  # fmt: skip
        rooms = [room for (_, kept_end), room in cut.items() if kept_end == end]
        if rooms:
            said.append(f"{len(rooms)} {words.format(min(rooms))}")
    return ", ".join(said)


class Sampler:
    """Completions by a model of tokenized prompts, up to max_new_tokens each, and their log-probs, on this
    process's share of a topology: every data-parallel rank computes its share in batches of batch_size and the
    results are gathered in order on every rank. A vision-language model (the tokenizer's `vision`, as
    modeling.tokenizers.load_tokenizer sets it) sees each prompt's images (pack_images; b"": none)."""

    def __init__(self, tokenizer, topology, max_new_tokens: int, batch_size: int, autocast: torch.dtype | None = None):
        self.tokenizer, self.topology = tokenizer, topology
        self.max_new_tokens, self.batch_size = max_new_tokens, batch_size
        self.autocast = autocast  # a training run's compute dtype where torch.autocast applies it (else None)
        self.fitted = PositionFit(tokenizer, max_new_tokens, topology.is_main)  # prompts cut to the positions
        self.said: set[str] = set()  # the lines on which path samples (say_path), each said once

    def sample(self, model, prompts, images, seeds, temperatures=1.0, top_p=1.0, keep_end=None) -> list[list[int]]:
        """Completions of rows of prompts (token ids; images: each prompt's, or None), row i sampled from seeds[i] at
        its temperature (`temperatures`: one for every row, or one per row) from the nucleus `top_p`, or greedy
        where seeds is None; a prompt too long cut as training cut it (keep_end: PositionFit's). A row is a function
        of its prompt, seed and temperature alone: the same in any batch, on any number of ranks. Sharded over the
        ranks and gathered. Where generation.decoding's own loop serves the model, rows of one prompt share its
        prefill and finished rows leave the batch; else transformers' generate decodes one temperature's rows at a
        time."""
        if seeds is None:
            model.eval()
            images = images or [b""] * len(prompts)
            greedy = lambda rows: self.decode_generate(  # noqa: E731
                model, [prompts[i] for i in rows], [images[i] for i in rows], keep_end and [keep_end[i] for i in rows],
                do_sample=False,
            )  # fmt: skip
            return self.sharded(prompts, greedy)
        temperatures = per_row(temperatures, len(prompts))
        return [c for c, _ in self.sampled(model, prompts, images, seeds, temperatures, top_p, False, keep_end)]

    def sample_scored(self, model, prompts, images, seeds: list[int], temperatures, top_p=1.0, keep_end=None):
        """`sample`'s completions and each one's log-prob under `model` at its temperature, as `score` gives it (the
        sampled KL's first term): summed while drawing where the own loop serves (the logits each token was drawn
        from are the ones it is scored by), else scored after sampling, each prompt cut as it was sampled."""
        temperatures = per_row(temperatures, len(prompts))
        sampled = self.sampled(model, prompts, images, seeds, temperatures, top_p, True, keep_end)
        completions, logps = [completion for completion, _ in sampled], [logp for _, logp in sampled]
        if None in logps:
            logps = self.score(model, prompts, completions, images, temperatures, keep_end)
        return completions, logps

    def sampled(self, model, prompts, images, seeds, temperatures, top_p, scored: bool, keep_end) -> list[tuple]:
        """(completion, log-prob or None) of every row: the log-prob where scored and the own loop serves."""
        images = images or [b""] * len(prompts)
        prompts = self.fitted(model, prompts, keep_end=keep_end)
        vision = getattr(self.tokenizer, "vision", None)
        problem = own_loop_problem(model, vision)
        self.say_path(problem)

        def batch(rows: list[int]) -> list[tuple]:
            if problem is None:
                return self.decode_own(model, [prompts[i] for i in rows], [seeds[i] for i in rows],
                                       [temperatures[i] for i in rows], top_p, scored)  # fmt: skip
            completions: dict[int, list[int]] = {}
            for temperature in dict.fromkeys(temperatures[i] for i in rows):
                same = [i for i in rows if temperatures[i] == temperature]
                decoded = self.decode_generate_seeded(model, [prompts[i] for i in same], [seeds[i] for i in same],
                                                      [images[i] for i in same], temperature, top_p)  # fmt: skip
                completions.update(zip(same, decoded))
            return [(completions[i], None) for i in rows]

        model.eval()
        return self.sharded(prompts, batch, by_prompt=problem is None)

    def computing(self):
        """The forward passes' context: the training run's autocast, so that its win rate and its rounds sample from
        the policy as it computes in training (a float32-weight policy trained in bfloat16 samples in bfloat16)."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.topology.device.type, dtype=self.autocast)

    def say_path(self, problem: str | None) -> None:
        """One line, the first time each path serves: the own decode loop (on how many ranks) or generate, and why;
        and the autocast dtype it computes in, where the run's applies."""
        ranks = f" on each of {self.topology.world_size} ranks" if self.topology.world_size > 1 else ""
        line = f"sampling: our decode loop{ranks}"
        if problem is not None:
            line = f"sampling: transformers' generate: {problem}"
        if self.autocast is not None:
            line += f" ({str(self.autocast).removeprefix('torch.')} autocast, as the run computes)"
        if line not in self.said and self.topology.is_main:
            print(line)
        self.said.add(line)

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

    static_loop = True  # decode_own's loop where it serves: the static one (the bench sets False to time the other)

    def decode_own(self, model, prompts, seeds: list[int], temperatures: list[float], top_p: float, scored: bool):
        """One batch's (completion, log-prob or None) by generation.static_decoding's loop where it serves the model
        (one line says which loop, and why), else generation.decoding's, each token drawn as SeededSampling draws it
        (RowDraws); where scored, each completion's float32 log-prob at its temperature, summed as it is drawn."""
        device = self.topology.device
        draws = RowDraws(self.uniforms(seeds), temperatures, top_p, scored, device)
        problem = static_loop_problem(model) if self.static_loop else "Sampler.static_loop is off"
        graphs = graphs_problem(model, device)
        line = f"sampling: static decode steps, {f'eager ({graphs})' if graphs else 'a CUDA graph per batch bucket'}"
        if problem is not None:
            line = f"sampling: decode steps without a static cache: {problem}"
        if line not in self.said and self.topology.is_main:
            print(line)
        self.said.add(line)
        with root_gathered(model), self.computing():
            completions = (decode if problem else static_decode)(model, prompts, draws, self.max_new_tokens,
                                                                  self.tokenizer.pad_token_id,
                                                                  self.tokenizer.eos_token_id, device)  # fmt: skip
        return list(zip(completions, draws.logps[:-1].tolist() if scored else [None] * len(prompts)))

    def score(self, model, prompts: list[list[int]], completions: list[list[int]], images: list[bytes] | None,
              temperatures: float | list[float], keep_end: list[bool] | None = None) -> list[float]:  # fmt: skip
        """Each completion's float32 log-probability under `model` sampling at its temperature (one per completion,
        or one for all): its logits divided by it, the distribution a completion sampled at that temperature, with
        top_p 1, was drawn from; a prompt too long cut as `sample` cut it (keep_end). Each prompt is computed once
        for all its completions (generation/prompt_groups.py); sharded over the ranks and gathered."""
        model.eval()
        n = len(prompts)
        prompts = self.fitted(model, prompts, completions, keep_end)
        temperatures = [float(t) for t in per_row(temperatures, n)]
        images = images or [b""] * n
        vision = getattr(self.tokenizer, "vision", None)
        scorer = prompt_scorer(model, self.topology, self.tokenizer.pad_token_id, vision)
        progress = lambda total: self.progress(total, "log-probs")  # noqa: E731
        return scores_by_prompt(scorer, model, self.topology, prompts, completions, images, self.batch_size,
                                progress, temperatures)  # fmt: skip

    @torch.no_grad()
    def decode_generate(
        self, model: torch.nn.Module, prompts: list[list[int]], images: list[bytes] | None = None,
        keep_end: list[bool] | None = None, **settings,
    ) -> list[list[int]]:  # fmt: skip
        """One batch of prompts (a prompt too long cut by keep_end: PositionFit) decoded by transformers' generate: the
        new ids, ending with the EOS where a completion stopped; settings: generate's (do_sample, temperature, top_p,
        logits_processor). Every rank calls it with as many prompts (synced_gpus: ranks done early join the others)."""
        pad_token_id, eos_token_id = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        prompts = self.fitted(model, prompts, keep_end=keep_end)
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
        with root_gathered(model), self.computing():
            output = model.generate(
                prompt_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=self.max_new_tokens,
                pad_token_id=pad_token_id,
                eos_token_id=eos_token_id,
                synced_gpus=is_sharded(model),
                **settings,
            )
        completions = []
        for row in output[:, prompt_ids.shape[1] :].tolist():
            end = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
            completions.append(row[:end])
        return completions

    def decode_generate_seeded(
        self, model, prompts: list[list[int]], seeds: list[int], images=None, temperature=1.0, top_p=1.0
    ) -> list[list[int]]:
        """One batch's completions sampled at `temperature` from the nucleus `top_p`, row i from its own seeds[i]
        alone: the same whatever rows share its batch and however many ranks there are (see SeededSampling)."""
        uniforms = self.uniforms(seeds)
        width = max(map(len, prompts))
        sampler = SeededSampling(uniforms.to(self.topology.device), width, temperature, top_p)
        processors = LogitsProcessorList([sampler])
        return self.decode_generate(model, prompts, images, do_sample=False, logits_processor=processors)


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


def per_row(temperatures, n: int) -> list:
    """One temperature for each of n rows: the one given for all, or the list given."""
    return list(temperatures) if isinstance(temperatures, (list, tuple)) else [temperatures] * n


def prompt_batches(rows: list[int], prompts: list[list[int]], n_prompts: int) -> list[list[int]]:
    """The rows in batches of the rows of n_prompts distinct prompts each, the prompts in order of length: each
    prompt is prefilled once for all its rows (generation.decoding), and prompts of similar lengths pad little. A row's
    completion does not depend on its batch, so any grouping draws the same completions. (A batch of a prompt
    sampled at 4 temperatures holds 4 rows: more rows per weight read, which bounds a CPU's decode step.)"""
    by_prompt: dict[tuple, list[int]] = {}
    for row in rows:
        by_prompt.setdefault(tuple(prompts[row]), []).append(row)
    groups = sorted(by_prompt.values(), key=lambda group: len(prompts[group[0]]))
    return [sum(groups[start : start + n_prompts], []) for start in range(0, len(groups), n_prompts)]
