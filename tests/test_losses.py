"""Each loss of losses.LOSSES against its paper's formula worked out by hand, in torchtune's style: log-probs in,
exact losses out. One pair throughout: pc = -1, pr = -3, rc = rr = -2, so c = 1, r = -1, h = 2; chosen has 2 scored
tokens and rejected 4."""

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from core.heads import response_sums
from core.loss_contract import PairStats, PreferenceLoss, RatioLoss
from core.losses import (
    LOSSES,
    DiscoPOPConfig,
    DPOConfig,
    DPOPConfig,
    FDPOConfig,
    IPOConfig,
    SimPOConfig,
    SmoothedConfig,
    compute,
)
from core.objective import PreferenceObjective
from utils import UserError


def softplus(x: float) -> float:
    """log(1 + e^x) = -log sigmoid(-x)."""
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def stats(pc=-1.0, pr=-3.0, rc=-2.0, rr=-2.0, nc=2, nr=4, sc=-2.0, sr=-2.0, requires_grad=False) -> PairStats:
    """sc, sr: the policy's sums of log sum_v p_v^2 over chosen's and rejected's tokens (WPO's)."""
    policy_chosen = torch.tensor([pc], requires_grad=requires_grad)
    tensors = [torch.tensor([v]) for v in (pr, rc, rr, nc, nr, sc, sr)]
    return PairStats(policy_chosen, *tensors)


def ratio(beta, **keys):
    return RatioLoss(name="x", beta=beta, nll_weight=0.0, length_normalized=False, **keys)


def dpo_config(beta, label_smoothing=0.0, length_normalized=False):
    return DPOConfig(
        name="dpo",
        beta=beta,
        nll_weight=0.0,
        length_normalized=length_normalized,
        label_smoothing=label_smoothing,
        reference_free=False,
    )


def preset(name: str, *overrides: str):
    """The loss's config as config/loss/<name>.yaml sets it (and any overrides), built into its schema's dataclass."""
    import config

    return OmegaConf.to_object(config.load(["model=tiny", f"loss={name}", *overrides]).loss)


def loss_of(name, config, s=None, state=None):
    output = LOSSES[name].function(config.statistics(s or stats()), config, state or {})
    return output.losses.item(), output.chosen_rewards.item(), output.rejected_rewards.item()


CLOSED_FORMS = [
    # (loss, config, expected loss), each from the formula in the loss's docstring with c = 1, r = -1, h = 2
    ("dpo", dpo_config(0.5), softplus(-1)),
    ("dpo", dpo_config(0.5, label_smoothing=0.25), 0.75 * softplus(-1) + 0.25 * softplus(1)),
    # per-token: c = -1/2 + 2/2 = 0.5, r = -3/4 + 2/4 = -0.25, h = 0.75
    ("dpo", dpo_config(0.5, length_normalized=True), softplus(-0.5 * 0.75)),
    ("ipo", IPOConfig(name="ipo", beta=0.5, nll_weight=0.0, length_normalized=False, reference_free=False), 1.0),
    ("ipo", IPOConfig(name="ipo", beta=0.1, nll_weight=0.0, length_normalized=False, reference_free=False), 9.0),
    ("ipo", IPOConfig(name="ipo", beta=0.5, nll_weight=0.0, length_normalized=True, reference_free=False), 0.0625),
    ("hinge", ratio(0.25), 0.5),
    ("hinge", ratio(1.0), 0.0),
    (
        "robust",
        SmoothedConfig(name="robust", beta=0.5, nll_weight=0.0, length_normalized=False, label_smoothing=0.1),
        (0.9 * softplus(-1) - 0.1 * softplus(1)) / 0.8,
    ),
    (
        "exo_pair",
        SmoothedConfig(name="exo_pair", beta=0.5, nll_weight=0.0, length_normalized=False, label_smoothing=1e-3),
        sigmoid(1) * (math.log(sigmoid(1)) - math.log(0.999)) + sigmoid(-1) * (math.log(sigmoid(-1)) - math.log(1e-3)),
    ),
    ("nca_pair", ratio(0.5), softplus(-0.5) + 0.5 * softplus(0.5) + 0.5 * softplus(-0.5)),
    ("sppo_hard", ratio(0.5), 0.0),  # targets +-1/(2 beta) = +-1: met exactly
    ("sppo_hard", ratio(0.25), 2.0),  # (1 - 2)^2 + (-1 + 2)^2
    ("apo_zero", ratio(0.5), (1 - sigmoid(0.5)) + sigmoid(-0.5)),
    ("apo_down", ratio(0.5), sigmoid(0.5) + 1 - sigmoid(1)),
    (
        "discopop",
        DiscoPOPConfig(name="discopop", beta=0.5, nll_weight=0.0, length_normalized=False, tau=0.05),
        (1 - sigmoid(20)) * softplus(-1) + sigmoid(20) * math.exp(-1),
    ),
    # pc > rc: no penalty, DPO
    (
        "dpop",
        DPOPConfig(name="dpop", beta=0.5, nll_weight=0.0, length_normalized=False, dpop_lambda=50.0),
        softplus(-1),
    ),
]


