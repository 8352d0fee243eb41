"""The seed's order of reward processing, recomputed independently (issue 21 item 10).

The seed (docs/numerics.md §2, §4, §5) processes a rollout's rewards in this order:

    overlong penalty → group shaping → running normalisation → reward clip → per-token reward (−β·kl + R at t*)

The oracle below is plain numpy in float64, written from those formulas; it calls nothing of
``expstream``. The stages (postprocess then advantage, as the pipeline runs them) must give the
same experiences within 1e-5. Tests taking ``state`` run on a MemoryState and (integration) on a
real Redis, whose Lua merge keeps the running moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from expstream.config.topology import load_topology
from schemas import Ragged, SampleBatch
from stages import advantage, postprocess
from stages.context import make_context

EOS, PAD = 9, 0
MAX_NEW, BUF, FACTOR = 16, 8, 1.0
BETA = 0.05
TOL = 1e-5


@dataclass
class Row:
    group: str
    index: int
    reward: float
    lp: np.ndarray  # actor log-probs of the valid actions
    ref: np.ndarray  # reference log-probs


def make_rows(seed: int, groups: int, n: int) -> list[Row]:
    """``groups`` prompt groups of n samples: rewards in [−2, 2] (so a clip at 0.5 bites), lengths
    1..MAX_NEW (so the overlong penalty bites), log-probs whose k3 KL is a few 0.1."""
    rng = np.random.default_rng(seed)
    rows = []
    for g in range(groups):
        for i in range(n):
            length = int(rng.integers(1, MAX_NEW + 1))
            lp = rng.uniform(-3.0, -0.1, length).astype(np.float32)
            ref = (lp + rng.normal(0.0, 0.5, length)).astype(np.float32)
            rows.append(Row(f"q{g}", i, float(np.float32(rng.uniform(-2.0, 2.0))), lp, ref))
    return rows


def rewarded(rows: list[Row], n: int, mrb: int) -> list[SampleBatch]:
    """The reward stage's output: group-contiguous samples cut into micro-batches of ``mrb``."""
    out = []
    for j in range(0, len(rows), mrb):
        part = rows[j:j + mrb]
        b = len(part)
        acts = [np.array([7] * (len(r.lp) - 1) + [EOS], np.int32) for r in part]
        out.append(SampleBatch(
            batch_id=f"p000000/m{j // mrb}", policy_version=0, n_samples_per_prompt=n, eos_token_id=EOS,
            pad_token_id=PAD, prompt_id=[r.group for r in part], group_id=[r.group for r in part],
            sample_index=[r.index for r in part], prompt=["p"] * b, label=[""] * b, reference=[""] * b,
            response=["r"] * b, prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)] * b, "int32"),
            response_ids=Ragged.from_rows(acts, "int32"), layout="padded",
            action_ids=Ragged.from_rows(acts, "int32"),
            action_mask=Ragged.from_rows([np.ones(len(a), bool) for a in acts], "bool"),
            action_log_probs=Ragged.from_rows([r.lp for r in part], "float32"),
            base_action_log_probs=Ragged.from_rows([r.ref for r in part], "float32"),
            rewards=np.array([r.reward for r in part], np.float32)))
    return out


def stream(batches: list[SampleBatch], overrides: list[str], state) -> dict[str, dict]:
    """postprocess then advantage over the micro-batches in order; per sample id what came out."""
    topo = load_topology(overrides=[
        "algo.kl_estimator=k3", f"algo.init_kl_coef={BETA}", "algo.gamma=1.0",
        f"generate.max_new_tokens={MAX_NEW}", f"algo.overlong_buffer_len={BUF}",
        f"algo.overlong_buffer_penalty_factor={FACTOR}", *overrides])
    pctx, actx = make_context(topo, "postprocess", state=state), make_context(topo, "advantage", state=state)
    got: dict[str, dict] = {}
    for b in batches:
        for scored in postprocess.process(b, pctx):
            for e in advantage.process(scored, actx):
                for i, sid in enumerate(e.sample_ids()):
                    got[sid] = {"adv": np.asarray(e.advantages.row(i), np.float64),
                                "ret": np.asarray(e.returns.row(i), np.float64),
                                "R": float(e.processed_rewards[i]),
                                "return": float(e.info["return"][i]),
                                "clip_frac": float(e.info["reward_clip_frac"][i])
                                if "reward_clip_frac" in e.info else None}
    return got


# --- the oracle: the seed's order, in numpy ----------------------------------------------------

def shape(r: np.ndarray, estimator: str) -> np.ndarray:
    n = len(r)
    if estimator in ("group_norm", "grpo"):
        if np.all(r == r[0]):
            return np.zeros(n)
        return (r - r.mean()) / (r.std(ddof=1) + 1e-9)
    if estimator == "rloo":
        return r - (r.sum() - r) / (n - 1)
    if estimator == "reinforce_baseline":
        return r - r.mean()
    return r.copy()


