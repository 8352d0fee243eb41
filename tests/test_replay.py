"""`expstream replay`: a real `expstream run` recorded, every stage replayed from its recorded input.

The recording is made from a real run on the session broker and redis-server (stage processes under
the supervisor): each topic is read back from the broker into the recording format. References are
computed here, never by the replay code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from expstream.bus import make_admin, read_topic
from expstream.errors import ConfigError
from expstream.recording import RecordFrame, RecordingWriter, iter_topic, partition_path, recorded_topics
from expstream.replay import Filters, parse_offsets, replay_run, republish, resolve_span
from expstream.topology import KafkaConfig, load_topology
from schemas import decode

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "prompts.jsonl"
N = 4
OUTPUTS = {"generate": "rollouts", "shard-preprocess": "batches", "actor-logprob": "actor", "reference": "reference",
           "critic": "critic", "reward": "rewarded", "postprocess": "scored", "advantage": "experiences"}


def _start_run(out: Path, cache: Path, broker: str, redis_url: str, prefix: str, *sets: str) -> subprocess.Popen:
    names = [f"topics.input={prefix}-prompts"] + [f"stages.{s}.output={prefix}-{t}" for s, t in OUTPUTS.items()]
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(PROMPTS), "--output", str(out), "--no-progress",
           "--bootstrap-servers", broker, "--redis-url", redis_url, "--run-id", prefix,
           "--set", f"models.cache_dir={cache}", "--set", f"generate.n_samples_per_prompt={N}",
           "--set", "generate.max_new_tokens=8", "--set", "run.timeout_s=120",
           # 3 samples per micro-batch: groups of 4 are split, so they complete across records
           "--set", "algo.micro_rollout_batch_size=3"]
    for s in [*names, *sets]:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _export(broker: str, out: Path) -> None:
    """Every topic of the run (and its .dlq twin) read back from the broker into out/topics/."""
    topo = load_topology(out / "run" / "topology.yaml")
    with RecordingWriter(out) as writer:
        for topic in topo.all_topics():
            for t in (topic, f"{topic}.dlq"):
                writer.extend(RecordFrame.from_consumer_record(r) for r in read_topic(broker, KafkaConfig(), t))
    shutil.copy(out / "run" / "topology.yaml", out / "topology.yaml")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, cache, broker, redis_url) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run") / "out"
    prefix = f"rp{uuid.uuid4().hex[:6]}"
    proc = _start_run(out, cache, broker, redis_url, prefix)
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    _export(broker, out)
    return out, prefix


def _values_by_batch(run: Path, topic: str) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for f in iter_topic(run, topic):
        bid = decode(f.value).batch_id
        assert out.get(bid, f.value) == f.value, f"{topic}: batch {bid} recorded twice with different bytes"
        out[bid] = f.value
    return out


pytestmark = pytest.mark.integration


def test_every_stage_replayed_alone_reproduces_the_recorded_bytes(recorded, tmp_path):
    run, prefix = recorded
    topo = load_topology(run / "topology.yaml")
    stages = topo.enabled_stages()
    assert [s.name for s in stages] == ["generate", "shard-preprocess", "actor-logprob", "reference", "reward",
                                        "postprocess", "advantage"]
    for st in stages:
        summary = replay_run(run, st.input, st.name, output=tmp_path / st.name)
        want = _values_by_batch(run, st.output)
        got = _values_by_batch(tmp_path / st.name, st.output)
        assert want, f"{st.output}: nothing recorded"
        assert sorted(got) == sorted(want), f"{st.name}: other batch ids"
        differing = [b for b in want if got[b] != want[b]]
        assert not differing, f"{st.name}: {len(differing)} batches differ from the recording, e.g. {differing[0]}"
        assert summary["dead_letters"] == 0 and summary["stages"][st.name]["batches"] == summary["records_in"]
    # the last stage's replay wrote experiences.msgpack: the recorded experiences, each sample once
    exp = (tmp_path / "advantage" / "experiences.msgpack").read_bytes()
    assert len(exp) == sum(len(v) for v in _values_by_batch(run, f"{prefix}-experiences").values())


def _rloo_reference(scored: dict[str, bytes]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per sample id: (advantages, returns) of rloo with gamma 1, by a plain loop over recorded `scored`."""
    groups: dict[str, dict[int, tuple[float, np.ndarray, int]]] = defaultdict(dict)
    for value in scored.values():
        b = decode(value)
        for i in range(len(b)):
            mask = np.asarray(b.action_mask.row(i), bool)
            groups[b.group_id[i]][int(b.sample_index[i])] = (float(b.processed_rewards[i]),
                                                             np.asarray(b.token_rewards.row(i), np.float64), mask)
    ref = {}
    for g, members in groups.items():
        assert sorted(members) == list(range(N))
        total = sum(r for r, _, _ in members.values())
        for k, (r, tr, mask) in members.items():
            shaped = r - (total - r) / (N - 1)
            tr = tr.copy()
            last = int(np.nonzero(mask)[0][-1])
            tr[last] += shaped - r
            tr[~mask] = 0.0
            g_t = np.zeros_like(tr)
            acc = 0.0
            for t in range(len(tr) - 1, -1, -1):
                acc = tr[t] + acc
                g_t[t] = acc
            ref[f"{g}#{k}"] = (g_t, g_t)
    return ref


