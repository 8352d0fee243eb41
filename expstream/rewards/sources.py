"""Reward sources: what scores a sample, which samples each one scores, and how the scores combine.

The seed's reward engine (``RewardComputationEngine``: gather -> process -> aggregate), streamed
one micro-batch at a time:

1. **Route** (:func:`route`): each sample's ``label`` picks its sources from ``rewards.recipe``
   (``"*"`` for every other label; no recipe: every source scores every sample). A label with
   no route and no ``"*"`` is a :class:`PoisonRecordError` naming the samples: the runner bisects
   the micro-batch and only those samples go to the dead-letter topic.
2. **Score** (:func:`score_sources`): each source is called once, with ``batch.select(rows)``,
   the sub-batch of its routed rows only (a reward model never sees a sample its recipe does
   not route to it). Sources run concurrently (a thread each) so a remote judge's latency
   overlaps a local model's forward pass.
3. **Combine** (:func:`combine_scores`): ``sum | mean | weighted | max`` over the sources that
   scored each sample, or ``module:function`` called with every source's full-length scores
   (NaN where a source did not score the sample).

A source is anything with ``name``, ``score(batch) -> float32 (len(batch),)`` and ``close()``:
:class:`ModelSource` (a sequence-classification model, or a vision-language one fed the pixels),
:class:`FnSource` (``module:function``) and ``expstream.rewards.http_client.HttpRewardSource`` (a server
speaking the /score API).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from expstream.config.topology import RewardsConfig, Topology
from expstream.errors import ConfigError, ExpstreamError, PoisonRecordError
from expstream.models.resolve import import_function, model_dir, reward_fn, source_model_dir
from schemas import SampleBatch

__all__ = ["RewardSource", "ModelSource", "FnSource", "Routing", "build_sources", "close_sources", "route",
           "score_sources", "combine_scores", "ROUTED_INFO_PREFIX"]

log = logging.getLogger("expstream.reward_sources")

#: ``info`` key prefix of the routing mask: ``info["reward_routed.<source>"]`` is 1.0 where the
#: source scored the sample, 0.0 where the recipe did not route it there (its reward_metrics entry
#: is then 0.0, a placeholder: NaN cannot travel, the wire refuses non-finite floats).
ROUTED_INFO_PREFIX = "reward_routed."


class RewardSource(Protocol):
    name: str

    def score(self, batch: SampleBatch) -> np.ndarray:
        """float32 (len(batch),): one score per row of ``batch`` (already the routed sub-batch)."""
        ...

    def close(self) -> None: ...


class ModelSource:
    """A sequence-classification reward model, scored at the last token (padded or packed layout).

    ``vision``: a vision-language reward model's :class:`expstream.models.vl.VisionInputs` (None for a text
    model): the samples' pixels, grids and ``mm_token_type_ids`` are then fed to it, as to the actor.
    """

    def __init__(self, name: str, model: Any, vision: Any = None) -> None:
        self.name, self.model, self.vision = name, model, vision

    @classmethod
    def load(cls, name: str, path: Any, topo: Topology, model: Any = None) -> ModelSource:
        """The source of the reward model at ``path`` (``model``: its weights when loaded already),
        with its own VisionInputs when it is a vision-language model."""
        from expstream.models.vl import load_reward_model, vision_for

        if model is None:
            model = load_reward_model(path, device=topo.models.device)
        return cls(name, model, vision_for(topo, path))

    def score(self, batch: SampleBatch) -> np.ndarray:
        from expstream.models.forward import forward_reward

        return forward_reward(self.model, batch, vision=self.vision)

    def close(self) -> None:
        pass


class FnSource:
    """A Python reward function, called as in the seed: ``fn(queries, prompts, labels)``.

    ``queries`` are the decoded prompt + repaired response tokens (no padding). A function that
    also takes a ``references`` keyword (or ``**kwargs``) gets the reference answers too, so a
    math checker can route on ``label`` (e.g. ``math``) and compare with ``reference``. A function
    with an ``images`` parameter gets each sample's images as a list of RGB PIL images (``[]`` for a
    text-only sample), read back from the run's blob store.
    """

    def __init__(self, name: str, fn: Callable, tokenizer: Any, *, what: str = "reward_fn",
                 blob_store: str | None = None) -> None:
        self.name, self.fn, self.tokenizer, self.what = name, fn, tokenizer, what
        self.blob_store = blob_store
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: call it the plain way
            params = []
        self.wants_references = any(p.name == "references" or p.kind is p.VAR_KEYWORD for p in params)
        self.wants_images = any(p.name == "images" for p in params)

    def _images(self, batch: SampleBatch) -> list[list[Any]]:
        from expstream.models.blobs import open_blob_store
        from expstream.models.media import load_image

        if not any(batch.images):
            return [[] for _ in range(len(batch))]
        store = open_blob_store(self.blob_store or "")
        return [[load_image(store.get(r), f"sample {sid} image {i}") for i, r in enumerate(refs)]
                for sid, refs in zip(batch.sample_ids(), batch.images, strict=True)]

    def score(self, batch: SampleBatch) -> np.ndarray:
        tok = self.tokenizer
        queries = [tok.decode(list(p) + list(a), skip_special_tokens=False)
                   for p, a in zip(batch.prompt_ids.rows(), batch.action_ids.rows(), strict=True)]
        args = (queries, list(batch.prompt), list(batch.label))
        kwargs: dict[str, Any] = {"references": list(batch.reference)} if self.wants_references else {}
        if self.wants_images:
            kwargs["images"] = self._images(batch)
        out = self.fn(*args, **kwargs)
        scores = np.asarray(out, dtype=np.float32).reshape(-1)
        if scores.shape != (len(batch),):
            raise PoisonRecordError(f"{self.what} returned {scores.shape[0]} scores for {len(batch)} samples; it "
                                    "must return one float per query")
        return scores

    def close(self) -> None:
        pass


def build_sources(topo: Topology, ctx: Any) -> dict[str, RewardSource]:
    """The reward sources the topology names, in its order, models loaded (``ctx.models`` gives
    the tokenizer when loaded already).

    ``rewards.sources: null``: the single-source configuration, ``model`` (models.reward) then
    ``fn`` (models.reward_fn), as before the rewards block existed.
    """
    from expstream.models.hf import load_tokenizer
    from expstream.models.vl import load_reward_model

    models = topo.models
    tokenizer = getattr(ctx, "models", {}).get("tokenizer")

    def tok() -> Any:
        nonlocal tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer(model_dir(topo, "tokenizer"))
        return tokenizer

    out: dict[str, RewardSource] = {}
    if topo.rewards.sources is None:
        if models.reward:
            out["model"] = ModelSource.load("model", model_dir(topo, "reward"), topo)
        if models.reward_fn:
            out["fn"] = FnSource("fn", reward_fn(models.reward_fn), tok(), blob_store=topo.run.blob_store)
        return out
    # two sources on one directory share the weights (each keeps its own VisionInputs: sources run in threads)
    loaded: dict[str, Any] = {}
    for name, cfg in topo.rewards.sources.items():
        if cfg.kind == "model":
            path = str(source_model_dir(topo, cfg))
            if path not in loaded:
                loaded[path] = load_reward_model(path, device=models.device)
            out[name] = ModelSource.load(name, path, topo, loaded[path])
        elif cfg.kind == "fn":
            out[name] = FnSource(name, import_function(cfg.fn or "", f"{cfg.where}.fn"), tok(), what=f"{cfg.where}.fn",
                                 blob_store=topo.run.blob_store)
        else:
            out[name] = _http_source(cfg, tok())
    return out


def _http_source(cfg: Any, tokenizer: Any) -> RewardSource:
    try:
        from expstream.rewards.http_client import HttpRewardSource
    except ImportError as exc:
        raise ConfigError(f"http sources need expstream.rewards.http_client ({exc})", field=f"{cfg.where}.kind",
                          fix="install aiohttp (pip install 'aiohttp>=3.9') in this environment, or use a "
                              "model or fn source") from exc
    # the tokenizer: each item's "query" is decoded from the token ids, exactly as a fn source sees it
    return HttpRewardSource(cfg.name, cfg.url, timeout_s=cfg.timeout_s, max_in_flight=cfg.max_in_flight,
                            batch_size=cfg.batch_size, retries=cfg.retries, tokenizer=tokenizer)


def close_sources(sources: Mapping[str, RewardSource]) -> None:
    """Close every source (an HTTP session, a pool); one failing to close does not stop the others."""
    for name, src in sources.items():
        try:
            src.close()
        except Exception as exc:  # closing at exit: report, never mask the real outcome
            log.warning("reward source %s: close failed (%s: %s)", name, type(exc).__name__, exc)


@dataclass
class Routing:
    """Which rows each source scores: ``rows[name]`` (int indices, ascending) and ``mask[name]``
    (bool (B,)); ``complete`` when every source scores every row (no recipe)."""

    rows: dict[str, np.ndarray]
    mask: dict[str, np.ndarray]
    complete: bool


def route(batch: SampleBatch, rewards: RewardsConfig, names: list[str]) -> Routing:
    """Step 1: the recipe's routes for ``batch``; a sample whose label has no route is poison."""
    b = len(batch)
    if rewards.recipe is None:
        full = np.ones(b, dtype=bool)
        return Routing({n: np.arange(b) for n in names}, {n: full for n in names}, complete=True)
    mask = {n: np.zeros(b, dtype=bool) for n in names}
    unrouted: list[int] = []
    for i, label in enumerate(batch.label):
        routed = rewards.route_of(label)
        if routed is None:
            unrouted.append(i)
            continue
        for n in routed:
            mask[n][i] = True
    if unrouted:
        ids = batch.sample_ids()
        shown = ", ".join(f"{ids[i]} (label {batch.label[i]!r})" for i in unrouted[:5])
        raise PoisonRecordError(f"reward: no route in rewards.recipe for {len(unrouted)} sample(s): {shown}; add "
                                "their label to rewards.recipe, or a \"*\" route for every other label")
    return Routing({n: np.flatnonzero(m) for n, m in mask.items()}, mask, complete=False)


