"""Hand-worked cases for expstream.rl.numerics (spec: docs/numerics.md).

Every expected value is derived here from first principles (arithmetic written out, or numpy),
never by calling the function under test.
"""

import math

import numpy as np
import pytest
import torch

from expstream.errors import ConfigError
from expstream.rl import moments as running
from expstream.rl import numerics as nx
from tests.tensors import B, moments_std, t


def close(a, b, atol=1e-6):
    np.testing.assert_allclose(
        np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64), atol=atol, rtol=0
    )


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §3 KL
# ---------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    lp = t([[-1.0, -2.0, float("nan")]])  # garbage at the masked position
    blp = t([[-1.5, -1.0, -3.0]])
    m = B([[1, 1, 0]])
    # d = [-1 - (-1.5), -2 - (-1), 0] = [0.5, -1.0, 0]
    k1 = nx.compute_approx_kl(lp, blp, m, "k1")
    assert k1.dtype == torch.float32
    close(k1, [[0.5, -1.0, 0.0]])
    # k2 = d^2/2 = [0.125, 0.5, 0]
    close(nx.compute_approx_kl(lp, blp, m, "k2"), [[0.125, 0.5, 0.0]])
    # k3 = exp(-d) - 1 + d = [e^-0.5 - 0.5, e^1 - 2, 0] = [0.1065307, 0.7182818, 0]
    k3 = nx.compute_approx_kl(lp, blp, m, "k3")
    close(k3, [[math.exp(-0.5) - 1 + 0.5, math.e - 1 - 1, 0.0]])
    for est in ("k1", "k2", "k3"):
        assert nx.compute_approx_kl(lp, blp, m, est)[0, 2].item() == 0.0


def test_kl_no_clamp_and_bf16_inputs():
    # d = 20: no clamp to 10 -> k1 = 20, k2 = 200
    lp, blp = t([[0.0]]), t([[-20.0]])
    assert nx.compute_approx_kl(lp, blp, B([[1]]), "k1").item() == 20.0
    assert nx.compute_approx_kl(lp, blp, B([[1]]), "k2").item() == 200.0
    out = nx.compute_approx_kl(lp.bfloat16(), blp.bfloat16(), None, "k1")
    assert out.dtype == torch.float32


def test_kl_unknown_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        nx.compute_approx_kl(t([[0.0]]), t([[0.0]]), B([[1]]), "k4")


def test_masked_mean_and_sum():
    x = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = B([[1, 1, 0], [0, 0, 0]])
    # row 0: (1+2)/2 = 1.5; row 1 empty -> 0 (decision; the seed gives NaN)
    close(nx.masked_mean(x, m, -1), [1.5, 0.0])
    close(nx.masked_mean(x, m), 1.5)
    close(nx.masked_sum(x, m, -1), [3.0, 0.0])
    close(nx.masked_sum(x, m), 3.0)
    x[0, 2] = float("nan")  # masked garbage does not leak
    close(nx.masked_mean(x, m, -1), [1.5, 0.0])


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §4 shaping
# ---------------------------------------------------------------------------------------------


def test_overlong_penalty():
    # max_new=20, buffer=8 -> L_exp = 12; penalty = min(0, -(L-12)/8 * 1.0)
    # L=10 -> +0.25 -> 0; L=12 -> 0; L=16 -> -0.5; L=20 -> -1.0
    p = nx.overlong_penalty(t([10.0, 12.0, 16.0, 20.0]), 20, 8, 1.0)
    assert p.dtype == torch.float32
    close(p, [0.0, 0.0, -0.5, -1.0])
    # defaults 1024/1024: L_exp = 0, so L=512 gets -512/1024 * 2.0 = -1.0
    close(nx.overlong_penalty(t([512.0]), 1024, 1024, 2.0), [-1.0])
    with pytest.raises(ValueError):
        nx.overlong_penalty(t([1.0]), 10, 0, 1.0)


def test_group_norm_hand():
    # r = [1,0,0,1]: mean .5, deviations ±.5, unbiased var = 4*.25/3 = 1/3, std = sqrt(1/3)
    # -> ±.5/sqrt(1/3) = ±0.8660254
    out = nx.shape_group_rewards(t([[1.0, 0.0, 0.0, 1.0]]), "group_norm")
    a = 0.5 / (math.sqrt(1 / 3) + 1e-9)
    close(out, [[a, -a, -a, a]])
    close(nx.shape_group_rewards(t([[1.0, 0.0, 0.0, 1.0]]), "grpo"), [[a, -a, -a, a]])