def test_postprocess_to_advantage_same_config_is_identical_and_rloo_matches_a_plain_loop(recorded, tmp_path):
    run, prefix = recorded
    same = replay_run(run, f"{prefix}-rewarded", "postprocess..advantage", output=tmp_path / "same")
    assert same["span"] == ["postprocess", "advantage"]
    for topic in (f"{prefix}-scored", f"{prefix}-experiences"):
        assert _values_by_batch(tmp_path / "same", topic) == _values_by_batch(run, topic), topic
    summary = json.loads((tmp_path / "same" / "summary.json").read_text())
    assert summary["estimator"] == "group_norm" and summary["source_run"] == str(run.resolve())

    rloo = replay_run(run, f"{prefix}-rewarded", "postprocess..advantage", output=tmp_path / "rloo",
                      overrides=["algo.advantage_estimator=rloo"])
    assert rloo["estimator"] == "rloo"
    ref = _rloo_reference(_values_by_batch(run, f"{prefix}-scored"))
    seen = set()
    for value in _values_by_batch(tmp_path / "rloo", f"{prefix}-experiences").values():
        b = decode(value)
        for i in range(len(b)):
            sid = f"{b.group_id[i]}#{b.sample_index[i]}"
            adv, ret = ref[sid]
            np.testing.assert_allclose(b.advantages.row(i), adv, atol=1e-5, err_msg=sid)
            np.testing.assert_allclose(b.returns.row(i), ret, atol=1e-5, err_msg=sid)
            seen.add(sid)
    assert seen == set(ref) and len(seen) == 6 * N
    # the estimator changed something: rloo's advantages are not group_norm's
    assert _values_by_batch(tmp_path / "rloo", f"{prefix}-experiences") != _values_by_batch(run, f"{prefix}-experiences")


def test_filters_select_rows_and_records(recorded, tmp_path):
    run, prefix = recorded
    rewarded = [decode(f.value) for f in iter_topic(run, f"{prefix}-rewarded")]
    group = rewarded[0].group_id[0]
    out = replay_run(run, f"{prefix}-rewarded", "postprocess..advantage", output=tmp_path / "g",
                     filters=Filters(groups=frozenset({group})))
    exps = [decode(v) for v in _values_by_batch(tmp_path / "g", f"{prefix}-experiences").values()]
    assert [(b.batch_id, sorted(b.sample_index)) for b in exps] == [(f"g/{group}", list(range(N)))]
    assert out["records_in"] == sum(group in b.group_id for b in rewarded)
    # the group's experience is the recorded one, byte for byte (rows cut from their micro-batches)
    assert _values_by_batch(tmp_path / "g", f"{prefix}-experiences")[f"g/{group}"] == \
        _values_by_batch(run, f"{prefix}-experiences")[f"g/{group}"]
    sid = f"{group}#1"
    replay_run(run, f"{prefix}-rewarded", "postprocess", output=tmp_path / "s", filters=Filters(samples=frozenset({sid})))
    [scored] = [decode(v) for v in _values_by_batch(tmp_path / "s", f"{prefix}-scored").values()]
    assert [f"{g}#{k}" for g, k in zip(scored.group_id, scored.sample_index, strict=True)] == [sid]
    first = next(iter(iter_topic(run, f"{prefix}-rewarded")))
    by_offset = replay_run(run, f"{prefix}-rewarded", "postprocess", output=tmp_path / "o",
                           filters=Filters(offsets=parse_offsets(f"{first.partition}:{first.offset}")))
    assert by_offset["records_in"] == 1


def test_dead_letters_undecodable_records_and_torn_tails(recorded, tmp_path):
    run, prefix = recorded
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("run"))
    topic = f"{prefix}-reference"
    path = partition_path(copy, topic, 0)
    frames = list(iter_topic(copy, topic, [0]))
    with RecordingWriter(copy) as w:  # a record that is not msgpack, after the real ones
        w.append(RecordFrame(topic, 0, frames[-1].offset + 1, frames[-1].timestamp + 1, b"k", b"\x00garbage"))
    with open(path, "ab") as f:  # and half a frame: the tail a SIGKILL leaves
        f.write(b"\x00\x00\x01\x00\x12\x34")
    out = replay_run(copy, topic, "reward", output=tmp_path / "r",
                     overrides=["models.reward=null", "models.reward_fn=tests.rewardfns:wrong_signature"])
    assert out["records_undecodable"] == 1 and out["undecodable"][0]["record"] == f"{topic}[0]@{frames[-1].offset + 1}"
    assert out["torn_tails"] == [f"{topic}[0]"]
    good = out["records_read"] - 1
    # every sample fails alone too, so every record goes whole (as the runner does after bisecting)
    assert out["records_in"] == good and out["dead_letters"] == good
    letters = list(iter_topic(tmp_path / "r", f"{topic}.dlq"))
    assert len(letters) == good
    originals = {(f.partition, f.offset): f.value for f in iter_topic(copy, topic)}
    for letter in letters:
        h = {k: v.decode() for k, v in letter.headers}
        assert h["stage"] == "reward" and h["original_topic"] == topic and h["error_class"] == "TypeError"
        assert letter.value == originals[(int(h["original_partition"]), int(h["original_offset"]))]


