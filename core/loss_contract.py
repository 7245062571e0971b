"""What every loss shares: the per-pair statistics it reads (PairStats), what it returns (LossOutput), the keys of
every objective (LossKeys), what a pair loss asks of the scorer and of the batch (PairLossNeeds, whose defaults ask
for nothing), and the keys of reference-free and log-ratio pair losses (PreferenceLoss, RatioLoss) that each loss's
config extends. The step (step.py) and the objective (objective.py) read these; the formulas and the registry of
losses by name are losses.py's, whose docstring gives the notation.
"""

import dataclasses
from dataclasses import dataclass

import torch
from omegaconf import MISSING

from utils import NON_NEGATIVE, POSITIVE, Range, check_ranges, ranged


@dataclass
class PairStats:
    """What a loss may read: summed log-probs of policy and reference, and scored-token counts; all [B]. The sums
    of log sum_v p_v^2 are there only where the loss asks for them (PreferenceLoss.reads_sum_sq)."""

    policy_chosen: torch.Tensor
    policy_rejected: torch.Tensor
    reference_chosen: torch.Tensor
    reference_rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_log_sum_sq: torch.Tensor | None = None
    rejected_log_sum_sq: torch.Tensor | None = None
    # For a loss that couples the pairs of a batch (aot): every pair of the optimizer step (or eval batch), [G] and
    # detached, and where these B pairs are in it ([B] long). None: these pairs are the whole batch.
    batch: "PairStats | None" = None
    batch_positions: torch.Tensor | None = None
    kl_estimate: torch.Tensor | None = None  # [] KTO's reference point z0 of the whole batch, detached

    @property
    def chosen_logratio(self) -> torch.Tensor:
        return self.policy_chosen - self.reference_chosen

    @property
    def rejected_logratio(self) -> torch.Tensor:
        return self.policy_rejected - self.reference_rejected

    @property
    def margin(self) -> torch.Tensor:
        """h = (pc - rc) - (pr - rr)."""
        return self.chosen_logratio - self.rejected_logratio

    def per_token(self) -> "PairStats":
        """The same pairs with every log-prob divided by its response's token count (per-token means)."""
        nc, nr = self.chosen_tokens.clamp(min=1), self.rejected_tokens.clamp(min=1)
        return PairStats(
            self.policy_chosen / nc,
            self.policy_rejected / nr,
            self.reference_chosen / nc,
            self.reference_rejected / nr,
            self.chosen_tokens,
            self.rejected_tokens,
            self.chosen_log_sum_sq,  # only WPO reads them, from the sums (wpo)
            self.rejected_log_sum_sq,
            self.batch.per_token() if self.batch is not None else None,
            self.batch_positions,
            self.kl_estimate,
        )

    def whole_batch(self) -> tuple["PairStats", torch.Tensor]:
        """(the batch these pairs belong to, detached, and their positions in it)."""
        if self.batch is not None:
            return self.batch, self.batch_positions
        policy = (self.policy_chosen.detach(), self.policy_rejected.detach())
        reference = (self.reference_chosen, self.reference_rejected)
        alone = PairStats(*policy, *reference, self.chosen_tokens, self.rejected_tokens)
        return alone, torch.arange(self.policy_chosen.numel(), device=self.policy_chosen.device)


@dataclass
class LossOutput:
    """Per-pair losses [B] (differentiable), rewards [B] (detached), and any named extra terms [B] to log."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    terms: dict[str, torch.Tensor] | None = None


# -------------------------------------------------------------------------------------------------------------
# Configs. Every pair loss has beta and nll_weight (RPO: + nll_weight * losses.chosen_nll, Pang et al. 2024,
# arXiv:2404.19733); losses on reference log-ratios also have length_normalized (they see per-token mean
# log-probs instead of sums).


@dataclass
class LossKeys:
    """The keys of every objective: its name, and the weight of a mixture-of-experts policy's router load-balancing
    loss (router_loss), added to whatever it trains on."""

    name: str = MISSING
    router_aux_loss_coef: float | None = dataclasses.field(
        default=None, metadata={"range": Range(0, null="for the model config's router_aux_loss_coef")}
    )

    def __post_init__(self):
        check_ranges(self, "loss.")  # the keys of its subclasses too

    def needs_reference(self) -> bool:
        """Whether it reads a reference model's log-probs (sft and reward never do; a pair loss says)."""
        return False


@dataclass
class PairLossNeeds(LossKeys):
    """What a pair loss asks of the scorer and of the batch beyond its pairs' summed log-probs; the defaults: nothing.
    Each loss config overrides what it needs (objective.PreferenceObjective reads them once)."""

    def statistics(self, stats: PairStats) -> PairStats:
        """What the loss function sees."""
        return stats

    def tail_weight(self) -> float:
        """How the tokens of a response beyond the pair's shorter one count in its summed log-probs (1: fully)."""
        return 1.0

    def couples_pairs(self) -> bool:
        """Whether a pair's loss depends on the other pairs of its batch (PairStats.batch)."""
        return False

    def needs_kl_estimate(self) -> bool:
        """Whether the loss reads the batch's KL estimate (PairStats.kl_estimate)."""
        return False

    def reads_labels(self) -> bool:
        """Whether the loss trains on labelled completions (unpaired data) as well as on pairs."""
        return False

    def reads_sum_sq(self) -> bool:
        """Whether the loss reads the policy's sums of log sum_v p_v^2 (PairStats)."""
        return False


@dataclass
class PreferenceLoss(PairLossNeeds):
    """Keys of a reference-free pair loss."""

    beta: float = ranged(POSITIVE)
    nll_weight: float = ranged(NON_NEGATIVE)


@dataclass
class RatioLoss(PreferenceLoss):
    """Keys of a loss on the policy's log-ratios to the reference."""

    length_normalized: bool = MISSING

    def needs_reference(self) -> bool:
        return not getattr(self, "reference_free", False)

    def statistics(self, stats: PairStats) -> PairStats:
        return stats.per_token() if self.length_normalized else stats
