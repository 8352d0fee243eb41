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
    assert summary["topology"] == str(ROOT / "topology.yaml"), "run from the checkout: ./topology.yaml is read"
    return summary, read_experiences(out / "experiences.msgpack")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


def check_common(summary: dict, exps: list, dropped: int = 0) -> dict[str, list[float]]:
    n_prompts = sum(1 for line in PROMPTS.read_text().splitlines() if line.strip()) - dropped
    assert summary["status"] == "ok" and summary["groups_complete"] == n_prompts
    assert summary["groups_dropped_dynamic_sampling"] == dropped
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


@pytest.mark.parametrize("estimator, extra", [
    ("reinforce", ["algo.advantage_cross_batch_norm=window", "algo.rollout_batch_size=10"]),
    ("reinforce_baseline", ["algo.advantage_cross_batch_norm=running", "algo.gamma=0.9"]),
    ("rloo", ["models.reward_fn=tests.rewardfns:first_char_code", "models.reward_combine=sum"]),
    ("grpo", ["algo.high_entropy_token_ratio=0.25", "algo.kl_estimator=k1"]),
    ("cpgd", ["algo.use_kl_loss=true"]),
])
def test_every_estimator_end_to_end(tmp_path, cache, estimator, extra):
    summary, exps = run_expstream(tmp_path, cache, f"algo.advantage_estimator={estimator}", *extra)
    per_group = check_common(summary, exps)
    if estimator == "rloo":  # leave-one-out shaped rewards of a group sum to zero (gamma 1, KL tiny)
        assert all("reward_metrics.model" in e.info and "reward_metrics.fn" in e.info for e in exps)
    if estimator == "grpo":
        for e in exps:
            mask = e.high_entropy_mask(0.25)
            assert (mask <= e.action_mask).all() and (mask.sum(-1) >= 1).all()
    if estimator == "cpgd":
        assert all(e.base_action_log_probs is not None for e in exps)
        assert all(torch.equal(e.info["kl"], torch.zeros_like(e.info["kl"])) for e in exps)
    if estimator == "reinforce":
        # the window normalises pooled valid advantages: over all experiences mean 0, biased var 1
        vals = torch.cat([e.advantages[e.action_mask] for e in exps])
        assert abs(float(vals.mean())) < 1e-4 and abs(float(vals.var(unbiased=False)) - 1) < 1e-3
    assert len(per_group) == 6


def test_dr_grpo_with_dynamic_sampling_drops_constant_groups(tmp_path, cache):
    summary, exps = run_expstream(tmp_path, cache, "algo.advantage_estimator=dr_grpo", "algo.dynamic_sampling=true",
                                  "models.reward=null", "models.reward_fn=tests.rewardfns:constant_for_arithmetic",
                                  "run.target_groups=4", "run.prompt_batch_size=1")
    per_group = check_common(summary, exps, dropped=2)  # the two "What is ..." prompts score 1.0 throughout
    # 4 groups wanted: the first 4 prompts are fed, the 2 dropped groups are topped up from the file
    assert summary["target_groups"] == 4 and summary["prompts_fed"] == 6
    assert set(per_group) == {"capital-1", "poem-1", "code-1", "logic-1"}
    for advs in per_group.values():
        assert abs(sum(advs)) < 1e-5  # minus the group mean, no std division


@pytest.mark.parametrize("estimator", ["reinforce", "group_norm"])
def test_dead_lettered_samples_do_not_stall_the_run(tmp_path, cache, estimator):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": f"ok{i}", "prompt": f"Question {i}?"} for i in range(3)]
    rows += [{"id": "empty", "prompt": " "}, {"id": "bad", "prompt": "a poison question"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out), "--no-progress",
         "--set", f"models.cache_dir={cache}", "--set", "generate.max_new_tokens=4", "--set", "models.reward=null",
         "--set", "models.reward_fn=tests.rewardfns:nan_for_poison", "--set", f"algo.advantage_estimator={estimator}",
         "--set", "run.timeout_s=120", "--set", "run.prompt_batch_size=5",
         "--set", "run.max_lost_group_share=0.5"],  # 2 of 5 groups are lost on purpose; the default fails on any
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_complete"] == 3 and summary["groups_dead_lettered"] == ["bad", "empty"]
    assert summary["status"] == "ok" and set(summary["lost_groups"]) == {"bad", "empty"}
    assert summary["lost_groups"]["bad"].startswith("dead letter from reward: ")
    assert summary["lost_groups"]["empty"].startswith("dead letter from generate: ")
    stages = {d["stage"] for d in summary["dead_letters"]}
    assert stages == {"generate", "reward"}
    exps = read_experiences(out / "experiences.msgpack")
    ids = Counter(s for e in exps for s in e.sample_ids)
    assert set(ids) == {f"ok{i}#{k}" for i in range(3) for k in range(N)} and set(ids.values()) == {1}
