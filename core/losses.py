"""Preference losses as components. Each `loss=<name>` is a registry entry here: a config dataclass (its keys,
checked by itself; values and comments in config/loss/<name>.yaml) and a function from per-pair statistics to
per-pair losses and rewards. objective.py applies them; nothing else knows a loss by name. What every loss reads
and returns, and the keys its config extends, are loss_contract.py's.

Notation, all [B] float32, one entry per pair: pc, pr = the policy's summed log-probs of chosen and rejected;
rc, rr = the reference's (zeros without a reference); nc, nr = their numbers of scored tokens; sc, sr = the sums
over their tokens of the policy's log sum_v p_v^2 (only for a loss that reads them: WPO). Log-ratios
c = pc - rc and r = pr - rr, h = c - r; sigma is the logistic function. Rewards are beta * c and beta * r unless a
loss defines its own, always detached: they are metrics, not loss terms.
"""

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from core.loss_contract import LossKeys, LossOutput, PairLossNeeds, PairStats, PreferenceLoss, RatioLoss
from utils import NON_NEGATIVE, POSITIVE, Range, UserError, ranged


def rewards(stats: PairStats, beta: float, losses: torch.Tensor, **terms) -> LossOutput:
    """LossOutput with the usual rewards beta * c and beta * r."""
    chosen, rejected = beta * stats.chosen_logratio.detach(), beta * stats.rejected_logratio.detach()
    return LossOutput(losses, chosen, rejected, terms or None)


def chosen_nll(stats: PairStats) -> torch.Tensor:
    """[B] per-token negative log-likelihood of each chosen response: -pc / nc."""
    return -stats.policy_chosen / stats.chosen_tokens.clamp(min=1)


# -------------------------------------------------------------------------------------------------------------
# Configs of the losses, on the keys every pair loss or log-ratio loss has (loss_contract.PreferenceLoss, RatioLoss).


@dataclass
class DPOConfig(RatioLoss):
    label_smoothing: float = ranged(Range(0, 0.5))
    reference_free: bool = MISSING  # a uniform reference: zeros for rc and rr, and no reference model


@dataclass
class LDDPOConfig(DPOConfig):
    """LD-DPO: DPO on length-desensitized log-probs (heads.response_sums), policy and reference alike."""

    ld_alpha: float = ranged(Range(0, 1))  # 1: DPO; 0: only the tokens within the shorter response count

    def tail_weight(self) -> float:
        return self.ld_alpha


@dataclass
class WPOConfig(DPOConfig):
    """WPO: DPO with each pair weighted by the policy's probability of sampling it (wpo)."""

    def reads_sum_sq(self) -> bool:
        return True

    def statistics(self, stats: PairStats) -> PairStats:
        return stats  # the weight needs the sums; wpo applies length_normalized to the DPO term itself


@dataclass
class AOTConfig(RatioLoss):
    """AOT: the pairs of a batch matched by rank (aot)."""

    label_smoothing: float = ranged(Range(0, 0.5))

    def couples_pairs(self) -> bool:
        return True


@dataclass
class UnpairedConfig(PreferenceLoss):
    """A loss on responses labelled desirable or not, one at a time (apo_zero_unpaired; kto adds a reference
    point): on pairs, chosen desirable and rejected undesirable."""

    desirable_weight: float = ranged(POSITIVE)  # lambda_D
    undesirable_weight: float = ranged(POSITIVE)  # lambda_U

    def needs_reference(self) -> bool:
        return True

    def reads_labels(self) -> bool:
        return True


@dataclass
class KTOConfig(UnpairedConfig):
    """KTO: an unpaired loss around the batch's reference point z0 (kto)."""

    def needs_kl_estimate(self) -> bool:
        return True


@dataclass
class IPOConfig(RatioLoss):
    reference_free: bool = MISSING


@dataclass
class SmoothedConfig(RatioLoss):
    """Losses with an assumed rate of flipped labels below one half."""

    label_smoothing: float = ranged(Range(0, 0.5, low_open=True, high_open=True))


@dataclass
class DiscoPOPConfig(RatioLoss):
    tau: float = ranged(POSITIVE)


@dataclass
class DPOPConfig(RatioLoss):
    dpop_lambda: float = ranged(NON_NEGATIVE)


F_DIVERGENCES = ("reverse_kl", "forward_kl", "js", "alpha")


