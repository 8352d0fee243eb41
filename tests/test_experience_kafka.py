"""read_experiences straight from a Kafka topic (real broker), with the consumer-side dedupe."""

from __future__ import annotations

import numpy as np
import pytest

from expstream import read_experiences
from expstream.bus import make_producer, send_all_and_confirm
from schemas import Ragged, SampleBatch, encode

pytestmark = pytest.mark.integration


def exp_batch(batch_id: str, group: str, indices: list[int]) -> SampleBatch:
    b = len(indices)
    rows = [np.array([7, 9], np.int32)] * b
    f = Ragged.from_rows([np.array([0.5, -0.5], np.float32)] * b, "float32")
    return SampleBatch(
        batch_id=batch_id, policy_version=3, n_samples_per_prompt=4, eos_token_id=9, pad_token_id=0,
        prompt_id=[group] * b, group_id=[group] * b, sample_index=indices, prompt=["p"] * b, label=[""] * b,
        reference=[""] * b, response=["r"] * b, prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)] * b, "int32"),
        response_ids=Ragged.from_rows(rows, "int32"), layout="padded", action_ids=Ragged.from_rows(rows, "int32"),
        action_mask=Ragged.from_rows([np.ones(2, bool)] * b, "bool"), action_log_probs=f, advantages=f, returns=f,
        info={"reward": np.ones(b, np.float32)})


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
