"""Hypothesis property tests for expstream.rl.numerics.

Expectations are computed here (numpy / plain Python), never by the function under test.
"""

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from expstream.rl import moments as running
from expstream.rl import numerics as nx
from tests.tensors import moments_std

SETTINGS = settings(max_examples=60, deadline=None)

finite32 = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def groups(draw, min_n=2, max_n=6, max_g=4):
    g = draw(st.integers(1, max_g))
    n = draw(st.integers(min_n, max_n))
    vals = draw(st.lists(st.lists(finite32, min_size=n, max_size=n), min_size=g, max_size=g))
    return np.array(vals, dtype=np.float32)


@st.composite
def masked_batch(draw, min_b=1, max_b=4, max_a=6):
    b = draw(st.integers(min_b, max_b))
    a = draw(st.integers(1, max_a))
    x = np.array(
        draw(st.lists(st.lists(finite32, min_size=a, max_size=a), min_size=b, max_size=b)), dtype=np.float32
    )
    m = np.array(
        draw(st.lists(st.lists(st.booleans(), min_size=a, max_size=a), min_size=b, max_size=b)), dtype=bool
    )
    return x, m


# ---------------------------------------------------------------------------------------------
# group shaping
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(groups())
def test_group_norm_zero_mean_unit_std(r):
    out = nx.shape_group_rewards(torch.from_numpy(r), "group_norm").numpy().astype(np.float64)
    x = r.astype(np.float64)
    for g in range(r.shape[0]):
        if np.all(x[g] == x[g, 0]):
            assert np.all(out[g] == 0.0)
            continue
        sigma = x[g].std(ddof=1)
        assert abs(out[g].mean()) < 1e-5
        # std of (r - mu)/(sigma + 1e-9) is sigma/(sigma + 1e-9) (= 1 up to the eps)
        assert abs(out[g].std(ddof=1) - sigma / (sigma + 1e-9)) < 1e-5


@SETTINGS
@given(groups())
def test_rloo_excludes_self_and_sums_to_zero(r):
    out = nx.shape_group_rewards(torch.from_numpy(r), "rloo").numpy().astype(np.float64)
    x = r.astype(np.float64)
    n = x.shape[1]
    for g in range(x.shape[0]):
        for i in range(n):
            others = np.delete(x[g], i)
            assert abs(out[g, i] - (x[g, i] - others.mean())) < 1e-5
        assert abs(out[g].sum()) < 1e-4


