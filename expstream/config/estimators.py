"""The one table of estimators: every advantage and KL estimator name, and what each one needs.

Config validation (``expstream.config.topology``), the advantage stage, ``expstream run`` and the math
(``expstream.rl.numerics``) all read this table, so adding an estimator is one row here plus its
formula, and no list elsewhere can fall out of step with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "CROSS_BATCH_ESTIMATORS",
    "ESTIMATORS",
    "GROUP_ESTIMATORS",
    "KL_ESTIMATORS",
    "TABLE",
    "Estimator",
    "estimator",
]

#: Group reward shaping (docs/numerics.md §4.3), the ``shaping`` of an :class:`Estimator`.
SHAPINGS = ("none", "leave_one_out", "mean", "zscore")


@dataclass(frozen=True)
class Estimator:
    """What one advantage estimator needs from the pipeline.

    * ``shaping``: how the scalar rewards of one prompt group are shaped before the estimator
      runs (docs/numerics.md §4.3): ``none`` (per-sample), ``leave_one_out`` (rloo), ``mean`` (centring) or
      ``zscore`` (group norm);
    * ``whiten``: ``algo.advantages_norm`` whitens its advantages per experience (docs/numerics.md §7.1);
    * ``cross_batch``: ``algo.advantage_cross_batch_norm`` applies to it (as in the
      seed, docs/numerics.md §7.2).
    """

    name: str
    shaping: str
    whiten: bool
    cross_batch: bool

    def __post_init__(self) -> None:
        if self.shaping not in SHAPINGS:
            raise ValueError(f"estimator {self.name}: shaping {self.shaping!r} not in {SHAPINGS}")

    @property
    def group(self) -> bool:
        """Shapes rewards within a prompt group, so the advantage stage must gather the whole group
        (Redis group buffers) and the run needs ``n_samples_per_prompt >= 2``."""
        return self.shaping != "none"

    @property
    def divides_by_n_minus_1(self) -> bool:
        """Its shaping divides by n − 1 (leave-one-out mean, unbiased std): n = 1 is an error,
        where centring alone just gives 0."""
        return self.shaping in ("leave_one_out", "zscore")


#: name -> Estimator, in the order error messages list them. ``grpo`` is an alias of
#: ``group_norm``; ``dr_grpo`` is group-mean centring without the std division (Dr. GRPO).
TABLE: Mapping[str, Estimator] = MappingProxyType({e.name: e for e in (
    Estimator("gae", shaping="none", whiten=True, cross_batch=True),
    Estimator("reinforce", shaping="none", whiten=True, cross_batch=True),
    Estimator("reinforce_baseline", shaping="mean", whiten=True, cross_batch=True),
    Estimator("rloo", shaping="leave_one_out", whiten=True, cross_batch=False),
    Estimator("group_norm", shaping="zscore", whiten=False, cross_batch=False),
    Estimator("grpo", shaping="zscore", whiten=False, cross_batch=False),
    Estimator("dr_grpo", shaping="mean", whiten=False, cross_batch=False),
    Estimator("cpgd", shaping="none", whiten=False, cross_batch=False),
)})

ESTIMATORS: tuple[str, ...] = tuple(TABLE)
GROUP_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in TABLE.items() if e.group)
CROSS_BATCH_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in TABLE.items() if e.cross_batch)

def uses_window(algo: Any) -> bool:
    """The advantage stage holds samples in a cross-batch normalisation window (``algo``: AlgoConfig);
    only then has a finite run something to release at the end of its input."""
    return algo.advantage_cross_batch_norm == "window" and algo.advantage_estimator in CROSS_BATCH_ESTIMATORS


#: Token-level KL estimators of ``compute_approx_kl`` (docs/numerics.md §3).
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")


def estimator(name: str) -> Estimator:
    """The table row of ``name``; an unknown name is a ValueError listing the allowed ones."""
    try:
        return TABLE[name]
    except KeyError:
        raise ValueError(f"unknown advantage estimator {name!r}; allowed: {', '.join(ESTIMATORS)}") from None
