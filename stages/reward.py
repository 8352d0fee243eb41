"""reward: the scalar reward per sample from one or several reward sources (expstream/rewards/sources.py).

``rewards.sources: null`` (the default): a reward model (``models.reward``) and/or a Python reward
function (``models.reward_fn``, ``module:function`` called as ``fn(queries, prompts, labels)``);
with both, ``models.reward_combine`` (sum | mean | model | fn) combines them and each score is
kept in ``reward_metrics`` under ``model`` and ``fn``.

``rewards.sources`` names the sources (model, fn, http). Per micro-batch:

1. route each sample by its label through ``rewards.recipe`` (unrouted label -> poison sample);
2. call each source once with the sub-batch of its rows (concurrently, one thread per source);
3. combine with ``rewards.combine`` over the sources that scored each sample;
4. write ``rewards``, every source's score in ``reward_metrics[<source>]`` (0.0 where it did not
   score the sample) and, with a recipe, ``info["reward_routed.<source>"]`` (1.0 scored, 0.0 not).

docs/reward.md "Sources and recipes" has the rules.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.models.resolve import combine_fn, model_dir
from expstream.rewards.sources import (
    ROUTED_INFO_PREFIX,
    build_sources,
    close_sources,
    combine_scores,
    route,
    score_sources,
)
from schemas import SampleBatch
from stages.context import StageContext


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import load_tokenizer

    ctx.models["tokenizer"] = load_tokenizer(model_dir(ctx.topology, "tokenizer"))
    sources = build_sources(ctx.topology, ctx)
    ctx.models["reward_sources"] = sources
    if ctx.topology.rewards.sources is None:  # the single-source keys, as before (tests and benches spy on them)
        if "model" in sources:
            ctx.models["rm"] = sources["model"].model
        if "fn" in sources:
            ctx.models["reward_fn"] = sources["fn"].fn
    ctx.models["reward_combine_fn"] = combine_fn(ctx.topology)
    if len(sources) > 1:
        ctx.models["reward_pool"] = ThreadPoolExecutor(len(sources), thread_name_prefix="reward-source")


def teardown(ctx: StageContext) -> None:
    """Close the sources (HTTP sessions) and the thread pool; safe to call twice."""
    close_sources(ctx.models.pop("reward_sources", {}))
    pool = ctx.models.pop("reward_pool", None)
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    topo = ctx.topology
    sources = ctx.models["reward_sources"]
    routing = route(batch, topo.rewards, list(sources))
    scores = score_sources(batch, sources, routing, ctx.models.get("reward_pool"))
    legacy = topo.rewards.sources is None
    if legacy:
        rule = topo.models.reward_combine
    else:
        rule = "custom" if ctx.models.get("reward_combine_fn") is not None else topo.rewards.combine
    if legacy and len(scores) == 1:
        rewards = next(iter(scores.values()))
    else:
        rewards = combine_scores(scores, routing.mask, rule, topo.rewards.weights, ctx.models.get("reward_combine_fn"))
    bad = ~np.isfinite(rewards)
    if bad.any():
        ids = [batch.sample_ids()[i] for i in np.flatnonzero(bad)]
        raise PoisonRecordError(f"reward: non-finite reward for samples {ids}; check the reward model/function")
    changes = {"rewards": rewards.astype(np.float32)}
    if ctx.metrics is not None and len(rewards):
        ctx.metrics.reward_mean.set(float(np.mean(rewards)))
    if not legacy or len(scores) > 1:
        changes["reward_metrics"] = {k: v.astype(np.float32) for k, v in scores.items()}
    else:
        changes["reward_metrics"] = None
    if not routing.complete:
        routed = {f"{ROUTED_INFO_PREFIX}{n}": m.astype(np.float32) for n, m in routing.mask.items()}
        changes["info"] = {**(batch.info or {}), **routed}
    return [batch.replace(**changes)]
