"""The reference trainer's losses: pure torch, no Kafka, no models (docs/async.md "Off-policy correction").

Shapes: every per-token tensor is (B, A) float32 with ``action_mask`` (B, A) bool; reductions are the
token mean over the valid actions of the whole batch (Σ loss_t·m_t / Σ m_t, 0 when no token is valid).

Three log-probs of the same tokens meet here:

* ``log_probs`` -- log π_θ, the weights being trained (carries the gradient);
* ``old_log_probs`` -- ``action_log_probs`` of the experience: actor-logprob's recomputation with the
  weights of version ``logprob_version`` (the PPO "old" policy, AReaL's proximal policy π_prox);
* ``behav_log_probs`` -- ``rollout_log_probs``: what the engine actually sampled from (π_behav).

``train.off_policy`` selects the importance correction against π_behav (C = ``train.is_cap``):

=============  ===========================================================================================
none           loss_t = −min(r_t·Â_t, clip(r_t, 1−ε, 1+ε)·Â_t),  r_t = exp(logπ_θ − logπ_old)
token_tis      loss_t · min(exp(logπ_old,t − logπ_behav,t), C)          (verl's truncated IS, "TIS")
seq_tis        loss_t · min(exp(Σ_t logπ_old,t − Σ_t logπ_behav,t), C)  (one weight per sample)
decoupled      loss_t · w_t, w_t = exp(logπ_prox,t − logπ_behav,t) if that is <= C else 0
               (AReaL's decoupled PPO: r_t against π_prox = π_old; tokens whose behaviour weight
               exceeds the cap are masked out, not truncated -- AReaL's ``behav_imp_weight_cap``)
=============  ===========================================================================================

Importance weights are constants (no gradient flows through them). GRPO-style training is the same
clipped objective with the pipeline's group advantages; the estimator lives upstream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from expstream.rl.numerics import kl_of_log_ratio

__all__ = [
    "KL_LOSS_ESTIMATORS",
    "OFF_POLICY_MODES",
    "LossTerms",
    "importance_weights",
    "kl_loss_terms",
    "masked_token_mean",
    "policy_loss",
    "value_loss",
]

OFF_POLICY_MODES = ("none", "token_tis", "seq_tis", "decoupled")
KL_LOSS_ESTIMATORS = ("k1", "k2", "k3")
# Why 0.2: the critic's value clip of the PPO papers and the seed (OpenRLHF value_clip default).
VALUE_CLIP = 0.2


@dataclass
class LossTerms:
    """The scalar loss and what the trainer logs about it (all 0-dim tensors)."""

    loss: Tensor  # () float32, carries the gradient
    policy_loss: Tensor  # () float32, detached
    kl: Tensor  # () float32, detached: token-mean KL(π_θ ‖ π_ref) estimate (0 without reference)
    clip_frac: Tensor  # () float32: share of valid tokens where the clipped branch was taken
    is_weight_mean: Tensor  # () float32: mean importance weight over valid tokens (1 for "none")
    is_masked_frac: Tensor  # () float32: share of valid tokens masked by the decoupled cap (0 otherwise)


def masked_token_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Σ x·m / Σ m over the whole batch; 0 when no position is valid (never NaN)."""
    m = mask.to(x.dtype)
    count = m.sum()
    return (x * m).sum() / count.clamp(min=1.0)


def _check(name: str, x: Tensor | None, shape: torch.Size) -> None:
    if x is not None and x.shape != shape:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not match action_mask {tuple(shape)}; "
                         "every per-token tensor is (B, A)")


def importance_weights(
    old_log_probs: Tensor, behav_log_probs: Tensor | None, action_mask: Tensor, mode: str, cap: float
) -> tuple[Tensor, Tensor]:
    """(weights (B, A), keep (B, A) bool) of the off-policy correction ``mode``; detached.

    ``keep`` is ``action_mask`` except for ``decoupled``, where tokens over the cap are dropped.
    Masked positions get weight 0. ``behav_log_probs`` None (an experience from before the
    rollout log-probs existed) with a mode other than ``none`` is a ValueError naming the fix.
    """
    if mode not in OFF_POLICY_MODES:
        raise ValueError(f"train.off_policy: got {mode!r}; use one of {', '.join(OFF_POLICY_MODES)}")
    mask = action_mask.bool()
    if mode == "none":
        return mask.to(torch.float32), mask
    if behav_log_probs is None:
        raise ValueError(f"train.off_policy={mode}: the experiences carry no rollout_log_probs (behaviour "
                         "log-probs from generate); set train.off_policy=none or regenerate them")
    if cap < 1:
        raise ValueError(f"train.is_cap: got {cap}; must be >= 1")
    old = old_log_probs.detach().double()
    behav = behav_log_probs.detach().double()
    zero = torch.zeros((), dtype=torch.float64)
    delta = torch.where(mask, old - behav, zero)
    if mode == "token_tis":
        w = torch.clamp(torch.exp(delta), max=cap)
        keep = mask
    elif mode == "seq_tis":
        w_seq = torch.clamp(torch.exp(delta.sum(dim=-1, keepdim=True)), max=cap)
        w = w_seq.expand_as(delta)
        keep = mask
    else:  # decoupled
        raw = torch.exp(delta)
        keep = mask & (raw <= cap)
        w = raw
    w = torch.where(keep, w, zero)
    return w.to(torch.float32), keep


