"""Per-token policy versions (issue 26 item 2): schema version 4, alignment, Experience, staleness by the oldest token."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from expstream.config.topology import load_topology
from expstream.rl.experience import make_experience_batch, split_experience_batch
from expstream.rl.padded import padded_fields
from expstream.rl.versions import align_token_versions, mixed_rows, oldest_versions, token_version_rows
from expstream.train.trainer import sample_versions
from schemas import Ragged, SampleBatch, decode, encode
from schemas.errors import ValidationError
from stages import shard_preprocess
from stages.context import make_context

EOS, PAD = 9, 0


def i32(rows):
    return Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")


def f32(rows):
    return Ragged.from_rows([np.asarray(r, np.float32) for r in rows], "float32")


def rollouts(token_versions=None):
    responses = [[7, 8, EOS], [3], [7, 7, 7]]
    return SampleBatch(
        batch_id="b", policy_version=2, n_samples_per_prompt=3, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=["g"] * 3, group_id=["g"] * 3, sample_index=[0, 1, 2], prompt=["p"] * 3, label=[""] * 3,
        reference=[""] * 3, response=["r"] * 3, prompt_ids=i32([[5, 6, 7], [6, 7], [5]]), response_ids=i32(responses),
        rollout_log_probs=f32([[-0.5, -1.5, -2.5], [-0.25], [-1.0, -2.0, -3.0]]), rollout_version=[2, 2, 2],
        token_versions=None if token_versions is None else i32(token_versions),
    )  # fmt: skip


def test_wire_version_5_only_with_token_versions_and_older_records_still_read():
    plain = encode(rollouts())
    assert msgpack.unpackb(plain, raw=False)["version"] == 2  # unchanged bytes without per-token versions
    assert b"token_versions" not in plain
    mixed = rollouts([[2, 3, 3], [4], [2, 2, 2]])
    data = encode(mixed)
    assert msgpack.unpackb(data, raw=False)["version"] == 5
    back = decode(data)
    assert [r.tolist() for r in back.token_versions.rows()] == [[2, 3, 3], [4], [2, 2, 2]]
    # absent -> every token of the sample's rollout_version
    assert [r.tolist() for r in token_version_rows(decode(plain))] == [[2, 2, 2], [2], [2, 2, 2]]
    # a version-3 record that carries the field is refused as unknown (a writer newer than it says)
    m = msgpack.unpackb(data, raw=False)
    m["version"] = 3
    with pytest.raises(ValidationError, match="unknown field 'token_versions'"):
        decode(msgpack.packb(m, use_bin_type=True))
    with pytest.raises(ValidationError, match="token_versions: ragged lengths"):
        rollouts([[2, 3], [4], [2, 2, 2]])
    with pytest.raises(ValidationError, match="token_versions: negative"):
        rollouts([[2, -1, 3], [4], [2, 2, 2]])


def test_oldest_and_mixed_by_hand():
    b = rollouts([[2, 3, 3], [4], [2, 2, 2]])
    assert oldest_versions(b) == [2, 2, 2]  # rollout_version 2 is older than row 1's only token (4)
    assert mixed_rows(b) == [True, False, False]
    assert sample_versions(b) == [2, 2, 2]
    b = rollouts([[1, 3, 3], [2], [2, 2, 2]])
    assert sample_versions(b) == [1, 2, 2]  # the oldest token bounds the staleness
    assert mixed_rows(rollouts()) == [False] * 3


def test_align_token_versions_by_hand():
    responses = [[7, 8, EOS], [3], [7, 7, 7]]
    actions = [[7, 8, EOS], [3, EOS], [7, 7, EOS]]
    out = align_token_versions([np.array(r) for r in responses], [np.array(v) for v in ([1, 2, 2], [5], [1, 1, 3])],
                               [np.array(a) for a in actions])
    assert [r.tolist() for r in out] == [[1, 2, 2], [5, 5], [1, 1, 3]] and all(r.dtype == np.int32 for r in out)
    with pytest.raises(ValueError, match="row 0: 3 response tokens but 2 token versions"):
        align_token_versions([np.array([1, 2, 3])], [np.array([1, 1])], [np.array([1, 2, 3])])


def test_token_versions_travel_through_shard_preprocess_to_buffer_items():
    topo = load_topology(overrides=["algo.micro_rollout_batch_size=2"])
    ctx = make_context(topo, "shard-preprocess")
    out = [decode(encode(o)) for o in shard_preprocess.process(decode(encode(rollouts([[2, 3, 3], [4], [2, 3, 4]]))),
                                                                ctx)]
    assert [r.tolist() for r in out[0].token_versions.rows()] == [[2, 3, 3], [4, 4]]
    assert [r.tolist() for r in out[1].token_versions.rows()] == [[2, 3, 4]]
    mb = out[0]
    mb = mb.replace(action_log_probs=f32([[0.0] * 3, [0.0] * 2]), returns=f32([[0.0] * 3, [0.0] * 2]),
                    advantages=f32([[0.0] * 3, [0.0] * 2]))
    from expstream.rl.experience import Experience

    exp = Experience(**padded_fields(mb))
    assert exp.token_versions.tolist() == [[2, 3, 3], [4, 4, 0]]
    items = split_experience_batch(exp)
    assert items[1].token_versions.tolist() == [4, 4, 0]
    assert make_experience_batch(items).token_versions.tolist() == [[2, 3, 3], [4, 4, 0]]
    # an older record: no per-token versions, the Experience says None (every action of rollout_versions[b])
    plain = shard_preprocess.process(rollouts(), ctx)[0].replace(
        action_log_probs=f32([[0.0] * 3, [0.0] * 2]), returns=f32([[0.0] * 3, [0.0] * 2]),
        advantages=f32([[0.0] * 3, [0.0] * 2]))
    assert Experience(**padded_fields(plain)).token_versions is None


def test_show_prints_the_version_of_each_token():
    from expstream.tools.samples import Located, split_samples
    from expstream.tools.showview import sample_dict

    batch = decode(encode(rollouts([[2, 3, 3], [4], [2, 2, 2]])))
    view = sample_dict(split_samples(batch, Located("t[0]@0", None, batch, None))[0])
    assert view["tokens"]["version"] == [2, 3, 3] and view["tokens"]["rollout_lp"] == [-0.5, -1.5, -2.5]
    plain = decode(encode(rollouts()))
    assert "version" not in sample_dict(split_samples(plain, Located("t[0]@0", None, plain, None))[0])["tokens"]
