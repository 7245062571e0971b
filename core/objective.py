"""What the policy is trained to do: a pair loss from losses.LOSSES over the policy's and the reference's
per-sequence log-probs (plus the RPO NLL term), or SFT's negative log-likelihood; with the per-pair metrics of the
DPO reference."""

import torch
from omegaconf import OmegaConf

from core.loss_contract import PairStats
from core.losses import LOSSES, bradley_terry, compute, running_reward_mean


class Objective:
    """What the training loop and the scorer ask of an objective, and the answers of one that asks for nothing
    more than the policy's summed log-probs of its examples' responses."""

    sft_targets = False  # trains on each prompt's sft_target, not on (chosen, rejected)
    needs_reference = False
    tail_weight = 1.0  # how the scorer sums each response (LD-DPO)
    reads_sum_sq = False  # the policy's sums of log sum_v p_v^2 (WPO)
    couples_pairs = False  # a pair's loss depends on the rest of its batch (aot)
    needs_kl_estimate = False  # KTO's reference point
    reads_labels = False  # trains on labelled completions too (KTO)
    reward_model = False  # trains a reward model: the scorer gives its rewards, not log-probs
    reads_margins = False  # reads each pair's margin from the data

    def __init__(self, loss):
        self.loss = loss
        self.state = {}

    def state_dict(self) -> dict:
        """The running state, for checkpoints (checkpoint.py: a stateful part)."""
        return dict(self.state)

    def load_state_dict(self, state: dict) -> None:
        """The running state this loss keeps; a checkpoint of another loss (resumed with loss= changed) may hold
        state this one has no use for."""
        self.state.update({key: value for key, value in state.items() if key in self.state})

    def observe(self, metrics: dict[str, list[float]]) -> None:
        """Fold one training step's gathered metrics into the running state (none here)."""


class PreferenceObjective(Objective):
    """A pair loss on (chosen, rejected). Its running state (bco_pair's reward mean) is updated once per training
    step from the whole batch's rewards, so that it is the same for any accumulation and number of ranks."""

    def __init__(self, loss):
        super().__init__(loss)
        self.needs_reference = loss.needs_reference()
        self.tail_weight = loss.tail_weight()
        self.reads_sum_sq = loss.reads_sum_sq()
        self.couples_pairs = loss.couples_pairs()
        self.needs_kl_estimate = loss.needs_kl_estimate()
        self.reads_labels = loss.reads_labels()
        self.state = {"reward_mean": 0.0, "rewards_seen": 0} if running_reward_mean(loss) else {}

    def __call__(
        self, policy_logps, reference_logps, n_tokens, split: str, log_sum_sq=None, batch_fields=None, labels=None
    ):
        """policy_logps, reference_logps (None: no reference, zeros), n_tokens, log_sum_sq (the policy's sums of
        log sum_v p_v^2, where reads_sum_sq): [2B], all chosen then all rejected. batch_fields: the PairStats
        fields read from the whole batch (step.CoupledBatch.part). labels: [B] bool for labelled completions
        (one response each: [B] inputs; see labelled). Returns the mean loss and [B] metrics named as in the DPO
        reference."""
        reference_logps = torch.zeros_like(policy_logps) if reference_logps is None else reference_logps
        if labels is not None:
            kl_estimate = (batch_fields or {}).get("kl_estimate")
            return self.labelled(policy_logps, reference_logps, n_tokens, split, kl_estimate, labels)
        stats = PairStats(*policy_logps.chunk(2), *reference_logps.chunk(2), *n_tokens.to(policy_logps).chunk(2))
        if log_sum_sq is not None:
            stats.chosen_log_sum_sq, stats.rejected_log_sum_sq = log_sum_sq.chunk(2)
        for name, value in (batch_fields or {}).items():
            setattr(stats, name, value)
        output = compute(self.loss, stats, self.state)
        metrics = {
            f"rewards_{split}/chosen": output.chosen_rewards,
            f"rewards_{split}/rejected": output.rejected_rewards,
            f"rewards_{split}/accuracies": (output.chosen_rewards > output.rejected_rewards).float(),
            f"rewards_{split}/margins": output.chosen_rewards - output.rejected_rewards,
            f"logps_{split}/chosen": stats.policy_chosen.detach(),
            f"logps_{split}/rejected": stats.policy_rejected.detach(),
        }
        for name, term in (output.terms or {}).items():
            metrics[f"{name}/{split}"] = term
        metrics[f"loss/{split}"] = output.losses.detach()
        return output.losses.mean(), metrics

    def labelled(self, policy_logps, reference_logps, n_tokens, split: str, kl_estimate, labels):
        """A loss on labelled completions (LossComponent.labelled: kto, apo_zero_unpaired): one response per example,
        desirable or not; the chosen_nll term of nll_weight on desirable ones. Rewards beta r are logged as TRL's
        KTO logs them: rewards_<split>/chosen over the desirable examples, /rejected over the others (NaN elsewhere,
        left out of the means); kto's reference point z0 as `kl`."""
        logratios = policy_logps - reference_logps
        losses = LOSSES[self.loss.name].labelled(logratios, labels, kl_estimate, self.loss)
        if self.loss.nll_weight:
            nll = -policy_logps / n_tokens.to(policy_logps).clamp(min=1)  # per-token, as losses.chosen_nll
            losses = losses + self.loss.nll_weight * torch.where(labels, nll, 0.0)
        rewards, logps = self.loss.beta * logratios.detach(), policy_logps.detach()
        nan = torch.full_like(rewards, float("nan"))
        metrics = {
            f"rewards_{split}/chosen": torch.where(labels, rewards, nan),
            f"rewards_{split}/rejected": torch.where(labels, nan, rewards),
            f"logps_{split}/chosen": torch.where(labels, logps, nan),
            f"logps_{split}/rejected": torch.where(labels, nan, logps),
            f"loss/{split}": losses.detach(),
        }
        if kl_estimate is not None:
            metrics[f"kl/{split}"] = kl_estimate.expand_as(rewards)
        return losses.mean(), metrics

    def observe(self, metrics: dict[str, list[float]]) -> None:
        """Fold one training step's gathered rewards into the running reward mean."""
        step = metrics.get("rewards_train/chosen", []) + metrics.get("rewards_train/rejected", [])
        if self.state and step:
            seen = self.state["rewards_seen"] + len(step)
            self.state["reward_mean"] += (sum(step) - len(step) * self.state["reward_mean"]) / seen
            self.state["rewards_seen"] = seen


