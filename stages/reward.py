"""reward: the scalar reward per sample from a reward model and/or a Python reward function.

A reward function is named in the topology as ``module:function`` and called as in the seed:
``fn(queries, prompts, labels) -> sequence of floats``, where ``queries`` are the decoded prompt +
repaired response (no padding tokens). With both sources, ``models.reward_combine`` says how they
combine (sum | mean | model | fn) and each source's score is kept in ``reward_metrics``.
"""

from __future__ import annotations

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.resolve import model_dir, reward_fn
from schemas import SampleBatch
from stages.common import forward_reward
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models import load_reward_model, load_tokenizer

    models = ctx.topology.models
    ctx.models["tokenizer"] = load_tokenizer(model_dir(ctx.topology, "tokenizer"))
    if models.reward:
        ctx.models["rm"] = load_reward_model(model_dir(ctx.topology, "reward"), device=models.device)
    if models.reward_fn:
        ctx.models["reward_fn"] = reward_fn(models.reward_fn)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    sources: dict[str, np.ndarray] = {}
    if "rm" in ctx.models:
        sources["model"] = forward_reward(ctx.models["rm"], batch)  # padded or packed, as the batch says
    if "reward_fn" in ctx.models:
        tok = ctx.models["tokenizer"]
        queries = [tok.decode(list(p) + list(a), skip_special_tokens=False)
                   for p, a in zip(batch.prompt_ids.rows(), batch.action_ids.rows(), strict=True)]
        scores = np.asarray(ctx.models["reward_fn"](queries, list(batch.prompt), list(batch.label)),
                            dtype=np.float32).reshape(-1)
        if scores.shape != (len(batch),):
            raise PoisonRecordError(f"reward_fn returned {scores.shape[0]} scores for {len(batch)} samples; it "
                                    "must return one float per query")
        sources["fn"] = scores
    combine = ctx.topology.models.reward_combine
    if len(sources) == 1:
        rewards = next(iter(sources.values()))
    elif combine in sources:
        rewards = sources[combine]
    else:
        stacked = np.stack(list(sources.values()))
        rewards = stacked.mean(0) if combine == "mean" else stacked.sum(0)
    bad = ~np.isfinite(rewards)
    if bad.any():
        ids = [batch.sample_ids()[i] for i in np.flatnonzero(bad)]
        raise PoisonRecordError(f"reward: non-finite reward for samples {ids}; check the reward model/function")
    metrics = {k: v.astype(np.float32) for k, v in sources.items()} if len(sources) > 1 else None
    return [batch.replace(rewards=rewards.astype(np.float32), reward_metrics=metrics)]