@dataclass
class FDPOConfig(RatioLoss):
    f_divergence: str = MISSING  # one of F_DIVERGENCES
    # the alpha divergence's parameter (Table 1's), which only it reads
    alpha: Optional[float] = ranged(Range(0, 1, low_open=True, high_open=True, null="unless f_divergence=alpha"))

    def __post_init__(self):
        super().__post_init__()
        if self.f_divergence not in F_DIVERGENCES:
            raise UserError(f"loss.f_divergence={self.f_divergence} is not one of: {', '.join(F_DIVERGENCES)}")
        if (self.alpha is None) == (self.f_divergence == "alpha"):
            raise UserError(
                "loss.f_divergence=alpha needs loss.alpha in (0, 1)"
                if self.alpha is None
                else f"loss.alpha={self.alpha} is read only with loss.f_divergence=alpha (here {self.f_divergence})"
            )


@dataclass
class SimPOConfig(PreferenceLoss):
    gamma: float = ranged(Range())  # the target margin: any finite number


@dataclass
class SFTConfig(LossKeys):
    """Supervised fine-tuning on each prompt's sft_target (objective.SFTObjective; not a pair loss)."""


@dataclass
class RewardConfig(LossKeys):
    """Reward modelling (objective.RewardObjective; not a pair loss on log-probs): a scalar-head model trained with
    the Bradley-Terry loss (bradley_terry)."""

    center_rewards_coefficient: float = ranged(NON_NEGATIVE)


@dataclass
class NLLConfig(PairLossNeeds):
    """The chosen response's per-token NLL on pair data: SFT as a term of a weighted loss (TRL's "sft" term)."""


@dataclass
class WeightedConfig(PairLossNeeds):
    """A weighted sum of pair losses, e.g. MPO (Wang et al. 2024, arXiv:2411.10442). `terms` maps each loss name to
    {weight: w, and that loss's own keys}; each term is checked by its own schema."""

    terms: dict[str, Any] = MISSING

    def __post_init__(self):
        super().__post_init__()
        self.components = {}  # name -> (weight, the term's config dataclass)
        for term, values in self.terms.items():
            if term not in LOSSES or LOSSES[term].function is None or LOSSES[term].schema is WeightedConfig:
                pair_losses = [n for n, c in LOSSES.items() if c.function and c.schema is not WeightedConfig]
                raise UserError(f"loss.terms.{term} is not a pair loss; valid: {', '.join(pair_losses)}")
            values = dict(values)
            weight = values.pop("weight", None)
            if not POSITIVE.admits(weight):
                raise UserError(f"loss.terms.{term}.weight={weight} must be a positive number")
            try:
                schema = OmegaConf.structured(LOSSES[term].schema)
                config = OmegaConf.to_object(OmegaConf.merge(schema, {**values, "name": term}))
            except (OmegaConfBaseException, UserError) as error:
                raise UserError(f"loss.terms.{term}: {str(error).splitlines()[0]}") from None
            if config.tail_weight() != 1.0:  # it changes how every term's log-probs are summed
                raise UserError(f"loss.terms.{term} weighs response tails for every term: use loss={term} alone")
            self.components[term] = (float(weight), config)

    def needs_reference(self) -> bool:
        return any(config.needs_reference() for _, config in self.components.values())

    # statistics: each term applies its own; tail_weight stays 1: no term may change it (__post_init__); nor does it
    # read labels (its other terms need pairs)

    def reads_sum_sq(self) -> bool:
        return any(config.reads_sum_sq() for _, config in self.components.values())

    def couples_pairs(self) -> bool:
        return any(config.couples_pairs() for _, config in self.components.values())

    def needs_kl_estimate(self) -> bool:
        return any(config.needs_kl_estimate() for _, config in self.components.values())


# -------------------------------------------------------------------------------------------------------------
# Losses: (stats, config, state) -> LossOutput. `state` is the objective's running state (see bco_pair).


def dpo(s: PairStats, cfg: DPOConfig, state: dict) -> LossOutput:
    """DPO (Rafailov et al. 2023, arXiv:2305.18290, eq. 7): -log sigma(beta h). With label_smoothing eps > 0,
    conservative DPO (Mitchell 2023): -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)."""
    x, eps = cfg.beta * s.margin, cfg.label_smoothing
    return rewards(s, cfg.beta, -(1 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x))