def score_sources(batch: SampleBatch, sources: Mapping[str, RewardSource], routing: Routing,
                  pool: ThreadPoolExecutor | None = None) -> dict[str, np.ndarray]:
    """Step 2: each source once, on its routed rows only; full-length float32 (B,) scores, 0.0 where
    a source did not score a row.

    With a ``pool``, sources run concurrently. When several fail, a retriable error (a reward server
    down) wins over a poison one, so an outage never dead-letters a sample; else the first source's.
    """
    b = len(batch)
    work = {n: routing.rows[n] for n in sources if routing.rows[n].size}

    def one(name: str) -> np.ndarray:
        rows = work[name]
        sub = batch if rows.size == b else batch.select(rows)
        scores = np.asarray(sources[name].score(sub), dtype=np.float32).reshape(-1)
        if scores.shape != (rows.size,):
            raise PoisonRecordError(f"reward source {name} returned {scores.shape[0]} scores for {rows.size} "
                                    "samples; it must return one per sample")
        return scores

    results: dict[str, np.ndarray | BaseException] = {}
    if pool is not None and len(work) > 1:
        futures = {n: pool.submit(one, n) for n in work}
        for n, fut in futures.items():
            exc = fut.exception()
            results[n] = exc if exc is not None else fut.result()
    else:
        for n in work:
            try:
                results[n] = one(n)
            except Exception as exc:  # collected, then raised by the rule below
                results[n] = exc
                break
    errors = [r for r in results.values() if isinstance(r, BaseException)]
    if errors:
        retriable = [e for e in errors if isinstance(e, ExpstreamError) and e.retriable]
        raise (retriable or errors)[0]
    out: dict[str, np.ndarray] = {}
    for name in sources:
        got = results.get(name)
        if isinstance(got, np.ndarray) and got.size == b:
            full = got
        else:
            full = np.zeros(b, dtype=np.float32)
            if isinstance(got, np.ndarray):
                full[work[name]] = got
        bad = ~np.isfinite(full)
        if bad.any():
            ids = [batch.sample_ids()[i] for i in np.flatnonzero(bad)]
            raise PoisonRecordError(f"reward source {name}: non-finite score for samples {ids}; check that "
                                    "reward model/function/server")
        out[name] = full
    return out