def test_bad_flags_name_the_flag(recorded, tmp_path):
    run, prefix = recorded
    topo = load_topology(run / "topology.yaml")
    with pytest.raises(ConfigError, match=f"--from.*stage advantage reads '{prefix}-scored'.*postprocess"):
        resolve_span(topo, f"{prefix}-rewarded", "advantage")
    with pytest.raises(ConfigError, match="--stages.*critic.*disabled"):
        resolve_span(topo, f"{prefix}-reference", "critic")
    with pytest.raises(ConfigError, match="--stages.*comes before"):
        resolve_span(topo, f"{prefix}-rewarded", "advantage..postprocess")
    with pytest.raises(ConfigError, match="--offsets"):
        parse_offsets("0:9-3")
    proc = subprocess.run([sys.executable, "-m", "expstream", "replay", str(run), "--from", "nope", "--stages",
                           "reward", "--output", str(tmp_path / "x")], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--from" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "expstream", "replay", str(run), "--from", f"{prefix}-scored",
                           "--stages", "advantage", "--bootstrap-servers", "127.0.0.1:1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--bootstrap-servers" in proc.stderr and "not built yet" in proc.stderr


def test_into_republishes_under_a_replay_namespace(recorded, broker, fresh_topic):
    run, prefix = recorded
    target = fresh_topic(2)
    report = republish(run, f"{prefix}-prompts", target, broker, tag="t1")
    assert report["sent"] == 3
    got = [decode(r.value) for r in read_topic(broker, KafkaConfig(), target)]
    want = [decode(f.value) for f in iter_topic(run, f"{prefix}-prompts")]
    assert sorted(b.batch_id for b in got) == sorted(f"replay-t1/{b.batch_id}" for b in want)
    assert sorted(p for b in got for p in b.prompt_id) == sorted(f"replay-t1/{p}" for b in want for p in b.prompt_id)
    kept = fresh_topic(1)
    republish(run, f"{prefix}-prompts", kept, broker, keep_ids=True, filters=Filters(batches=frozenset({"p000001"})))
    [rec] = list(read_topic(broker, KafkaConfig(), kept))
    assert rec.value == _values_by_batch(run, f"{prefix}-prompts")["p000001"]
    assert dict(rec.headers)["replay_of"].decode().startswith(f"{prefix}-prompts[")


def test_a_killed_run_replays_from_its_partial_recording(tmp_path, cache, broker, redis_url):
    prefix = f"rk{uuid.uuid4().hex[:6]}"
    out = tmp_path / "killed"
    proc = _start_run(out, cache, broker, redis_url, prefix)

    deadline = time.monotonic() + 300
    admin = make_admin(broker, KafkaConfig())

    def complete_groups() -> set[str]:
        have: dict[str, set[int]] = defaultdict(set)
        if f"{prefix}-rewarded" in admin.list_topics():  # (reading a topic not created yet would create it)
            for r in read_topic(broker, KafkaConfig(), f"{prefix}-rewarded"):
                b = decode(r.value)
                for g, k in zip(b.group_id, b.sample_index, strict=True):
                    have[g].add(int(k))
        return {g for g, ks in have.items() if ks == set(range(N))}

    while not complete_groups():  # kill -9 as soon as one group is through reward: the rest is mid-way
        assert time.monotonic() < deadline and proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.1)
    admin.close()
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "summary.json").exists()
    time.sleep(1.0)  # the stages die with the run (PR_SET_PDEATHSIG)
    _export(broker, out)
    rewarded = [decode(f.value) for f in iter_topic(out, f"{prefix}-rewarded")]
    have: dict[str, set[int]] = defaultdict(set)
    for b in rewarded:
        for g, k in zip(b.group_id, b.sample_index, strict=True):
            have[g].add(int(k))
    complete = {g for g, ks in have.items() if ks == set(range(N))}
    assert complete
    replay_run(out, f"{prefix}-rewarded", "postprocess..advantage", output=tmp_path / "r")
    got = _values_by_batch(tmp_path / "r", f"{prefix}-experiences")
    assert set(got) == {f"g/{g}" for g in complete}
    # the run may have died before any experience was out (an empty topic leaves no recording)
    recorded = _values_by_batch(out, f"{prefix}-experiences") if f"{prefix}-experiences" in recorded_topics(out) else {}
    assert len(recorded) < 6, "killed mid-way: not every group reached the experiences topic"
    assert all(got[b] == v for b, v in recorded.items())
