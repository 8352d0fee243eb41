"""Streaming forms of the seed's whole-batch steps: cross-batch normalisation, KL controller,
use_kl_loss, dynamic sampling, running reward norm, and same-input-same-output.

Tests taking ``state`` run twice: on a MemoryState and (integration) on a real Redis."""

from __future__ import annotations

import numpy as np
import pytest

from expstream.config.topology import load_topology
from expstream.train.control import PipelineControl
from schemas import Ragged, SampleBatch, encode
from stages import advantage, end_of_input, held_samples, postprocess
from stages.context import make_context

EOS, PAD = 9, 0


def f32(rows):
    return Ragged.from_rows([np.asarray(r, np.float32) for r in rows], "float32")


def scored(batch_id, rewards, lengths, group="g", start=0, n=None):
    """A postprocessed micro-batch with zero KL: token rewards are R at the last action."""
    b = len(rewards)
    tok = [[0.0] * (k - 1) + [r] for r, k in zip(rewards, lengths, strict=True)]
    return SampleBatch(
        batch_id=batch_id, policy_version=0, n_samples_per_prompt=n or b, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=[group] * b, group_id=[group] * b, sample_index=list(range(start, start + b)),
        prompt=["p"] * b, label=[""] * b, reference=[""] * b, response=["r"] * b,
        prompt_ids=Ragged.from_rows([np.array([5], np.int32)] * b, "int32"),
        response_ids=Ragged.from_rows([np.full(k, 7, np.int32) for k in lengths], "int32"),
        layout="padded",
        action_ids=Ragged.from_rows([np.full(k, 7, np.int32) for k in lengths], "int32"),
        action_mask=Ragged.from_rows([np.ones(k, bool) for k in lengths], "bool"),
        action_log_probs=f32([[-1.0] * k for k in lengths]),
        rewards=np.array(rewards, np.float32), processed_rewards=np.array(rewards, np.float32),
        kl=f32([[0.0] * k for k in lengths]), kl_coef=0.0, token_rewards=f32(tok),
        info={"reward": np.array(rewards, np.float32), "kl": np.zeros(b, np.float32)})


def test_running_cross_batch_normalisation_uses_pooled_moments(state):
    topo = load_topology(overrides=["algo.advantage_estimator=reinforce", "algo.advantage_cross_batch_norm=running"])
    ctx = make_context(topo, "advantage", state=state)
    [a] = advantage.process(scored("a", [1.0, 3.0], [1, 1]), ctx)
    # first batch alone: valid advantages [1, 3] -> mean 2, biased var 1 -> [-1, 1]
    np.testing.assert_allclose(a.advantages.values, [-1.0, 1.0], rtol=1e-6)
    [b] = advantage.process(scored("b", [5.0], [2]), ctx)
    # reinforce, gamma 1: advantages [5, 5]; pooled over [1, 3, 5, 5]: mean 3.5, biased var
    # ((2.5^2 + 0.5^2 + 1.5^2 * 2) / 4) = 2.75 -> (5 - 3.5) / sqrt(2.75) = 0.904534
    np.testing.assert_allclose(b.advantages.values, [0.904534, 0.904534], rtol=1e-5)
    # redelivery of "a" gives the same bytes (the snapshot stored under its batch id)
    [again] = advantage.process(scored("a", [1.0, 3.0], [1, 1]), ctx)
    assert encode(again) == encode(a)


