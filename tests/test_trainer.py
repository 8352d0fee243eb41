"""The reference trainer: reward rises in-process, and `expstream train` survives SIGKILL exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import example_prompt_batches

from expstream.config.topology import find_topology, load_topology
from expstream.models.hf import SamplingSupport, load_causal_lm
from expstream.models.resolve import model_dir
from expstream.train import PolicyTrainer, experience_from_records
from schemas import encode
from stages.local import LocalChain

ROOT = Path(__file__).resolve().parents[1]




def _learning_curve(overrides: list[str], steps: int) -> list[float]:
    """The synchronous loop in one process: generate with the current weights, train one step on
    exactly those experiences, load the new weights into generate and actor-logprob."""
    torch.manual_seed(0)
    topo = load_topology(find_topology(None), ["run.seed=1", "train.batch_size=16", *overrides])
    chain = LocalChain(topo).setup()
    actor = load_causal_lm(model_dir(topo, "actor"))
    support = SamplingSupport.of(chain.contexts["generate"].models["tokenizer"], actor, topo.generate.backend,
                                 topo.generate.min_new_tokens)  # as `expstream train` wires it
    trainer = PolicyTrainer(topo, actor, support=support)
    followers = [chain.contexts["generate"].models["generator"].model, chain.contexts["actor-logprob"].models["lm"]]
    per_step = topo.train.batch_size // (topo.run.prompt_batch_size * topo.generate.n_samples_per_prompt)
    rewards = []
    for step in range(steps):
        exps = chain.run(example_prompt_batches(topo, f"s{step}", per_step))
        assert sum(len(b.prompt_id) for b in exps) == topo.train.batch_size
        trainer.train_step(experience_from_records([(b, range(len(b.prompt_id))) for b in exps]))
        for model in followers:
            model.load_state_dict(trainer.actor_state(), strict=True)
        chain.state.set_policy_version(step + 1)
        rewards.append(sum(float(r) for b in exps for r in b.rewards) / topo.train.batch_size)
    return rewards


@pytest.mark.parametrize("overrides, margin", [
    # the example task: the share of "e" in the response (0.09 -> 0.34 measured)
    (["models.reward=null", "models.reward_fn=expstream.rewards:target_char_rate"], 0.1),
    # the default topology's tiny reward model (0.25 -> 0.32 measured)
    ([], 0.03),
])
def test_reward_rises_within_30_steps(overrides, margin):
    rewards = _learning_curve(overrides, 30)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + margin, f"reward did not rise: first 5 steps {first:.4f}, last 5 {last:.4f}: {rewards}"


# ---------------------------------------------------------------------------------------------------
# `expstream train` killed and resumed: every produced sample trained exactly once
# ---------------------------------------------------------------------------------------------------


def _produce_experiences(broker: str, topic: str, records: int) -> set[str]:
    from expstream.kafka.clients import make_producer, send_and_confirm

    topo = load_topology(find_topology(None), ["run.seed=2"])
    exps = LocalChain(topo).setup().run(example_prompt_batches(topo, "k", records))
    producer = make_producer(broker)
    ids = set()
    try:
        for b in exps:
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
            ids.update(f"{g}#{i}" for g, i in zip(b.group_id, b.sample_index, strict=True))
    finally:
        producer.close()
    return ids


def _train_cmd(broker: str, redis_url: str, run_id: str, out: Path, topic: str, steps: int) -> list[str]:
    return [sys.executable, "-m", "expstream", "train", "--bootstrap-servers", broker, "--redis-url", redis_url,
            "--run-id", run_id, "--output", str(out), "--set", f"stages.advantage.output={topic}",
            "--set", "train.batch_size=8", "--set", f"train.max_steps={steps}",
            "--set", "async.max_staleness=100"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.integration
@pytest.mark.parametrize("fault", ["after_publish:3", "after_checkpoint:3"])
def test_kill_and_resume_trains_every_sample_exactly_once(broker, redis_url, run_id, fresh_topic, tmp_path, fault):
    from expstream.kafka.topics import create_topics
    from expstream.train.weights import DirectoryWeightStore

    create_topics(broker, {"policy": 1}, with_dlq=False)
    topic = fresh_topic(2)
    produced = _produce_experiences(broker, topic, records=6)  # 6 records x 8 samples
    steps = len(produced) // 8
    out = tmp_path / "train-out"
    cmd = _train_cmd(broker, redis_url, run_id, out, topic, steps)
    env = {**os.environ, "EXPSTREAM_FAULT": f"trainer:{fault}"}
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert first.returncode == -9, first.stderr[-3000:]
    before = _lines(out / "train.jsonl")
    env.pop("EXPSTREAM_FAULT")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed at step" in second.stderr
    after = _lines(out / "train.jsonl")
    # what was logged before the kill is kept as it was: a prefix of the final log
    assert after[: len(before)] == before
    assert [line["step"] for line in after] == list(range(steps))
    trained = [sid for line in after for sid in line["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert set(trained) == produced
    # the store holds exactly versions 1..steps, and the final model and done marker exist
    store = DirectoryWeightStore(out / "weights")
    assert store.versions("actor") == list(range(1, steps + 1))
    assert json.loads((out / "train" / "done.json").read_text())["steps"] == steps
    assert (out / "final" / "config.json").exists()
    assert load_causal_lm(out / "final") is not None


@pytest.mark.integration
def test_a_trainer_resumes_from_a_format_1_checkpoint_and_drops_what_it_trained(broker, redis_url, run_id,
                                                                                fresh_topic, tmp_path):
    """Issue 28 item 6: checkpoints now carry only the settled ids of the dedupe horizon (format 2). One
    written before (format 1: every trained id in `taken`) still resumes: killed after step 3's checkpoint,
    its meta.json turned back into format 1, and the records it trained sent again. With
    async.max_staleness=100 the staleness rule drops nothing, so only the restored ids keep those copies
    from being trained twice."""
    from expstream.kafka.clients import make_producer, send_and_confirm
    from expstream.kafka.topics import create_topics
    from expstream.train.checkpoint import read_checkpoint

    create_topics(broker, {"policy": 1}, with_dlq=False)
    topic = fresh_topic(1)
    topo = load_topology(find_topology(None), ["run.seed=2"])
    exps = LocalChain(topo).setup().run(example_prompt_batches(topo, "f1", 6))
    producer = make_producer(broker)
    try:
        for b in exps:
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
        produced = {f"{g}#{i}" for b in exps for g, i in zip(b.group_id, b.sample_index, strict=True)}
        steps = len(produced) // 8
        out = tmp_path / "train-out"
        cmd = _train_cmd(broker, redis_url, run_id, out, topic, steps)
        env = {**os.environ, "EXPSTREAM_FAULT": "trainer:after_checkpoint:3"}
        first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
        assert first.returncode == -9, first.stderr[-3000:]
        ckpt = read_checkpoint(out)
        meta_path = out / "train" / "checkpoint" / "meta.json"
        meta = json.loads(meta_path.read_text())
        assert meta["format"] == 2 and "taken" not in meta
        trained = [[sid, v] for e in meta.pop("settled") for sid, v in e["taken"]]
        assert ckpt.step >= 2 and len(trained) == ckpt.step * 8
        meta.update(format=1, taken=trained, dropped=[])
        meta_path.write_text(json.dumps(meta))
        copies = [b for b in exps if {f"{g}#{i}" for g, i in zip(b.group_id, b.sample_index, strict=True)}
                  <= {sid for sid, _ in trained}]
        assert len(copies) >= 2
        for b in copies:  # copies of trained records (redelivered, same versions)
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
    finally:
        producer.close()
    env.pop("EXPSTREAM_FAULT")
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    n = len(trained)
    assert f"resumed at step {ckpt.step}" in second.stderr and f"{n} settled ids kept ({n} trained)" in second.stderr
    after = _lines(out / "train.jsonl")
    assert [line["step"] for line in after] == list(range(steps))
    ids = [sid for line in after for sid in line["sample_ids"]]
    assert len(ids) == len(set(ids)), "a sample was trained twice"
    assert set(ids) == produced
    assert json.loads((out / "train" / "done.json").read_text())["duplicates"] >= sum(len(b.prompt_id) for b in copies)
    meta = json.loads(meta_path.read_text())
    assert meta["format"] == 2 and {sid for e in meta["settled"] for sid, _ in e["taken"]} <= produced


def test_train_without_redis_is_a_config_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "EXPSTREAM_REDIS_URL"}
    res = subprocess.run([sys.executable, "-m", "expstream", "train", "--bootstrap-servers", "127.0.0.1:1",
                          "--output", str(tmp_path / "o")], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr
    assert "--redis-url" in res.stderr and "EXPSTREAM_REDIS_URL" in res.stderr
    assert not (tmp_path / "o").exists(), "refused only after the trainer had started on its output directory"


@pytest.mark.integration
def test_drop_policy_never_trains_a_sample_staler_than_k(broker, redis_url, run_id, fresh_topic, tmp_path):
    """async.on_stale=drop, k=1. First 8 samples of version 0 and 8 of version 1: steps 0 and 1 train
    them. Then, once step 1 is logged, 8 late samples of version 0 (two versions old at step 2:
    dropped, counted, one log line each) and 8 of version 2, which step 2 trains."""
    from expstream.kafka.clients import make_producer, send_and_confirm
    from expstream.kafka.topics import create_topics

    create_topics(broker, {"policy": 1}, with_dlq=False)
    topic = fresh_topic(1)
    topo = load_topology(find_topology(None), ["run.seed=3"])
    exps = LocalChain(topo).setup().run(example_prompt_batches(topo, "d", 4))
    assert [len(b.prompt_id) for b in exps] == [4] * 8  # one record per group of 4
    has_rollout_version = "rollout_version" in set(exps[0].__dataclass_fields__)

    def at(b, v):
        return b.replace(policy_version=v, **({"rollout_version": [v] * 4} if has_rollout_version else {}))

    first = [at(exps[0], 0), at(exps[1], 0), at(exps[2], 1), at(exps[3], 1)]
    late = [at(exps[4], 0), at(exps[5], 0), at(exps[6], 2), at(exps[7], 2)]
    ids = [{f"{g}#{i}" for g, i in zip(b.group_id, b.sample_index, strict=True)} for b in exps]
    producer = make_producer(broker)
    out = tmp_path / "drop-out"
    cmd = _train_cmd(broker, redis_url, run_id, out, topic, 3)[:-2] + ["--set", "async.max_staleness=1",
                                                                       "--set", "async.on_stale=drop"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for b in first:
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
        deadline = time.monotonic() + 180
        while len(_lines(out / "train.jsonl")) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        for b in late:
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
        _, stderr = proc.communicate(timeout=180)
    finally:
        producer.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    lines = _lines(out / "train.jsonl")
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert [set(line["sample_ids"]) for line in lines] == [ids[0] | ids[1], ids[2] | ids[3], ids[6] | ids[7]]
    assert all(int(s) <= 1 for line in lines for s in line["staleness_hist"])
    assert [line["dropped_stale"] for line in lines] == [0, 0, 8]
    assert json.loads((out / "train" / "done.json").read_text())["dropped_stale"] == 8
    assert stderr.count("> async.max_staleness=1") == 8  # one log line per dropped sample


def test_recomputed_old_log_probs_keep_learning_from_stale_samples():
    """train.old_log_probs=recompute: π_old is the weights being trained, so samples whose
    actor-logprob log-probs came from a policy far away still give the plain policy gradient
    −mean_t(Â_t ∇log π_θ) over the sampled actions (computed here by hand); with `stage` the clip zeroes it."""
    topo = load_topology(find_topology(None), ["run.seed=3", "train.batch_size=8", "train.max_grad_norm=0"])
    exps = LocalChain(topo).setup().run(example_prompt_batches(topo, "stale", 1))
    exp = experience_from_records([(b, range(len(b.prompt_id))) for b in exps])
    exp.advantages = torch.where(exp.action_mask, torch.ones_like(exp.advantages), 0.0)  # every token pushed up
    exp.action_log_probs = exp.action_log_probs - 1.0  # "old" policy much less likely: r_t = e > 1 + ε

    def grads(mode: str) -> list[torch.Tensor]:
        actor = load_causal_lm(model_dir(topo, "actor"))
        trainer = PolicyTrainer(load_topology(find_topology(None), ["train.batch_size=8", "train.max_grad_norm=0",
                                                                     f"train.old_log_probs={mode}"]), actor)
        trainer.optimizer.step = lambda: None  # keep the weights: compare gradients only
        trainer.train_step(exp)
        return [p.grad.clone() for p in actor.parameters() if p.grad is not None]

    # by hand: the on-policy gradient of −Σ_t Â_t log π_θ / N (token mean over the mask)
    actor = load_causal_lm(model_dir(topo, "actor")).requires_grad_(True)
    a = exp.action_mask.shape[1]
    logits = actor(input_ids=exp.sequences, attention_mask=exp.attention_mask,
                   position_ids=(exp.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -(a + 1):-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, exp.sequences[:, -a:].unsqueeze(-1)).squeeze(-1)
    # over the sampled actions: an EOS the pipeline forced at the length limit is not trained (docs/numerics.md §14.12)
    assert exp.forced_mask.any()
    mask = (exp.action_mask & ~exp.forced_mask).float()
    (-(logp * mask).sum() / mask.sum()).backward()
    expected = [p.grad.clone() for p in actor.parameters() if p.grad is not None]

    recomputed = grads("recompute")
    assert len(recomputed) == len(expected)
    for g, e in zip(recomputed, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)
    clipped = grads("stage")
    assert sum(float(g.abs().sum()) for g in clipped) < 1e-6 * sum(float(e.abs().sum()) for e in expected)


@pytest.mark.integration
def test_the_custom_trainer_of_docs_async_runs_and_publishes(broker, redis_url, run_id, fresh_topic, tmp_path):
    """docs/async.md "Writing your own trainer", run as written (addresses, paths and the number of
    steps substituted): it trains on real experience records and announces version 1."""
    import re

    from expstream.state import RedisState
    from expstream.train.weights import open_store

    doc = (ROOT / "docs" / "async.md").read_text()
    section = doc[doc.index("## Writing your own trainer"):]
    code = section[section.index("```python") + len("```python"): section.index("```", section.index("```python") + 9)]
    assert code.count("\n") <= 45  # "a 40-line example"
    topic = fresh_topic(2)
    _produce_experiences(broker, topic, 2)  # 16 samples: one step of train.batch_size=16
    actor_dir = model_dir(load_topology(find_topology(None), []), "actor")
    code = re.sub(r"^BOOT, REDIS, RUN = .*$", f"BOOT, REDIS, RUN = {broker!r}, {redis_url!r}, {run_id!r}", code,
                  flags=re.M)
    code = (code.replace('"runs/rl/final"', repr(str(actor_dir))).replace('"runs/rl/weights"', repr(str(tmp_path)))
            .replace('"experiences"', repr(topic)).replace("while version < 20:", "while version < 1:"))
    exec(compile(code, "docs/async.md", "exec"), {"__name__": "docs_example"})  # noqa: S102 - our own docs
    assert open_store(str(tmp_path)).versions("actor") == [1]
    assert RedisState(redis_url, run_id).policy_version() == 1


@pytest.mark.integration
def test_a_trainer_whose_supervisor_is_gone_stops(broker, redis_url, run_id, fresh_topic, tmp_path):
    """Started with EXPSTREAM_EXIT_WITH_PARENT=1 (as the supervisor starts it) and no PDEATHSIG, the
    trainer notices its parent is gone and stops, instead of waiting for experiences forever."""
    from tests.test_orphans import alive

    cmd = _train_cmd(broker, redis_url, run_id, tmp_path / "out", fresh_topic(1), 1000)
    parent = subprocess.Popen(
        [sys.executable, "-c", "import os, subprocess, sys, time\n"
         "p = subprocess.Popen(sys.argv[1:], env={**os.environ, 'EXPSTREAM_EXIT_WITH_PARENT': '1'})\n"
         "print(p.pid, flush=True)\ntime.sleep(600)", *cmd], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    trainer = int(parent.stdout.readline())
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "out").exists():  # run_trainer has started (it makes --output first)
            assert time.monotonic() < deadline and alive(trainer), "the trainer did not start"
            time.sleep(0.2)
        time.sleep(3)  # loading models, or already polling for experiences: either way it must stop
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
    deadline = time.monotonic() + 60
    while alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(trainer), "the orphaned trainer is still running"
