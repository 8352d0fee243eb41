"""schemas.tensors.all_finite: the one-pass finiteness check the codec validates float fields with (issue 28 item 4)."""

from __future__ import annotations

import numpy as np
import pytest

from schemas.tensors import all_finite


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 17, 999])
def test_a_single_non_finite_value_anywhere_is_found(bad: float, where: int) -> None:
    x = np.random.default_rng(where).standard_normal(1000).astype(np.float32)
    x[where] = bad
    assert not all_finite(x)
    assert not all_finite(x.astype(np.float64))


def test_finite_values_whose_squares_overflow_are_finite() -> None:
    # x . x overflows float32 (|x| > ~1.8e19): the check must confirm element by element, not refuse
    x = np.array([3e38, -3e38, 1.0], np.float32)
    with np.errstate(over="ignore"):
        assert np.isinf(np.dot(x, x))
    assert all_finite(x)


def test_empty_and_2d_arrays() -> None:
    assert all_finite(np.empty(0, np.float32))
    assert all_finite(np.ones((3, 4), np.float32))
    m = np.ones((3, 4), np.float32)
    m[2, 3] = np.nan
    assert not all_finite(m)
