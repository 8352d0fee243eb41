"""The trainer's losses against hand-written per-token loops (expstream/train/loss.py, docs/async.md)."""

from __future__ import annotations

import math

import pytest
import torch

from expstream.train.loss import importance_weights, policy_loss, value_loss

EPS = 0.2
CAP = 2.0


def _batch(seed: int = 0, b: int = 3, a: int = 5):
    g = torch.Generator().manual_seed(seed)
    new = -torch.rand(b, a, generator=g) * 3
    old = new + (torch.rand(b, a, generator=g) - 0.5) * 0.8  # ratios on both sides of the clip range
    behav = old + (torch.rand(b, a, generator=g) - 0.5) * 2.0  # some weights over the cap
    adv = torch.randn(b, a, generator=g)
    base = new + (torch.rand(b, a, generator=g) - 0.5)
    mask = torch.ones(b, a, dtype=torch.bool)
    mask[0, 3:] = False
    mask[2, 1:] = False
    # garbage at masked positions must not matter
    for t in (new, old, behav, adv, base):
        t[~mask] = 1e3
    return new, old, behav, adv, base, mask


def _reference(new, old, behav, adv, mask, mode, base=None, kl_coef=0.0, est="k3"):
    """A plain Python loop over tokens: the formulas of docs/async.md written out."""
    b, a = mask.shape
    total, count, kl_total = 0.0, 0, 0.0
    for i in range(b):
        seq_delta = sum(float(old[i, t]) - float(behav[i, t]) for t in range(a) if mask[i, t])
        for t in range(a):
            if not mask[i, t]:
                continue
            count += 1
            r = math.exp(float(new[i, t]) - float(old[i, t]))
            A = float(adv[i, t])
            lt = max(-r * A, -min(max(r, 1 - EPS), 1 + EPS) * A)
            if mode == "none":
                w = 1.0
            elif mode == "token_tis":
                w = min(math.exp(float(old[i, t]) - float(behav[i, t])), CAP)
            elif mode == "seq_tis":
                w = min(math.exp(seq_delta), CAP)
            else:
                raw = math.exp(float(old[i, t]) - float(behav[i, t]))
                w = raw if raw <= CAP else 0.0
            total += lt * w
            if base is not None:
                d = float(new[i, t]) - float(base[i, t])
                kl_total += {"k1": d, "k2": d * d / 2, "k3": math.exp(-d) - 1 + d}[est]
    return total / count + kl_coef * kl_total / count


@pytest.mark.parametrize("mode", ["none", "token_tis", "seq_tis", "decoupled"])
def test_policy_loss_matches_a_per_token_loop(mode):
    new, old, behav, adv, _, mask = _batch()
    terms = policy_loss(new, old, adv, mask, clip_eps=EPS, off_policy=mode, behav_log_probs=behav, is_cap=CAP)
    assert terms.loss.item() == pytest.approx(_reference(new, old, behav, adv, mask, mode), rel=1e-5, abs=1e-6)


def test_the_modes_differ_on_this_batch():
    """Guards the loop test: the batch has weights over the cap and both clip branches."""
    new, old, behav, adv, _, mask = _batch()
    values = {m: _reference(new, old, behav, adv, mask, m) for m in ("none", "token_tis", "seq_tis", "decoupled")}
    assert len({round(v, 6) for v in values.values()}) == 4
    w, keep = importance_weights(old, behav, mask, "decoupled", CAP)
    assert (mask & ~keep).any()  # some token masked by the cap
    assert (w[keep] <= CAP).all()


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_in_loss_matches_the_loop(est):
    new, old, behav, adv, base, mask = _batch(seed=3)
    terms = policy_loss(new, old, adv, mask, clip_eps=EPS, base_log_probs=base, kl_coef=0.1, kl_estimator=est)
    want = _reference(new, old, behav, adv, mask, "none", base=base, kl_coef=0.1, est=est)
    assert terms.loss.item() == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_gradient_flows_only_through_the_new_log_probs():
    new, old, behav, adv, base, mask = _batch(seed=5)
    new = new.clone().requires_grad_(True)
    old = old.clone().requires_grad_(True)
    policy_loss(new, old, adv, mask, off_policy="token_tis", behav_log_probs=behav, base_log_probs=base,
                kl_coef=0.5).loss.backward()
    assert old.grad is None or torch.count_nonzero(old.grad) == 0
    assert torch.count_nonzero(new.grad[mask]) > 0
    assert torch.count_nonzero(new.grad[~mask]) == 0


def test_on_policy_gradient_is_the_policy_gradient():
    """At r = 1 (new == old) the clip is inactive: d loss / d logp_t = −Â_t / N."""
    new, _, _, adv, _, mask = _batch(seed=7)
    new = new.clone().requires_grad_(True)
    policy_loss(new, new.detach().clone(), adv, mask).loss.backward()
    n = int(mask.sum())
    for i in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[i, t]:
                assert float(new.grad[i, t]) == pytest.approx(-float(adv[i, t]) / n, rel=1e-5)


def test_off_policy_without_behaviour_log_probs_names_the_fix():
    new, old, _, adv, _, mask = _batch()
    with pytest.raises(ValueError, match="rollout_log_probs.*train.off_policy=none"):
        policy_loss(new, old, adv, mask, off_policy="token_tis", behav_log_probs=None)
    with pytest.raises(ValueError, match="train.off_policy"):
        policy_loss(new, old, adv, mask, off_policy="tis")


def test_value_loss_matches_the_loop():
    g = torch.Generator().manual_seed(11)
    v = torch.randn(2, 4, generator=g)
    old = v + (torch.rand(2, 4, generator=g) - 0.5)
    ret = torch.randn(2, 4, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    total, n = 0.0, 0
    for i in range(2):
        for t in range(4):
            if mask[i, t]:
                vc = float(old[i, t]) + min(max(float(v[i, t]) - float(old[i, t]), -0.2), 0.2)
                total += 0.5 * max((float(v[i, t]) - float(ret[i, t])) ** 2, (vc - float(ret[i, t])) ** 2)
                n += 1
    assert value_loss(v, old, ret, mask).item() == pytest.approx(total / n, rel=1e-5)


def test_empty_mask_gives_zero_not_nan():
    z = torch.zeros(2, 3)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    assert policy_loss(z, z, z, mask).loss.item() == 0.0
