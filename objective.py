"""What the policy is trained to do: each `loss=` option is a config dataclass (its own keys, checked by itself)
and an objective that turns per-sequence log-probs into a loss and the reference's per-example metrics."""

import functools
from dataclasses import dataclass

import torch

from losses import preference_loss
from preference_datasets import PreferencePair, sft_examples
from utils import UserError


@dataclass
class DPOConfig:
    """DPO (Rafailov et al. 2023); label_smoothing > 0 is conservative DPO, the assumed rate of flipped labels."""

    name: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    reference_free: bool = False  # a uniform reference: no reference model is loaded

    def __post_init__(self):
        check_beta(self.beta)
        if not 0 <= self.label_smoothing <= 0.5:
            raise UserError(f"loss.label_smoothing={self.label_smoothing} must be in [0, 0.5]")


@dataclass
class IPOConfig:
    """IPO (Azar et al. 2023); beta plays the role of tau."""

    name: str = "ipo"
    beta: float = 0.1
    reference_free: bool = False

    def __post_init__(self):
        check_beta(self.beta)


@dataclass
class SFTConfig:
    """Supervised fine-tuning on each prompt's sft_target."""

    name: str = "sft"


def check_beta(beta: float) -> None:
    if beta <= 0:
        raise UserError(f"loss.beta={beta} must be positive")


class PreferenceObjective:
    """DPO, conservative DPO, IPO or their reference-free forms, over (chosen, rejected) pairs."""

    sft_targets = False  # trains on (chosen, rejected), not on sft_target

    def __init__(self, loss, ipo: bool = False):
        self.loss = loss
        self.ipo = ipo
        self.needs_reference = not loss.reference_free

    def examples(self, pairs: list[PreferencePair]) -> list[PreferencePair]:
        return pairs

    def __call__(self, policy_logps: torch.Tensor, reference_logps: torch.Tensor | None, split: str):
        """policy_logps, reference_logps: [2B] (all chosen, then all rejected; None: reference-free, zeros).
        Returns the mean loss and [B] metrics named as in the DPO reference."""
        policy_chosen, policy_rejected = policy_logps.chunk(2)
        reference_chosen, reference_rejected = (
            torch.zeros_like(policy_logps) if reference_logps is None else reference_logps
        ).chunk(2)
        losses, chosen_rewards, rejected_rewards = preference_loss(
            policy_chosen,
            policy_rejected,
            reference_chosen,
            reference_rejected,
            beta=self.loss.beta,
            label_smoothing=self.loss.get("label_smoothing", 0.0),
            ipo=self.ipo,
        )
        metrics = {
            f"rewards_{split}/chosen": chosen_rewards,
            f"rewards_{split}/rejected": rejected_rewards,
            f"rewards_{split}/accuracies": (chosen_rewards > rejected_rewards).float(),
            f"rewards_{split}/margins": chosen_rewards - rejected_rewards,
            f"logps_{split}/chosen": policy_chosen.detach(),
            f"logps_{split}/rejected": policy_rejected.detach(),
            f"loss/{split}": losses.detach(),
        }
        return losses.mean(), metrics


class SFTObjective:
    """The negative log-likelihood of each prompt's sft_target (one example per prompt)."""

    sft_targets = True
    needs_reference = False

    def __init__(self, loss):
        self.loss = loss

    def examples(self, pairs: list[PreferencePair]) -> list[PreferencePair]:
        return sft_examples(pairs)

    def __call__(self, policy_logps: torch.Tensor, reference_logps: None, split: str):
        losses = -policy_logps
        return losses.mean(), {f"logps_{split}/chosen": policy_logps.detach(), f"loss/{split}": losses.detach()}


# loss name -> (its config schema, its objective)
LOSSES = {
    "dpo": (DPOConfig, PreferenceObjective),
    "ipo": (IPOConfig, functools.partial(PreferenceObjective, ipo=True)),
    "sft": (SFTConfig, SFTObjective),
}


def build_objective(loss):
    """The objective of the `loss` config node."""
    return LOSSES[loss.name][1](loss)
