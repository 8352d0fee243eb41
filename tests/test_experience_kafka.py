"""read_experiences straight from a Kafka topic (real broker), with the consumer-side dedupe."""

from __future__ import annotations

import pytest

from expstream import read_experiences
from expstream.kafka.clients import make_producer, send_all_and_confirm
from schemas import encode
from tests.runners import exp_batch

pytestmark = pytest.mark.integration





def test_read_experiences_from_a_topic_dedupes_by_sample_id(broker, fresh_topic, kafka_cfg):
    topic = fresh_topic(2)
    producer = make_producer(broker, kafka_cfg)
    records = [exp_batch("g/a", "a", [0, 1, 2, 3]), exp_batch("m1", "b", [0, 1]), exp_batch("m1", "b", [0, 1]),
               exp_batch("m2", "b", [2, 3])]
    send_all_and_confirm(producer, [(topic, encode(r), r.group_id[0].encode(), None) for r in records])
    producer.close()
    exps = read_experiences(None, bootstrap=broker, topic=topic, timeout_s=20)
    ids = sorted(s for e in exps for s in e.sample_ids)
    assert ids == sorted([f"a#{i}" for i in range(4)] + [f"b#{i}" for i in range(4)])
    assert len(exps) == 3  # the doubled record is dropped whole
    e = next(e for e in exps if e.batch_id == "g/a")
    assert e.sequences.tolist() == [[5, 6, 7, 9]] * 4 and e.policy_version == 3
    raw = read_experiences(None, bootstrap=broker, topic=topic, timeout_s=20, dedupe=False)
    assert sum(len(e.sample_ids) for e in raw) == 10