@pytest.mark.parametrize("name,config,expected", CLOSED_FORMS, ids=[f"{c[0]}-{i}" for i, c in enumerate(CLOSED_FORMS)])
def test_closed_form(name, config, expected):
    loss, chosen_reward, rejected_reward = loss_of(name, config)
    assert loss == pytest.approx(expected, abs=1e-6)
    if not getattr(config, "length_normalized", False):
        assert (chosen_reward, rejected_reward) == pytest.approx((config.beta * 1, config.beta * -1))


def f_dpo_config(f_divergence, alpha=None, beta=0.5):
    return FDPOConfig(
        name="f_dpo", beta=beta, nll_weight=0.0, length_normalized=False, f_divergence=f_divergence, alpha=alpha
    )


# f'(u) at u = e^c = e and u = e^r = 1/e, from Table 1 of Wang et al. 2023, and the loss
# -log sigma(beta (f'(e^c) - f'(e^r))) with beta 0.5
F_DPO_CLOSED_FORMS = [
    ("reverse_kl", None, 1.0, -1.0),  # log u: DPO
    ("forward_kl", None, 1 - 1 / math.e, 1 - math.e),  # 1 - 1/u
    ("js", None, math.log(2 * math.e / (1 + math.e)), math.log(2 / (1 + math.e))),  # log(2u / (1 + u))
    ("alpha", 0.5, 2 * (1 - math.e**-0.5), 2 * (1 - math.e**0.5)),  # (1 - u^-alpha) / alpha
]


@pytest.mark.parametrize("f_divergence,alpha,f_chosen,f_rejected", F_DPO_CLOSED_FORMS)
def test_f_dpo_closed_form(f_divergence, alpha, f_chosen, f_rejected):
    loss, chosen_reward, rejected_reward = loss_of("f_dpo", f_dpo_config(f_divergence, alpha))
    assert loss == pytest.approx(softplus(-0.5 * (f_chosen - f_rejected)), abs=1e-6)
    assert (chosen_reward, rejected_reward) == pytest.approx((0.5 * f_chosen, 0.5 * f_rejected), abs=1e-6)


def test_f_dpo_reverse_kl_is_dpo_and_alpha_spans_reverse_to_forward_kl():
    s = stats(pc=-1.3, pr=-2.1, rc=-1.7, rr=-1.2)
    dpo = loss_of("dpo", dpo_config(0.5), s)[0]
    assert loss_of("f_dpo", f_dpo_config("reverse_kl"), s)[0] == dpo
    assert loss_of("f_dpo", f_dpo_config("alpha", alpha=1e-5), s)[0] == pytest.approx(dpo, abs=1e-4)
    forward_kl = loss_of("f_dpo", f_dpo_config("forward_kl"), s)[0]
    assert loss_of("f_dpo", f_dpo_config("alpha", alpha=1 - 1e-5), s)[0] == pytest.approx(forward_kl, abs=1e-4)