def test_group_norm_n2_and_constant_groups():
    # n = 2, r = [0, 1]: mean .5, unbiased std = sqrt(.5) -> ±.5/.7071068 = ±0.7071068
    b = 0.5 / (math.sqrt(0.5) + 1e-9)
    close(nx.shape_group_rewards(t([[0.0, 1.0]]), "group_norm"), [[-b, b]])
    # constant groups give exactly 0 (0/1 and 0.1/0.3/0.7 values, float32)
    r = t([[1.0, 0.0, 0.0, 1.0], [0.7, 0.7, 0.7, 0.7], [0.1, 0.1, 0.1, 0.1], [0.3, 0.3, 0.3, 0.3]])
    for est in ("group_norm", "grpo", "rloo", "reinforce_baseline", "dr_grpo"):
        out = nx.shape_group_rewards(r, est)
        assert out.dtype == torch.float32
        assert (out[1:] == 0).all(), est


def test_rloo_hand():
    # group [1,2,3,6], sum 12: 1-(11)/3 = -8/3; 2-10/3 = -4/3; 3-9/3 = 0; 6-6/3 = 4
    out = nx.shape_group_rewards(t([[1.0, 2.0, 3.0, 6.0]]), "rloo")
    close(out, [[-8 / 3, -4 / 3, 0.0, 4.0]], atol=1e-6)
    close(out.sum(), 0.0, atol=1e-6)
    # n = 2: [0, 1] -> [0-1, 1-0] = [-1, 1]
    close(nx.shape_group_rewards(t([[0.0, 1.0]]), "rloo"), [[-1.0, 1.0]])


def test_reinforce_baseline_and_dr_grpo_hand():
    # mean of [1,2,3,6] = 3 -> [-2,-1,0,3]; two groups are independent
    r = t([[1.0, 2.0, 3.0, 6.0], [0.0, 0.0, 1.0, 1.0]])
    expected = [[-2.0, -1.0, 0.0, 3.0], [-0.5, -0.5, 0.5, 0.5]]
    close(nx.shape_group_rewards(r, "reinforce_baseline"), expected)
    close(nx.shape_group_rewards(r, "dr_grpo"), expected)


def test_identity_estimators_and_errors():
    r = t([[0.5, -1.0], [2.0, 3.0]])
    for est in ("gae", "reinforce", "cpgd"):
        assert nx.shape_group_rewards(r, est).tolist() == r.tolist()
    for est in ("rloo", "group_norm", "grpo"):
        with pytest.raises(ValueError, match="n_samples_per_prompt must be > 1"):
            nx.shape_group_rewards(t([[1.0], [2.0]]), est)
    # n = 1 is well defined for reinforce_baseline (r - r = 0)
    assert nx.shape_group_rewards(t([[1.0], [2.0]]), "reinforce_baseline").tolist() == [[0.0], [0.0]]
    with pytest.raises(ValueError, match="allowed"):
        nx.shape_group_rewards(r, "reinforce++")
    with pytest.raises(ValueError):
        nx.shape_group_rewards(t([1.0, 2.0]), "rloo")


def test_group_is_constant():
    r = t([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.3, 0.3, 0.3], [0.0, 0.0, 0.0]])
    assert nx.group_is_constant(r).tolist() == [True, False, True, True]
    assert nx.group_is_constant(t([[float("nan"), float("nan")]])).tolist() == [False]


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §9 running moments, §5 reward processing
# ---------------------------------------------------------------------------------------------


