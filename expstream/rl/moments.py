"""Running statistics shared by a whole run, as scalar formulas: no torch, no Redis.

Two updates are applied to run-wide state, once per id, by every stage replica:

* :func:`moments_merge` — Chan's parallel merge of the running (count, mean, M2) with one batch
  (docs/numerics.md §9), for the running reward normalisation and the running cross-batch
  advantage normalisation;
* :func:`adaptive_kl_update` — one step of the adaptive KL controller (docs/numerics.md §10).

These are the only Python forms of the formulas. :class:`expstream.state.MemoryState` calls them;
:class:`expstream.state.RedisState` runs the same arithmetic as Lua scripts, written operation for
operation in the same order (tests/test_state_reference.py checks the Lua against these
functions), so both states give the same doubles.
"""

from __future__ import annotations

import numpy as np

from expstream.errors import ConfigError, PoisonRecordError

__all__ = ["batch_moments", "moments_merge", "merge_batch_moments", "adaptive_kl_update", "check_kl_update"]

#: The clip on the relative KL error of one controller step (Ziegler et al.; the seed's value).
KL_ERROR_CLIP = 0.2


def batch_moments(values: np.ndarray) -> tuple[int, float, float]:
    """(k, mean, M2) of one batch in float64 — what RedisState sends to its Lua merge.

    Non-finite values are a poison record (a NaN merged once would poison every later batch).
    """
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    if v.size == 0:
        return 0, 0.0, 0.0
    if not np.all(np.isfinite(v)):
        raise PoisonRecordError(
            f"non-finite reward values in batch ({int((~np.isfinite(v)).sum())} of {v.size})"
        )
    mean = float(v.mean())
    m2 = float(np.sum((v - mean) ** 2))
    return int(v.size), mean, m2


def merge_batch_moments(count: float, mean: float, m2: float, k: int, mean_b: float,
                        m2_b: float) -> tuple[float, float, float]:
    """Merge a batch's (k, mean_b, M2_b) into (count, mean, M2)::

        δ = mean_b − mean;  N = count + k
        mean ← mean + δ·k/N;  M2 ← M2 + M2_b + δ²·count·k/N;  count ← N

    The state starts at an exact zero, so ``mean`` and ``sqrt(M2 / (count − 1))`` are the exact
    pooled statistics of everything merged (the seed's prior count 1e-24 agrees to ~1e-12). An
    empty batch (k = 0) changes nothing. Same operation order as the Lua.
    """
    count, mean, m2 = float(count), float(mean), float(m2)
    if k > 0:
        total = count + k
        delta = mean_b - mean
        mean = mean + delta * k / total
        m2 = m2 + m2_b + delta * delta * count * k / total
        count = total
    return count, mean, m2


def moments_merge(count: float, mean: float, m2: float, batch: np.ndarray) -> tuple[float, float, float]:
    """Merge the values of ``batch`` (any array-like, e.g. a CPU tensor) into (count, mean, M2)."""
    return merge_batch_moments(count, mean, m2, *batch_moments(np.asarray(batch)))


def check_kl_update(target: float, horizon: float) -> None:
    """An adaptive controller needs a positive target and horizon (ConfigError naming the field)."""
    if not target > 0:
        raise ConfigError(
            f"target KL must be > 0, got {target!r}", field="kl_target", fix="set a positive target"
        )
    if not horizon > 0:
        raise ConfigError(
            f"KL horizon must be > 0, got {horizon!r}",
            field="kl_horizon",
            fix="set a positive horizon (e.g. 10000)",
        )


def adaptive_kl_update(value: float, current_kl: float, target: float | None, n_steps: float,
                       horizon: float = 10000) -> float:
    """One KL-coefficient update.

    Adaptive (``target`` set): ``e = clip(current/target − 1, −0.2, 0.2)``;
    ``value · (1 + e · n_steps / horizon)``, with n_steps = rollout_batch_size · n per update.
    Fixed controller (``target=None``, the default config): ``value`` unchanged (β = init_kl_coef
    for the whole run).
    """
    if target is None:
        return float(value)
    check_kl_update(target, horizon)
    e = float(current_kl) / float(target) - 1
    e = -KL_ERROR_CLIP if e < -KL_ERROR_CLIP else (KL_ERROR_CLIP if e > KL_ERROR_CLIP else e)
    return float(value) * (1 + e * float(n_steps) / float(horizon))
