"""SampleBatch schema version 2 (issue 9): behaviour log-probs and policy versions on the wire.

Version 2 adds ``rollout_log_probs`` (response-level before shard-preprocess, action-level after),
``rollout_version`` and ``logprob_version``. Readers accept version-1 records (new fields absent);
writers write version 2.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from schemas import Ragged, SampleBatch, decode, encode
from schemas.errors import ValidationError, VersionError
from tests.test_schemas import make_batch


def _v1_bytes(batch: SampleBatch) -> bytes:
    """The record a version-1 writer produced for ``batch`` (which holds no v2 field)."""
    m = msgpack.unpackb(encode(batch), raw=False)
    assert m["version"] == 2
    m["version"] = 1
    return msgpack.packb(m, use_bin_type=True)


def test_version_1_records_are_still_read_with_new_fields_absent():
    old = make_batch()
    out = decode(_v1_bytes(old))
    assert out == old
    assert out.rollout_log_probs is None and out.rollout_version == [] and out.logprob_version == []
    # re-encoding writes version 2 and, the new fields being absent, nothing else changes
    m = msgpack.unpackb(encode(out), raw=False)
    assert m["version"] == 2 and not {"rollout_log_probs", "rollout_version", "logprob_version"} & m.keys()


def test_version_1_record_with_a_v2_field_is_refused():
    m = msgpack.unpackb(encode(make_batch(rollout_version=[4, 4])), raw=False)
    m["version"] = 1
    with pytest.raises(ValidationError, match=r"SampleBatch\.rollout_version: unknown field .* version 1"):
        decode(msgpack.packb(m, use_bin_type=True))


def test_v2_fields_round_trip_and_are_written_in_field_order():
    b = make_batch(
        rollout_log_probs=Ragged.from_rows([[-0.25, -1.5, -3.0], [-0.125]], "float32"),
        rollout_version=[4, 5], logprob_version=[6, 6],
    )  # fmt: skip
    data = encode(b)
    m = msgpack.unpackb(data, raw=False)
    assert m["version"] == 2
    assert m["rollout_version"] == [4, 5] and m["logprob_version"] == [6, 6]
    keys = list(m)
    assert keys.index("response_ids") < keys.index("rollout_log_probs") < keys.index("rollout_version") < \
        keys.index("layout")
    assert keys.index("action_entropy" if "action_entropy" in m else "action_log_probs") < keys.index("logprob_version")
    assert np.frombuffer(m["rollout_log_probs"]["values"]["data"], "<f4").tolist() == [-0.25, -1.5, -3.0, -0.125]
    out = decode(data)
    assert out == b and encode(out) == data


def test_rollout_log_probs_is_response_level_before_actions_and_action_level_after():
    raw = make_batch(layout="", action_ids=None, action_mask=None, action_log_probs=None,
                     response_ids=Ragged.from_rows([[7, 8, 9, 2], [9]], "int32"),
                     rollout_log_probs=Ragged.from_rows([[-1, -1, -1, -1], [-1]], "float32"))  # fmt: skip
    assert decode(encode(raw)) == raw
    with pytest.raises(ValidationError, match=r"SampleBatch\.rollout_log_probs: ragged lengths \[3, 1\] disagree "
                                              r"with response_ids lengths \[4, 1\]"):  # fmt: skip
        raw.replace(rollout_log_probs=Ragged.from_rows([[-1, -1, -1], [-1]], "float32"))
    with pytest.raises(ValidationError, match="response_ids is missing"):
        raw.replace(response_ids=None)
    # with action_ids set it must follow the action lengths [3, 1], not the response's
    with pytest.raises(ValidationError, match=r"rollout_log_probs: ragged lengths \[4, 1\] disagree with action_ids"):
        make_batch(response_ids=raw.response_ids, rollout_log_probs=raw.rollout_log_probs)
    with pytest.raises(ValidationError, match=r"rollout_log_probs: non-finite values .* samples \['a#1'\]"):
        make_batch(rollout_log_probs=Ragged.from_rows([[-1, -1, -1], [-np.inf]], "float32"))
    with pytest.raises(ValidationError, match=r"rollout_log_probs: has dtype float64"):
        make_batch(rollout_log_probs=Ragged.from_rows([[-1, -1, -1], [-1]], "float64"))


@pytest.mark.parametrize("name", ["rollout_version", "logprob_version"])
def test_version_lists_empty_or_one_per_sample(name):
    assert getattr(make_batch(**{name: []}), name) == []
    assert getattr(make_batch(**{name: np.array([1, 2])}), name) == [1, 2]
    with pytest.raises(ValidationError, match=rf"SampleBatch\.{name}: has 1 entries but B=2"):
        make_batch(**{name: [1]})
    with pytest.raises(ValidationError, match=rf"SampleBatch\.{name}: negative policy versions \[-1\]"):
        make_batch(**{name: [0, -1]})
    with pytest.raises(ValidationError, match=rf"SampleBatch\.{name}: entry 1 is str"):
        make_batch(**{name: [0, "1"]})


def test_select_and_concat_carry_the_new_per_sample_fields():
    b = make_batch(rollout_log_probs=Ragged.from_rows([[-0.5, -0.75, -1.0], [-2.0]], "float32"),
                   rollout_version=[3, 4], logprob_version=[5, 6])  # fmt: skip
    s = b.select([1])
    assert s.rollout_version == [4] and s.logprob_version == [6]
    assert s.rollout_log_probs.rows()[0].tolist() == [-2.0]
    c = SampleBatch.concat([s, b], batch_id="c")
    assert c.rollout_version == [4, 3, 4] and c.logprob_version == [6, 5, 6]
    assert [r.tolist() for r in c.rollout_log_probs.rows()] == [[-2.0], [-0.5, -0.75, -1.0], [-2.0]]
    # a batch without versions (e.g. decoded from version 1) makes the joined lists unknown, not short
    old = make_batch()
    c2 = SampleBatch.concat([b, old], batch_id="c2")
    assert c2.rollout_version == [] and c2.logprob_version == [] and c2.rollout_log_probs is None
    assert len(c2) == 4
    assert make_batch().select([0]).rollout_version == []


def test_unknown_version_error_names_every_readable_version():
    m = msgpack.unpackb(encode(make_batch()), raw=False)
    m["version"] = 0
    with pytest.raises(VersionError, match=r"version 0 is not supported by this reader \(it reads version 1 or "
                                           r"2 or 3 or 4 or 5 or 6\); upgrade the reader or have the writer emit version 6"):  # fmt: skip
        decode(msgpack.packb(m, use_bin_type=True))