def wpo(s: PairStats, cfg: WPOConfig, state: dict) -> LossOutput:
    """WPO (Zhou et al. 2024, arXiv:2406.11827): off-policy pairs reweighted towards on-policy ones, DPO's loss
    times w(chosen) w(rejected), detached. w(y) = exp(mean over y's tokens of log(p_t / sum_v p_v^2)): each token's
    probability relative to sum_v p_v^2, the expected probability of a token the policy samples itself (the
    paper's weight alignment, as TRL 1.16 computes it), so w = exp((pc - sc) / nc) for chosen, likewise for
    rejected. Logged as `wpo_weight`."""
    nc, nr = s.chosen_tokens.clamp(min=1), s.rejected_tokens.clamp(min=1)
    log_weight = (s.policy_chosen - s.chosen_log_sum_sq) / nc + (s.policy_rejected - s.rejected_log_sum_sq) / nr
    weight = log_weight.detach().exp()
    output = dpo(s.per_token() if cfg.length_normalized else s, cfg, state)
    output.losses = weight * output.losses
    output.terms = {"wpo_weight": weight}
    return output


def aot(s: PairStats, cfg: AOTConfig, state: dict) -> LossOutput:
    """AOT for paired data (Melnyk et al. 2024, arXiv:2406.05882): distributional alignment by optimal transport in
    one dimension, which matches sorted samples: the policy's margins pc - pr of the batch, sorted, each against the
    reference margin rc - rr of the same rank, under cDPO's loss: with d_k = sort(pc - pr)_k - sort(rc - rr)_k,
    mean_k -(1 - eps) log sigma(beta d_k) - eps log sigma(-beta d_k). (TRL 1.16's `aot`.)"""
    batch, positions = s.whole_batch()
    own = s.policy_chosen - s.policy_rejected
    x = (batch.policy_chosen - batch.policy_rejected).index_put((positions,), own)
    y = batch.reference_chosen - batch.reference_rejected
    return rewards(s, cfg.beta, sorted_match_losses(x, y, positions, cfg))


def aot_unpaired(s: PairStats, cfg: AOTConfig, state: dict) -> LossOutput:
    """AOT for unpaired data (Melnyk et al. 2024, arXiv:2406.05882): the chosen log-ratios c of the batch, sorted,
    each against the rejected log-ratio r of the same rank: d_k = sort(c)_k - sort(r)_k, under cDPO's loss as in
    aot. (TRL 1.16's `aot_unpaired`.)"""
    batch, positions = s.whole_batch()
    x = batch.chosen_logratio.index_put((positions,), s.chosen_logratio)
    y = batch.rejected_logratio.index_put((positions,), s.rejected_logratio)
    return rewards(s, cfg.beta, sorted_match_losses(x, y, positions, cfg))


def sorted_match_losses(x: torch.Tensor, y: torch.Tensor, positions: torch.Tensor, cfg: AOTConfig) -> torch.Tensor:
    """[B] per-pair losses of the batch loss L = mean_k l(beta (sort(x)_k - sort(y)_k)), l cDPO's, for the B pairs at
    `positions` of the batch's G; x, y: [G], live (differentiable) at those positions and detached elsewhere.

    Each pair is charged the term of the rank its x sorts to (a permutation: the G charges average to L). Its
    gradient is that of L through these pairs' entries, scaled by G / B: the trainer averages micro-batch means
    over micro-batches and ranks, so summed it gives exactly the gradient of L, for any accumulation and rank
    count (stable sorts: every rank ranks ties alike)."""
    x_sorted, x_order = torch.sort(x, stable=True)
    d = cfg.beta * (x_sorted - torch.sort(y, stable=True).values)
    eps = cfg.label_smoothing
    terms = -(1 - eps) * F.logsigmoid(d) - eps * F.logsigmoid(-d)  # [G]
    rank = torch.empty_like(x_order).scatter_(0, x_order, torch.arange(x.numel(), device=x.device))
    surrogate = terms.mean() * (x.numel() / positions.numel())
    return terms.detach()[rank[positions]] + (surrogate - surrogate.detach())


