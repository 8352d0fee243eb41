"""postprocess: token KL, overlong penalty, KL-penalised rewards.

Per micro-batch (docs/numerics.md §2):

1. ``kl`` = k1/k2/k3 of actor vs reference log-probs over the action mask less the actions the
   EOS repair forced (zeros when ``use_kl_loss`` or without a reference; docs/numerics.md §14.12);
   ``info.kl`` its masked mean per sample over those sampled actions.
2. ``processed_rewards`` = raw reward + overlong penalty when ``overlong_buffer``
   (docs/numerics.md §4.1): the reward group shaping starts from.
3. ``token_rewards`` = −β·kl + that reward at the last valid action, with β from the run state
   (shared by replicas).

A multi-turn episode's environment rewards (``turn_rewards``, docs/numerics.md §15): with gae and
reinforce each sits at its turn's last model token in ``token_rewards``; with every other estimator
their sum is added to the raw reward (``info.reward`` and what group shaping starts from).

Group shaping, the running normalisation and the reward clip come after, in the advantage stage,
in the seed's order (shaping first): only there is a prompt group whole.
"""

from __future__ import annotations

import numpy as np
import torch

from expstream.models.forward import scalar
from expstream.rl import numerics
from expstream.rl.episodes import PER_TOKEN_ESTIMATORS, turn_reward_sums, turn_reward_tokens
from expstream.rl.layout import action_field, forced_action_mask, padded, to_ragged
from schemas import SampleBatch
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
    per_token = algo.advantage_estimator in PER_TOKEN_ESTIMATORS
    if batch.turn_rewards is not None and not per_token:  # multi-turn: the episode's return, shaped as one scalar
        raw = raw + turn_reward_sums(batch)
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
    beta = kl_coefficient(ctx)
    token_rewards = numerics.kl_penalized_rewards(r, kl, mask, beta)
    if batch.turn_rewards is not None and per_token:  # each turn's reward at its last model token (docs/numerics.md §15)
        token_rewards = token_rewards + turn_reward_tokens(batch, width) * mask
    return [batch.replace(
        kl=to_ragged(kl, batch),
        kl_coef=beta,
        processed_rewards=scalar(r),
        token_rewards=to_ragged(token_rewards, batch),
        info={**(batch.info or {}), **info},
        base_action_log_probs=batch.base_action_log_probs if algo.use_kl_loss else None,
    )]