def test_moments_merge_by_hand():
    # [1,2,3]: count 3, mean 2, M2 = 1+0+1 = 2; std = sqrt(2/2) = 1
    c, m, m2 = running.moments_merge(0, 0.0, 0.0, t([1.0, 2.0, 3.0]))
    assert (c, m, m2) == (3.0, 2.0, 2.0)
    assert moments_std(c, m2) == 1.0
    # + [10]: delta = 8, N = 4, M2 = 2 + 0 + 64*3*1/4 = 50, mean = 2 + 8/4 = 4
    # check: values 1,2,3,10 -> mean 4, squared deviations 9+4+1+36 = 50
    c, m, m2 = running.moments_merge(c, m, m2, t([10.0]))
    assert (c, m, m2) == (4.0, 4.0, 50.0)
    assert moments_std(c, m2) == pytest.approx(math.sqrt(50 / 3), abs=1e-12)
    # empty batch: unchanged
    assert running.moments_merge(c, m, m2, t([])) == (4.0, 4.0, 50.0)


def test_moments_merge_vs_numpy_and_seed_prior():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, size=k).astype(np.float32) for k in (5, 1, 8, 3, 16)]
    c, m, m2 = 0.0, 0.0, 0.0
    # the seed's recurrence (docs/numerics.md §9), with its 1e-24 prior, written out in float64
    sc, sm, sv = 1e-24, 0.0, 1.0
    seen = []
    for bat in batches:
        c, m, m2 = running.moments_merge(c, m, m2, torch.from_numpy(bat))
        x = bat.astype(np.float64)
        bm, bv, k = x.mean(), x.var(), x.size
        delta, tot = bm - sm, sc + k
        big_m2 = sv * sc + bv * k + delta**2 * sc * k / tot
        sm, sv, sc = sm + delta * k / tot, big_m2 / tot, tot
        seed_std = math.sqrt(sv * tot / (tot - 1))
        seen.append(x)
        pooled = np.concatenate(seen)
        assert m == pytest.approx(pooled.mean(), abs=1e-12)
        assert moments_std(c, m2) == pytest.approx(pooled.std(ddof=1), abs=1e-12)
        assert m == pytest.approx(sm, abs=1e-12)
        assert moments_std(c, m2) == pytest.approx(seed_std, abs=1e-12)


def test_normalize_rewards_at_the_std_edges():
    # first batch of one element: N-1 = 0 -> inf (docs/numerics.md §9), and the reward becomes 0
    c, m, m2 = running.moments_merge(0, 0.0, 0.0, t([2.5]))
    assert moments_std(c, m2) == math.inf
    assert nx.normalize_rewards(t([2.5]), m, math.inf, True).tolist() == [0.0]
    assert nx.normalize_rewards(t([2.5]), m, math.inf, False).tolist() == [0.0]
    # r = [1, 3], mean 2, std 2: minus_mean -> [-0.5, 0.5]; else -> [0.5, 1.5]
    close(nx.normalize_rewards(t([1.0, 3.0]), 2.0, 2.0, True), [-0.5, 0.5])
    close(nx.normalize_rewards(t([1.0, 3.0]), 2.0, 2.0, False), [0.5, 1.5])
    # all-equal history: std 0; zero numerators stay 0
    c, m, m2 = running.moments_merge(0, 0.0, 0.0, t([0.0, 0.0, 0.0]))
    assert moments_std(c, m2) == 0.0
    assert nx.normalize_rewards(t([0.0, 0.0]), m, 0.0, False).tolist() == [0.0, 0.0]


