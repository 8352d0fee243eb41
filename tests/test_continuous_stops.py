"""How a continuous run stops (issue 21 item 14): prompts that yield nothing stop it with a clear error,
Ctrl-C leaves final/ (tests/test_continuous.py), and no process leaves a semaphore for the resource
tracker to clean up ("leaked semaphore objects" at the end of every continuous run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_continuous import ROOT, continuous_cmd

from expstream.launch.continuous import YieldWatch

FEED, HOLD, BARREN = YieldWatch.FEED, YieldWatch.HOLD, YieldWatch.BARREN


def test_every_sample_of_an_epoch_lost_with_nothing_in_flight_is_barren():
    w = YieldWatch(epoch_samples=10)
    assert w.check(produced=0, lost=0, fed=16, now=0.0) == FEED
    assert w.check(produced=0, lost=8, fed=16, now=1.0) == FEED  # under an epoch's worth lost
    assert w.check(produced=0, lost=12, fed=16, now=2.0) == HOLD  # an epoch lost in a row; 4 still in flight
    assert w.check(produced=0, lost=16, fed=16, now=3.0) == BARREN  # they were lost too: nothing comes


def test_an_experience_while_holding_resets_the_count_and_feeding_goes_on():
    w = YieldWatch(epoch_samples=10)
    w.check(produced=0, lost=0, fed=40, now=0.0)
    assert w.check(produced=0, lost=24, fed=40, now=1.0) == HOLD  # a good prompt is still on its way
    assert w.check(produced=2, lost=30, fed=40, now=2.0) == FEED  # it came out: losses count from here
    assert w.check(produced=2, lost=38, fed=40, now=3.0) == FEED  # 8 < 10 since then
    assert w.check(produced=2, lost=40, fed=50, now=4.0) == HOLD
    assert w.check(produced=2, lost=48, fed=50, now=5.0) == BARREN


def test_samples_held_without_change_resume_the_feeding_after_the_stall_time():
    w = YieldWatch(epoch_samples=10, stall_s=30.0)
    w.check(produced=0, lost=0, fed=20, now=0.0)
    assert w.check(produced=0, lost=12, fed=20, now=1.0) == HOLD  # 8 held (e.g. an advantage window)
    assert w.check(produced=0, lost=12, fed=20, now=20.0) == HOLD
    assert w.check(produced=0, lost=12, fed=20, now=31.0) == FEED  # nothing moved for 30 s: more input may
    assert w.check(produced=0, lost=20, fed=30, now=32.0) == FEED  # counting anew from 12 lost


def test_a_forked_process_unlinks_the_semaphores_it_made(tmp_path):
    from expstream.launch.forkserver import ForkedProcess

    name_file = tmp_path / "name"
    proc = ForkedProcess("forkentries:make_named_lock", [sys.executable, "-m", "x", str(name_file)],
                         tmp_path / "child.log", {"PYTHONPATH": str(ROOT / "tests")})
    assert proc.wait(timeout=120) == 0, (tmp_path / "child.log").read_text()[-3000:]
    name = name_file.read_text().lstrip("/")
    # a named POSIX semaphore lives in /dev/shm as sem.<name> until unlinked; left there, the resource
    # tracker unlinks it at the end of the run with the "leaked semaphore objects" warning
    assert not (Path("/dev/shm") / f"sem.{name}").exists(), f"{name} was not unlinked when the process ended"


@pytest.mark.e2e
@pytest.mark.integration
def test_a_continuous_run_whose_every_prompt_is_dead_lettered_stops_after_an_epoch(tmp_path):
    cache = ROOT / ".cache" / "expstream" / "models"
    # every prompt is longer than 2 tokens and none is truncated: generate dead-letters each one
    cmd, out = continuous_cmd(tmp_path, cache, "train.max_steps=5", "generate.prompt_max_len=2",
                              "generate.truncate_prompts=false", "run.timeout_s=150")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and "the prompts yield nothing" in summary["error"], summary["error"]
    assert "no trainer step" not in summary["error"]  # not the run.timeout_s ending
    # a record holds 2 prompts, 5 prompts an epoch: what was fed before the first epoch was all lost,
    # plus the flow-control headroom, not thousands of epochs
    assert summary["epochs_started"] <= 8 and summary["steps"] == 0, summary
    assert "Traceback" not in proc.stderr and "leaked semaphore" not in proc.stderr