def test_window_cross_batch_normalisation_and_flush(state):
    topo = load_topology(overrides=["algo.advantage_estimator=reinforce", "algo.advantage_cross_batch_norm=window",
                                    "algo.rollout_batch_size=3"])
    ctx = make_context(topo, "advantage", state=state)
    assert advantage.process(scored("w1", [0.0, 2.0], [1, 1]), ctx) == []  # 2 of 3 samples: window open
    out = advantage.process(scored("w2", [4.0], [1]), ctx)  # closes the window
    # window values [0, 2, 4]: mean 2, biased var 8/3 -> [-1.224745, 0, 1.224745]
    np.testing.assert_allclose(np.concatenate([b.advantages.values for b in out]), [-1.224745, 0, 1.224745],
                               rtol=1e-5)
    assert advantage.process(scored("w1", [0.0, 2.0], [1, 1]), ctx) == []  # redelivered non-closer: nothing
    assert [b.batch_id for b in advantage.process(scored("w2", [4.0], [1]), ctx)] == ["w1", "w2"]
    assert advantage.process(scored("w3", [1.0, 2.0], [1, 1]), ctx) == []
    assert held_samples(ctx) == 2
    [last] = end_of_input(ctx)  # the stage hook `expstream run` and LocalChain call at the end
    np.testing.assert_allclose(last.advantages.values, [-1.0, 1.0], rtol=1e-5)  # [1, 2]: mean 1.5, var .25
    assert held_samples(ctx) == 0
    assert end_of_input(ctx) == []


def test_group_estimators_skip_cross_batch_normalisation(state):
    topo = load_topology(overrides=["algo.advantage_estimator=rloo", "algo.advantage_cross_batch_norm=running"])
    ctx = make_context(topo, "advantage", state=state)
    [g] = advantage.process(scored("r", [1.0, 3.0], [1, 1], n=2), ctx)
    # rloo: r_i - mean(others): [1 - 3, 3 - 1], not renormalised
    np.testing.assert_allclose(g.advantages.values, [-2.0, 2.0])


def test_dynamic_sampling_drops_constant_groups_and_counts_them(state):
    topo = load_topology(overrides=["algo.advantage_estimator=group_norm", "algo.dynamic_sampling=true"])
    ctx = make_context(topo, "advantage", state=state)
    assert advantage.process(scored("c", [0.5, 0.5], [1, 2], group="const", n=2), ctx) == []
    [kept] = advantage.process(scored("v", [0.0, 1.0], [1, 1], group="varied", n=2), ctx)
    assert kept.group_id == ["varied", "varied"]
    assert state.counters()["dynamic_sampling_dropped_groups"] == 1
    advantage.process(scored("c", [0.5, 0.5], [1, 2], group="const", n=2), ctx)  # redelivery: counted once
    assert state.counters()["dynamic_sampling_dropped_groups"] == 1


def _pair(extra=()):
    topo = load_topology(overrides=["algo.kl_estimator=k1", "algo.init_kl_coef=0.5", *extra])
    b = scored("k", [1.0, 2.0], [2, 1]).replace(
        base_action_log_probs=f32([[-1.5, -1.0], [-0.25]]), action_log_probs=f32([[-1.0, -2.0], [-0.5]]),
        kl=None, kl_coef=None, token_rewards=None, processed_rewards=None, info={})
    return topo, b


@pytest.mark.integration
def test_adaptive_kl_controller_shared_through_redis(redis_url, run_id, redis_state):
    topo, batch = _pair(["algo.kl_target=0.1", "algo.kl_horizon=100", "algo.rollout_batch_size=10"])
    control = PipelineControl(redis_url, run_id, topo)
    assert control.kl_coef() == 0.5
    # kl 0.2 vs target 0.1: e = clip(1.0, -0.2, 0.2) = 0.2; beta = 0.5 * (1 + 0.2 * 10 / 100) = 0.51
    assert control.report_kl("step-1", 0.2) == pytest.approx(0.51)
    assert control.report_kl("step-1", 0.2) == pytest.approx(0.51)  # retried report applied once
    [out] = postprocess.process(batch, make_context(topo, "postprocess", state=redis_state))
    assert out.kl_coef == pytest.approx(0.51)
    # row 0 k1 kl [0.5, -1.0]: token rewards [-0.51 * 0.5, 0.51 + 1.0]
    np.testing.assert_allclose(out.token_rewards.row(0), [-0.255, 1.51], rtol=1e-6)
    fixed = PipelineControl(redis_url, run_id + "f", load_topology())
    assert fixed.report_kl("s", 5.0) == fixed.kl_coef() == 0.01  # fixed controller: reports change nothing
    control.close()
    fixed.close()