def test_f_dpo_stays_finite_far_below_the_reference():
    # c = -200: u^-1 = e^200 overflows float32; the exponent is capped, so the loss is large and finite
    for f_divergence, alpha in (("forward_kl", None), ("alpha", 0.5)):
        s = stats(pc=-202.0, requires_grad=True)
        output = LOSSES["f_dpo"].function(s, f_dpo_config(f_divergence, alpha), {})
        output.losses.sum().backward()
        assert torch.isfinite(output.losses).all() and output.losses.item() > 1e30
        assert torch.isfinite(s.policy_chosen.grad).all()


def test_f_dpo_refuses_an_unknown_divergence_and_an_alpha_nothing_reads():
    with pytest.raises(UserError, match="loss.f_divergence=kl is not one of: reverse_kl, forward_kl, js, alpha"):
        f_dpo_config("kl")
    with pytest.raises(UserError, match=r"^loss.f_divergence=alpha needs loss.alpha in \(0, 1\)$"):
        f_dpo_config("alpha")
    with pytest.raises(UserError, match=r"^loss.alpha=0.3 is read only with loss.f_divergence=alpha \(here js\)$"):
        f_dpo_config("js", alpha=0.3)
    with pytest.raises(UserError, match=r"^loss.alpha=1.5 must be"):
        f_dpo_config("alpha", alpha=1.5)


def test_ld_dpo_closed_form_from_token_log_probs():
    # LD-DPO (Liu et al. 2024): chosen 2 scored tokens, rejected 4, so 2 shared and a tail of 2 on rejected, weighed
    # by ld_alpha = 0.5 (the preset) in the policy's and the reference's sums alike:
    # pc = -0.5 - 0.25 = -0.75, pr = -0.5 - 0.5 + 0.5 (-1 - 2) = -2.5, rc = -2, rr = -0.5 + 0.5 (-1) = -1;
    # c = 1.25, r = -1.5, h = 2.75: loss -log sigma(0.1 x 2.75), rewards 0.125 and -0.15.
    config = preset("ld_dpo")
    assert config.tail_weight() == 0.5
    lengths = SimpleNamespace(sequence_lengths=torch.tensor([2, 4]), shared_lengths=torch.tensor([2, 2]))
    policy = response_sums(torch.tensor([-0.5, -0.25, -0.5, -0.5, -1.0, -2.0]), lengths, config.tail_weight())
    reference = response_sums(torch.tensor([-1.0, -1.0, -0.25, -0.25, -0.5, -0.5]), lengths, config.tail_weight())
    assert policy.tolist() == [-0.75, -2.5] and reference.tolist() == [-2.0, -1.0]
    loss, metrics = PreferenceObjective(config)(policy, reference, lengths.sequence_lengths, "train")
    assert loss.item() == pytest.approx(softplus(-0.275), abs=1e-7)
    assert metrics["rewards_train/chosen"].item() == pytest.approx(0.125)
    assert metrics["rewards_train/rejected"].item() == pytest.approx(-0.15)
    full = response_sums(torch.tensor([-0.5, -0.25, -0.5, -0.5, -1.0, -2.0]), lengths, 1.0)
    assert full.tolist() == [-0.75, -4.0]  # ld_alpha = 1: the plain sums, DPO


def test_a_loss_that_weighs_tails_is_not_a_weighted_term():
    # ld_alpha changes how the scorer sums every response: as one term of several it would change the others too
    keys = "beta: 0.1, nll_weight: 0, length_normalized: false, label_smoothing: 0, reference_free: false"
    with pytest.raises(UserError, match="loss.terms.ld_dpo weighs response tails for every term"):
        preset("mpo", f"+loss.terms.ld_dpo={{weight: 1.0, {keys}, ld_alpha: 0.5}}")
    assert "ld_dpo" in preset("mpo", f"+loss.terms.ld_dpo={{weight: 1.0, {keys}, ld_alpha: 1.0}}").components


