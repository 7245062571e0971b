"""Our trainer against TRL 1.16 itself: for every loss both have, TRL's DPOTrainer, KTOTrainer or RewardTrainer (or
trl.experimental's CPOTrainer and ORPOTrainer) and ours train the same tiny random model (saved once, loaded by both)
on the same four pairs (their token ids checked equal), in float32, in one process, on the whole batch every step (no
accumulation), with the same AdamW (lr, betas, eps, no weight decay), a constant rate and the same clipping, for 3
steps. Every step's loss and gradient norm agree to 1e-5 relative, or the loss is computed otherwise on purpose
(docs/losses.md#against-trl-116): then the runs differ from the step the documented reason predicts on, and not
before, and TRL's convention swapped into ours (CONVENTIONS) makes them agree to 1e-5 at every step (where ours
cannot compute TRL's, the first step's losses differ by exactly what the two conventions give from the same
log-probs)."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import transformers

from conftest import TINY_DIR, build_trainer, tiny_lm_config, write_jsonl
from core import heads as scoring
from core import losses
from core.objective import PreferenceObjective
from core.step import mismatched

STEPS = 3
LR = 1e-3
MAX_GRAD_NORM = 1.0
ADAM_EPS = 1e-8  # TrainingArguments' default (torch's AdamW has the same, and weight decay 0.01 where TRL has 0)
MAX_LENGTH, MAX_PROMPT_LENGTH = 256, 128  # far above these pairs: neither trainer truncates
RTOL = 1e-5
DIFFERENT = 1e-3  # a documented difference shows at least this relative difference (of loss or gradient norm)

# Plain text, so that both tokenize prompt and responses alike (the byte-level tokenizer has no merges across the
# prompt's end), of different lengths: the chosen responses' lengths differ (the NLL's conventions then differ), and
# the longer response of a pair is sometimes the chosen one, sometimes the rejected one (LD-DPO's tails).
PAIRS = [
    {"prompt": "Q: 2 + 2?\nA:", "chosen": " 4.", "rejected": " 5, I think.", "margin": 0.5},
    {"prompt": "Name a colour.", "chosen": " Blue, like a clear sky.", "rejected": " Seven.", "margin": 1.5},
    {"prompt": "Say hi:", "chosen": " Hi there!", "rejected": " No.", "margin": 0.0},
    {"prompt": "The capital of France?", "chosen": " Paris.", "rejected": " It is Berlin, I believe.", "margin": 2.0},
]


@dataclass
class Case:
    """One loss in both trainers: TRL's trainer (dpo, kto, reward, cpo or orpo) and its config fields, our
    overrides, the data both train on (pairs; labelled: the pairs unpaired, KTO's labelled completions; margins: pairs
    with a margin column), the conventions (CONVENTIONS) by which ours differs on purpose, and the tiny model's
    architecture (conftest.tiny_lm_config: model_type and any config fields, e.g. a mixture of experts')."""

    trl_trainer: str
    trl: dict
    ours: tuple[str, ...]
    data: str = "pairs"
    conventions: tuple[str, ...] = ()
    model: dict = field(default_factory=lambda: {"model_type": "llama"})

    @property
    def kl_estimate(self) -> bool:
        """Whether TRL's KTOTrainer estimates its reference point (every loss_type but apo_zero_unpaired)."""
        return self.trl_trainer == "kto" and self.trl.get("loss_type", "kto") == "kto"


def term(name: str, weight: float, **keys) -> str:
    """An override adding a term to our weighted loss (loss=mpo), with its weight and keys."""
    values = ",".join(f"{key}:{value}" for key, value in {"weight": weight, **keys}.items())
    return f"+loss.terms.{name}={{{values}}}"


RATIO_KEYS = {"beta": 0.1, "nll_weight": 0, "length_normalized": "false"}
WEIGHTED_DPO_IPO_HINGE = (
    "loss=mpo",
    "~loss.terms.dpo",
    "~loss.terms.bco_pair",
    "~loss.terms.nll",
    term("dpo", 0.5, **RATIO_KEYS, label_smoothing=0.0, reference_free="false"),
    term("ipo", 0.25, **{**RATIO_KEYS, "length_normalized": "true"}, reference_free="false"),
    term("hinge", 2.0, **RATIO_KEYS),
)

# TRL's name (and settings) = ours. A case is one entry; another trainer's loss_type (e.g. KTOTrainer's
# apo_zero_unpaired, data="labelled") or a mixture of experts' router loss (model={"model_type": ..., its expert
# settings}, TRL's router_aux_loss_coef) is one entry more.
CASES = {
    "sigmoid = dpo": Case("dpo", {"loss_type": ["sigmoid"]}, ("loss=dpo",)),
    "sigmoid_norm = dpo_norm": Case("dpo", {"loss_type": ["sigmoid_norm"], "beta": 5.0}, ("loss=dpo_norm",)),
    "ipo = ipo per token": Case("dpo", {"loss_type": ["ipo"]}, ("loss=ipo", "loss.length_normalized=true")),
    "hinge": Case("dpo", {"loss_type": ["hinge"]}, ("loss=hinge",)),
    "robust": Case("dpo", {"loss_type": ["robust"], "label_smoothing": 0.1}, ("loss=robust",)),
    "exo_pair": Case("dpo", {"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, ("loss=exo_pair",)),
    "nca_pair": Case("dpo", {"loss_type": ["nca_pair"]}, ("loss=nca_pair",)),
    # beta 1: rewards large enough for delta's difference to show at step 3 (CONVENTIONS)
    "bco_pair": Case(
        "dpo", {"loss_type": ["bco_pair"], "beta": 1.0}, ("loss=bco_pair", "loss.beta=1.0"), conventions=("bco_shift",)
    ),
    "sppo_hard": Case("dpo", {"loss_type": ["sppo_hard"]}, ("loss=sppo_hard",)),
    "aot": Case("dpo", {"loss_type": ["aot"], "label_smoothing": 0.1}, ("loss=aot", "loss.label_smoothing=0.1")),
    "aot_unpaired": Case("dpo", {"loss_type": ["aot_unpaired"]}, ("loss=aot_unpaired",)),
    "apo_zero": Case("dpo", {"loss_type": ["apo_zero"]}, ("loss=apo_zero",)),
    "apo_down": Case("dpo", {"loss_type": ["apo_down"]}, ("loss=apo_down",)),
    "discopop": Case("dpo", {"loss_type": ["discopop"], "discopop_tau": 0.05}, ("loss=discopop",)),
    "f-DPO forward_kl": Case(
        "dpo", {"f_divergence_type": "forward_kl"}, ("loss=f_dpo", "loss.f_divergence=forward_kl")
    ),
    "f-DPO js_divergence = js": Case("dpo", {"f_divergence_type": "js_divergence"}, ("loss=f_dpo",)),
    "f-DPO alpha_divergence, coef 0.3 = alpha 0.7": Case(
        "dpo",
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        ("loss=f_dpo", "loss.f_divergence=alpha", "loss.alpha=0.7"),
    ),
    "LD-DPO ld_alpha = ld_dpo": Case("dpo", {"ld_alpha": 0.3}, ("loss=ld_dpo", "loss.ld_alpha=0.3")),
    "WPO use_weighting = wpo": Case("dpo", {"use_weighting": True}, ("loss=wpo",)),
    "WPO on sigmoid_norm = wpo per token": Case(
        "dpo",
        {"loss_type": ["sigmoid_norm"], "use_weighting": True, "beta": 5.0},
        ("loss=wpo", "loss.length_normalized=true", "loss.beta=5.0"),
    ),
    "loss_type list = weighted": Case(
        "dpo", {"loss_type": ["sigmoid", "ipo", "hinge"], "loss_weights": [0.5, 0.25, 2.0]}, WEIGHTED_DPO_IPO_HINGE
    ),
    "sft = nll": Case("dpo", {"loss_type": ["sft"]}, ("loss=nll",), conventions=("nll_per_pair",)),
    "RPO: sigmoid + 0.5 sft = dpo nll_weight 0.5": Case(
        "dpo",
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
        ("loss=dpo", "loss.nll_weight=0.5"),
        conventions=("nll_per_pair",),
    ),
    "MPO = mpo": Case(
        "dpo",
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        ("loss=mpo",),
        conventions=("nll_per_pair", "bco_shift"),
    ),
    # KTO's weights chosen so that its KL estimate is above 0 (it is clamped there) after step 1 (tested)
    "KTO on pairs": Case(
        "kto", {"desirable_weight": 1.25, "undesirable_weight": 1.0}, ("loss=kto", "loss.desirable_weight=1.25")
    ),
    "KTO on labelled completions": Case(
        "kto",
        {"desirable_weight": 1.25, "undesirable_weight": 1.0},
        ("loss=kto", "loss.desirable_weight=1.25"),
        data="labelled",
    ),
    "KTO apo_zero_unpaired on pairs": Case(
        "kto",
        {"loss_type": "apo_zero_unpaired", "desirable_weight": 1.25, "undesirable_weight": 1.0},
        ("loss=apo_zero_unpaired", "loss.desirable_weight=1.25"),
    ),
    "KTO apo_zero_unpaired on labelled completions": Case(
        "kto",
        {"loss_type": "apo_zero_unpaired", "desirable_weight": 1.25, "undesirable_weight": 1.0},
        ("loss=apo_zero_unpaired", "loss.desirable_weight=1.25"),
        data="labelled",
    ),
    # The router load-balancing loss of a mixture of experts (TRL logs it inside `loss`; ours as aux_loss/train), a
    # coefficient large enough to move the gradient norm
    "router loss, Mixtral": Case(
        "dpo",
        {"loss_type": ["sigmoid"], "router_aux_loss_coef": 0.1},
        ("loss=dpo", "loss.router_aux_loss_coef=0.1"),
        model={"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "router loss, Qwen3-MoE": Case(
        "dpo",
        {"loss_type": ["sigmoid"], "router_aux_loss_coef": 0.1},
        ("loss=dpo", "loss.router_aux_loss_coef=0.1"),
        model={"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
    # trl.experimental's CPOTrainer and ORPOTrainer (no reference): cpo_alpha is CPO's NLL weight
    "CPOTrainer sigmoid = cpo": Case("cpo", {"cpo_alpha": 0.0}, ("loss=cpo", "loss.nll_weight=0")),
    "CPOTrainer simpo = simpo": Case(
        "cpo", {"loss_type": "simpo", "cpo_alpha": 0.0, "beta": 2.0, "simpo_gamma": 0.5}, ("loss=simpo",)
    ),
    "CPOTrainer with its NLL = cpo": Case("cpo", {"cpo_alpha": 1.0}, ("loss=cpo",), conventions=("nll_per_pair",)),
    "ORPOTrainer = orpo": Case("orpo", {"beta": 0.1}, ("loss=orpo", "loss.beta=0.1"), conventions=("orpo_nll",)),
    "RewardTrainer = reward": Case("reward", {}, ("loss=reward",), conventions=("reward_before_eos",)),
    "RewardTrainer with margins and centring": Case(
        "reward",
        {"center_rewards_coefficient": 0.01},
        ("loss=reward", "loss.center_rewards_coefficient=0.01"),
        data="margins",
        conventions=("reward_before_eos",),
    ),
}


# -------------------------------------------------------------------------------------------------------------
# The documented differences (docs/losses.md#against-trl-116): TRL's convention, to swap into ours, and the first
# step at which the reason predicts a difference.


def pooled_chosen_nll(stats: losses.PairStats) -> torch.Tensor:
    """TRL's NLL term: the mean over every chosen token of the batch, the same number for each pair ([B])."""
    return (-stats.policy_chosen.sum() / stats.chosen_tokens.sum()).expand_as(stats.policy_chosen)


def pooled_nll(monkeypatch) -> None:
    """TRL's NLL term in every loss of ours that adds the chosen NLL (nll, nll_weight, cpo, orpo)."""
    monkeypatch.setattr(losses, "chosen_nll", pooled_chosen_nll)


def unshifted(monkeypatch) -> None:
    """TRL 1.16's bco_pair has no shift: delta stays 0 (our running reward mean is never updated)."""
    monkeypatch.setattr(PreferenceObjective, "observe", lambda self, metrics: None)


def read_at_eos(monkeypatch) -> None:
    """TRL's RewardTrainer reads a reward where its classifier pools: the last token that is not padding, which is
    the EOS it appends to every response."""
    monkeypatch.setattr(scoring, "reward_positions", lambda batch, eos_token_id: batch.last_positions)


def orpo_nll_gap(model_dir: Path, examples: list[dict]) -> float:
    """Our ORPO loss minus TRL's ORPOTrainer's at step 1 (the same weights; their odds-ratio terms are equal): our NLL
    of the initial model (each pair's chosen response per token, averaged over pairs) minus TRL's (every token of
    prompt + chosen after the first, pooled over the batch), both from one plain forward of each sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ours, theirs = [], []
    with torch.no_grad():
        for example in examples:
            prompt, chosen = list(example["prompt"]), list(example["responses"][0])
            sequence = torch.tensor([prompt + chosen])
            logps = model(sequence).logits[0, :-1].log_softmax(-1).gather(-1, sequence[0, 1:, None])[:, 0]
            ours.append(-logps[len(prompt) - 1 :].mean())
            theirs.append(-logps)
    return (torch.stack(ours).mean() - torch.cat(theirs).mean()).item()


@dataclass(frozen=True)
class Convention:
    """What a documented difference predicts: the first step (1-based) where the runs differ, and either TRL's
    convention swapped into ours (swap_in(monkeypatch)), or, where ours cannot compute TRL's, the difference of the
    first step's losses (step_one_gap(model_dir, examples))."""

    differs_from_step: int
    swap_in: Callable[[pytest.MonkeyPatch], None] | None = None
    step_one_gap: Callable[[Path, list[dict]], float] | None = None


CONVENTIONS = {
    # ours: each pair's chosen NLL per token, averaged over pairs; TRL's: pooled over the batch's chosen tokens. The
    # chosen responses' lengths differ, so they differ from the first step.
    "nll_per_pair": Convention(1, swap_in=pooled_nll),
    # ours: delta = the mean reward of the steps before; every reward of step 1 is 0 (policy = reference), so delta
    # is 0 in steps 1 and 2 and the losses part at step 3.
    "bco_shift": Convention(3, swap_in=unshifted),
    # ours: a reward is read at the response's last token before its EOS; TRL's at the EOS: from the first step.
    "reward_before_eos": Convention(1, swap_in=read_at_eos),
    # ours: as nll_per_pair; TRL's ORPOTrainer: its NLL over the prompt's tokens too (after the first), pooled, as
    # its code says the ORPO authors' did. Our scorer computes no prompt log-probs: the first step's gap is checked.
    "orpo_nll": Convention(1, step_one_gap=orpo_nll_gap),
}


# -------------------------------------------------------------------------------------------------------------
# The model, the data and the two runs


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """model_dir(model: dict, reward: bool) -> the directory of a tiny random model of that architecture and its
    tokenizer (assets/tiny-llama's), a causal LM or (reward) a sequence classifier with one output, made once."""
    made = {}

    def model_dir(model: dict, reward: bool) -> Path:
        key = (json.dumps(model, sort_keys=True), reward)
        if key not in made:
            tokenizer = transformers.AutoTokenizer.from_pretrained(TINY_DIR)
            ids = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
            config = tiny_lm_config(**model, **ids, pad_token_id=tokenizer.pad_token_id, num_labels=1)
            torch.manual_seed(0)
            auto = transformers.AutoModelForSequenceClassification if reward else transformers.AutoModelForCausalLM
            directory = tmp_path_factory.mktemp("reward_model" if reward else "model")
            auto.from_config(config).save_pretrained(directory)
            tokenizer.save_pretrained(directory)
            made[key] = directory
        return made[key]

    return model_dir


def our_rows(case: Case) -> list[dict]:
    """The rows our trainer trains on, in this order: PAIRS, with their margins (margins), or unpaired, each chosen
    response a desirable completion and each rejected one not (labelled)."""
    if case.data == "labelled":
        return [
            {"prompt": pair["prompt"], "completion": pair[key], "label": key == "chosen"}
            for pair in PAIRS
            for key in ("chosen", "rejected")
        ]
    keys = ("prompt", "chosen", "rejected") + (("margin",) if case.data == "margins" else ())
    return [{key: pair[key] for key in keys} for pair in PAIRS]


def trl_rows(case: Case) -> list[dict]:
    """The rows TRL trains on: ours, reversed for KTOTrainer. It pairs each row's prompt with the previous row's
    completion for its KL estimate (the first with the last's), ours each example's prompt with the next example's
    responses (core.step.mismatched): in reverse order, its mismatched (prompt, completion) pairs are ours
    (assert_same_token_ids checks it)."""
    return our_rows(case)[::-1] if case.trl_trainer == "kto" else our_rows(case)


def our_data(directory: Path, case: Case) -> Path:
    """Our rows as a dataset directory: train.jsonl is trained on; test.jsonl (the same rows) is the eval split the
    config asks for."""
    directory.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        write_jsonl(directory / name, our_rows(case))
    return directory


def trl_run(case: Case, model_dir: Path, output_dir: Path):
    """TRL's trainer on trl_rows for STEPS steps of the whole batch: ([(loss, grad_norm)] per step, the trainer)."""
    import datasets
    import trl
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    rows = trl_rows(case)
    trainers = {
        "dpo": (trl.DPOTrainer, trl.DPOConfig, transformers.AutoModelForCausalLM),
        "kto": (trl.KTOTrainer, trl.KTOConfig, transformers.AutoModelForCausalLM),
        "reward": (trl.RewardTrainer, trl.RewardConfig, transformers.AutoModelForSequenceClassification),
        "cpo": (CPOTrainer, CPOConfig, transformers.AutoModelForCausalLM),
        "orpo": (ORPOTrainer, ORPOConfig, transformers.AutoModelForCausalLM),
    }
    trainer_class, config_class, model_class = trainers[case.trl_trainer]
    args = config_class(
        output_dir=str(output_dir),
        per_device_train_batch_size=len(rows) * (2 if case.trl_trainer == "kto" and case.data != "labelled" else 1),
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=MAX_GRAD_NORM,
        adam_epsilon=ADAM_EPS,
        weight_decay=0.0,
        max_length=MAX_LENGTH,
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        dataloader_num_workers=0,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **case.trl,
    )
    model = model_class.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    trainer = trainer_class(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    trainer.train()
    steps = [(entry["loss"], entry["grad_norm"]) for entry in trainer.state.log_history if "loss" in entry]
    assert len(steps) == STEPS
    return steps, trainer


def our_run(make_config, case: Case, model_dir: Path, data_dir: Path, run_dir: Path):
    """Our trainer on the same data for STEPS steps of the whole batch, in file order (as TRL's sequential sampler
    gives it): ([(loss, grad_norm)] per step, the examples)."""
    block = type(transformers.AutoModel.from_pretrained(model_dir).layers[0]).__name__  # model.block_name's class
    config = make_config(
        f"local_run_dir={run_dir}",
        f"model.name_or_path={model_dir}",
        "model.random_init=false",
        f"model.block_name={block}",
        f"datasets=[{data_dir}]",
        f"batch_size={len(our_rows(case))}",
        f"eval_batch_size={len(our_rows(case))}",
        f"max_length={MAX_LENGTH}",
        f"max_prompt_length={MAX_PROMPT_LENGTH}",
        f"lr={LR}",
        "warmup_steps=0",
        f"max_grad_norm={MAX_GRAD_NORM}",
        f"+optimizer_kwargs.eps={ADAM_EPS}",
        "+optimizer_kwargs.weight_decay=0.0",
        "reference_cache=false",
        *case.ours,
    )
    trainer = build_trainer(config)
    examples = trainer.data.train_examples.take(range(len(trainer.data.train_examples)))
    steps = []
    mean = lambda values: sum(values) / len(values)  # noqa: E731
    routers = trainer.batch_loss.routers
    for _ in range(STEPS):
        metrics = trainer.train_step(examples)
        loss = mean(metrics["loss/train"])
        if routers is not None:  # what TRL's `loss` holds besides the objective's: the weighted router loss
            loss += routers.coefficient * mean(metrics["aux_loss/train"])
        steps.append((loss, metrics["grad_norm"][0]))
    return steps, examples


# -------------------------------------------------------------------------------------------------------------
# What both trained on


def ids(values) -> tuple[int, ...]:
    return tuple(int(value) for value in values)


def assert_same_token_ids(case: Case, trl_trainer, examples: list[dict]) -> None:
    """TRL's tokenized rows hold exactly our examples' ids (prompt and responses, EOS included); for KTO also its
    mismatched (prompt, completion) pairs are ours (core.step.mismatched), as a multiset."""
    rows = list(trl_trainer.train_dataset)
    if case.trl_trainer == "dpo":
        theirs = [(ids(r["prompt_ids"]), ids(r["chosen_ids"]), ids(r["rejected_ids"])) for r in rows]
        assert theirs == [(ids(e["prompt"]), *map(ids, e["responses"])) for e in examples]
    elif case.trl_trainer in ("cpo", "orpo"):
        theirs = [(ids(r["prompt_input_ids"]), ids(r["chosen_input_ids"]), ids(r["rejected_input_ids"])) for r in rows]
        ours = [
            (ids(e["prompt"]), *(ids(e["prompt"]) + ids(response) for response in e["responses"])) for e in examples
        ]
        assert theirs == ours
    elif case.trl_trainer == "reward":
        theirs = [(ids(r["chosen_ids"]), ids(r["rejected_ids"])) for r in rows]
        assert theirs == [tuple(ids(e["prompt"]) + ids(response) for response in e["responses"]) for e in examples]
        if case.data == "margins":
            assert [r["margin"] for r in rows] == pytest.approx([e["margin"] for e in examples])
    else:
        labelled = [
            (ids(e["prompt"]), ids(response), label)
            for e in examples
            for response, label in zip(e["responses"], [e["label"]] if "label" in e else [True, False])
        ]
        assert sorted((ids(r["prompt_ids"]), ids(r["completion_ids"]), r["label"]) for r in rows) == sorted(labelled)
        if not case.kl_estimate:
            return
        ours_kl = sorted(
            (ids(e["prompt"]), ids(r))
            for e in mismatched(examples, MAX_LENGTH, MAX_PROMPT_LENGTH)
            for r in e["responses"]
        )
        assert sorted((ids(r["prompt_ids"]), ids(r["KL_completion_ids"])) for r in rows) == ours_kl


def relative_differences(ours: list[tuple[float, float]], theirs: list[tuple[float, float]]) -> list[float]:
    """Per step, the larger relative difference of the loss and of the gradient norm."""
    return [max(abs(a - b) / abs(b) for a, b in zip(o, t)) for o, t in zip(ours, theirs)]


@pytest.mark.slow  # ~30 cases, each a TRL run and one or two of ours on a tiny model: about 2 minutes
@pytest.mark.parametrize("case", [pytest.param(case, id=name) for name, case in CASES.items()])
def test_each_loss_matches_trl_step_by_step(make_config, model_dirs, tmp_path, monkeypatch, case):
    model_dir = model_dirs(case.model, case.trl_trainer == "reward")
    data_dir = our_data(tmp_path / "data", case)
    trl_steps, trl_trainer = trl_run(case, model_dir, tmp_path / "trl")
    ours, examples = our_run(make_config, case, model_dir, data_dir, tmp_path / "ours")
    assert_same_token_ids(case, trl_trainer, examples)
    if case.kl_estimate:
        # its KL estimate counts after step 1 (at step 1 it is 0: policy = reference)
        assert all(entry["kl"] > 0 for entry in trl_trainer.state.log_history if "loss" in entry and entry["step"] > 1)
    differences = relative_differences(ours, trl_steps)
    if not case.conventions:
        assert max(differences) < RTOL, (ours, trl_steps)
        return
    # Ours agrees with TRL up to the step the documented reason predicts, and differs from it on
    first = min(CONVENTIONS[name].differs_from_step for name in case.conventions)
    assert max(differences[: first - 1], default=0.0) < RTOL, (ours, trl_steps)
    assert min(differences[first - 1 :]) > DIFFERENT, (ours, trl_steps)
    conventions = [CONVENTIONS[name] for name in case.conventions]
    if all(convention.swap_in for convention in conventions):
        # TRL's conventions swapped in, ours is TRL's at every step: the documented reasons are the whole difference
        with monkeypatch.context() as patch:
            for convention in conventions:
                convention.swap_in(patch)
            swapped, _ = our_run(make_config, case, model_dir, data_dir, tmp_path / "ours_swapped")
        assert max(relative_differences(swapped, trl_steps)) < RTOL, (swapped, trl_steps)
    else:  # the first step's losses differ by exactly what the conventions give from the initial model's log-probs
        gap = sum(convention.step_one_gap(model_dir, examples) for convention in conventions)
        assert ours[0][0] - trl_steps[0][0] == pytest.approx(gap, abs=RTOL * abs(trl_steps[0][0]))
