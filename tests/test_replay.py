"""`expstream replay`: a real `expstream run` recorded, every stage replayed from its recorded input.

The recording is the one the run's own recorder wrote (`record.enabled=true` on the session broker
and redis-server, stage processes under the supervisor), in process and through the broker.
References are computed here, never by the replay code.
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
import yaml

from expstream.config.topology import KafkaConfig, load_topology
from expstream.errors import ConfigError
from expstream.kafka.clients import read_topic
from expstream.kafka.letters import sample_errors
from expstream.tools.recording import (
    PartitionReader,
    RecordFrame,
    RecordingWriter,
    iter_topic,
    partition_path,
    recorded_partitions,
    recorded_topics,
)
from expstream.tools.replay import Filters, replay_run, republish, resolve_span
from expstream.tools.replayinput import parse_offsets
from schemas import decode
from tests.harness import start_expstream

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "prompts.jsonl"
N = 4
OUTPUTS = {"generate": "rollouts", "shard-preprocess": "batches", "actor-logprob": "actor", "reference": "reference",
           "critic": "critic", "reward": "rewarded", "postprocess": "scored", "advantage": "experiences"}


def _start_run(out: Path, cache: Path, broker: str, redis_url: str, prefix: str, *sets: str,
               new_session: bool = False, env: dict[str, str] | None = None) -> subprocess.Popen:
    names = [f"topics.input={prefix}-prompts"] + [f"stages.{s}.output={prefix}-{t}" for s, t in OUTPUTS.items()]
    proc, _ = start_expstream(out.parent, "--bootstrap-servers", broker, "--redis-url", redis_url, "--run-id", prefix,
                              prompts=PROMPTS, out=out, cache=cache, start_new_session=new_session, env=env,
                              sets=[f"generate.n_samples_per_prompt={N}", "generate.max_new_tokens=8",
                                    "run.timeout_s=120",
                                    # 3 samples per micro-batch: groups of 4 are split, so they complete across records
                                    "algo.micro_rollout_batch_size=3", "record.enabled=true", *names, *sets])
    return proc


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache  # the session's tiny-model cache (tests/conftest.py)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, cache, broker, redis_url) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("run") / "out"
    prefix = f"rp{uuid.uuid4().hex[:6]}"
    proc = _start_run(out, cache, broker, redis_url, prefix)
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    # the recorder's recording, nothing exported: every topic of the run and its dead-letter twin
    assert {f"{prefix}-{t}" for t in ["prompts", *OUTPUTS.values()] if t != "critic"} <= set(recorded_topics(out))
    assert json.loads((out / "summary.json").read_text())["recording"]["torn_tails"] == 0
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
        # the record went whole; each sample's own failure travels beside the record's (issue 21 item 12)
        own = sample_errors(h)
        assert sorted(own) == sorted(h["sample_ids"].split(",")) and own
        assert all(why.startswith("TypeError: ") for why in own.values()), own


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
    assert proc.returncode == 2 and "--bootstrap-servers" in proc.stderr, proc.stderr  # a broker that does not answer


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


def _complete_groups(frames) -> set[str]:
    have: dict[str, set[int]] = defaultdict(set)
    for f in frames:
        b = decode(f.value)
        for g, k in zip(b.group_id, b.sample_index, strict=True):
            have[g].add(int(k))
    return {g for g, ks in have.items() if ks == set(range(N))}


def test_a_killed_run_replays_from_its_partial_recording(tmp_path, cache, broker, redis_url):
    """A run SIGKILLed mid-way (its whole process group, the recorder with it) leaves a readable recording (what
    tests/test_recorder.py checked on a killed run of its own), and replays from it."""
    prefix = f"rk{uuid.uuid4().hex[:6]}"
    out = tmp_path / "killed"
    # a slow judge (tests/rewardfns.py, 1 s per record of 3 samples, 8 records): the kill comes seconds before the
    # last group can be rewarded, however fast the rest runs (CI once saw all 6 groups through before the kill).
    # Not a gate holding one prompt: a poll can bring that prompt's record first, and nothing would pass reward.
    proc = _start_run(out, cache, broker, redis_url, prefix, "models.reward=null",
                      "models.reward_fn=tests.rewardfns:slow_with_gate", new_session=True,
                      env={"EXPSTREAM_TEST_REWARD_SLEEP_S": "1.0"})
    rewarded = f"{prefix}-rewarded"
    try:
        deadline = time.monotonic() + 300
        # kill -9 as soon as the RECORDING holds one group through reward: the rest is mid-way
        while not (rewarded in recorded_topics(out) and _complete_groups(iter_topic(out, rewarded))):
            assert time.monotonic() < deadline and proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole process group, as tests/test_recorder.py does
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "summary.json").exists()
    time.sleep(1.0)  # the recorder and the stages die with the run (PR_SET_PDEATHSIG)
    # readable: in every partition whole frames at consecutive offsets, then at most a torn tail (never raises)
    seen = 0
    for topic in recorded_topics(out):
        for part in recorded_partitions(out, topic):
            frames = list(PartitionReader(partition_path(out, topic, part), topic, part))
            assert [f.offset for f in frames] == list(range(len(frames))), (topic, part)
            for f in frames:
                assert decode(f.value) is not None
            seen += len(frames)
    assert seen >= 2 and {f"{prefix}-prompts", f"{prefix}-rollouts"} <= set(recorded_topics(out))
    complete = _complete_groups(iter_topic(out, rewarded))  # what the recorder had written (torn tail cut)
    assert complete
    summary = replay_run(out, rewarded, "postprocess..advantage", output=tmp_path / "r")
    got = _values_by_batch(tmp_path / "r", f"{prefix}-experiences")
    assert set(got) == {f"g/{g}" for g in complete}
    assert summary["source_run"] == str(out.resolve())
    # the run may have died before any experience was recorded
    exps = f"{prefix}-experiences"
    recorded = _values_by_batch(out, exps) if exps in recorded_topics(out) else {}
    assert len(recorded) < 6, "killed mid-way: not every group reached the experiences topic"
    assert all(got[b] == v for b, v in recorded.items())


def test_a_chained_run_is_byte_identical_to_the_unchained_run(recorded, cache, broker, redis_url, tmp_path):
    """The same configuration and seed with `chains:` (stages/chain.py): the same experiences byte for byte,
    the chains' inner topics never created nor recorded, every stage inside a chain accounted for on its own."""
    run, prefix = recorded
    chained = f"ch{uuid.uuid4().hex[:6]}"
    out = tmp_path / "chained"
    proc = _start_run(out, cache, broker, redis_url, chained,
                      "chains=[[actor-logprob, reference, critic], [postprocess, advantage]]")
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    for topic in ("rewarded", "experiences"):  # chain boundaries: recorded, the same bytes per batch
        want = _values_by_batch(run, f"{prefix}-{topic}")
        got = _values_by_batch(out, f"{chained}-{topic}")
        assert want and sorted(got) == sorted(want), topic
        assert [b for b in want if got[b] != want[b]] == [], f"{topic}: chained batches differ from the unchained run"
    assert (out / "experiences.msgpack").read_bytes() and len((out / "experiences.msgpack").read_bytes()) == \
        len((run / "experiences.msgpack").read_bytes())
    inner = {f"{chained}-actor", f"{chained}-scored"}
    assert inner.isdisjoint(recorded_topics(out)) and f"{chained}-reference" in recorded_topics(out)
    summary = json.loads((out / "summary.json").read_text())
    acc = summary["accounting"]
    assert all(acc[s]["balanced"] and acc[s]["samples_in"] == 6 * N for s in ("actor-logprob", "reference",
                                                                               "postprocess", "advantage")), acc
    assert summary["stages"]["postprocess"]["batches"] == summary["stages"]["reward"]["batches"]
    last = json.loads((out / "status.jsonl").read_text().splitlines()[-1])["stages"]  # status: a row per stage
    assert (last["reference"]["chain"], last["reference"]["input_topic"]) == ("actor-logprob+reference", None)
    assert last["actor-logprob"]["input_topic"] == f"{chained}-batches" and "chain" not in last["reward"]
    logs = {p.name for p in (out / "run" / "logs").glob("*.log")}
    assert {"actor-logprob+reference-0.log", "postprocess+advantage-0.log"} <= logs
    assert not {"reference-0.log", "advantage-0.log"} & logs


