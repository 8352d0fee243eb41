"""Each outcome writes and prints itself (expstream/launch/outcome.py); tests/test_sizes.py keeps launch/ small."""

from __future__ import annotations

import json
import time
from pathlib import Path

from expstream.config.topology import load_topology
from expstream.launch.outcome import ContinuousOutcome, RunOutcome


def test_a_finite_outcome_prints_what_it_wrote(tmp_path: Path, capsys) -> None:
    out = RunOutcome(topo=load_topology(None), run_id="r1", out_dir=tmp_path, rows=3, started=time.monotonic())
    out.fail("stage reward[0] used up its restarts")
    out.print_summary()
    printed = capsys.readouterr().out.splitlines()
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert printed[0] == "run r1: failed"
    assert printed[1].startswith("  prompts 3, groups complete 0, samples 0")
    assert printed[-1] == f"  wrote {tmp_path / 'experiences.msgpack'} and {tmp_path / 'summary.json'}"


def test_a_continuous_outcome_prints_its_training(tmp_path: Path, capsys) -> None:
    topo = load_topology(None, ["train.enabled=true", "train.max_steps=7"])
    out = ContinuousOutcome(topo=topo, run_id="c1", out_dir=tmp_path, rows=2, started=time.monotonic())
    (tmp_path / "train.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.25}) + "\n")
    out.print_summary()
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "run c1 (continuous): ok"
    assert printed[1].startswith("  steps 1/7, policy version None") and "reward first step 0.2500" in printed[1]
    assert printed[-1] == f"  wrote {tmp_path / 'train.jsonl'}, {tmp_path / 'summary.json'}"
