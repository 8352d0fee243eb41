"""Test-only reference formulas (oracles) that no production code needs.

Production code reads the running std from ``expstream.state.Moments``; these tests check the
Python merge of :func:`expstream.rl.moments.moments_merge` with the plain formula below.
"""

from __future__ import annotations

import math

import torch


def moments_std(count: float, m2: float) -> float:
    """Unbiased (Bessel) std of all samples merged so far: ``sqrt(M2 / (count − 1))`` (docs/numerics.md §9).

    count == 0 (nothing seen) → NaN; 0 < count <= 1 (a first batch of one element) → inf, so a
    normalised reward becomes 0 as in the seed; an all-equal history gives 0.
    """
    count, m2 = float(count), float(m2)
    if count <= 0:
        return math.nan
    if count <= 1:
        return math.inf
    return math.sqrt(max(m2, 0.0) / (count - 1.0))


# short constructors for hand-written tensors in tests
def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def L(x):  # noqa: N802 - reads like a type tag in the tables
    return torch.tensor(x, dtype=torch.long)


def B(x):  # noqa: N802
    return torch.tensor(x, dtype=torch.bool)


# tiny weights for the weight-store tests (tests/test_weights.py, tests/test_objstore.py): no model to load
def small_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """The state dict of :class:`Small`, seeded (a different ``seed``: different weights, same shapes)."""
    g = torch.Generator().manual_seed(seed)
    return {"lin.weight": torch.randn(3, 4, generator=g), "lin.bias": torch.randn(3, generator=g)}


class Small(torch.nn.Module):
    """A Linear(4, 3): what a follower loads :func:`small_state_dict` into."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