def kto_losses(logratios: torch.Tensor, desirable: torch.Tensor, kl_estimate: torch.Tensor, cfg: KTOConfig):
    """KTO (Ethayarajh et al. 2024, arXiv:2402.01306), [N] losses of labelled responses (desirable: [N] bool) from
    their log-ratios r = log pi / pi_ref: lambda_y - v, with v = lambda_D sigma(beta (r - z0)) for a desirable
    response and lambda_U sigma(beta (z0 - r)) for an undesirable one; z0 the batch's KL estimate (detached)."""
    if kl_estimate is None:
        raise ValueError("kto reads the batch's KL estimate (PairStats.kl_estimate)")
    desired = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * (logratios - kl_estimate)))
    undesired = cfg.undesirable_weight * (1 - torch.sigmoid(cfg.beta * (kl_estimate - logratios)))
    return torch.where(desirable, desired, undesired)


def apo_zero_unpaired_losses(logratios: torch.Tensor, desirable: torch.Tensor, kl_estimate, cfg: UnpairedConfig):
    """APO-zero on labelled responses (D'Oosterlinck et al. 2024, arXiv:2408.06266; TRL's KTO loss_type
    apo_zero_unpaired), [N] from [N]: raise each desirable response's likelihood, lambda_D (1 - sigma(beta r)), and
    lower each undesirable one's, lambda_U sigma(beta r). No reference point (kl_estimate is not read)."""
    raised = cfg.desirable_weight * (1 - torch.sigmoid(cfg.beta * logratios))
    return torch.where(desirable, raised, cfg.undesirable_weight * torch.sigmoid(cfg.beta * logratios))


def unpaired(s: PairStats, cfg: UnpairedConfig, state: dict) -> LossOutput:
    """A loss on labelled responses (LossComponent.labelled) on pairs: the chosen response desirable, the rejected
    undesirable, each pair's loss the mean of their two, so that the mean over pairs is the mean over responses (as
    KTO's). kto's reference point z0 = max(0, mean log-ratio of mismatched prompt and response pairs of the whole
    batch) (step.BatchLoss.kl_estimate) is logged as `kl`."""
    n = s.chosen_logratio.numel()
    logratios = torch.cat([s.chosen_logratio, s.rejected_logratio])
    desirable = torch.arange(2 * n, device=logratios.device) < n
    losses = LOSSES[cfg.name].labelled(logratios, desirable, s.kl_estimate, cfg).view(2, n).mean(0)
    terms = {"kl": s.kl_estimate.expand_as(losses)} if s.kl_estimate is not None else {}
    return rewards(s, cfg.beta, losses, **terms)


def ipo(s: PairStats, cfg: IPOConfig, state: dict) -> LossOutput:
    """IPO (Azar et al. 2023, arXiv:2310.12036, eq. 17): (h - 1 / (2 beta))^2."""
    return rewards(s, cfg.beta, (s.margin - 1 / (2 * cfg.beta)) ** 2)