def test_a_run_with_the_librdkafka_client_is_byte_identical(recorded, cache, broker, redis_url, tmp_path):
    """The same configuration and seed with ``kafka.client: confluent`` (every stage's producer and consumer
    through librdkafka, expstream/kafka/rdconsumer.py) and the partitions assigned by hand (the recorded run's
    stages joined their groups): every topic the same bytes per batch, the same experiences."""
    run, prefix = recorded
    ck = f"ck{uuid.uuid4().hex[:6]}"
    out = tmp_path / "confluent"
    proc = _start_run(out, cache, broker, redis_url, ck, "kafka.client=confluent", "run.assign_partitions=true")
    stdout, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{stdout}\n{stderr[-4000:]}"
    for topic in ("rollouts", "rewarded", "experiences"):
        want = _values_by_batch(run, f"{prefix}-{topic}")
        got = _values_by_batch(out, f"{ck}-{topic}")
        assert want and sorted(got) == sorted(want), topic
        assert [b for b in want if got[b] != want[b]] == [], f"{topic}: batches differ from the kafka-python run"
    assert len((out / "experiences.msgpack").read_bytes()) == len((run / "experiences.msgpack").read_bytes())
    log = (out / "run" / "logs" / "advantage-0.log").read_text()
    assert "assigned by the run" in log, "no group join"
    assert "consumer of group" in log and "librdkafka" in log, "the stage consumed through librdkafka"


