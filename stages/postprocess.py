"""postprocess: token KL, reward shaping (overlong penalty, running norm, clip), KL-penalised rewards.

Order per micro-batch (see docs/numerics.md for where this differs from the seed and why):

1. ``kl`` = k1/k2/k3 of actor vs reference log-probs over the action mask less the actions the
   EOS repair forced (zeros when ``use_kl_loss`` or without a reference; docs/numerics.md §14.12);
   ``info.kl`` its masked mean per sample over those sampled actions.
2. R = raw reward (+ overlong penalty when ``overlong_buffer``).
3. Running normalisation from moments in Redis, merged atomically once per batch id: the
   snapshot after merging this batch normalises it (also on redelivery).
4. Reward clip: ``info.reward_clip_frac`` measured before the clamp.
5. ``token_rewards`` = −β·kl + R at the last valid action, with β from Redis (shared by replicas).
"""

from __future__ import annotations

import numpy as np
import torch

from expstream import numerics
from expstream.layout import action_field, forced_action_mask, padded, to_ragged
from schemas import SampleBatch
from stages.common import scalar
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    return None


def kl_coefficient(ctx: StageContext) -> float:
    return float(ctx.state.kl_coef(ctx.topology.algo.init_kl_coef))


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    algo, gen = ctx.topology.algo, ctx.topology.generate
    lay = padded(batch)
    mask, width = lay.action_mask, lay.num_actions
    # the KL is estimated on the sampled actions only: an EOS the repair forced has no KL (0 there)
    kl_mask = mask & ~forced_action_mask(batch, width)
    if batch.base_action_log_probs is not None and not algo.use_kl_loss:
        kl = numerics.compute_approx_kl(action_field(batch, "action_log_probs", width),
                                        action_field(batch, "base_action_log_probs", width), kl_mask,
                                        algo.kl_estimator)
    else:
        kl = torch.zeros(mask.shape, dtype=torch.float32)
    raw = torch.from_numpy(np.array(batch.rewards, dtype=np.float32))
    response_length = mask.sum(-1).to(torch.float32)
    info = {
        "kl": scalar(numerics.masked_mean(kl, kl_mask, dim=-1)),
        "reward": scalar(raw),
        "response_length": scalar(response_length),
        "total_length": scalar(lay.attention_mask.sum(-1).to(torch.float32)),
    }
    r = raw.clone()
    if algo.overlong_buffer:
        r = r + numerics.overlong_penalty(response_length, gen.max_new_tokens, algo.overlong_buffer_len,
                                          algo.overlong_buffer_penalty_factor)
    if algo.reward_running_norm:
        m = ctx.state.merge_reward_moments(batch.batch_id, r.numpy().astype(np.float64))
        r = numerics.normalize_rewards(r, m.mean, m.std, algo.reward_running_norm_minus_mean).to(torch.float32)
        if not bool(torch.isfinite(r).all()):
            # std is inf after one reward in total and 0 while every reward so far was equal: the
            # seed gives 0 (or ±huge) there; we give 0 and say so rather than emit inf downstream.
            ctx.log.warning("postprocess batch=%s: running std %.3g cannot normalise; rewards set to 0",
                            batch.batch_id, m.std)
            r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    if algo.reward_clip > 0:
        c = algo.reward_clip
        info["reward_clip_frac"] = scalar(numerics.clip_fraction(r, -c, c))
        r = r.clamp(-c, c)
    beta = kl_coefficient(ctx)
    token_rewards = numerics.kl_penalized_rewards(r, kl, mask, beta)
    return [batch.replace(
        kl=to_ragged(kl, batch),
        kl_coef=beta,
        processed_rewards=scalar(r),
        token_rewards=to_ragged(token_rewards, batch),
        info={**(batch.info or {}), **info},
        base_action_log_probs=batch.base_action_log_probs if algo.use_kl_loss else None,
    )]