def combine_scores(scores: Mapping[str, np.ndarray], mask: Mapping[str, np.ndarray], rule: str,
                   weights: Mapping[str, float] | None = None, fn: Callable | None = None) -> np.ndarray:
    """Step 3: one float32 reward per sample, over the sources that scored it.

    ``rule``: ``sum``, ``mean``, ``max``, ``weighted`` (Σ weight·score, weights not renormalised
    over the routed sources: a sample the recipe sends to one source gets that source's weighted
    score), a source name (the legacy ``models.reward_combine: model | fn``), or ``custom`` with
    ``fn(scores) -> (B,)`` given each source's scores with NaN where it did not score a sample.
    """
    names = list(scores)
    if rule in scores:
        return scores[rule].astype(np.float32)
    if rule == "custom":
        if fn is None:
            raise ValueError("combine_scores: rule 'custom' needs fn")
        given = {n: np.where(mask[n], scores[n], np.float32(np.nan)).astype(np.float32) for n in names}
        out = np.asarray(fn(given), dtype=np.float32).reshape(-1)
        b = len(next(iter(scores.values())))
        if out.shape != (b,):
            raise PoisonRecordError(f"rewards.combine function returned {out.shape[0]} rewards for {b} samples; "
                                    "it must return one per sample")
        return out
    if rule == "weighted":
        w = weights or {}
        stacked = np.stack([np.where(mask[n], np.float32(w[n]) * scores[n], np.float32(0)) for n in names])
        return stacked.sum(0).astype(np.float32)
    if rule == "max":
        return np.stack([np.where(mask[n], scores[n], np.float32(-np.inf)) for n in names]).max(0).astype(np.float32)
    stacked = np.stack([np.where(mask[n], scores[n], np.float32(0)) for n in names])
    total = stacked.sum(0)
    if rule == "sum":
        return total.astype(np.float32)
    if rule == "mean":
        if all(mask[n].all() for n in names):
            return stacked.mean(0).astype(np.float32)  # every source scored every sample: numpy's own mean
        count = np.stack([mask[n] for n in names]).sum(0).astype(np.float32)
        return (total / count).astype(np.float32)
    raise ValueError(f"combine_scores: unknown rule {rule!r}")