def hinge(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """SLiC's calibration loss (Zhao et al. 2023, arXiv:2305.10425): max(0, 1 - beta h)."""
    return rewards(s, cfg.beta, torch.relu(1 - cfg.beta * s.margin))


def robust(s: PairStats, cfg: SmoothedConfig, state: dict) -> LossOutput:
    """Robust DPO (Chowdhury et al. 2024, arXiv:2403.00409): the unbiased loss under label-flip rate eps,
    ((1 - eps)(-log sigma(beta h)) + eps log sigma(-beta h)) / (1 - 2 eps)."""
    x, eps = cfg.beta * s.margin, cfg.label_smoothing
    return rewards(s, cfg.beta, (-(1 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1 - 2 * eps))


def exo_pair(s: PairStats, cfg: SmoothedConfig, state: dict) -> LossOutput:
    """EXO for pairs (Ji et al. 2024, arXiv:2402.00856): the reverse KL from the policy's pairwise preference
    sigma(beta h) to the smoothed target (1 - eps, eps):
    sigma(beta h) (log sigma(beta h) - log(1 - eps)) + sigma(-beta h) (log sigma(-beta h) - log eps)."""
    x, eps = cfg.beta * s.margin, cfg.label_smoothing
    losses = torch.sigmoid(x) * (F.logsigmoid(x) - math.log(1 - eps))
    losses = losses + torch.sigmoid(-x) * (F.logsigmoid(-x) - math.log(eps))
    return rewards(s, cfg.beta, losses)


def nca_pair(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """NCA for pairs (Chen et al. 2024, arXiv:2402.05369): absolute rather than relative likelihood,
    -log sigma(beta c) - 1/2 log sigma(-beta c) - 1/2 log sigma(-beta r)."""
    c, r = cfg.beta * s.chosen_logratio, cfg.beta * s.rejected_logratio
    return rewards(s, cfg.beta, -F.logsigmoid(c) - 0.5 * F.logsigmoid(-c) - 0.5 * F.logsigmoid(-r))


def bco_pair(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """BCO for pairs (Jung et al. 2024, arXiv:2404.04656): each response classified on its own reward against a
    shift delta, -log sigma(beta c - delta) - log sigma(-(beta r - delta)). delta is the running mean of all
    rewards of the steps before this one (objective.PreferenceObjective.observe), so that it is the same whatever
    the accumulation and the number of ranks."""
    delta = state.get("reward_mean", 0.0)
    c, r = cfg.beta * s.chosen_logratio, cfg.beta * s.rejected_logratio
    return rewards(s, cfg.beta, -F.logsigmoid(c - delta) - F.logsigmoid(-(r - delta)))


def sppo_hard(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """SPPO with hard labels (Wu et al. 2024, arXiv:2405.00675): the chosen log-ratio regressed to 1/(2 beta) and the
    rejected one to -1/(2 beta): (c - 1/(2 beta))^2 + (r + 1/(2 beta))^2."""
    target = 1 / (2 * cfg.beta)
    return rewards(s, cfg.beta, (s.chosen_logratio - target) ** 2 + (s.rejected_logratio + target) ** 2)


def apo_zero(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """APO-zero (D'Oosterlinck et al. 2024, arXiv:2408.06266), for chosen better than the policy: raise chosen and
    lower rejected likelihood, (1 - sigma(beta c)) + sigma(beta r)."""
    c, r = cfg.beta * s.chosen_logratio, cfg.beta * s.rejected_logratio
    return rewards(s, cfg.beta, (1 - torch.sigmoid(c)) + torch.sigmoid(r))


def apo_down(s: PairStats, cfg: RatioLoss, state: dict) -> LossOutput:
    """APO-down (D'Oosterlinck et al. 2024, arXiv:2408.06266), for chosen worse than the policy: lower both, rejected
    more, sigma(beta c) + (1 - sigma(beta h))."""
    return rewards(s, cfg.beta, torch.sigmoid(cfg.beta * s.chosen_logratio) + (1 - torch.sigmoid(cfg.beta * s.margin)))


def discopop(s: PairStats, cfg: DiscoPOPConfig, state: dict) -> LossOutput:
    """DiscoPOP, the log-ratio modulated loss (Chris Lu et al. 2024, arXiv:2406.08414): with x = beta h and
    m = sigma(x / tau), (1 - m) (-log sigma(x)) + m exp(-x)."""
    x = cfg.beta * s.margin
    modulation = torch.sigmoid(x / cfg.tau)
    return rewards(s, cfg.beta, (1 - modulation) * -F.logsigmoid(x) + modulation * torch.exp(-x))


def dpop(s: PairStats, cfg: DPOPConfig, state: dict) -> LossOutput:
    """DPO-Positive (Pal et al. 2024, arXiv:2402.13228, eq. 3): the chosen likelihood may not fall below the
    reference's, -log sigma(beta (h - lambda max(0, rc - pc)))."""
    penalty = cfg.dpop_lambda * torch.relu(s.reference_chosen - s.policy_chosen)
    return rewards(s, cfg.beta, -F.logsigmoid(cfg.beta * (s.margin - penalty)))


EXPONENT_CAP = 80.0  # exp(80) ~ 5.5e34 stays finite in float32 (largest ~3.4e38); TRL caps its alpha divergence so


def f_dpo(s: PairStats, cfg: FDPOConfig, state: dict) -> LossOutput:
    """f-DPO (Wang et al. 2023, arXiv:2309.16240, Theorem 1 and Table 1): DPO with the reverse KL regulariser
    replaced by an f-divergence, whose reward is beta f'(u) of the ratio u = exp(c):
    -log sigma(beta (f'(e^c) - f'(e^r))), rewards beta f'(e^c) and beta f'(e^r) (0 where u = 1, as DPO's).
    f'(u) is log u (reverse_kl: DPO), 1 - 1/u (forward_kl), log(2u / (1 + u)) = log 2 + log sigma(log u) (js), and
    (1 - u^-alpha) / alpha (alpha, 0 < alpha < 1; alpha -> 0 is reverse KL, alpha -> 1 forward KL; TRL's
    f_alpha_divergence_coef is 1 - alpha). Exponents are capped at EXPONENT_CAP so that a ratio far below the
    reference's gives a large finite loss, not inf."""

    def f_prime(logratio: torch.Tensor) -> torch.Tensor:
        if cfg.f_divergence == "reverse_kl":
            return logratio
        if cfg.f_divergence == "forward_kl":
            return -torch.expm1((-logratio).clamp(max=EXPONENT_CAP))  # 1 - 1/u without cancellation near u = 1
        if cfg.f_divergence == "js":
            return math.log(2) + F.logsigmoid(logratio)
        return -torch.expm1((-cfg.alpha * logratio).clamp(max=EXPONENT_CAP)) / cfg.alpha

    chosen, rejected = cfg.beta * f_prime(s.chosen_logratio), cfg.beta * f_prime(s.rejected_logratio)
    return LossOutput(-F.logsigmoid(chosen - rejected), chosen.detach(), rejected.detach())


def simpo(s: PairStats, cfg: SimPOConfig, state: dict) -> LossOutput:
    """SimPO (Meng et al. 2024, arXiv:2405.14734, eq. 6), reference-free on per-token means m = p / n:
    -log sigma(beta (mc - mr) - gamma). Rewards beta * mc and beta * mr."""
    t = s.per_token()
    losses = -F.logsigmoid(cfg.beta * (t.policy_chosen - t.policy_rejected) - cfg.gamma)
    return LossOutput(losses, cfg.beta * t.policy_chosen.detach(), cfg.beta * t.policy_rejected.detach())


def orpo(s: PairStats, cfg: PreferenceLoss, state: dict) -> LossOutput:
    """ORPO (Hong et al. 2024, arXiv:2403.07691, eqs. 6-7): the chosen NLL plus beta (the paper's lambda) times
    -log sigma(log odds(chosen) - log odds(rejected)), odds(y) = m / (1 - m) of the per-token mean probability
    exp(mean log-prob). Rewards beta * mean log-probs."""
    t = s.per_token()

    def log_odds(mean_logps):
        return mean_logps - torch.log1p(-torch.exp(mean_logps).clamp(max=1 - 1e-6))

    odds_ratio = -F.logsigmoid(log_odds(t.policy_chosen) - log_odds(t.policy_rejected))
    losses = chosen_nll(s) + cfg.beta * odds_ratio
    chosen, rejected = cfg.beta * t.policy_chosen.detach(), cfg.beta * t.policy_rejected.detach()
    return LossOutput(losses, chosen, rejected, {"odds_ratio": odds_ratio.detach()})


def nll(s: PairStats, cfg: NLLConfig, state: dict) -> LossOutput:
    """The chosen response's per-token NLL, -pc / nc (TRL pools it over the batch's tokens instead). Rewards are
    the per-token mean log-probs of chosen and rejected."""
    t = s.per_token()
    return LossOutput(chosen_nll(s), t.policy_chosen.detach(), t.policy_rejected.detach())


def weighted(s: PairStats, cfg: WeightedConfig, state: dict) -> LossOutput:
    """sum_i w_i loss_i, each term on its own statistics; each term is logged (`loss_<name>`). Rewards are those of
    the first term."""
    outputs = {name: (w, compute(term, s, state)) for name, (w, term) in cfg.components.items()}
    losses = sum(w * output.losses for w, output in outputs.values())
    first = next(iter(outputs.values()))[1]
    terms = {f"loss_{name}": output.losses.detach() for name, (_, output) in outputs.items()}
    return LossOutput(losses, first.chosen_rewards, first.rejected_rewards, terms)


def cpo(s: PairStats, cfg: PreferenceLoss, state: dict) -> LossOutput:
    """CPO's preference term (Xu et al. 2024, arXiv:2401.08417, eq. 3), DPO with a uniform reference:
    -log sigma(beta (pc - pr)); CPO adds the chosen NLL through nll_weight (its cpo_alpha, 1 in the paper).
    Rewards beta * pc and beta * pr."""
    losses = -F.logsigmoid(cfg.beta * (s.policy_chosen - s.policy_rejected))
    return LossOutput(losses, cfg.beta * s.policy_chosen.detach(), cfg.beta * s.policy_rejected.detach())


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor, center: float) -> torch.Tensor:
    """[B] reward-model losses from [B] rewards r_c, r_r and margins m: -log sigma(r_c - r_r - m), the
    Bradley-Terry likelihood of the preference (Bradley & Terry 1952; as InstructGPT trains its reward model, Ouyang
    et al. 2022, arXiv:2203.02155, eq. 1), with Llama 2's margin from the data (Touvron et al. 2023,
    arXiv:2307.09288, eq. 2: a pair rated far apart must score farther apart), plus center (r_c + r_r)^2, which
    keeps rewards centred on zero (Eisenstein et al. 2023, arXiv:2312.09244; TRL's center_rewards_coefficient)."""
    return -F.logsigmoid(chosen - rejected - margin) + center * (chosen + rejected) ** 2


@dataclass(frozen=True)
class LossComponent:
    schema: type
    function: Callable[[PairStats, object, dict], LossOutput] | None  # None: not a pair loss (objective below)
    running_reward_mean: bool = False  # its state holds the mean reward of all earlier steps (checkpointed)
    objective: str = "pairs"  # what it trains: "pairs" (a pair loss), "sft" or "reward" (objective.OBJECTIVES)
    # A loss on labelled responses, (logratios [N], desirable [N] bool, kl_estimate, config) -> [N] losses: on
    # labelled completions as it is, on pairs through `unpaired`.
    labelled: Callable[[torch.Tensor, torch.Tensor, Any, object], torch.Tensor] | None = None


LOSSES = {
    "dpo": LossComponent(DPOConfig, dpo),
    "dpo_norm": LossComponent(DPOConfig, dpo),  # its YAML: length_normalized, Tulu 3's beta
    "ipo": LossComponent(IPOConfig, ipo),
    "hinge": LossComponent(RatioLoss, hinge),
    "robust": LossComponent(SmoothedConfig, robust),
    "exo_pair": LossComponent(SmoothedConfig, exo_pair),
    "nca_pair": LossComponent(RatioLoss, nca_pair),
    "bco_pair": LossComponent(RatioLoss, bco_pair, running_reward_mean=True),
    "sppo_hard": LossComponent(RatioLoss, sppo_hard),
    "apo_zero": LossComponent(RatioLoss, apo_zero),
    "apo_down": LossComponent(RatioLoss, apo_down),
    "discopop": LossComponent(DiscoPOPConfig, discopop),
    "dpop": LossComponent(DPOPConfig, dpop),
    "f_dpo": LossComponent(FDPOConfig, f_dpo),
    "ld_dpo": LossComponent(LDDPOConfig, dpo),  # DPO on the sums its tail_weight asks the scorer for
    "wpo": LossComponent(WPOConfig, wpo),
    "aot": LossComponent(AOTConfig, aot),
    "aot_unpaired": LossComponent(AOTConfig, aot_unpaired),
    "kto": LossComponent(KTOConfig, unpaired, labelled=kto_losses),
    "apo_zero_unpaired": LossComponent(UnpairedConfig, unpaired, labelled=apo_zero_unpaired_losses),
    "simpo": LossComponent(SimPOConfig, simpo),
    "orpo": LossComponent(PreferenceLoss, orpo),
    "cpo": LossComponent(PreferenceLoss, cpo),
    "nll": LossComponent(NLLConfig, nll),
    "weighted": LossComponent(WeightedConfig, weighted),
    "sft": LossComponent(SFTConfig, None, objective="sft"),
    "reward": LossComponent(RewardConfig, None, objective="reward"),
}


def compute(config, stats: PairStats, state: dict) -> LossOutput:
    """The configured loss on the statistics it reads, plus nll_weight x chosen_nll (RPO) for a loss with that
    key, logged as the term `nll`. A weighted loss applies it to each term."""
    output = LOSSES[config.name].function(config.statistics(stats), config, state)
    nll_weight = getattr(config, "nll_weight", 0.0)
    if nll_weight:
        nll = chosen_nll(stats)
        output.losses = output.losses + nll_weight * nll
        output.terms = {**(output.terms or {}), "nll": nll.detach()}
    return output


def running_reward_mean(loss) -> bool:
    """Whether the loss (or a term of it) keeps the running reward mean (bco_pair)."""
    names = list(getattr(loss, "components", {})) or [loss.name]
    return any(LOSSES[name].running_reward_mean for name in names)