def test_use_kl_loss_keeps_base_log_probs_and_no_kl_in_reward():
    topo, batch = _pair(["algo.use_kl_loss=true"])
    [out] = postprocess.process(batch, make_context(topo, "postprocess"))
    assert out.base_action_log_probs is not None
    np.testing.assert_allclose(out.kl.values, 0.0)
    np.testing.assert_allclose(out.token_rewards.values, [0.0, 1.0, 2.0])


def test_running_reward_norm_is_applied_once_per_unit_id(state):
    over = ["algo.reward_running_norm=true", "algo.reward_running_norm_minus_mean=true"]
    ctx = make_context(load_topology(overrides=["algo.advantage_estimator=reinforce", *over]), "advantage", state=state)
    [first] = advantage.process(scored("m", [1.0, 2.0], [1, 1]), ctx)
    # rewards [1, 2]: mean 1.5, unbiased std sqrt(0.5) -> (r - 1.5) / 0.707107 = [-0.707107, 0.707107]
    np.testing.assert_allclose(first.processed_rewards, [-0.707107, 0.707107], rtol=1e-5)
    [second] = advantage.process(scored("m", [1.0, 2.0], [1, 1]), ctx)
    assert encode(second) == encode(first)
    assert state.get_moments("reward").count == 2
    # a group estimator merges the shaped rewards of the complete group, once per group id:
    # rloo of [0, 4] is [-4, 4]; pooled with [1, 2]: mean 0.75, unbiased std sqrt(34.75 / 3) = 3.403430
    gctx = make_context(load_topology(overrides=["algo.advantage_estimator=rloo", *over]), "advantage", state=state)
    assert advantage.process(scored("h0", [0.0], [1], group="h", n=2), gctx) == []
    [g] = advantage.process(scored("h1", [4.0], [1], group="h", start=1, n=2), gctx)
    np.testing.assert_allclose(g.processed_rewards, [(-4 - 0.75) / 3.403430, (4 - 0.75) / 3.403430], rtol=1e-5)
    [again] = advantage.process(scored("h1", [4.0], [1], group="h", start=1, n=2), gctx)
    assert encode(again) == encode(g)
    assert state.get_moments("reward").count == 4


def test_a_whole_group_in_one_batch_gives_the_bytes_of_a_split_group(state):
    topo = load_topology(overrides=["algo.advantage_estimator=group_norm"])
    ctx = make_context(topo, "advantage", state=state)
    whole = scored("w", [1.0, 3.0, 2.0], [1, 2, 1], group="gw", n=3).replace(sample_index=[2, 0, 1])
    [fast] = advantage.process(whole, ctx)
    # shared (Redis) state parks every group, so a crash-redelivery meets the same buffer; one
    # process (MemoryState) has no one to meet and skips the round trip
    assert state.group_status("gw") == ((3, 3, "w") if state.shared else (0, None, None))
    assert fast.sample_index == [0, 1, 2] and fast.batch_id == "g/gw"
    # the same samples arriving in two records go through the buffer and give the same bytes
    first = whole.select([1], batch_id="s1").replace(group_id=["gs"], prompt_id=["gs"])
    second = whole.select([2, 0], batch_id="s2").replace(group_id=["gs", "gs"], prompt_id=["gs", "gs"])
    assert advantage.process(first, ctx) == []
    [slow] = advantage.process(second, ctx)
    assert state.group_status("gs") == (3, 3, "s2")
    assert encode(slow.replace(group_id=["gw"] * 3, prompt_id=["gw"] * 3, batch_id="g/gw")) == encode(fast)