def test_wpo_weighs_dpo_by_the_aligned_sampling_probability():
    # WPO (Zhou et al. 2024): w = exp((pc - sc)/nc + (pr - sr)/nr) = exp((-1 + 2)/2 + (-3 + 2)/4) = exp(1/4), detached;
    # the loss is w times DPO's, so its gradient is w times DPO's: -w beta sigma(-beta h) at beta 0.5, h = 2.
    config = preset("wpo", "loss.beta=0.5")
    assert config.reads_sum_sq() and not preset("dpo").reads_sum_sq()
    s = stats(requires_grad=True)
    output = compute(config, s, {})
    weight = math.exp(0.25)
    assert output.losses.item() == pytest.approx(weight * softplus(-1), abs=1e-6)
    assert output.terms["wpo_weight"].item() == pytest.approx(weight)
    assert (output.chosen_rewards.item(), output.rejected_rewards.item()) == pytest.approx((0.5, -0.5))
    output.losses.sum().backward()
    assert s.policy_chosen.grad.item() == pytest.approx(-weight * 0.5 * sigmoid(-1), abs=1e-6)
    # length_normalized: the DPO term on per-token means (h = 0.75), the weight as before
    normalized = compute(preset("wpo", "loss.beta=0.5", "loss.length_normalized=true"), stats(), {})
    assert normalized.losses.item() == pytest.approx(weight * softplus(-0.375), abs=1e-6)
    # a policy sure of every token (p_t = 1, so sum p^2 = 1) has weight 1
    assert compute(config, stats(pc=0.0, pr=0.0, sc=0.0, sr=0.0), {}).terms["wpo_weight"].item() == 1.0


# (pc, pr, rc, rr): policy margins x = pc - pr = 2, -1, 1 and reference margins y = rc - rr = 0, 3, -1; chosen
# log-ratios c = 1, -4, 1.5 and rejected r = -1, 0, -0.5
AOT_PAIRS = [(-1.0, -3.0, -2.0, -2.0), (-5.0, -4.0, -1.0, -4.0), (-1.5, -2.5, -3.0, -2.0)]


@pytest.mark.parametrize(
    "name,charges",
    [
        # sort(x) = -1, 1, 2 against sort(y) = -1, 0, 3: d = 0, 1, -1; pair 1's x sorts last, pair 2's first
        ("aot", [softplus(1), math.log(2), softplus(-1)]),
        # sort(c) = -4, 1, 1.5 against sort(r) = -1, -0.5, 0: d = -3, 1.5, 1.5
        ("aot_unpaired", [softplus(-1.5), softplus(3), softplus(-1.5)]),
    ],
)
def test_aot_matches_sorted_samples_closed_form(name, charges):
    # AOT (Melnyk et al. 2024) at beta 1: each pair is charged -log sigma(d) of the rank its x (aot) or c
    # (aot_unpaired) sorts to; the charges average to the batch loss, whose gradient they carry.
    config = preset(name, "loss.beta=1.0")
    assert config.couples_pairs() and not preset("dpo").couples_pairs()
    s = batch(*AOT_PAIRS)
    s.policy_chosen.requires_grad_()
    output = compute(config, s, {})
    assert output.losses.tolist() == pytest.approx(charges, abs=1e-6)
    output.losses.mean().backward()
    # d L / d pc of pair 1: its x (aot) sorts to d = -1, its c (aot_unpaired) to d = 1.5; l'(d) = -sigma(-d), / 3
    expected = -sigmoid(1) / 3 if name == "aot" else -sigmoid(-1.5) / 3
    assert s.policy_chosen.grad[0].item() == pytest.approx(expected, abs=1e-6)
    assert output.chosen_rewards.tolist() == pytest.approx([1.0, -4.0, 1.5])  # beta c, as DPO's


@pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
def test_aot_over_micro_batches_equals_the_whole_batch(name):
    # The batch split in micro-batches that see the whole batch detached (core.step.BatchLoss.couple) gives the same
    # per-pair charges, and the trainer's average of micro-batch means gives the whole batch's gradient.
    config = preset(name, "loss.label_smoothing=0.1")
    torch.manual_seed(0)
    columns = [torch.randn(8) * 10 for _ in range(4)] + [torch.randint(1, 9, (8,)).float() for _ in range(2)]

    def leaves():
        return [column.clone().requires_grad_(i < 2) for i, column in enumerate(columns)]

    whole = leaves()
    full = compute(config, PairStats(*whole), {})
    full.losses.mean().backward()
    split, charges = leaves(), []
    detached = PairStats(*(column.detach() for column in split))
    for positions in (torch.tensor([4, 5, 6, 7]), torch.tensor([0, 1, 2, 3])):
        part = PairStats(*(column[positions] for column in split), batch=detached, batch_positions=positions)
        output = compute(config, part, {})
        (output.losses.mean() / 2).backward()
        charges.append(output.losses.detach())
    torch.testing.assert_close(torch.cat(charges[::-1]), full.losses.detach(), rtol=0, atol=1e-6)
    for a, b in zip(split[:2], whole[:2]):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
    assert whole[0].grad.abs().min() > 0  # every pair moves


def test_kto_closed_form_on_pairs():
    # KTO (Ethayarajh et al. 2024) with c = 1, r = -1, z0 = 0.5, beta 0.5, lambda_D = 1, lambda_U = 1.5: chosen
    # 1 - sigma(0.5 (1 - 0.5)), rejected 1.5 (1 - sigma(0.5 (0.5 + 1))); the pair's loss is their mean. Its gradient
    # in pc: -beta sigma(x) sigma(-x) / 2 at x = 0.25 (z0 is a constant).
    config = preset("kto", "loss.beta=0.5", "loss.undesirable_weight=1.5")
    assert config.needs_kl_estimate() and config.needs_reference() and not preset("dpo").needs_kl_estimate()
    s = stats(requires_grad=True)
    s.kl_estimate = torch.tensor(0.5)
    output = compute(config, s, {})
    expected = ((1 - sigmoid(0.25)) + 1.5 * (1 - sigmoid(0.75))) / 2
    assert output.losses.item() == pytest.approx(expected, abs=1e-7)
    assert output.terms["kl"].item() == 0.5
    assert (output.chosen_rewards.item(), output.rejected_rewards.item()) == pytest.approx((0.5, -0.5))
    output.losses.sum().backward()
    assert s.policy_chosen.grad.item() == pytest.approx(-0.5 * sigmoid(0.25) * sigmoid(-0.25) / 2, abs=1e-7)
    # policy equal to reference, z0 = 0: every response scores 1/2, weighted
    s = stats(pc=-3.0, pr=-5.0, rc=-3.0, rr=-5.0)
    s.kl_estimate = torch.tensor(0.0)
    assert compute(config, s, {}).losses.item() == pytest.approx((0.5 + 1.5 * 0.5) / 2)


def test_apo_zero_unpaired_closed_form_on_pairs_and_on_labelled_responses():
    # APO-zero unpaired (TRL's KTO loss_type) with c = 1, r = -1, beta 0.5, lambda_D = 1, lambda_U = 1.5: chosen
    # 1 - sigma(0.5), rejected 1.5 sigma(-0.5), no reference point; the pair's loss is their mean. Its gradient in
    # pc: -beta sigma(0.5) sigma(-0.5) / 2.
    config = preset("apo_zero_unpaired", "loss.beta=0.5", "loss.undesirable_weight=1.5")
    assert config.needs_reference() and config.reads_labels() and not config.needs_kl_estimate()
    s = stats(requires_grad=True)
    output = compute(config, s, {})
    assert output.losses.item() == pytest.approx(((1 - sigmoid(0.5)) + 1.5 * sigmoid(-0.5)) / 2, abs=1e-7)
    assert output.terms is None  # no kl to log
    output.losses.sum().backward()
    assert s.policy_chosen.grad.item() == pytest.approx(-0.5 * sigmoid(0.5) * sigmoid(-0.5) / 2, abs=1e-7)
    # labelled responses one at a time: log-ratios 2 (desirable) and 2 (undesirable)
    labelled = LOSSES["apo_zero_unpaired"].labelled
    losses = labelled(torch.tensor([2.0, 2.0]), torch.tensor([True, False]), None, config)
    torch.testing.assert_close(losses, torch.tensor([1 - sigmoid(1.0), 1.5 * sigmoid(1.0)]), rtol=0, atol=1e-7)


