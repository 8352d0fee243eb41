"""End to end through `expstream run`: real broker, real redis-server, one process per stage."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from expstream import read_experiences

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "prompts.jsonl"
N = 4


def run_expstream(tmp_path: Path, cache: Path, *sets: str, timeout: int = 400) -> tuple[dict, list]:
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(PROMPTS), "--output", str(out),
           "--no-progress", "--set", f"models.cache_dir={cache}", "--set", f"generate.n_samples_per_prompt={N}",
           "--set", "generate.max_new_tokens=8", "--set", "run.timeout_s=120"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    summary = json.loads((out / "summary.json").read_text())
    return summary, read_experiences(out / "experiences.msgpack")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def check_common(summary: dict, exps: list) -> dict[str, list[float]]:
    n_prompts = sum(1 for line in PROMPTS.read_text().splitlines() if line.strip())
    assert summary["status"] == "ok" and summary["groups_complete"] == n_prompts
    ids = Counter(s for e in exps for s in e.sample_ids)
    assert len(ids) == n_prompts * N and set(ids.values()) == {1}, "every sample exactly once"
    per_group: dict[str, list[float]] = {}
    for e in exps:
        b, a = e.action_mask.shape
        assert e.sequences.shape[0] == b and e.attention_mask.shape == e.sequences.shape
        for name in ("action_log_probs", "advantages", "returns"):
            t = getattr(e, name)
            assert t.shape == (b, a) and torch.isfinite(t).all(), name
            assert (t[~e.action_mask] == 0).all(), f"{name} is zero outside the action mask"
        assert (e.action_mask.sum(-1) >= 1).all()
        # the response part of the attention mask covers exactly the valid actions' tokens
        assert (e.attention_mask[:, -a:].sum(-1) == e.action_mask.sum(-1)).all()
        for sid, row_adv, row_mask in zip(e.sample_ids, e.advantages, e.action_mask, strict=True):
            per_group.setdefault(sid.split("#")[0], []).append(float(row_adv[row_mask][0]))
    assert all(len(v) == N for v in per_group.values())
    return per_group


def test_group_norm_end_to_end_with_two_advantage_replicas(tmp_path, cache):
    summary, exps = run_expstream(tmp_path, cache, "algo.advantage_estimator=group_norm",
                                  "stages.advantage.replicas=2")
    per_group = check_common(summary, exps)
    for group, advs in per_group.items():
        assert abs(sum(advs) / N) < 1e-5, f"group {group} advantages have zero mean"
    assert all(e.batch_id.startswith("g/") for e in exps), "groups are emitted whole"
    assert summary["stages"]["advantage"]["batches"] >= 2


def test_gae_end_to_end_with_critic(tmp_path, cache):
    summary, exps = run_expstream(tmp_path, cache, "algo.advantage_estimator=gae")
    check_common(summary, exps)
    assert "critic" in summary["stages"]
    assert all(e.values is not None and e.values.shape == e.action_mask.shape for e in exps)