def kl_loss_terms(log_probs: Tensor, base_log_probs: Tensor, action_mask: Tensor, estimator: str) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate (B, A), differentiable; d = logπ_θ − logπ_ref:
    k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d. Masked positions are 0."""
    if estimator not in KL_LOSS_ESTIMATORS:
        raise ValueError(f"algo.kl_estimator: got {estimator!r}; use one of {', '.join(KL_LOSS_ESTIMATORS)}")
    mask = action_mask.bool()
    d = torch.where(mask, log_probs - base_log_probs.detach(), torch.zeros_like(log_probs))
    k = kl_of_log_ratio(d, estimator)
    return torch.where(mask, k, torch.zeros_like(k))


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    action_mask: Tensor,
    *,
    clip_eps: float = 0.2,
    off_policy: str = "none",
    behav_log_probs: Tensor | None = None,
    is_cap: float = 2.0,
    base_log_probs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
) -> LossTerms:
    """PPO-clip / GRPO-style policy loss with the off-policy correction and the optional KL term.

    loss = mean_t[ w_t · max(−r_t·Â_t, −clip(r_t, 1−ε, 1+ε)·Â_t) ]  +  kl_coef · mean_t[ kl_t ]

    over the valid tokens (``keep``: ``action_mask``, less the decoupled cap's masked tokens for the
    policy term; the denominator is always Σ action_mask, as in AReaL). ``base_log_probs`` None or
    ``kl_coef == 0``: no KL term (the logged KL is still measured when a reference is given).
    """
    shape = action_mask.shape
    for name, x in (("log_probs", log_probs), ("old_log_probs", old_log_probs), ("advantages", advantages),
                    ("behav_log_probs", behav_log_probs), ("base_log_probs", base_log_probs)):
        _check(name, x, shape)
    mask = action_mask.bool()
    w, keep = importance_weights(old_log_probs, behav_log_probs, mask, off_policy, is_cap)
    zero = torch.zeros_like(log_probs)
    log_ratio = torch.where(mask, log_probs - old_log_probs.detach(), zero)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()
    surr1 = -adv * ratio
    surr2 = -adv * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.maximum(surr1, surr2) * w
    per_token = torch.where(keep, per_token, zero)
    pg = masked_token_mean(per_token, mask)
    loss = pg
    kl_mean = torch.zeros((), dtype=torch.float32)
    if base_log_probs is not None:
        kl_tok = kl_loss_terms(log_probs, base_log_probs, mask, kl_estimator)
        kl_term = masked_token_mean(kl_tok, mask)
        kl_mean = kl_term.detach()
        if kl_coef > 0:
            loss = loss + kl_coef * kl_term
    clipped = (surr2 > surr1) & mask
    return LossTerms(
        loss=loss,
        policy_loss=pg.detach(),
        kl=kl_mean,
        clip_frac=masked_token_mean(clipped.float(), mask).detach(),
        is_weight_mean=masked_token_mean(w, mask).detach(),
        is_masked_frac=masked_token_mean((mask & ~keep).float(), mask).detach(),
    )


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, action_mask: Tensor,
               clip: float = VALUE_CLIP) -> Tensor:
    """Clipped value loss of the critic (gae): 0.5 · mean_t max((V−R)², (V_clip−R)²),
    V_clip = V_old + clip(V − V_old, −clip, clip); token mean over ``action_mask``."""
    for name, x in (("values", values), ("old_values", old_values), ("returns", returns)):
        _check(name, x, action_mask.shape)
    old = old_values.detach()
    ret = returns.detach()
    v_clip = old + torch.clamp(values - old, -clip, clip)
    per_token = 0.5 * torch.maximum((values - ret) ** 2, (v_clip - ret) ** 2)
    return masked_token_mean(per_token, action_mask.bool())
