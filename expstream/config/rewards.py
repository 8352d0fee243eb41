"""The ``rewards:`` topology block: several reward sources, how they combine, which samples each scores.

Read by :mod:`expstream.config.topology` (which re-exports :class:`RewardsConfig`); this module checks the
block on its own terms (kinds, kind-specific keys, names, combine rule, weights, recipe) with an
error that names the field and the fix. What only the machine can check (a model directory
exists, a ``module:function`` imports) is :mod:`expstream.models.resolve`'s job. docs/topology.md has
every key, docs/reward.md "Sources and recipes" the semantics.

``sources: null`` keeps the single-source behaviour of ``models.reward`` / ``models.reward_fn`` /
``models.reward_combine`` byte for byte.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from expstream.config.fieldtypes import check_block, check_fields
from expstream.config.redaction import redact_url
from expstream.errors import ConfigError, unknown_key_error

__all__ = ["SOURCE_KINDS", "COMBINE_RULES", "DEFAULT_ROUTE", "RewardSourceConfig", "RewardsConfig"]

#: kind -> the keys a source of that kind takes besides ``kind`` (first: the required one).
SOURCE_KINDS: dict[str, tuple[str, ...]] = {
    "model": ("path",),
    "fn": ("fn",),
    "http": ("url", "timeout_s", "max_in_flight", "batch_size", "retries"),
}
#: Built-in combine rules; anything else must be ``module:function``.
COMBINE_RULES = ("sum", "mean", "weighted", "max")
#: The recipe key that routes every label without a route of its own.
DEFAULT_ROUTE = "*"
# A source name is a reward_metrics key and the suffix of an info key (reward_routed.<name>):
# keep it to characters every consumer (CSV headers, dotted diff keys, other languages) takes as is.
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass
class RewardSourceConfig:
    """One entry of ``rewards.sources``; ``name`` is its key there (set by the loader)."""

    kind: str
    name: str = ""
    path: str | None = None  # model: builtin:tiny or a sequence-classification directory
    fn: str | None = None  # fn: "module:function", called as fn(queries, prompts, labels)
    url: str | None = None  # http: http://host:port of a server speaking the /score API (docs/reward.md)
    # http: seconds one request may take before it counts as a failure (then retried). 10 s covers an
    # LLM judge scoring a batch of 8 on a loaded server; a hung server is noticed within that.
    timeout_s: float = 10.0
    max_in_flight: int = 8  # http: concurrent requests per consumer (the bench: 8 in flight ~ 8x one)
    batch_size: int = 8  # http: items per request
    retries: int = 3  # http: attempts after the first, with backoff, before RewardServerUnavailable

    @property
    def where(self) -> str:
        return f"rewards.sources.{self.name}"

    @classmethod
    def from_raw(cls, name: str, raw: Any) -> RewardSourceConfig:
        where = f"rewards.sources.{name}"
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"source name {name!r} is not a plain name", field=where,
                              fix="use letters, digits, '_' and '-' only (it becomes a reward_metrics key)")
        data = check_block(raw, where)
        kind = data.get("kind")
        if kind not in SOURCE_KINDS:
            raise ConfigError(f"kind: got {kind!r}", field=f"{where}.kind",
                              fix=f"set kind to one of {', '.join(SOURCE_KINDS)}")
        allowed = ("kind", *SOURCE_KINDS[kind])
        every = {f.name for f in dataclasses.fields(cls)} - {"name"}
        for key in data:
            if key in every and key not in allowed:
                owner = next(k for k, keys in SOURCE_KINDS.items() if key in keys)
                raise ConfigError(f"{key!r} is a key of kind {owner} sources, not of kind {kind}",
                                  field=f"{where}.{key}", fix=f"remove it, or set kind: {owner}")
            if key not in allowed:
                raise unknown_key_error(where, key, allowed)
        required = SOURCE_KINDS[kind][0]
        if data.get(required) in (None, ""):
            example = {"model": "builtin:tiny", "fn": "expstream.rewards:contains_label",
                       "http": "http://127.0.0.1:8000"}[kind]
            raise ConfigError(f"a {kind} source needs {required!r}", field=f"{where}.{required}",
                              fix=f"add {required}: {example}")
        return cls(**check_fields(cls, {**data, "name": name}, where))

    def __post_init__(self) -> None:
        w = self.where
        if self.kind == "fn" and self.fn is not None and ":" not in self.fn:
            raise ConfigError(f"got {self.fn!r}", field=f"{w}.fn", fix="write it as 'package.module:function'")
        if self.kind == "http":
            if not (self.url or "").startswith(("http://", "https://")):
                raise ConfigError(f"got {redact_url(self.url)!r}", field=f"{w}.url",
                                  fix="give the server's base address, e.g. http://127.0.0.1:8000")
            for key, low in (("timeout_s", 0.0), ("max_in_flight", 1), ("batch_size", 1), ("retries", 0)):
                value = getattr(self, key)
                ok = value > low if key == "timeout_s" else value >= low
                if not ok:
                    raise ConfigError(f"got {value!r}", field=f"{w}.{key}",
                                      fix=f"must be {'>' if key == 'timeout_s' else '>='} {low}")


@dataclass
class RewardsConfig:
    """The ``rewards:`` block (docs/topology.md "rewards")."""

    sources: dict[str, Any] | None = None  # name -> RewardSourceConfig after loading; null = models.* sources
    combine: str = "sum"  # sum | mean | weighted | max | "module:function"
    weights: dict[str, float] = field(default_factory=dict)  # combine: weighted
    recipe: dict[str, list[str]] | None = None  # label -> source names; "*" the default; null = all score all

    def __post_init__(self) -> None:
        if self.sources is None:
            self._check_without_sources()
            return
        if not isinstance(self.sources, dict) or not self.sources:
            raise ConfigError("an empty map has no source", field="rewards.sources",
                              fix="name at least one source, e.g. rm: {kind: model, path: builtin:tiny}; "
                                  "or null for models.reward / models.reward_fn")
        self.sources = {name: cfg if isinstance(cfg, RewardSourceConfig) else RewardSourceConfig.from_raw(name, cfg)
                        for name, cfg in self.sources.items()}
        names = list(self.sources)
        if self.combine not in COMBINE_RULES and ":" not in self.combine:
            raise ConfigError(f"got {self.combine!r}", field="rewards.combine",
                              fix=f"use one of {', '.join(COMBINE_RULES)} or 'module:function'")
        for name, weight in self.weights.items():
            if name not in self.sources:
                raise unknown_key_error("rewards.weights", name, names, what="source")
            if weight != weight or weight in (float("inf"), float("-inf")):
                raise ConfigError(f"got {weight!r}", field=f"rewards.weights.{name}", fix="give a finite number")
        if self.combine == "weighted":
            missing = [n for n in names if n not in self.weights]
            if missing:
                raise ConfigError(f"combine: weighted, but no weight for {', '.join(missing)}",
                                  field=f"rewards.weights.{missing[0]}",
                                  fix="give every source a weight (0 keeps its score in reward_metrics only)")
        elif self.weights:
            raise ConfigError(f"weights are used by combine: weighted only (combine is {self.combine!r})",
                              field="rewards.weights", fix="set rewards.combine: weighted, or remove the weights")
        if self.recipe is not None:
            self._check_recipe(names)

    def _check_recipe(self, names: list[str]) -> None:
        if not self.recipe:
            raise ConfigError("an empty recipe routes no label anywhere", field="rewards.recipe",
                              fix='add routes (label: [source, ...]; "*" for every other label), '
                                  "or null for every source on every sample")
        for label, routed in self.recipe.items():
            where = f"rewards.recipe.{label}"
            if not routed:
                raise ConfigError("no source: such a sample could not be scored", field=where,
                                  fix=f"list at least one of {', '.join(names)}")
            for name in routed:
                if name not in self.sources:
                    raise unknown_key_error(where, name, names, what="source")
            if len(set(routed)) != len(routed):
                raise ConfigError(f"a source is listed twice in {routed}", field=where, fix="list each source once")

    def _check_without_sources(self) -> None:
        fix = "with rewards.sources null the reward is models.reward / models.reward_fn; name sources to use it"
        if self.recipe is not None:
            raise ConfigError("a recipe routes labels to rewards.sources, which is null", field="rewards.recipe",
                              fix=fix)
        if self.weights:
            raise ConfigError("weights name rewards.sources, which is null", field="rewards.weights", fix=fix)
        if self.combine != "sum":
            raise ConfigError("combines rewards.sources, which is null", field="rewards.combine",
                              fix="use models.reward_combine for a reward model plus a reward_fn, or name "
                                  "rewards.sources to combine several")

    def route_of(self, label: str) -> list[str] | None:
        """The sources that score a sample with ``label`` (every source without a recipe); None:
        the recipe has no route for it (and no ``"*"``)."""
        if self.sources is None:
            return None
        if self.recipe is None:
            return list(self.sources)
        return self.recipe.get(label, self.recipe.get(DEFAULT_ROUTE))
