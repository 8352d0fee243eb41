"""Tests of the wire contract (schemas/): tensors, Ragged, messages, codec, errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import schemas
from schemas import (
    DecodeError,
    PromptBatch,
    Ragged,
    SampleBatch,
    SchemaError,
    UnknownSchemaError,
    ValidationError,
    VersionError,
    decode,
    decode_tensor,
    encode,
    encode_tensor,
    peek_header,
)

ROOT = Path(__file__).resolve().parents[1]


def i32(*xs: int) -> bytes:
    return b"".join(int(x).to_bytes(4, "little", signed=True) for x in xs)


def f32(*xs: float) -> bytes:
    return np.asarray(xs, dtype="<f4").tobytes()


def tensor(dtype: str, shape: list[int], data: bytes) -> dict:
    return {"dtype": dtype, "shape": shape, "data": data}


def make_batch(**changes) -> SampleBatch:
    """Two samples of one group, with action-level fields; lengths [3, 1]."""
    kw = dict(
        batch_id="p000001/m0", policy_version=3, n_samples_per_prompt=2, eos_token_id=2, pad_token_id=0,
        prompt_id=["a", "a"], group_id=["a", "a"], sample_index=[0, 1], prompt=["hi", "hi"],
        label=["4", "4"], reference=["", ""], response=["x y", "z"],
        prompt_ids=Ragged.from_rows([[5, 6], [5, 6]], "int32"),
        response_ids=Ragged.from_rows([[7, 8, 2], [9]], "int32"), layout="padded",
        action_ids=Ragged.from_rows([[7, 8, 2], [9]], "int32"),
        action_mask=Ragged.from_rows([[True, True, True], [True]], "bool"),
        action_log_probs=Ragged.from_rows([[-0.5, -1.0, -0.25], [-2.0]], "float32"),
        rewards=[1.0, 0.0], info={"kl": [0.0, 0.5]},
    )  # fmt: skip
    kw.update(changes)
    return SampleBatch(**kw)


# -- errors -----------------------------------------------------------------------------------
def test_error_hierarchy_is_valueerror_and_not_retriable():
    for cls in (SchemaError, DecodeError, UnknownSchemaError, VersionError, ValidationError):
        assert issubclass(cls, ValueError) and issubclass(cls, SchemaError)
        assert cls.retriable is False


# -- tensors ----------------------------------------------------------------------------------
DTYPE_CASES = [
    ("bool", np.array([True, False, True]), b"\x01\x00\x01"),
    ("int8", np.array([-1, 2], dtype=np.int8), b"\xff\x02"),
    ("uint8", np.array([255, 0], dtype=np.uint8), b"\xff\x00"),
    ("int16", np.array([-2, 258], dtype=np.int16), b"\xfe\xff\x02\x01"),
    ("int32", np.array([1, -2], dtype=np.int32), b"\x01\x00\x00\x00\xfe\xff\xff\xff"),
    ("int64", np.array([-1], dtype=np.int64), b"\xff" * 8),
    ("float16", np.array([1.0, -2.0], dtype=np.float16), b"\x00\x3c\x00\xc0"),
    ("bfloat16", np.array([0x3F80, 0xC000], dtype=np.uint16), b"\x80\x3f\x00\xc0"),  # 1.0, -2.0
    ("float32", np.array([1.0, 0.5], dtype=np.float32), b"\x00\x00\x80\x3f\x00\x00\x00\x3f"),
    ("float64", np.array([1.0], dtype=np.float64), b"\x00\x00\x00\x00\x00\x00\xf0\x3f"),
]


@pytest.mark.parametrize("name,arr,data", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_tensor_every_dtype_bytes_and_round_trip(name, arr, data):
    d = encode_tensor(arr, name if name == "bfloat16" else None)
    assert d == {"dtype": name, "shape": [len(arr)], "data": data}
    wire = msgpack.unpackb(msgpack.packb(d, use_bin_type=True), raw=False)
    back = decode_tensor(wire)
    assert back.dtype == (np.uint16 if name == "bfloat16" else arr.dtype)
    assert back.tolist() == arr.tolist()


def test_tensor_shape_c_order_big_endian_and_zero_size():
    arr = np.arange(6, dtype=">i4").reshape(2, 3)  # big-endian input is written little-endian
    d = encode_tensor(arr)
    assert d == tensor("int32", [2, 3], i32(0, 1, 2, 3, 4, 5))
    assert decode_tensor(d).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert encode_tensor(np.asfortranarray(np.array([[1, 2], [3, 4]], np.int32)))["data"] == i32(1, 2, 3, 4)
    empty = decode_tensor(encode_tensor(np.zeros((0, 4), np.float32)))
    assert empty.shape == (0, 4) and empty.dtype == np.float32
    assert encode_tensor([1, 2], "int16") == tensor("int16", [2], b"\x01\x00\x02\x00")


def test_tensor_errors():
    with pytest.raises(ValidationError, match="bfloat16"):
        encode_tensor(np.array([1], np.uint16))
    with pytest.raises(ValidationError, match="cast it first"):
        encode_tensor(np.array([1.0]), "float32")
    with pytest.raises(ValidationError, match=r"rewards: data has 7 bytes but shape \[2\] of float32 needs"):
        decode_tensor(tensor("float32", [2], b"\x00" * 7), field="rewards")
    with pytest.raises(ValidationError, match="unknown dtype 'complex64'"):
        decode_tensor(tensor("complex64", [1], b"\x00" * 8))
    with pytest.raises(ValidationError, match="exactly the keys"):
        decode_tensor({"dtype": "int8", "shape": [0], "data": b"", "extra": 1})
    with pytest.raises(ValidationError, match="msgpack bin"):
        decode_tensor(tensor("int8", [1], "a"))
    with pytest.raises(ValidationError, match="non-negative ints"):
        decode_tensor(tensor("int8", [-1], b""))
    with pytest.raises(ValidationError, match="0 and 1"):
        decode_tensor(tensor("bool", [1], b"\x02"))


# -- Ragged -----------------------------------------------------------------------------------
def test_ragged_basics():
    r = Ragged.from_rows([[1, 2, 3], [], [4]], "int32")
    assert len(r) == 3 and r.total == 4 and r.dtype == "int32"
    assert r.values.dtype == np.int32 and r.lengths.dtype == np.int32
    assert r.offsets.tolist() == [0, 3, 3, 4] and r.offsets.dtype == np.int64
    assert [x.tolist() for x in r.rows()] == [[1, 2, 3], [], [4]]
    assert r.row(0).tolist() == [1, 2, 3] and r.row(1).tolist() == [] and r.row(-1).tolist() == [4]
    with pytest.raises(IndexError):
        r.row(3)
    assert r.select([2, 0, 0]) == Ragged(
        np.array([4, 1, 2, 3, 1, 2, 3], np.int32), np.array([1, 3, 3], np.int32)
    )
    assert r.select(np.array([False, True, False])).rows()[0].tolist() == []
    assert len(r.select([])) == 0
    both = Ragged.concat([r, Ragged.from_rows([[9]], "int32")])
    assert both.lengths.tolist() == [3, 0, 1, 1] and both.values.tolist() == [1, 2, 3, 4, 9]
    assert len(Ragged.concat([], dtype="float32")) == 0
    assert r.to_padded(-1).tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]]
    assert r.to_dict() == {
        "lengths": tensor("int32", [3], i32(3, 0, 1)),
        "values": tensor("int32", [4], i32(1, 2, 3, 4)),
    }
    assert Ragged.from_dict(r.to_dict()) == r
    empty = Ragged.from_rows([], "bool")
    assert len(empty) == 0 and empty.rows() == [] and empty.offsets.tolist() == [0]


def test_ragged_bfloat16_keeps_its_name():
    r = Ragged.from_rows([np.array([0x3F80], np.uint16), np.array([], np.uint16)], "bfloat16")
    wire = msgpack.unpackb(msgpack.packb(r.to_dict(), use_bin_type=True), raw=False)
    assert wire["values"] == tensor("bfloat16", [1], b"\x80\x3f")
    back = Ragged.from_dict(wire)
    assert back.dtype == "bfloat16" and back.values.dtype == np.uint16 and back == r
    with pytest.raises(ValidationError, match="uint16 bit patterns"):
        Ragged.from_rows([[1.0]], "bfloat16")


def test_ragged_validation():
    with pytest.raises(ValidationError, match="lengths sum to 3 but values has 2"):
        Ragged(np.array([1, 2], np.int32), np.array([1, 2]))
    with pytest.raises(ValidationError, match="non-negative"):
        Ragged(np.array([], np.int32), np.array([1, -1]))
    with pytest.raises(ValidationError, match="1-D"):
        Ragged(np.zeros((2, 2), np.int32), np.array([2, 2]))
    with pytest.raises(ValidationError, match="without loss"):
        Ragged.from_rows([[0.5]], "int32")
    with pytest.raises(ValidationError, match="different dtypes"):
        Ragged.concat([Ragged.from_rows([[1]], "int32"), Ragged.from_rows([[1]], "int64")])
    with pytest.raises(ValidationError, match=r"lengths: must be an int32"):
        Ragged.from_dict(
            {"lengths": tensor("int64", [1], b"\x00" * 8), "values": tensor("int8", [0], b"")}, field="x"
        )
    assert Ragged(np.array([1, 2], np.int8), [1, 1]).lengths.dtype == np.int32


# -- messages ---------------------------------------------------------------------------------
def test_field_table_matches_dataclasses():
    for cls in (PromptBatch, SampleBatch):
        assert list(cls.FIELDS) == [f.name for f in dataclasses.fields(cls)]
    assert list(SampleBatch.FIELDS)[:5] == [
        "batch_id", "policy_version", "n_samples_per_prompt", "eos_token_id", "pad_token_id"
    ]  # fmt: skip


def test_sample_batch_conversions_and_ids():
    b = make_batch()
    assert len(b) == 2 and b.sample_ids() == ["a#0", "a#1"]
    assert b.rewards.dtype == np.float32 and b.rewards.tolist() == [1.0, 0.0]
    assert b.info["kl"].dtype == np.float32 and b.reward_metrics == {} and b.kl_coef is None
    assert b.replace(kl_coef=1).kl_coef == 1.0


@pytest.mark.parametrize(
    "changes,pattern",
    [
        (dict(action_log_probs=Ragged.from_rows([[-0.5, -1.0], [-1.0, -2.0]], "float32")),
         r"^SampleBatch\.action_log_probs: ragged lengths \[2, 2\] disagree with action_ids lengths \[3, 1\] "
         r"\(first at sample a#0\); every action-level field must have one value per action token$"),
        (dict(rewards=[1.0, float("nan")]), r"^SampleBatch\.rewards: non-finite .*\['a#1'\]"),
        (dict(rewards=np.array([1.0, 0.0])), r"^SampleBatch\.rewards: has dtype float64; cast it to float32"),
        (dict(rewards=[1.0]), r"^SampleBatch\.rewards: has shape \(1,\) but must be \(B,\) = \(2,\)"),
        (dict(sample_index=[0, 2]), r"^SampleBatch\.sample_index: values \[2\] at rows \[1\] are outside \[0, n"),
        (dict(sample_index=[0, -1]), r"^SampleBatch\.sample_index"),
        (dict(label=["4"]), r"^SampleBatch\.label: has 1 entries but B=2"),
        (dict(response=["a", 3]), r"^SampleBatch\.response: entry 1 is int"),
        (dict(layout="ragged"), r"^SampleBatch\.layout: unknown layout 'ragged'"),
        (dict(n_samples_per_prompt=0, sample_index=[0, 0]), r"^SampleBatch\.n_samples_per_prompt: must be >= 1"),
        (dict(policy_version="3"), r"^SampleBatch\.policy_version: expected int"),
        (dict(kl_coef=float("inf")), r"^SampleBatch\.kl_coef: must be finite"),
        (dict(action_ids=None), r"^SampleBatch\.action_mask: is set but action_ids is missing"),
        (dict(prompt_ids=Ragged.from_rows([[1]], "int32")), r"^SampleBatch\.prompt_ids: has 1 rows but B=2"),
        (dict(prompt_ids=Ragged.from_rows([[1], [2]], "int64")), r"^SampleBatch\.prompt_ids: has dtype int64 but must be int32"),
        (dict(action_mask=Ragged.from_rows([[1, 1, 1], [1]], "int32")), r"^SampleBatch\.action_mask: has dtype int32 but must be bool"),
        (dict(values=Ragged.from_rows([[0.0, 0.0, 0.0], [np.inf]], "float32")), r"^SampleBatch\.values: non-finite .*\['a#1'\]"),
        (dict(values=[[0.0, 0.0, 0.0], [1.0]]), r"^SampleBatch\.values: expected schemas\.Ragged"),
        (dict(info={"kl": [0.0, float("nan")]}), r"^SampleBatch\.info\['kl'\]: non-finite .*\['a#1'\]"),
        (dict(reward_metrics={"rm": np.zeros(2, np.float16)}), r"^SampleBatch\.reward_metrics\['rm'\]: has dtype float16"),
        (dict(info={1: [0.0, 0.0]}), r"^SampleBatch\.info: key 1 is int"),
    ],
)  # fmt: skip
def test_sample_batch_validation_names_the_field(changes, pattern):
    with pytest.raises(ValidationError, match=pattern) as ei:
        make_batch(**changes)
    assert ei.value.field is not None and ei.value.field.startswith("SampleBatch.")


def test_prompt_batch_validation():
    p = PromptBatch("p000000", ["0", "1"], ["a", "b"], ["", ""], ["", ""])
    assert len(p) == 2
    with pytest.raises(ValidationError, match=r"^PromptBatch\.label: has 1 entries but B=2"):
        PromptBatch("p000000", ["0", "1"], ["a", "b"], [""], ["", ""])
    with pytest.raises(ValidationError, match=r"^PromptBatch\.batch_id: expected str"):
        PromptBatch(7)


def test_select_and_concat():
    b = make_batch(kl_coef=0.1, reward_metrics={"rm": [0.5, 0.25]})
    s = b.select([1], batch_id="g/a")
    assert s.batch_id == "g/a" and s.sample_ids() == ["a#1"] and s.response == ["z"]
    assert s.action_ids.rows()[0].tolist() == [9] and s.action_log_probs.values.tolist() == [-2.0]
    assert (
        s.rewards.tolist() == [0.0]
        and s.info["kl"].tolist() == [0.5]
        and s.reward_metrics["rm"].tolist() == [0.25]
    )
    assert (s.policy_version, s.layout, s.kl_coef) == (3, "padded", 0.1)
    assert b.select([0, 1]) == b and b.select([]).sample_ids() == []

    other = make_batch(
        policy_version=1,
        group_id=["b", "b"],
        prompt_id=["b", "b"],
        kl_coef=0.2,
        info={"kl": [1, 2], "x": [0, 0]},
    )
    c = SampleBatch.concat([b, other], batch_id="joined")
    assert c.batch_id == "joined" and len(c) == 4 and c.sample_ids() == ["a#0", "a#1", "b#0", "b#1"]
    assert c.policy_version == 1 and c.kl_coef == 0.1
    assert c.action_ids.lengths.tolist() == [3, 1, 3, 1]
    assert c.action_ids.values.tolist() == [7, 8, 2, 9, 7, 8, 2, 9]
    assert c.rewards.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert list(c.info) == ["kl"] and c.info["kl"].tolist() == [0.0, 0.5, 1.0, 2.0]
    assert c.reward_metrics == {}  # only the first batch had "rm"
    assert SampleBatch.concat([b, other.replace(kl_coef=None)], "j").kl_coef is None
    with pytest.raises(ValidationError, match=r"SampleBatch\.eos_token_id: batches to concat disagree"):
        SampleBatch.concat([b, make_batch(eos_token_id=5)], "j")
    with pytest.raises(ValueError):
        SampleBatch.concat([], "j")


# -- codec ------------------------------------------------------------------------------------
def test_prompt_batch_exact_bytes():
    p = PromptBatch(batch_id="p000000", prompt_id=["0"], prompt=["hi"], label=[""], reference=[""])
    expected = msgpack.packb(
        {"schema": "expstream.PromptBatch", "version": 1, "batch_id": "p000000", "prompt_id": ["0"],
         "prompt": ["hi"], "label": [""], "reference": [""]}, use_bin_type=True)  # fmt: skip
    assert encode(p) == expected
    assert decode(expected) == p
    readme_hex = (  # schemas/README.md, "A PromptBatch, byte by byte"
        "87 a6736368656d61 b565787073747265616d2e50726f6d70744261746368 a776657273696f6e 01"
        " a862617463685f6964 a770303030303030 a970726f6d70745f6964 91a130 a670726f6d7074 91a26869"
        " a56c6162656c 91a0 a97265666572656e6365 91a0"
    )
    assert encode(p) == bytes.fromhex(readme_hex) and len(expected) == 100


def test_sample_batch_exact_wire_map():
    """The worked example of schemas/README.md: one sample, two action tokens."""
    b = SampleBatch(
        batch_id="p000000/m0", policy_version=0, n_samples_per_prompt=1, eos_token_id=2, pad_token_id=0,
        prompt_id=["q1"], group_id=["q1"], sample_index=[0], prompt=["1+1="], label=["2"], reference=[""],
        response=["2"], prompt_ids=Ragged.from_rows([[16, 10, 16, 28]], "int32"),
        response_ids=Ragged.from_rows([[17, 2]], "int32"), layout="padded",
        action_ids=Ragged.from_rows([[17, 2]], "int32"), action_mask=Ragged.from_rows([[True, True]], "bool"),
        rewards=[1.0], info={"reward": [1.0]},
    )  # fmt: skip
    expected = {
        "schema": "expstream.SampleBatch", "version": 2, "batch_id": "p000000/m0", "policy_version": 0,
        "n_samples_per_prompt": 1, "eos_token_id": 2, "pad_token_id": 0, "prompt_id": ["q1"],
        "group_id": ["q1"], "sample_index": [0], "prompt": ["1+1="], "label": ["2"], "reference": [""],
        "response": ["2"],
        "prompt_ids": {"lengths": tensor("int32", [1], i32(4)), "values": tensor("int32", [4], i32(16, 10, 16, 28))},
        "response_ids": {"lengths": tensor("int32", [1], i32(2)), "values": tensor("int32", [2], i32(17, 2))},
        "layout": "padded",
        "action_ids": {"lengths": tensor("int32", [1], i32(2)), "values": tensor("int32", [2], i32(17, 2))},
        "action_mask": {"lengths": tensor("int32", [1], i32(2)), "values": tensor("bool", [2], b"\x01\x01")},
        "rewards": tensor("float32", [1], b"\x00\x00\x80\x3f"), "reward_metrics": {},
        "info": {"reward": tensor("float32", [1], b"\x00\x00\x80\x3f")},
    }  # fmt: skip
    data = encode(b)
    assert data == msgpack.packb(expected, use_bin_type=True) and len(data) == 718
    assert msgpack.unpackb(data, raw=False) == expected
    assert decode(data) == b and encode(decode(data)) == data
    # v2 (issue 9) changed only the version byte of this example: none of the new fields is set
    assert peek_header(data) == ("expstream.SampleBatch", 2, "p000000/m0")


def test_round_trip_full_batch_and_info_key_order():
    b = make_batch(
        kl_coef=0.05, action_entropy=Ragged.from_rows([[0.1, 0.2, 0.3], [0.4]], "float32"),
        base_action_log_probs=Ragged.from_rows([[-0.6, -1.1, -0.2], [-2.5]], "float32"),
        values=Ragged.from_rows([[0.0, 0.1, 0.2], [0.3]], "float32"), reward_metrics={"b": [1, 2], "a": [3, 4]},
        kl=Ragged.from_rows([[0.1, -0.1, 0.05], [0.5]], "float32"), processed_rewards=[0.5, -0.5],
        token_rewards=Ragged.from_rows([[0.0, 0.0, 0.5], [-0.5]], "float32"),
        advantages=Ragged.from_rows([[1.0, 1.0, 1.0], [-1.0]], "float32"),
        returns=Ragged.from_rows([[0.5, 0.5, 0.5], [-0.5]], "float32"), info={"z": [0, 0], "kl": [1, 1]},
    )  # fmt: skip
    data = encode(b)
    out = decode(data)
    assert out == b and encode(out) == data
    assert out.kl_coef == 0.05 and list(out.info) == ["kl", "z"] and list(out.reward_metrics) == ["a", "b"]
    assert out.returns.rows()[1].tolist() == [-0.5] and out.processed_rewards.tolist() == [0.5, -0.5]
    # the same message with the dict keys in another order encodes to the same bytes
    assert encode(b.replace(info={"kl": b.info["kl"], "z": b.info["z"]})) == data


def test_optional_none_fields_are_omitted():
    wire = msgpack.unpackb(encode(make_batch()), raw=False)
    for name in ("action_entropy", "values", "kl", "kl_coef", "processed_rewards", "advantages"):
        assert name not in wire
    assert wire["layout"] == "padded" and wire["reward_metrics"] == {}


def test_empty_batch_and_zero_length_rows():
    empty = SampleBatch(batch_id="e", policy_version=0, n_samples_per_prompt=4, eos_token_id=2, pad_token_id=0,
                        prompt_ids=Ragged.from_rows([], "int32"), action_ids=Ragged.from_rows([], "int32"),
                        action_log_probs=Ragged.from_rows([], "float32"), rewards=[])  # fmt: skip
    out = decode(encode(empty))
    assert len(out) == 0 and out == empty and out.rewards.shape == (0,) and out.action_ids.total == 0
    zero = make_batch(action_ids=Ragged.from_rows([[], [9]], "int32"), action_mask=Ragged.from_rows([[], [True]], "bool"),
                      action_log_probs=Ragged.from_rows([[], [-1.0]], "float32"))  # fmt: skip
    out = decode(encode(zero))
    assert out.action_ids.lengths.tolist() == [0, 1] and out.action_log_probs.row(0).tolist() == []


def test_decode_is_zero_copy():
    n = 1 << 20
    lp = np.linspace(-5, 0, n, dtype=np.float32)
    b = make_batch(action_ids=Ragged.from_rows([np.zeros(n - 1, np.int32), [1]], "int32"), action_mask=None,
                   action_log_probs=Ragged(lp, np.array([n - 1, 1], np.int32)))  # fmt: skip
    data = encode(b)  # 8 MB of tensors: a framed record (version 6), whose tensors view the record itself
    out = decode(data)
    arr = out.action_log_probs.values
    assert not arr.flags.owndata and not arr.flags.writeable
    base = arr
    while isinstance(base, np.ndarray):
        base = base.base
    assert base is data  # no copy at all
    assert arr.ctypes.data % 4 == 0 and np.array_equal(arr, lp)


@pytest.mark.parametrize("cut", [0, 1, 10, 100, -1])
def test_truncated_bytes_decode_error(cut):
    data = encode(make_batch())
    with pytest.raises(DecodeError, match="truncated"):
        decode(data[:cut])


def test_decode_errors():
    good = msgpack.unpackb(encode(make_batch()), raw=False)

    def enc(**changes):
        m = dict(good)
        m.update(changes)
        return msgpack.packb({k: v for k, v in m.items() if v is not ...}, use_bin_type=True)

    with pytest.raises(DecodeError, match="not valid msgpack"):
        decode(b"\xc1")
    with pytest.raises(DecodeError, match="expected a map"):
        decode(msgpack.packb([1, 2]))
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode(encode(make_batch()) + b"\x00")
    with pytest.raises(DecodeError):
        decode("not bytes")
    with pytest.raises(VersionError, match="version 7 is not supported by this reader \\(it reads version 1 or 2 or 3 or 4 or 5 or 6\\)"):
        decode(enc(version=7))  # 6 is the framed one (schemas/frame.py)
    with pytest.raises(DecodeError, match="framed record has no 'payload' entry"):
        decode(enc(version=6))  # a version-6 map without its payload
    with pytest.raises(VersionError, match="version 3 is not supported"):
        decode(msgpack.packb({**msgpack.unpackb(encode(PromptBatch("p", ["0"], ["x"], [""], [""]))), "version": 3}))
    with pytest.raises(VersionError):
        decode(enc(version=...))
    with pytest.raises(UnknownSchemaError, match="unknown schema 'expstream.Other'"):
        decode(enc(schema="expstream.Other"))
    with pytest.raises(UnknownSchemaError):
        decode(enc(schema=...))
    with pytest.raises(ValidationError, match=r"SampleBatch\.temperature: unknown field") as ei:
        decode(enc(temperature=1.0))
    assert ei.value.field == "SampleBatch.temperature"
    with pytest.raises(ValidationError, match=r"SampleBatch\.rewards: expected a tensor map"):
        decode(enc(rewards=[1.0, 0.0]))
    with pytest.raises(ValidationError, match=r"SampleBatch\.action_ids: expected a ragged map"):
        decode(enc(action_ids=[[7, 8, 2], [9]]))
    with pytest.raises(ValidationError, match=r"SampleBatch\.info: expected a map"):
        decode(enc(info=[1]))
    with pytest.raises(ValidationError, match=r"SampleBatch\.batch_id: required field is missing"):
        decode(enc(batch_id=...))
    with pytest.raises(ValidationError, match=r"SampleBatch\.rewards: non-finite .*\['a#0'\]"):
        decode(enc(rewards=tensor("float32", [2], f32(float("nan"), 0.0))))
    with pytest.raises(ValidationError, match=r"SampleBatch\.rewards: wire dtype is float64"):
        decode(enc(rewards=tensor("float64", [2], np.zeros(2).tobytes())))
    with pytest.raises(ValidationError, match=r"SampleBatch\.sample_index: values \[5\]"):
        decode(enc(sample_index=[0, 5]))
    bad_lengths = {
        "lengths": tensor("int32", [2], i32(2, 2)),
        "values": tensor("float32", [4], f32(0, 0, 0, 0)),
    }
    with pytest.raises(
        ValidationError, match=r"SampleBatch\.action_log_probs: ragged lengths \[2, 2\] disagree"
    ):
        decode(enc(action_log_probs=bad_lengths))
    with pytest.raises(ValidationError, match=r"SampleBatch\.prompt_ids\.values: data has 3 bytes"):
        decode(
            enc(
                prompt_ids={
                    "lengths": tensor("int32", [1], i32(1)),
                    "values": tensor("int32", [1], b"\x00" * 3),
                }
            )
        )


def test_peek_header_best_effort():
    p = PromptBatch("p000009", ["0"], ["a"], [""], [""])
    assert peek_header(encode(p)) == ("expstream.PromptBatch", 1, "p000009")
    assert peek_header(encode(p)[:40]) == ("expstream.PromptBatch", 1, None)  # cut inside batch_id
    assert peek_header(b"\xc1garbage") == (None, None, None)
    assert peek_header(msgpack.packb({"schema": 3, "version": "1"})) == (None, None, None)
    assert peek_header(None) == (None, None, None)


def test_schemas_imports_no_torch_nor_project_packages():
    code = (
        "import sys, schemas; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'expstream', 'stages')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_readme_documents_every_field():
    text = (ROOT / "schemas" / "README.md").read_text()
    for cls in (PromptBatch, SampleBatch):
        for name in cls.FIELDS:
            assert f"`{name}`" in text, name
    for name in schemas.DTYPES:
        assert f"`{name}`" in text, name


# -- properties -------------------------------------------------------------------------------
finite32 = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def sample_batches(draw):
    B = draw(st.integers(0, 6))
    n = draw(st.integers(1, 4))
    a_len = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))
    p_len = draw(st.lists(st.integers(0, 5), min_size=B, max_size=B))

    def floats(lengths):
        return Ragged.from_rows(
            [draw(st.lists(finite32, min_size=k, max_size=k)) for k in lengths], "float32"
        )

    ids = [draw(st.text(max_size=4)) for _ in range(B)]
    text = st.lists(st.text(max_size=6), min_size=B, max_size=B)
    return SampleBatch(
        batch_id=draw(st.text(max_size=8)), policy_version=draw(st.integers(0, 2**40)), n_samples_per_prompt=n,
        eos_token_id=draw(st.integers(-5, 10**6)), pad_token_id=draw(st.integers(-5, 10**6)),
        prompt_id=ids, group_id=ids, sample_index=draw(st.lists(st.integers(0, n - 1), min_size=B, max_size=B)),
        prompt=draw(text), label=draw(text), reference=draw(text), response=draw(text),
        prompt_ids=Ragged.from_rows([draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=k, max_size=k)) for k in p_len], "int32"),
        layout=draw(st.sampled_from(["", "padded", "packed"])),
        action_ids=Ragged.from_rows([[7] * k for k in a_len], "int32"),
        action_mask=Ragged.from_rows([draw(st.lists(st.booleans(), min_size=k, max_size=k)) for k in a_len], "bool"),
        action_log_probs=floats(a_len), advantages=floats(a_len) if draw(st.booleans()) else None,
        rollout_log_probs=floats(a_len) if draw(st.booleans()) else None,
        rollout_version=draw(st.sampled_from([[], [v for v in range(B)]])),
        logprob_version=draw(st.sampled_from([[], [2**40] * B])),
        rewards=draw(st.none() | st.lists(finite32, min_size=B, max_size=B)),
        kl_coef=draw(st.none() | st.floats(0, 1)),
        info={k: draw(st.lists(finite32, min_size=B, max_size=B)) for k in draw(st.sets(st.text(max_size=3), max_size=3))},
    )  # fmt: skip


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sample_batches())
def test_property_round_trip(batch):
    data = encode(batch)
    out = decode(data)
    assert out == batch
    assert encode(out) == data
    assert len(out.action_log_probs.rows()) == len(batch)
    assert all(
        np.array_equal(x, y)
        for x, y in zip(out.action_log_probs.rows(), batch.action_log_probs.rows(), strict=True)
    )


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(list(schemas.DTYPES)),
    st.lists(st.integers(0, 4), max_size=6),
    st.data(),
)
def test_property_ragged_every_dtype(dtype, lengths, data):
    raw = data.draw(st.binary(min_size=sum(lengths) * schemas.DTYPES[dtype].itemsize,
                              max_size=sum(lengths) * schemas.DTYPES[dtype].itemsize))  # fmt: skip
    values = np.frombuffer(raw, dtype=schemas.DTYPES[dtype]).copy()
    if dtype == "bool":
        values = np.frombuffer(raw, np.uint8).astype(bool)
    r = Ragged(values, np.asarray(lengths, np.int32), dtype)
    wire = msgpack.unpackb(msgpack.packb(r.to_dict(), use_bin_type=True), raw=False)
    back = Ragged.from_dict(wire)
    assert back == r and back.dtype == dtype and back.lengths.tolist() == lengths


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_property_corrupted_bytes_raise_only_schema_errors(data):
    good = encode(make_batch(kl_coef=0.1))
    pos = data.draw(st.integers(0, len(good) - 1))
    byte = data.draw(st.integers(0, 255))
    corrupt = good[:pos] + bytes([byte]) + good[pos + 1 :]
    try:
        decode(corrupt)
    except SchemaError:
        pass