def test_dpop_penalises_chosen_below_the_reference():
    # pc = -2.5 < rc = -2: c = -0.5, r = -1, h = 0.5, penalty 50 x 0.5; -log sigma(0.5 (0.5 - 25))
    config = DPOPConfig(name="dpop", beta=0.5, nll_weight=0.0, length_normalized=False, dpop_lambda=50.0)
    assert loss_of("dpop", config, stats(pc=-2.5))[0] == pytest.approx(softplus(12.25), rel=1e-6)


def test_bco_pair_shifts_rewards_by_the_running_mean():
    # beta c = 0.5, beta r = -0.5, delta = 0.2: -log sigma(0.3) - log sigma(0.7)
    loss = loss_of("bco_pair", ratio(0.5), state={"reward_mean": 0.2})[0]
    assert loss == pytest.approx(softplus(-0.3) + softplus(-0.7), abs=1e-6)
    objective = PreferenceObjective(preset("bco_pair"))
    objective.observe({"rewards_train/chosen": [1.0, 2.0], "rewards_train/rejected": [3.0, 2.0]})
    assert objective.state["reward_mean"] == pytest.approx(2.0)
    objective.observe({"rewards_train/chosen": [0.0], "rewards_train/rejected": [0.0]})
    assert objective.state["reward_mean"] == pytest.approx(8 / 6)  # every reward seen counts once


def test_reference_free_losses_read_only_the_policy():
    # SimPO: per-token means -1/2 and -3/4; beta (mc - mr) - gamma = 2 x 0.25 - 0.5 = 0, so ln 2.
    simpo = SimPOConfig(name="simpo", beta=2.0, nll_weight=0.0, gamma=0.5)
    loss, chosen_reward, rejected_reward = loss_of("simpo", simpo)
    assert loss == pytest.approx(math.log(2), abs=1e-7) and (chosen_reward, rejected_reward) == (-1.0, -1.5)
    # ORPO: NLL 1/2 plus beta x -log sigma(log odds(-1/2) - log odds(-3/4)), log odds(m) = m - log(1 - e^m)
    orpo = PreferenceLoss(name="orpo", beta=0.1, nll_weight=0.0)
    log_odds = [m - math.log(1 - math.exp(m)) for m in (-0.5, -0.75)]
    assert loss_of("orpo", orpo)[0] == pytest.approx(0.5 + 0.1 * softplus(-(log_odds[0] - log_odds[1])), abs=1e-6)
    # CPO's preference term: -log sigma(beta (pc - pr)) = softplus(-0.5 x 2)
    cpo = PreferenceLoss(name="cpo", beta=0.5, nll_weight=1.0)
    assert loss_of("cpo", cpo)[0] == pytest.approx(softplus(-1), abs=1e-7)
    for config in (simpo, orpo, cpo):  # the reference log-probs play no part
        assert loss_of(config.name, config, stats(rc=5.0, rr=-9.0))[0] == loss_of(config.name, config)[0]
        assert not config.needs_reference()


def test_nll_weight_adds_the_chosen_per_token_nll():
    # RPO: DPO + 0.5 x (1 / 2) with pc = -1 over 2 tokens
    config = dpo_config(0.5)
    config.nll_weight = 0.5
    objective = PreferenceObjective(config)
    loss, metrics = objective(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0]), torch.tensor([2, 4]), "train")
    assert loss.item() == pytest.approx(softplus(-1) + 0.25, abs=1e-6)
    assert metrics["nll/train"].item() == pytest.approx(0.5)