def seed_order(rows: list[Row], units: list[list[int]], estimator: str, *, overlong: bool, clip: float,
               running_norm: bool = False, minus_mean: bool = False) -> dict[str, dict]:
    """Per sample: R after overlong → shaping → running norm (per unit, in order) → clip, and the
    KL-penalised token rewards, returns and advantages (γ = 1, no whitening)."""
    r = np.array([row.reward for row in rows], np.float64)
    length = np.array([len(row.lp) for row in rows], np.float64)
    if overlong:
        r = r + np.minimum(0.0, -(length - (MAX_NEW - BUF)) / BUF * FACTOR)
    groups: dict[str, list[int]] = {}
    for k, row in enumerate(rows):
        groups.setdefault(row.group, []).append(k)
    shaped = np.empty_like(r)
    for members in groups.values():
        shaped[members] = shape(r[members], estimator)
    seen: list[float] = []
    final = shaped.copy()
    frac = np.full(len(rows), np.nan)
    for unit in units:
        x = shaped[unit]
        if running_norm:  # update with this unit first, then normalise by the pooled statistics
            seen.extend(x.tolist())
            allv = np.array(seen)
            std = math.inf if len(allv) <= 1 else float(allv.std(ddof=1))
            x = (x - allv.mean()) / std if minus_mean else x / std
        if clip > 0:
            frac[unit] = ((x > clip) | (x < -clip)).sum() / len(unit)
            x = np.clip(x, -clip, clip)
        final[unit] = x
    out = {}
    for k, row in enumerate(rows):
        d = row.lp.astype(np.float64) - row.ref.astype(np.float64)
        kl = np.exp(-d) - 1 + d
        tok = -BETA * kl
        tok[-1] += final[k]
        ret = np.cumsum(tok[::-1])[::-1]
        out[f"{row.group}#{row.index}"] = {"adv": ret, "ret": ret, "R": final[k], "return": tok.sum(),
                                           "clip_frac": None if clip <= 0 else frac[k]}
    return out


def group_units(rows: list[Row]) -> list[list[int]]:
    units: dict[str, list[int]] = {}
    for k, row in enumerate(rows):
        units.setdefault(row.group, []).append(k)
    return list(units.values())


def batch_units(rows: list[Row], mrb: int) -> list[list[int]]:
    return [list(range(j, min(j + mrb, len(rows)))) for j in range(0, len(rows), mrb)]


def assert_matches(got: dict[str, dict], want: dict[str, dict]) -> None:
    assert sorted(got) == sorted(want)
    worst = []
    for sid, w in want.items():
        g = got[sid]
        for key in ("adv", "ret", "R", "return", "clip_frac"):
            if w[key] is None:
                assert g[key] is None, f"{sid} {key}: expected no value"
                continue
            err = float(np.max(np.abs(np.asarray(g[key]) - np.asarray(w[key]))))
            if err > TOL:
                worst.append((err, sid, key, g[key], w[key]))
    worst.sort(key=lambda x: x[0], reverse=True)
    assert not worst, f"{len(worst)} values differ from the seed's order; worst: {worst[:3]}"


# --- the cases ---------------------------------------------------------------------------------

def test_group_norm_overlong_and_clip_follow_the_seeds_order(state):
    """The issue's case: group_norm, overlong buffer, reward_clip 0.5, groups split across
    micro-batches (n = 4, micro-batches of 3). The clip acts on the group z-scores, so it clips
    the outliers of every group, not the raw rewards before the group statistics."""
    rows = make_rows(21, groups=7, n=4)
    got = stream(rewarded(rows, n=4, mrb=3), ["algo.advantage_estimator=group_norm", "algo.overlong_buffer=true",
                                               "algo.reward_clip=0.5"], state)
    # the clip fraction is measured over the unit the advantage stage emits: the group
    assert_matches(got, seed_order(rows, group_units(rows), "group_norm", overlong=True, clip=0.5))


@pytest.mark.parametrize("estimator, minus_mean, clip", [("rloo", False, 1.0), ("group_norm", True, 0.0),
                                                         ("reinforce_baseline", True, 0.75)])
def test_running_norm_follows_group_shaping(state, estimator, minus_mean, clip):
    """Running normalisation of the shaped rewards, moments shared in the run state. One group per
    micro-batch (n = micro-batch size), so every unit is exactly one of the seed's experiences."""
    rows = make_rows(5, groups=6, n=4)
    got = stream(rewarded(rows, n=4, mrb=4),
                 [f"algo.advantage_estimator={estimator}", "algo.overlong_buffer=true", "algo.reward_running_norm=true",
                  f"algo.reward_running_norm_minus_mean={str(minus_mean).lower()}", f"algo.reward_clip={clip}"], state)
    assert_matches(got, seed_order(rows, group_units(rows), estimator, overlong=True, clip=clip,
                                   running_norm=True, minus_mean=minus_mean))


def test_per_sample_estimator_normalises_per_micro_batch(state):
    """No group: the seed's unit is the micro-batch (groups split across them make no difference)."""
    rows = make_rows(9, groups=5, n=3)
    got = stream(rewarded(rows, n=3, mrb=4),
                 ["algo.advantage_estimator=reinforce", "algo.overlong_buffer=true", "algo.reward_running_norm=true",
                  "algo.reward_running_norm_minus_mean=true", "algo.reward_clip=0.8"], state)
    assert_matches(got, seed_order(rows, batch_units(rows, 4), "reinforce", overlong=True, clip=0.8,
                                   running_norm=True, minus_mean=True))
