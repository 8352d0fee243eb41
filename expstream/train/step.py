"""One optimisation step of the reference trainer, independent of Kafka (tests drive it in-process).

:class:`PolicyTrainer` holds the actor (and critic) being trained and their Adam optimisers;
:meth:`PolicyTrainer.train_step` takes one padded :class:`~expstream.rl.experience.Experience` (the
seed's trainer layout: left-padded, responses right-aligned, as ``make_experience_batch`` builds it)
and does one optimisation step with the losses of ``expstream/train/loss.py``.
:func:`experience_from_records` turns chosen rows of decoded ``SampleBatch`` records into that batch.

The policy terms (ratio, clipped loss, KL in the loss) cover the *sampled* actions only: an action
the EOS repair forced (``Experience.forced_mask``) is left out (:func:`trained_mask`,
docs/numerics.md §14.12). A step whose loss or gradient is not finite changes nothing: no
optimiser step, the gradients dropped, the reason in :attr:`StepResult.skipped`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from expstream.config.topology import Topology
from expstream.models.hf import SamplingSupport
from expstream.rl.experience import (
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)
from expstream.rl.layout import position_ids_from_attention
from expstream.train.loss import policy_loss, value_loss

__all__ = ["PolicyTrainer", "StepResult", "experience_from_records", "action_log_probs_with_grad",
           "response_positions", "trained_mask", "values_with_grad"]


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


def response_positions(action_mask: Tensor) -> Tensor:
    """(B, A) long: the response position of every action column, i.e. the column less the row's first
    valid action column (negative left of it: padding of a left-padded, right-aligned row)."""
    m = action_mask.bool()
    cols = torch.arange(m.shape[1], device=m.device).expand_as(m)
    first = torch.where(m, cols, torch.full_like(cols, m.shape[1])).min(dim=1).values
    return cols - first[:, None]


def action_log_probs_with_grad(model: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                               support: SamplingSupport | None = None, action_mask: Tensor | None = None) -> Tensor:
    """log π_θ of the last ``num_actions`` tokens, (B, A) float32, differentiable (docs/numerics.md §1.3).

    ``support`` (with ``action_mask``, which places each row's response): the tokens generation cannot
    sample at a position are left out of the softmax there, so that π_θ is the distribution the actions
    were sampled from (docs/numerics.md §14.12). A target outside the support (only at positions the
    action mask leaves out) gets the most negative float32, never -inf."""
    logits = _forward(model, sequences, attention_mask).logits[:, -(num_actions + 1): -1].float()
    if support is not None and (support.never or (support.stops and support.min_new_tokens > 0)):
        if action_mask is None:
            raise ValueError("action_log_probs_with_grad: a sampling support needs the action_mask")
        logits = logits.masked_fill(support.banned(response_positions(action_mask), logits.shape[-1]), float("-inf"))
    targets = sequences[:, -num_actions:]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp.clamp(min=torch.finfo(logp.dtype).min)


def values_with_grad(critic: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int) -> Tensor:
    """Critic values V_t (B, A) float32, differentiable: outputs at positions [:-1], last A."""
    out = _forward(critic, sequences, attention_mask).logits
    values = out[..., 0] if out.dim() == 3 else out
    return values[:, :-1][:, -num_actions:].float()


def trained_mask(exp: Experience) -> Tensor:
    """(B, A) bool: the actions the policy loss trains -- ``action_mask`` less the actions the EOS repair
    forced (``exp.forced_mask``; a truncated row's last token was never sampled by the policy)."""
    mask = exp.action_mask.bool()
    if exp.forced_mask is None:
        return mask
    return mask & ~exp.forced_mask.bool()


@dataclass
class StepResult:
    loss: float  # the policy loss (plus the KL term when in the loss)
    kl: float  # token-mean KL(π_θ ‖ π_ref) estimate before the update (0 without reference log-probs)
    clip_frac: float
    is_weight_mean: float
    is_masked_frac: float
    grad_norm: float  # before clipping; non-finite when the step was skipped for it
    value_loss: float | None  # None when no critic is trained
    # why (part of) the step changed nothing: "actor: non-finite loss" | "actor: non-finite gradient" |
    # "critic: ..."; empty when every model took its optimiser step
    skipped: list[str] = field(default_factory=list)
    trained_tokens: int = 0  # actions in the policy loss (action_mask less the forced ones)


class PolicyTrainer:
    """The actor (and optional critic) under training, their optimisers, and the step."""

    def __init__(self, topo: Topology, actor: Any, critic: Any = None, support: SamplingSupport | None = None) -> None:
        """``support``: what generation can sample (``SamplingSupport.of(tokenizer, actor, backend,
        min_new_tokens)``); π_θ's softmax is restricted to it. None: the whole vocabulary everywhere."""
        self.topo = topo
        self.support = support
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
        a = int(exp.action_mask.shape[1])
        mask = trained_mask(exp)
        logp = action_log_probs_with_grad(self.actor, exp.sequences, exp.attention_mask, a, self.support,
                                          exp.action_mask)
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
        skipped: list[str] = []
        grad_norm = _guarded_step(self.actor, self.optimizer, terms.loss, cfg.max_grad_norm, "actor", skipped)
        vloss = None
        if self.critic is not None and self.critic_optimizer is not None and exp.values is not None:
            values = values_with_grad(self.critic, exp.sequences, exp.attention_mask, a)
            # the critic values states, and the state before a forced EOS is a sampled one: the seed's mask
            vl = value_loss(values, exp.values, exp.returns, exp.action_mask)
            _guarded_step(self.critic, self.critic_optimizer, vl, cfg.max_grad_norm, "critic", skipped)
            vloss = float(vl.detach())
        return StepResult(loss=float(terms.loss.detach()), kl=float(terms.kl), clip_frac=float(terms.clip_frac),
                          is_weight_mean=float(terms.is_weight_mean), is_masked_frac=float(terms.is_masked_frac),
                          grad_norm=grad_norm, value_loss=vloss, skipped=skipped, trained_tokens=int(mask.sum()))

    def actor_state(self) -> dict[str, Tensor]:
        return {k: v.detach().contiguous().clone() for k, v in self.actor.state_dict().items()}

    def critic_state(self) -> dict[str, Tensor] | None:
        if self.critic is None:
            return None
        return {k: v.detach().contiguous().clone() for k, v in self.critic.state_dict().items()}


def _guarded_step(model: Any, optimizer: Any, loss: Tensor, max_norm: float, role: str, skipped: list[str]) -> float:
    """Backward, clip and step -- unless the loss or the gradient norm is not finite: then no step is
    taken, the gradients are dropped and ``"<role>: non-finite loss|gradient"`` is appended to
    ``skipped`` (the weights and the optimiser state stay exactly as they were). Returns the
    gradient norm before clipping (NaN when the loss was not finite)."""
    optimizer.zero_grad(set_to_none=True)
    if not bool(torch.isfinite(loss.detach())):
        skipped.append(f"{role}: non-finite loss")
        return math.nan
    loss.backward()
    norm = _clip(model, max_norm)
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        skipped.append(f"{role}: non-finite gradient")
        return norm
    optimizer.step()
    return norm


def _clip(model: Any, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params])))
