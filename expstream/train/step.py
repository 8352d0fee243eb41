"""One optimisation step of the reference trainer, independent of Kafka (tests drive it in-process).

:class:`PolicyTrainer` holds the actor (and critic) being trained and their Adam optimisers;
:meth:`PolicyTrainer.train_step` takes one padded :class:`~expstream.rl.experience.Experience` (the
seed's trainer layout: left-padded, responses right-aligned, as ``make_experience_batch`` builds it)
and does one optimisation step with the losses of ``expstream/train/loss.py``.
:func:`experience_from_records` turns chosen rows of decoded ``SampleBatch`` records into that batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from expstream.config.topology import Topology
from expstream.rl.experience import (
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)
from expstream.rl.layout import position_ids_from_attention
from expstream.train.loss import policy_loss, value_loss

__all__ = ["PolicyTrainer", "StepResult", "experience_from_records", "action_log_probs_with_grad",
           "values_with_grad"]


def experience_from_records(parts: Sequence[tuple[Any, Sequence[int]]]) -> Experience:
    """One padded Experience from ``(SampleBatch, rows)`` pairs: the rows trimmed of their own padding,
    then batched with ``make_experience_batch`` (left padding; the last A columns are the actions)."""
    items = []
    for batch, rows in parts:
        items.extend(split_experience_batch(Experience.from_sample_batch(batch, rows=list(rows))))
    return make_experience_batch(remove_padding_in_sequences(items))


def _forward(model: Any, sequences: Tensor, attention_mask: Tensor) -> Any:
    return model(input_ids=sequences, attention_mask=attention_mask,
                 position_ids=position_ids_from_attention(attention_mask), use_cache=False)


def action_log_probs_with_grad(model: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
    """log π_θ of the last ``num_actions`` tokens, (B, A) float32, differentiable (docs/numerics.md §1.3)."""
    logits = _forward(model, sequences, attention_mask).logits[:, -(num_actions + 1): -1].float()
    targets = sequences[:, -num_actions:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def values_with_grad(critic: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
    """Critic values V_t (B, A) float32, differentiable: outputs at positions [:-1], last A."""
    out = _forward(critic, sequences, attention_mask).logits
    values = out[..., 0] if out.dim() == 3 else out
    return values[:, :-1][:, -num_actions:].float()


@dataclass
class StepResult:
    loss: float  # the policy loss (plus the KL term when in the loss)
    kl: float  # token-mean KL(π_θ ‖ π_ref) estimate before the update (0 without reference log-probs)
    clip_frac: float
    is_weight_mean: float
    is_masked_frac: float
    grad_norm: float
    value_loss: float | None  # None when no critic is trained


class PolicyTrainer:
    """The actor (and optional critic) under training, their optimisers, and the step."""

    def __init__(self, topo: Topology, actor: Any, critic: Any = None) -> None:
        self.topo = topo
        self.actor = actor
        self.actor.requires_grad_(True)
        self.actor.train()
        self.optimizer = torch.optim.Adam(self.actor.parameters(), lr=topo.train.lr)
        self.critic = critic
        self.critic_optimizer = None
        if critic is not None:
            critic.requires_grad_(True)
            critic.train()
            self.critic_optimizer = torch.optim.Adam(critic.parameters(), lr=topo.train.critic_lr)

    def train_step(self, exp: Experience) -> StepResult:
        """One optimisation step on ``exp`` (every row once, one Adam step per model)."""
        cfg, algo = self.topo.train, self.topo.algo
        mask = exp.action_mask
        a = int(mask.shape[1])
        logp = action_log_probs_with_grad(self.actor, exp.sequences, exp.attention_mask, a)
        # π_old: with "recompute" the weights being trained (one optimisation step per batch, so their
        # log-probs are this very forward pass, detached: r_t = 1 and the clip starts from the current
        # policy, as verl's and AReaL's recomputed old/proximal log-probs do); with "stage" the
        # actor-logprob stage's, which in an asynchronous loop may be several versions old.
        old = logp.detach() if cfg.old_log_probs == "recompute" else exp.action_log_probs
        terms = policy_loss(
            logp, old, exp.advantages, mask,
            clip_eps=cfg.clip_eps, off_policy=cfg.off_policy,
            behav_log_probs=getattr(exp, "rollout_log_probs", None), is_cap=cfg.is_cap,
            base_log_probs=exp.base_action_log_probs,
            kl_coef=cfg.kl_loss_coef if algo.use_kl_loss else 0.0, kl_estimator=algo.kl_estimator,
        )
        self.optimizer.zero_grad(set_to_none=True)
        terms.loss.backward()
        grad_norm = _clip(self.actor, cfg.max_grad_norm)
        self.optimizer.step()
        vloss = None
        if self.critic is not None and self.critic_optimizer is not None and exp.values is not None:
            values = values_with_grad(self.critic, exp.sequences, exp.attention_mask, a)
            vl = value_loss(values, exp.values, exp.returns, mask)
            self.critic_optimizer.zero_grad(set_to_none=True)
            vl.backward()
            _clip(self.critic, cfg.max_grad_norm)
            self.critic_optimizer.step()
            vloss = float(vl.detach())
        return StepResult(loss=float(terms.loss.detach()), kl=float(terms.kl), clip_frac=float(terms.clip_frac),
                          is_weight_mean=float(terms.is_weight_mean), is_masked_frac=float(terms.is_masked_frac),
                          grad_norm=grad_norm, value_loss=vloss)

    def actor_state(self) -> dict[str, Tensor]:
        return {k: v.detach().contiguous().clone() for k, v in self.actor.state_dict().items()}

    def critic_state(self) -> dict[str, Tensor] | None:
        if self.critic is None:
            return None
        return {k: v.detach().contiguous().clone() for k, v in self.critic.state_dict().items()}


def _clip(model: Any, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