# ------------------------------------------------------------------------------------------------
# through a broker (expstream/tools/replaybroker.py): the span as stage processes on fresh topics
# ------------------------------------------------------------------------------------------------


def test_broker_replay_of_reward_is_byte_identical_cli_with_its_own_redis(recorded, broker, tmp_path):
    run, prefix = recorded
    out = tmp_path / "b-reward"
    proc = subprocess.run([sys.executable, "-m", "expstream", "replay", str(run), "--from", f"{prefix}-reference",
                           "--stages", "reward", "--bootstrap-servers", broker, "--output", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={k: v for k, v in os.environ.items() if k != "EXPSTREAM_REDIS_URL"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["via"] == "broker" and summary["status"] == "ok" and summary["span"] == ["reward"]
    want = _values_by_batch(run, f"{prefix}-rewarded")
    assert _values_by_batch(out, f"{prefix}-rewarded") == want  # under the recorded name, byte for byte
    n_in = sum(len(decode(f.value)) for f in iter_topic(run, f"{prefix}-reference"))
    assert summary["samples_in"] == summary["samples_out"] == n_in and summary["dead_letters"] == 0
    # it really went through the broker: the renamed topics hold the same bytes
    renamed = summary["topics"][f"{prefix}-rewarded"]
    assert renamed.startswith("replay-") and renamed.endswith(f".{prefix}-rewarded")
    on_broker = {decode(r.value).batch_id: r.value for r in read_topic(broker, KafkaConfig(), renamed)}
    assert on_broker == want
    # a redis-server of its own (no --redis-url), stopped with the replay; the stage ran as a process
    assert (out / "run" / "logs" / "reward-0.log").is_file()
    assert load_topology(out / "run" / "topology.yaml").enabled_stages()[0].input == \
        summary["topics"][f"{prefix}-reference"]


def test_broker_replay_postprocess_to_advantage_is_byte_identical(recorded, broker, redis_url, tmp_path):
    from expstream.tools.replaybroker import broker_replay

    run, prefix = recorded
    out = tmp_path / "b-pa"
    summary = broker_replay(run, f"{prefix}-rewarded", "postprocess..advantage", broker, redis_url=redis_url,
                            output=out)
    assert summary["status"] == "ok", summary.get("error")
    for topic in (f"{prefix}-scored", f"{prefix}-experiences"):
        assert _values_by_batch(out, topic) == _values_by_batch(run, topic), topic
    btopo = load_topology(out / "run" / "topology.yaml")
    assert [s.name for s in btopo.enabled_stages()] == ["postprocess", "advantage"]
    # experiences.msgpack: every recorded experience once
    assert len((out / "experiences.msgpack").read_bytes()) == \
        sum(len(v) for v in _values_by_batch(run, f"{prefix}-experiences").values())
    assert summary["samples"] == 6 * N and summary["samples_out"] == 6 * N


def test_generate_from_a_continuous_configuration_does_not_block_on_admission(recorded, tmp_path):
    """A continuous run's topology (train.enabled) with a bound that admits only the first prompt record:
    the replay has no trainer to raise it, so it must run with the loop off, not wait for ever."""
    run, prefix = recorded
    copy = tmp_path / "continuous"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("run"))
    raw = yaml.safe_load((copy / "topology.yaml").read_text())
    raw["train"] = {**raw.get("train", {}), "enabled": True, "batch_size": 8}
    raw["async"] = {**raw.get("async", {}), "max_staleness": 0, "on_stale": "backpressure"}
    (copy / "topology.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    prompts = list(iter_topic(copy, f"{prefix}-prompts"))
    per_record = 2 * N  # run.prompt_batch_size x n: (v + k + 1) * B = 8 admits one record, not three
    assert len(prompts) == 3 and all(len(decode(f.value)) * N == per_record for f in prompts)
    out = tmp_path / "gen"
    proc = subprocess.run([sys.executable, "-m", "expstream", "replay", str(copy), "--from", f"{prefix}-prompts",
                           "--stages", "generate", "--output", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _values_by_batch(out, f"{prefix}-rollouts") == _values_by_batch(run, f"{prefix}-rollouts")
    assert load_topology(out / "topology.yaml").train.enabled is False
    assert json.loads((out / "summary.json").read_text())["loop_disabled"] is True


def test_broker_topology_renames_the_span_and_disables_the_rest():
    """Pure: the --set entries of a broker replay, and which samples a group estimator cannot emit."""
    from expstream.tools.replay import ReplayItem
    from expstream.tools.replaybroker import broker_overrides, input_sample_ids, unreachable_samples
    from schemas import PromptBatch

    topo = load_topology(None, ["chains=[[postprocess, advantage]]"])  # a chained run: replayed unchained
    sets = broker_overrides(topo, ["postprocess", "advantage"], "rewarded", "t1")
    btopo = load_topology(None, ["chains=[[postprocess, advantage]]", *sets])
    assert all(not u.chained for u in btopo.units())
    assert [(s.name, s.input, s.output) for s in btopo.enabled_stages()] == [
        ("postprocess", "replay-t1.rewarded", "replay-t1.scored"),
        ("advantage", "replay-t1.scored", "replay-t1.experiences")]
    prompts = ReplayItem(None, PromptBatch(batch_id="p000000", prompt_id=["a", "b"], prompt=["x", "y"], label=["", ""],
                                      reference=["", ""]))
    assert input_sample_ids([prompts], 2) == ["a#0", "a#1", "b#0", "b#1"]
    ids = ["a#0", "a#1", "a#2", "a#3", "b#0", "b#2"]  # group b cut by a --samples filter
    assert unreachable_samples(topo, ["postprocess", "advantage"], ids) == {"b#0", "b#2"}
    assert unreachable_samples(topo, ["postprocess"], ids) == set()
    assert unreachable_samples(load_topology(None, ["algo.advantage_estimator=reinforce"]), ["advantage"], ids) == set()


# ------------------------------------------------------------------------------------------------
# a hand-made recording: damage and filters are refused before anything runs (issue 21, items 7, 14)
# ------------------------------------------------------------------------------------------------


def _prompt_run(root: Path, n: int = 3) -> Path:
    """A run directory with the default topology and ``n`` one-prompt records on ``prompts``."""
    from schemas import PromptBatch, encode

    root.mkdir(parents=True)
    (root / "topology.yaml").write_text(yaml.safe_dump(load_topology().raw))
    with RecordingWriter(root) as w:
        for k in range(n):
            w.append(RecordFrame("prompts", 0, k, 1_764_000_000_000 + k, None, encode(PromptBatch(
                batch_id=f"p{k:06d}", prompt_id=[str(k)], prompt=[f"q{k}"], label=[""], reference=[""]))))
    return root


def test_filters_that_match_nothing_are_refused(tmp_path, capsys):
    from expstream.cli import main

    run = _prompt_run(tmp_path / "run")
    for flag, value in (("--batches", "p999999"), ("--groups", "77"), ("--samples", "77#0"), ("--offsets", "0:50-60"),
                        ("--offsets", "3:0")):
        out = tmp_path / f"out{flag}{value}"
        code = main(["replay", str(run), "--from", "prompts", "--stages", "generate", "--output", str(out),
                     flag, value])
        err = capsys.readouterr().err
        assert code == 2, (flag, value, err)  # was: exit 0 after replaying nothing
        assert f"{flag} selected none of the 3 record(s) of prompts" in err and "p000000" in err and "0:0-2" in err
        assert not out.exists()
    with pytest.raises(ConfigError, match="--batches selected none"):  # --into: checked before the broker is asked
        republish(run, "prompts", "x", "127.0.0.1:1", filters=Filters(batches=frozenset({"nope"})))


def test_a_damaged_recording_is_refused_and_a_torn_one_warned_about(tmp_path, capsys, caplog):
    from expstream.cli import main
    from expstream.tools.replay import prepare_replay

    run = _prompt_run(tmp_path / "run")
    path = partition_path(run, "prompts", 0)
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(100))  # was: replayed as if torn, only summary.json's torn_tails said so
    code = main(["replay", str(run), "--from", "prompts", "--stages", "generate", "--output", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}: corrupt at byte {len(whole)}" in err and "Traceback" not in err
    path.write_bytes(whole[:-7])  # the tail a SIGKILL leaves
    with caplog.at_level("WARNING", logger="expstream.replay"):
        prep = prepare_replay(run, "prompts", "generate", output=tmp_path / "o2")
    assert len(prep.items) == 2 and prep.counts["torn_tails"] == ["prompts[0]"]
    assert any(f"{path}: torn last frame at byte" in r.getMessage() for r in caplog.records)