def test_kl_penalized_rewards():
    R = t([1.0, 2.0, 3.0])
    kl = t([[0.1, 0.2, 0.0], [0.3, 0.0, 5.0], [0.0, 0.0, 0.0]])  # 5.0 is masked garbage
    m = B([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # beta 0.5: row 0: [-0.05, -0.1 + 1, 0]; row 1: [-0.15 + 2, 0, 0]; row 2 (no True): R at A-1
    out = nx.kl_penalized_rewards(R, kl, m, 0.5)
    assert out.dtype == torch.float32
    close(out, [[-0.05, 0.9, 0.0], [1.85, 0.0, 0.0], [0.0, 0.0, 3.0]])
    # sum over t = R - beta * sum(kl): 1 - 0.5*0.3 = 0.85
    close(out.sum(-1)[0], 0.85)
    # beta <= 0 -> treated as 0
    close(nx.kl_penalized_rewards(R, kl, m, -1.0), [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])
    close(nx.kl_penalized_rewards(R, None, m, 0.5), [[0.0, 1.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]])


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §8 clip fractions
# ---------------------------------------------------------------------------------------------


def test_clip_fraction():
    x = t([[0.5, 2.0, -3.0], [1.0, -1.0, 0.0]])
    # strict: 2.0 > 1 and -3.0 < -1 count; 1.0 and -1.0 do not -> 2/6
    out = nx.clip_fraction(x, -1.0, 1.0)
    assert out.dtype == torch.float32 and out.shape == (2,)
    close(out, [1 / 3, 1 / 3])
    # rewards (B,): [0.5, 5, -5, 1] with c = 1 -> 2/4
    close(nx.clip_fraction(t([0.5, 5.0, -5.0, 1.0]), -1.0, 1.0), [0.5] * 4)
    assert nx.clip_fraction(t([]), -1.0, 1.0).shape == (0,)
    assert nx.clip_fraction(torch.zeros((3, 0)), -1.0, 1.0).tolist() == [0.0, 0.0, 0.0]


def test_clip_fraction_masked():
    x = t([[0.5, 2.0, -3.0], [1.0, -1.0, 0.0]])
    m = B([[1, 1, 0], [1, 1, 0]])
    # valid: 0.5, 2.0, 1.0, -1.0 -> only 2.0 is clipped -> 1/4
    close(nx.clip_fraction_masked(x, m, -1.0, 1.0), [0.25, 0.25])
    assert nx.clip_fraction_masked(x, torch.zeros_like(m), -1.0, 1.0).tolist() == [0.0, 0.0]


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §6 estimators
# ---------------------------------------------------------------------------------------------


def test_cumulative_returns():
    # F = [1,2,3,(4 masked -> 0)], gamma .5:
    # G3 = 0 (masked); G2 = 3; G1 = 2 + .5*3 = 3.5; G0 = 1 + .5*3.5 = 2.75
    out = nx.cumulative_returns(t([[1.0, 2.0, 3.0, 4.0]]), B([[1, 1, 1, 0]]), 0.5)
    close(out, [[2.75, 3.5, 3.0, 0.0]])


def _gae_case():
    # 1x3 (+ a masked 4th column with garbage), gamma .9, lambda .8, R = 1 at the EOS action
    rewards = t([[0.0, 0.0, 1.0, 7.0]])
    values = t([[0.5, 0.4, 0.3, 5.0]])
    mask = B([[1, 1, 1, 0]])
    # V_3 := 0 (masked)
    # d2 = 1 + .9*0 - .3 = 0.7;  d1 = 0 + .9*.3 - .4 = -0.13;  d0 = 0 + .9*.4 - .5 = -0.14
    # gl = .72: A2 = .7; A1 = -.13 + .72*.7 = 0.374; A0 = -.14 + .72*.374 = 0.12928
    adv = [0.12928, 0.374, 0.7, 0.0]
    ret = [0.12928 + 0.5, 0.374 + 0.4, 0.7 + 0.3, 0.0]  # returns = A + V
    return rewards, values, mask, adv, ret


def test_gae_hand():
    rewards, values, mask, adv, ret = _gae_case()
    a, r = nx.gae(rewards, values, mask, 0.9, 0.8)
    close(a, [adv], atol=1e-6)
    close(r, [ret], atol=1e-6)


def test_compute_advantages_gae_clip_before_clamp():
    rewards, values, mask, adv, ret = _gae_case()
    a, r, info = nx.compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lambd=0.8)
    close(a, [adv], atol=1e-6)
    close(r, [ret], atol=1e-6)
    assert info["advantage_clip_frac"].tolist() == [0.0]  # GAE always reports it
    a, r, info = nx.compute_advantages(
        "gae", rewards, mask, values=values, gamma=0.9, lambd=0.8, advantage_clip=0.5
    )
    # before the clamp 0.7 > 0.5: 1 of 3 valid -> 1/3 (the seed measures after: 0)
    close(info["advantage_clip_frac"], [1 / 3])
    close(a, [[0.12928, 0.374, 0.5, 0.0]], atol=1e-6)
    close(r, [ret], atol=1e-6)  # returns are not clipped
    with pytest.raises(ValueError, match="values"):
        nx.compute_advantages("gae", rewards, mask)


def test_compute_advantages_gae_whitening():
    rewards, values, mask, adv, ret = _gae_case()
    a, r, _ = nx.compute_advantages(
        "gae", rewards, mask, values=values, gamma=0.9, lambd=0.8, advantages_norm=True
    )
    raw = np.array(adv[:3])
    expected = (raw - raw.mean()) / (raw.std(ddof=1) + 1e-9)
    close(a[0, :3], expected, atol=1e-6)
    assert a[0, 3].item() == 0.0  # padding stays 0 (the seed writes -mu/sigma there)
    close(r, [ret], atol=1e-6)  # returns from the raw advantages


def _reinforce_case():
    # R = [1, -1]; rows of 3 and 2 valid actions; R sits at the last valid action
    tok = t([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    mask = B([[1, 1, 1], [1, 1, 0]])
    return tok, mask


def test_compute_advantages_reinforce_family():
    tok, mask = _reinforce_case()
    # gamma 1: the scalar is copied to every valid token
    for est in ("reinforce", "rloo", "group_norm", "grpo", "dr_grpo", "reinforce_baseline"):
        a, r, info = nx.compute_advantages(est, tok, mask, gamma=1.0)
        close(a, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
        close(r, a)
        assert info == {}
    # gamma .5: row 0 [.25, .5, 1]; row 1 [-.5, -1, 0]
    a, _, _ = nx.compute_advantages("reinforce", tok, mask, gamma=0.5)
    close(a, [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    a, _, _ = nx.compute_advantages("group_norm", tok, mask, gamma=0.5)
    close(a, [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    # reinforce_baseline forces gamma = 1
    a, _, _ = nx.compute_advantages("reinforce_baseline", tok, mask, gamma=0.5)
    close(a, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])


def test_compute_advantages_reinforce_clip_and_whiten():
    tok, mask = _reinforce_case()
    a, r, info = nx.compute_advantages("reinforce", tok, mask, gamma=0.5, advantage_clip=0.75)
    # valid values before clamp: .25 .5 1 -.5 -1 -> 1 and -1 are outside ±.75 -> 2/5
    close(info["advantage_clip_frac"], [0.4, 0.4])
    close(a, [[0.25, 0.5, 0.75], [-0.5, -0.75, 0.0]])
    close(r, [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]])
    # whitening, eps 1e-8: valid [1,1,1,-1,-1]: mean .2; squared deviations 3*.64 + 2*1.44 = 4.8;
    # unbiased var 4.8/4 = 1.2 -> std 1.0954451; (1-.2)/std = 0.7302967, (-1-.2)/std = -1.0954451
    a, r, _ = nx.compute_advantages("reinforce", tok, mask, gamma=1.0, advantages_norm=True)
    s = math.sqrt(1.2) + 1e-8
    close(a, [[0.8 / s] * 3, [-1.2 / s, -1.2 / s, 0.0]])
    close(r, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    # group_norm is never whitened
    a, _, _ = nx.compute_advantages("group_norm", tok, mask, gamma=1.0, advantages_norm=True)
    close(a, [[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])


def test_cpgd_scores_hand():
    r = t([1.0, 0.0, 0.0, 1.0])
    # mean .5, biased std .5
    c = 0.5 / (0.5 + 1e-6)
    close(nx.cpgd_scores(r), [c, -c, -c, c])
    # clip_filter_like_weight: factor min(B / max(1, #(std>0)), 3) = min(4/1, 3) = 3 -> ±1.5
    close(nx.cpgd_scores(r, "clip_filter_like_weight"), [1.5, -1.5, -1.5, 1.5])
    close(nx.cpgd_scores(r, "mean"), [0.5, -0.5, -0.5, 0.5])
    assert nx.cpgd_scores(t([0.3, 0.3])).tolist() == [0.0, 0.0]
    assert nx.cpgd_scores(t([2.0])).tolist() == [0.0]


def test_compute_advantages_cpgd_is_not_zero():
    tok = t([[9.0, 9.0], [9.0, 9.0], [9.0, 9.0], [9.0, 9.0]])  # ignored: CPGD reads raw rewards
    mask = B([[1, 1], [1, 0], [1, 1], [1, 0]])
    c = 0.5 / (0.5 + 1e-6)
    a, r, info = nx.compute_advantages(
        "cpgd", tok, mask, raw_rewards=t([1.0, 0.0, 0.0, 1.0]), advantage_clip=0.1, advantages_norm=True
    )
    close(a, [[c, c], [-c, 0.0], [-c, -c], [c, 0.0]])
    close(r, a)
    assert info == {}
    with pytest.raises(ValueError, match="raw_rewards"):
        nx.compute_advantages("cpgd", tok, mask)
    with pytest.raises(ValueError, match="allowed"):
        nx.compute_advantages("ppo", tok, mask)


def test_whiten():
    x = t([[1.0, 2.0, 3.0, 0.0]])
    m = B([[1, 1, 1, 0]])
    # mean 2, unbiased std 1 -> [-1/(1+eps), 0, 1/(1+eps)], padding untouched
    out = nx.whiten(x, m, 1e-8)
    close(out, [[-1.0, 0.0, 1.0, 0.0]], atol=1e-7)
    assert out[0, 3].item() == 0.0
    # one or zero valid elements: unchanged
    assert nx.whiten(x, B([[1, 0, 0, 0]]), 1e-8).tolist() == x.tolist()
    assert nx.whiten(x, B([[0, 0, 0, 0]]), 1e-8).tolist() == x.tolist()


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §7.2 streaming normalisation
# ---------------------------------------------------------------------------------------------


def test_apply_normalization():
    x = t([[1.0, 2.0, 0.0], [3.0, 6.0, 0.0]])
    m = B([[1, 1, 0], [1, 1, 0]])
    # valid values 1, 2, 3, 6: mean 3, biased var (4 + 1 + 0 + 9)/4 = 3.5
    mean, var = 3.0, 3.5
    s = math.sqrt(3.5)
    out = nx.apply_normalization(x, m, mean, var)
    close(out, [[-2 / s, -1 / s, 0.0], [0.0, 3 / s, 0.0]])
    # variance floor 1e-8: rstd = 1e4
    close(nx.apply_normalization(t([[3.5]]), B([[1]]), 3.0, 0.0), [[5000.0]], atol=1e-3)


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §10 KL controller, §11 entropy mask
# ---------------------------------------------------------------------------------------------


def test_adaptive_kl_update():
    # current/target - 1 = 1 -> clipped to .2; 0.01 * (1 + .2 * 1000/10000) = 0.0102
    assert running.adaptive_kl_update(0.01, 0.02, 0.01, 1000, 10000) == pytest.approx(0.0102, abs=1e-15)
    # 0.009/0.01 - 1 = -0.1 -> 0.01 * (1 - 0.1*0.1) = 0.0099
    assert running.adaptive_kl_update(0.01, 0.009, 0.01, 1000, 10000) == pytest.approx(0.0099, abs=1e-15)
    # fixed controller
    assert running.adaptive_kl_update(0.01, 5.0, None, 1000) == 0.01
    with pytest.raises(ConfigError, match="kl_target"):
        running.adaptive_kl_update(0.01, 0.1, 0.0, 10)


def test_high_entropy_mask():
    ent = t([[0.1, 0.9, 0.5, 0.7, 5.0], [0.3, 0.2, 0.0, 0.0, 0.0]])
    m = B([[1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
    # rho .4, n_valid 4 -> k = max(1, floor(1.6)) = 1 -> only the 0.9 (the masked 5.0 never wins)
    assert nx.high_entropy_mask(ent, m, 0.4).int().tolist() == [[0, 1, 0, 0, 0], [0] * 5]
    # rho .5 -> k = 2 -> 0.9 and 0.7
    assert nx.high_entropy_mask(ent, m, 0.5).int().tolist() == [[0, 1, 0, 1, 0], [0] * 5]
    # rho .1 -> floor(.4) = 0 -> k = 1
    assert nx.high_entropy_mask(ent, m, 0.1).int().tolist() == [[0, 1, 0, 0, 0], [0] * 5]
    for rho in (0.0, 1.0, -1.0):
        out = nx.high_entropy_mask(ent, m, rho)
        assert out.dtype == torch.bool and out.tolist() == m.tolist()
    # ties among zero-entropy valid tokens: earliest positions, never padding
    z = torch.zeros((1, 5))
    assert nx.high_entropy_mask(z, B([[0, 1, 1, 1, 1]]), 0.5).int().tolist() == [[0, 1, 1, 0, 0]]