def test_label_smoothing_symmetry():
    # Swapping chosen and rejected with eps -> 1 - eps gives the same loss; at eps = 1/2 the order is irrelevant.
    pair, swapped = stats(-1.3, -2.9, -2.2, -1.7), stats(-2.9, -1.3, -1.7, -2.2)
    for eps in (0.1, 0.3):
        a = loss_of("dpo", dpo_config(0.7, eps), pair)[0]
        b = loss_of("dpo", _smoothed(0.7, 1 - eps), swapped)[0]
        assert a == pytest.approx(b, abs=1e-6)
    assert loss_of("dpo", dpo_config(0.7, 0.5), pair)[0] == pytest.approx(
        loss_of("dpo", dpo_config(0.7, 0.5), swapped)[0]
    )
    assert loss_of("dpo", dpo_config(0.7), pair)[0] != pytest.approx(loss_of("dpo", dpo_config(0.7), swapped)[0])


def _smoothed(beta, eps):
    """A DPO config with eps above 1/2, which the schema refuses: only to state the symmetry."""
    config = dpo_config(beta)
    config.label_smoothing = eps
    return config


REFERENCE_LOSSES = [name for name, c in LOSSES.items() if c.function and issubclass(c.schema, RatioLoss)]


def test_ln2_and_zero_rewards_when_policy_equals_reference():
    same = stats(pc=-12.5, pr=-3.25, rc=-12.5, rr=-3.25)
    assert loss_of("dpo", dpo_config(0.1), same)[0] == pytest.approx(math.log(2), abs=1e-7)
    for name in REFERENCE_LOSSES:  # every reference-based loss, as its YAML sets it: zero rewards at step one
        assert loss_of(name, preset(name), same)[1:] == (0.0, 0.0), name


GRADIENTS = [
    # d loss / d pc at c = 1, r = -1, h = 2, from differentiating each formula by hand
    ("dpo", dpo_config(0.5), -0.5 * sigmoid(-1)),
    ("ipo", IPOConfig(name="ipo", beta=0.5, nll_weight=0.0, length_normalized=False, reference_free=False), 2 * 1.0),
    ("hinge", ratio(0.25), -0.25),
    ("sppo_hard", ratio(0.25), 2 * (1 - 2)),
    ("apo_zero", ratio(0.5), -0.5 * sigmoid(0.5) * sigmoid(-0.5)),
    # f-DPO: -sigma(-x) beta f'' where x = beta (f'(e^c) - f'(e^r)) and f'' = d f'(e^c) / dc
    ("f_dpo", f_dpo_config("js"), -sigmoid(-0.5) * 0.5 * sigmoid(-1)),  # f' = log 2 + log sigma(c), x = 0.5
    ("f_dpo", f_dpo_config("forward_kl"), -sigmoid(-math.sinh(1)) * 0.5 * math.exp(-1)),  # f' = 1 - e^-c
]


@pytest.mark.parametrize("name,config,expected", GRADIENTS, ids=[f"{g[0]}-{i}" for i, g in enumerate(GRADIENTS)])
def test_gradient_closed_form(name, config, expected):
    s = stats(requires_grad=True)
    output = LOSSES[name].function(s, config, {})
    output.losses.sum().backward()
    assert s.policy_chosen.grad.item() == pytest.approx(expected, abs=1e-6)
    assert not output.chosen_rewards.requires_grad


def test_weighted_terms_add_up_and_are_logged():
    # MPO's preset: 0.8 DPO + 0.2 BCO (delta 0) + 1.0 NLL, with beta 0.1 for both preference terms
    mpo = preset("mpo")
    loss, chosen_reward, rejected_reward = loss_of("weighted", mpo)
    dpo, bco, nll = softplus(-0.2), softplus(-0.1) + softplus(-0.1), 0.5
    assert loss == pytest.approx(0.8 * dpo + 0.2 * bco + 1.0 * nll, abs=1e-6)
    assert (chosen_reward, rejected_reward) == pytest.approx((0.1, -0.1))  # the first term's (DPO's) rewards
    output = LOSSES["weighted"].function(stats(), mpo, {})
    assert {name: value.item() for name, value in output.terms.items()} == pytest.approx(
        {"loss_dpo": dpo, "loss_bco_pair": bco, "loss_nll": nll}
    )
    assert mpo.needs_reference() and PreferenceObjective(mpo).state == {"reward_mean": 0.0, "rewards_seen": 0}


