"""`expstream run` end to end against a hostile experiences topic and against lost groups.

* Garbage, a PromptBatch, a batch that is not an experience and a foreign group's experience are
  on the `experiences` topic before the run starts (the collector reads it from the beginning):
  the run finishes, counts and keeps them aside, and writes its outputs.
* Every group dead-lettered (a reward function with the wrong signature): exit 1 with one line,
  unless `run.max_lost_group_share=1`.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest

from expstream import read_experiences
from expstream.kafka.clients import make_producer
from expstream.kafka.topics import create_topics
from expstream.launch.localservers import LocalBroker
from schemas import encode
from tests.harness import run_expstream
from tests.runners import exp_batch
from tests.test_collector import GARBAGE, prompt_batch

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
ROOT = Path(__file__).resolve().parents[1]
N = 4
PARTITIONS = 8  # topology.yaml topics.partitions: the run's create_topics accepts the topic as it is


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache  # the session's tiny-model cache (tests/conftest.py)


def run(tmp_path: Path, cache: Path, rows: list[dict], *sets: str, bootstrap: str | None = None):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_expstream(tmp_path, *(["--bootstrap-servers", bootstrap] if bootstrap else []), prompts=prompts,
                         cache=cache, sets=["generate.max_new_tokens=4", "models.reward=null",
                                            f"generate.n_samples_per_prompt={N}", "run.timeout_s=120",
                                            "run.prompt_batch_size=4", *sets])


def test_garbage_on_the_experiences_topic_is_kept_aside_and_the_run_finishes(tmp_path, cache):
    broker = LocalBroker(tmp_path / "broker")
    bootstrap = broker.start()
    try:
        create_topics(bootstrap, {"experiences": PARTITIONS}, with_dlq=True)
        producer = make_producer(bootstrap)
        for value in (GARBAGE, encode(prompt_batch("p9", ["ok0"])),
                      encode(exp_batch("noadv", "ok0", [0]).replace(advantages=None, returns=None)),
                      encode(exp_batch("g/zz", "zz", [0, 1, 2, 3])), encode(exp_batch("g/ok1", "ok1", [0, 1, 2, 3]))):
            producer.send("experiences", value=value, key=b"x", partition=0).get(timeout=30)
        producer.close()
        rows = [{"id": f"ok{i}", "prompt": f"Question {i}?"} for i in range(2)]
        rows += [{"id": "bad", "prompt": "a poison question"}]
        proc, out = run(tmp_path, cache, rows, "models.reward_fn=tests.rewardfns:nan_for_poison",
                        "run.max_lost_group_share=0.5", bootstrap=bootstrap)
    finally:
        broker.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["groups_complete"] == 2
    assert set(summary["lost_groups"]) == {"bad"} and "reward" in summary["lost_groups"]["bad"]
    # the garbage, the PromptBatch, the batch without advantages, group zz, and the made-up
    # experience of a real group id (ok1) that was on the topic before the run
    rejected = summary["rejected_records"]
    assert rejected["count"] == 5 and rejected["file"] == "rejected.msgpack"
    reasons = sorted(r["reason"].split(":")[0] for r in rejected["first"])
    assert reasons == ["foreign", "foreign", "not an experience", "undecodable", "wrong schema"]
    assert [r["where"] for r in rejected["first"]] == [f"experiences[0]@{o}" for o in range(5)]
    assert summary["foreign_samples"] == 8
    kept = list(msgpack.Unpacker(open(out / "rejected.msgpack", "rb"), raw=False))
    assert len(kept) == 5 and kept[0]["value"] == GARBAGE
    ids = sorted(s for e in read_experiences(out / "experiences.msgpack") for s in e.sample_ids)
    assert ids == sorted(f"ok{g}#{i}" for g in range(2) for i in range(N))


@pytest.mark.parametrize("share, code", [(None, 1), (1, 0)])
def test_every_group_lost_fails_the_run_unless_the_share_allows_it(tmp_path, cache, share, code):
    rows = [{"id": f"q{i}", "prompt": f"Question {i}?"} for i in range(3)]
    sets = ["models.reward_fn=tests.rewardfns:wrong_signature"]
    if share is not None:
        sets.append(f"run.max_lost_group_share={share}")
    proc, out = run(tmp_path, cache, rows, *sets)
    assert proc.returncode == code, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "experiences.msgpack").read_bytes() == b""
    assert summary["groups_complete"] == 0 and set(summary["lost_groups"]) == {"q0", "q1", "q2"}
    assert all("reward" in why and "TypeError" in why for why in summary["lost_groups"].values())
    failed = [line for line in proc.stderr.splitlines() if line.startswith("expstream: run failed:")]
    if code == 1:
        assert summary["status"] == "failed"
        assert len(failed) == 1, proc.stderr[-3000:]
        assert failed[0].startswith("expstream: run failed: 3 of 3 groups lost (over run.max_lost_group_share=0): "
                                    "q0, q1, q2: dead letter from reward: TypeError")
        assert summary["error"] == failed[0].removeprefix("expstream: run failed: ")
    else:
        assert summary["status"] == "ok" and failed == [] and summary["error"] is None