@SETTINGS
@given(groups(min_n=1))
def test_reinforce_baseline_is_centred(r):
    out = nx.shape_group_rewards(torch.from_numpy(r), "reinforce_baseline").numpy().astype(np.float64)
    x = r.astype(np.float64)
    np.testing.assert_allclose(out, x - x.mean(axis=1, keepdims=True), atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# estimators
# ---------------------------------------------------------------------------------------------


def reward_to_go(x, m, gamma=1.0):
    out = np.zeros_like(x, dtype=np.float64)
    for b in range(x.shape[0]):
        run = 0.0
        for t in range(x.shape[1] - 1, -1, -1):
            run = (x[b, t] if m[b, t] else 0.0) + gamma * run
            out[b, t] = run if m[b, t] else 0.0
    return out


@SETTINGS
@given(masked_batch())
def test_gae_gamma_lambda_one_zero_values_is_reward_to_go(batch):
    x, m = batch
    adv, ret = nx.gae(torch.from_numpy(x), torch.zeros(x.shape), torch.from_numpy(m), 1.0, 1.0)
    expected = reward_to_go(x.astype(np.float64), m)
    np.testing.assert_allclose(adv.numpy(), expected, atol=1e-4, rtol=0)
    np.testing.assert_allclose(ret.numpy(), expected, atol=1e-4, rtol=0)


@SETTINGS
@given(masked_batch(), st.sampled_from([1.0, 0.9, 0.5]))
def test_cumulative_returns_matches_loop(batch, gamma):
    x, m = batch
    out = nx.cumulative_returns(torch.from_numpy(x), torch.from_numpy(m), gamma)
    np.testing.assert_allclose(out.numpy(), reward_to_go(x.astype(np.float64), m, gamma), atol=1e-4, rtol=0)


@SETTINGS
@given(
    masked_batch(), st.sampled_from(["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "cpgd"])
)
def test_compute_advantages_padding_is_zero(batch, est):
    x, m = batch
    xt, mt = torch.from_numpy(x), torch.from_numpy(m)
    adv, ret, _ = nx.compute_advantages(
        est,
        xt,
        mt,
        values=xt * 0.5,
        raw_rewards=xt[:, 0],
        gamma=0.9,
        lambd=0.95,
        advantages_norm=True,
        advantage_clip=1.0,
    )
    assert torch.all(adv[~mt] == 0) and torch.all(ret[~mt] == 0)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()


@SETTINGS
@given(masked_batch())
def test_whitening_zero_mean_over_mask(batch):
    x, m = batch
    x = np.where(m, x, 0.0).astype(np.float32)  # our padding is 0
    out = nx.whiten(torch.from_numpy(x), torch.from_numpy(m), 1e-8).numpy().astype(np.float64)
    assert np.all(out[~m] == 0.0)  # padding is never written
    vals = x[m].astype(np.float64)
    if vals.size < 2:
        assert np.array_equal(out, x)
        return
    w = out[m]
    assert abs(w.mean()) < 1e-5
    sd = vals.std(ddof=1)
    if sd > 1e-3:
        assert abs(w.std(ddof=1) - sd / (sd + 1e-8)) < 1e-4


# ---------------------------------------------------------------------------------------------
# KL
# ---------------------------------------------------------------------------------------------

logp = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False, width=32)


@SETTINGS
@given(st.data(), st.sampled_from(["k1", "k2", "k3"]))
def test_kl_masked_zero_and_k3_nonnegative(data, est):
    b = data.draw(st.integers(1, 3))
    a = data.draw(st.integers(1, 5))
    lp = np.array(
        data.draw(st.lists(st.lists(logp, min_size=a, max_size=a), min_size=b, max_size=b)), np.float32
    )
    blp = np.array(
        data.draw(st.lists(st.lists(logp, min_size=a, max_size=a), min_size=b, max_size=b)), np.float32
    )
    m = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=a, max_size=a), min_size=b, max_size=b)))
    lp_garbage = np.where(m, lp, np.nan).astype(np.float32)  # garbage at masked positions
    blp_garbage = np.where(m, blp, np.inf).astype(np.float32)
    kl = nx.compute_approx_kl(
        torch.from_numpy(lp_garbage), torch.from_numpy(blp_garbage), torch.from_numpy(m), est
    )
    kl = kl.numpy()
    assert kl.dtype == np.float32
    assert np.all(kl[~m] == 0.0)
    d = lp.astype(np.float64) - blp.astype(np.float64)
    if est == "k3":
        assert np.all(kl >= 0.0)
        expected = np.where(m, np.exp(-d) - 1 + d, 0.0)
    elif est == "k2":
        expected = np.where(m, d * d / 2, 0.0)
    else:
        expected = np.where(m, d, 0.0)
    np.testing.assert_allclose(kl, expected, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(
    st.lists(
        st.floats(min_value=-(2.0**-10), max_value=2.0**-10, allow_nan=False, width=32),
        min_size=1,
        max_size=8,
    )
)
def test_k3_nonnegative_for_tiny_differences(ds):
    lp = torch.tensor(ds, dtype=torch.float32)[None]
    kl = nx.compute_approx_kl(lp, torch.zeros_like(lp), None, "k3")
    assert torch.all(kl >= 0)


# ---------------------------------------------------------------------------------------------
# running moments
# ---------------------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.lists(finite32, min_size=0, max_size=6), min_size=1, max_size=6))
def test_moments_merge_is_pooled(batches):
    c, m, m2 = 0.0, 0.0, 0.0
    for bat in batches:
        c, m, m2 = running.moments_merge(c, m, m2, torch.tensor(bat, dtype=torch.float32))
    pooled = np.array([v for bat in batches for v in bat], dtype=np.float32).astype(np.float64)
    assert c == pooled.size
    if pooled.size == 0:
        return
    assert abs(m - pooled.mean()) < 1e-9
    if pooled.size >= 2:
        assert abs(moments_std(c, m2) - pooled.std(ddof=1)) < 1e-9
    else:
        assert moments_std(c, m2) == math.inf
