"""End to end through `expstream run`: real broker, real redis-server, one process per stage."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from expstream import read_experiences
from tests.harness import PROMPTS, ROOT, chain_experiences, leftovers, run_expstream

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
N = 4
COMMON = [f"generate.n_samples_per_prompt={N}", "generate.max_new_tokens=8"]


def run(tmp_path: Path, cache: Path, *sets: str, timeout: int = 400) -> tuple[dict, list]:
    """One whole run; it finished and left no process and no open port (its stages, broker, redis-server)."""
    _, out = run_expstream(tmp_path, cache=cache, sets=[*COMMON, "run.timeout_s=120", *sets], timeout=timeout,
                           check=True)
    assert leftovers(out / "run") == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["topology"] == str(ROOT / "topology.yaml"), "run from the checkout: ./topology.yaml is read"
    return summary, read_experiences(out / "experiences.msgpack")


def check_common(summary: dict, exps: list, dropped: int = 0) -> dict[str, list[float]]:
    n_prompts = sum(1 for line in PROMPTS.read_text().splitlines() if line.strip()) - dropped
    assert summary["status"] == "ok" and summary["groups_complete"] == n_prompts
    assert summary["groups_dropped_dynamic_sampling"] == dropped
    return check_experiences(exps, n_prompts)


def check_experiences(exps: list, n_prompts: int) -> dict[str, list[float]]:
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


def test_group_norm_end_to_end_with_two_advantage_replicas(tmp_path, model_cache):
    summary, exps = run(tmp_path, model_cache, "algo.advantage_estimator=group_norm",
                                  "stages.advantage.replicas=2")
    per_group = check_common(summary, exps)
    for group, advs in per_group.items():
        assert abs(sum(advs) / N) < 1e-5, f"group {group} advantages have zero mean"
    assert all(e.batch_id.startswith("g/") for e in exps), "groups are emitted whole"
    assert summary["stages"]["advantage"]["batches"] >= 2


def test_gae_end_to_end_with_critic(tmp_path, model_cache):
    summary, exps = run(tmp_path, model_cache, "algo.advantage_estimator=gae")
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
def test_every_estimator_through_the_stages(model_cache, estimator, extra):
    """The estimators' numbers, in process (LocalChain, the codec between stages): what a whole run
    adds (Kafka, replicas, the collector, the summary) is covered by the runs above and below."""
    exps = chain_experiences(model_cache, *COMMON, f"algo.advantage_estimator={estimator}", *extra)
    per_group = check_experiences(exps, n_prompts=6)
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


def test_dr_grpo_with_dynamic_sampling_drops_constant_groups(tmp_path, model_cache):
    summary, exps = run(tmp_path, model_cache, "algo.advantage_estimator=dr_grpo", "algo.dynamic_sampling=true",
                                  "models.reward=null", "models.reward_fn=tests.rewardfns:constant_for_arithmetic",
                                  "run.target_groups=4", "run.prompt_batch_size=1")
    per_group = check_common(summary, exps, dropped=2)  # the two "What is ..." prompts score 1.0 throughout
    # 4 groups wanted: the first 4 prompts are fed, the 2 dropped groups are topped up from the file
    assert summary["target_groups"] == 4 and summary["prompts_fed"] == 6
    assert set(per_group) == {"capital-1", "poem-1", "code-1", "logic-1"}
    for advs in per_group.values():
        assert abs(sum(advs)) < 1e-5  # minus the group mean, no std division


@pytest.mark.parametrize("estimator", ["reinforce", "group_norm"])
def test_dead_lettered_samples_do_not_stall_the_run(tmp_path, model_cache, estimator):
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": f"ok{i}", "prompt": f"Question {i}?"} for i in range(3)]
    rows += [{"id": "empty", "prompt": " "}, {"id": "bad", "prompt": "a poison question"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, out = run_expstream(
        tmp_path, prompts=prompts, cache=model_cache,
        sets=["generate.max_new_tokens=4", "models.reward=null", "models.reward_fn=tests.rewardfns:nan_for_poison",
              f"algo.advantage_estimator={estimator}", "run.timeout_s=120", "run.prompt_batch_size=5",
              "run.max_lost_group_share=0.5"])  # 2 of 5 groups are lost on purpose; the default fails on any
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