class SFTObjective(Objective):
    """The negative log-likelihood of each prompt's sft_target (one example per prompt), summed over its tokens."""

    sft_targets = True

    def __call__(
        self, policy_logps, reference_logps, n_tokens, split: str, log_sum_sq=None, batch_fields=None, labels=None
    ):
        losses = -policy_logps
        return losses.mean(), {f"logps_{split}/chosen": policy_logps.detach(), f"loss/{split}": losses.detach()}


class RewardObjective(Objective):
    """A reward model trained on pairs: the Bradley-Terry loss on its rewards of chosen and rejected
    (losses.bradley_terry), with each pair's margin where the data gives one. No reference."""

    reward_model = True
    reads_margins = True

    def __call__(self, rewards, reference_logps, n_tokens, split: str, *unread, margins=None):
        """rewards: [2B], all chosen then all rejected; margins: [B] (None: 0); no reference, and nothing of what
        the other objectives read besides (*unread). Returns the mean loss and [B]
        metrics: the rewards, whether chosen scores higher (accuracies), by how much (margins), the pair's mean
        reward, and the columns whose spread over the pairs is logged (utils.metric_mean: */chosen_std)."""
        chosen, rejected = rewards.chunk(2)
        margins = torch.zeros_like(chosen) if margins is None else margins.to(chosen)
        losses = bradley_terry(chosen, rejected, margins, self.loss.center_rewards_coefficient)
        chosen, rejected = chosen.detach(), rejected.detach()
        metrics = {
            f"rewards_{split}/chosen": chosen,
            f"rewards_{split}/rejected": rejected,
            f"rewards_{split}/accuracies": (chosen > rejected).float(),
            f"rewards_{split}/margins": chosen - rejected,
            f"rewards_{split}/mean": (chosen + rejected) / 2,
            f"rewards_{split}/chosen_std": chosen,
            f"rewards_{split}/rejected_std": rejected,
            f"loss/{split}": losses.detach(),
        }
        return losses.mean(), metrics


OBJECTIVES = {"pairs": PreferenceObjective, "sft": SFTObjective, "reward": RewardObjective}


def build_objective(loss_config):
    """The objective of the `loss` config node (checked: its schema's dataclass is built from it)."""
    loss = OmegaConf.to_object(loss_config)
    return OBJECTIVES[LOSSES[loss.name].objective](loss)