def test_a_weighted_term_keeps_its_own_nll_weight():
    # The dpo term with nll_weight 0.5 adds 0.8 x 0.5 x (1 / 2) to MPO's loss, and logs it inside loss_dpo.
    mpo = preset("mpo")
    plain = loss_of("weighted", mpo)[0]
    mpo.components["dpo"][1].nll_weight = 0.5
    output = LOSSES["weighted"].function(stats(), mpo, {})
    assert output.losses.item() == pytest.approx(plain + 0.8 * 0.5 * 0.5, abs=1e-6)
    assert output.terms["loss_dpo"].item() == pytest.approx(softplus(-0.2) + 0.25, abs=1e-6)


def batch(*pairs) -> PairStats:
    """PairStats of several pairs (pc, pr, rc, rr), one scored token each: length plays no part in DPO."""
    columns = [torch.tensor(column) for column in zip(*pairs)]
    return PairStats(*columns, torch.ones(len(pairs)), torch.ones(len(pairs)))


def test_dpo_reproduces_torchtune():
    # torchtune's tests/torchtune/rlhf/loss/test_dpo_loss.py (test_dpo_loss), beta 0.1, no label smoothing:
    # pc = [-0.5, -10, -1], pr = [-0.1, -30, -21], rc = [-0.5, -10.1, -0.1], rr = [-0.1, -20.1, -0.1].
    # c = pc - rc = [0, 0.1, -0.9], r = pr - rr = [0, -9.9, -20.9], h = [0, 10, 20], beta h = [0, 1, 2];
    # -log sigma(beta h) = [ln 2, ln(1 + 1/e), ln(1 + 1/e^2)] = [0.693147, 0.313262, 0.126928].
    s = batch((-0.5, -0.1, -0.5, -0.1), (-10.0, -30.0, -10.1, -20.1), (-1.0, -21.0, -0.1, -0.1))
    output = compute(dpo_config(0.1), s, {})
    assert output.losses.tolist() == pytest.approx([0.693147, 0.313262, 0.126928], abs=1e-5)
    # beta c and beta r: the rewards torchtune's KTO test in the same file lists for these inputs
    assert output.chosen_rewards.tolist() == pytest.approx([0.0, 0.01, -0.09], abs=1e-6)
    assert output.rejected_rewards.tolist() == pytest.approx([0.0, -0.99, -2.09], abs=1e-6)


# (pc, pr, rc, rr), all multiples of 1/8 so that float32 holds them and their margins exactly
SWEEP_PAIRS = [
    (-1.0, -3.0, -2.0, -2.0),  # h = 2
    (-12.5, -9.75, -11.0, -14.25),  # c = -1.5, r = 4.5: h = -6, the policy has moved towards rejected
    (-4.25, -4.25, -4.25, -4.25),  # h = 0: policy equals reference
    (-7.125, -8.0, -7.0, -8.0),  # h = -0.125
    (-20.0, -45.5, -22.5, -30.0),  # c = 2.5, r = -15.5: h = 18
]


def cdpo(beta: float, eps: float, h: float) -> float:
    """Sigmoid DPO with label smoothing (cDPO, Mitchell 2023), in plain floats:
    -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)."""
    return -(1 - eps) * math.log(sigmoid(beta * h)) - eps * math.log(sigmoid(-beta * h))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.2, 0.3])
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 1.0])
def test_dpo_sweep_matches_the_cdpo_formula(beta, eps):
    output = compute(dpo_config(beta, eps), batch(*SWEEP_PAIRS), {})
    margins = [(pc - rc) - (pr - rr) for pc, pr, rc, rr in SWEEP_PAIRS]
    assert output.losses.tolist() == pytest.approx([cdpo(beta, eps, h) for h in margins], rel=1e-6, abs=1e-6)
    assert output.chosen_rewards.tolist() == pytest.approx([beta * (pc - rc) for pc, _, rc, _ in SWEEP_PAIRS])
    assert output.rejected_rewards.tolist() == pytest.approx([beta * (pr - rr) for _, pr, _, rr in SWEEP_PAIRS])
