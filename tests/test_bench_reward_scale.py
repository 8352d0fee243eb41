"""bench/reward_scale.py's arithmetic on hand-made ticks (the runs themselves are the bench's, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import their helpers as `common`

import reward_scale as rs  # noqa: E402


def test_key_spread_cap_follows_range_assignment() -> None:
    parts = {0: 8, 1: 9, 2: 10, 3: 5}  # 32 records
    assert rs.ideal_ratio(parts, 1) == pytest.approx(1.0)
    assert rs.ideal_ratio(parts, 2) == pytest.approx(32 / 17)  # {0,1} = 17, {2,3} = 15
    assert rs.ideal_ratio(parts, 4) == pytest.approx(32 / 10)
    # 5 partitions over 2 replicas: the first takes 3 (range assignment), not every other one
    assert rs.ideal_ratio({0: 1, 1: 1, 2: 10, 3: 1, 4: 1}, 2) == pytest.approx(14 / 12)
    assert rs.ideal_ratio({}, 4) != rs.ideal_ratio({}, 4)  # NaN: nothing was read


def _tick(t: float, out: int, lag: int = 0, replicas: int = 1, inputs: int = 0) -> dict:
    return {"t": t, "lag": lag, "lag_parts": {}, "out_records": out, "in_parts": {0: inputs}, "replicas": replicas}


def test_windowed_rate_counts_samples_over_the_window() -> None:
    ticks = [_tick(float(t), out=2 * t) for t in range(11)]  # 2 records (16 samples) per second
    rates = rs.windowed_rates(ticks, per_record=8)
    assert rates[0][0] == pytest.approx(3.0)  # the first window of at least half RATE_WINDOW_S
    assert all(v == pytest.approx(16.0) for _, v in rates)


def test_autoscale_report_times_from_the_work_arriving() -> None:
    t0 = 1000.0
    ticks = [_tick(0.0, 0), _tick(1.0, 0), _tick(2.0, 0, lag=20, inputs=20)]
    ticks += [_tick(float(t), out=(t - 6) * 2 if t > 6 else 0, lag=10, replicas=4, inputs=20) for t in range(3, 20)]
    run = {"ticks": ticks, "samples_per_record": 8, "t0_epoch": t0, "steady_samples_per_s": 12.0,
           "stages": {"reward": {"replicas": 1}},
           "scale_events": [{"stage": "reward", "from": 1, "to": 4, "time": t0 + 2.5, "lag": 20},
                            {"stage": "generate", "from": 2, "to": 1, "time": t0 + 9.0, "lag": 0},
                            {"stage": "reward", "from": 4, "to": 2, "time": t0 + 18.0, "lag": 1}]}
    best = {"ticks": [_tick(float(t), out=3 * t) for t in range(20)], "samples_per_record": 8,
            "steady_samples_per_s": 15.0}
    rep = rs.autoscale_report(run, best)
    assert rep["work_arrived_at_s"] == pytest.approx(2.0)
    assert rep["peak_replicas"] == 4
    assert rep["time_to_peak_replicas_s"] == pytest.approx(0.5)
    assert (rep["scale_ups"], rep["scale_downs"]) == (1, 1)  # generate's event is not the reward stage's
    assert rep["peak_window_rate"] == pytest.approx(16.0)  # 2 records/s x 8 once the replicas run
    # the first window at >= 90 % of 16/s (14.4) ends at t = 11 (windows 6..11: 10 records over 5 s)
    assert rep["time_to_steady_s"] == pytest.approx(11.0 - 2.0)
    assert rep["best_fixed_peak_window_rate"] == pytest.approx(24.0)
    assert rep["steady_vs_best_fixed"] == pytest.approx(12.0 / 15.0)
