"""Framed SampleBatch records (schema version 6, schemas/frame.py): round trips, views, old versions,
and corrupt, truncated or lying frames refused with a SchemaError (never another exception)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    DecodeError,
    Ragged,
    SampleBatch,
    SchemaError,
    ValidationError,
    decode,
    encode,
    peek_header,
)
from schemas import frame as framing

B, WIDTH = 8, 700  # 8 float fields x 8 x 700 x 4 bytes = 179 KB of floats: above FRAME_MIN_BYTES


def big_batch(width: int = WIDTH, **changes) -> SampleBatch:
    """B samples with every float ragged field, a mask, ragged rows of different lengths (one empty)."""
    rng = np.random.default_rng(1)
    lens = [width - 3 * i for i in range(B - 1)] + [0]

    def rows(dtype):
        if dtype == "int32":
            return Ragged.from_rows([rng.integers(0, 500, n) for n in lens], "int32")
        return Ragged.from_rows([rng.standard_normal(n).astype(np.float32) for n in lens], "float32")

    kw = dict(batch_id="p000007/m1", policy_version=2, n_samples_per_prompt=4, eos_token_id=2, pad_token_id=0,
              prompt_id=[f"q{i // 4}" for i in range(B)], group_id=[f"q{i // 4}" for i in range(B)],
              sample_index=[i % 4 for i in range(B)], prompt=["é " * i for i in range(B)], label=[""] * B,
              reference=[""] * B, response=["r"] * B, prompt_ids=Ragged.from_rows([[5, 6, 7]] * B, "int32"),
              response_ids=rows("int32"), layout="padded", rollout_version=[1] * B)
    kw["action_ids"] = kw["response_ids"]
    kw["action_mask"] = Ragged.from_rows([np.arange(n) % 3 != 0 for n in lens], "bool")
    for name in ("action_log_probs", "base_action_log_probs", "values", "kl", "token_rewards", "advantages",
                 "returns", "rollout_log_probs"):
        kw[name] = rows("float32")
    kw["token_versions"] = Ragged.from_rows([np.full(n, 1) for n in lens], "int32")
    kw.update(rewards=rng.standard_normal(B).astype(np.float32), kl_coef=0.05,
              info={"kl": np.zeros(B, np.float32), "reward": np.ones(B, np.float32)},
              reward_metrics={"a": np.arange(B, dtype=np.float32)})
    kw.update(changes)
    return SampleBatch(**kw)


@pytest.fixture(scope="module")
def record() -> bytes:
    return encode(big_batch())


def test_a_large_batch_is_framed_and_round_trips_as_read_only_views(record):
    batch = big_batch()
    assert peek_header(record) == ("expstream.SampleBatch", 6, "p000007/m1")
    back = decode(record)
    assert back == batch and back.kl_coef == 0.05 and back.info.keys() == {"kl", "reward"}
    assert encode(back) == record  # canonical: the same message, the same bytes
    for arr in (back.values.values, back.action_mask.values, back.rewards, back.info["kl"], back.response_ids.lengths):
        assert not arr.flags.writeable and arr.ctypes.data % arr.itemsize == 0
        with pytest.raises(ValueError, match="read-only"):
            arr[:1] = 0
    assert back.action_log_probs.row(B - 1).size == 0 and back.action_log_probs.row(0).tolist() == \
        batch.action_log_probs.row(0).tolist()
    # one msgpack object still (experiences files are split by msgpack's skip())
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=len(record))
    unpacker.feed(record)
    whole = list(unpacker)
    assert len(whole) == 1 and list(whole[0])[-1] == "payload" and whole[0]["version"] == 6


def test_small_batches_stay_at_their_version_and_bytes(monkeypatch):
    small = big_batch(width=20)  # 8 x 8 x 20 x 4 bytes of floats: below the threshold
    data = encode(small)
    assert peek_header(data)[1] == 5 and b"payload" not in data  # token_versions: version 5, a plain map
    assert decode(data) == small
    monkeypatch.setattr(framing, "FRAME_MIN_BYTES", 1)
    framed = encode(small)
    assert peek_header(framed)[1] == 6 and decode(framed) == small and framed != data


def test_old_versions_still_decode():
    batch = big_batch(width=20, token_versions=None)
    v2 = encode(batch)
    assert peek_header(v2)[1] == 2 and decode(v2) == batch
    old = msgpack.unpackb(v2, raw=False)
    for version in (2, 3, 4, 5):  # the fields of version 2 are readable at every later version
        assert decode(msgpack.packb({**old, "version": version}, use_bin_type=True)) == batch


def test_every_dtype_frames_aligned_and_round_trips():
    arrays = {name: np.arange(7).astype(dt) for name, dt in [("float32", np.float32), ("int8", np.int8),
              ("float64", np.float64), ("bool", bool), ("int16", np.int16), ("int64", np.int64), ("uint8", np.uint8),
              ("float16", np.float16), ("int32", np.int32)]}
    arrays["bfloat16"] = np.array([0x3F80, 0xC000, 0], np.uint16)  # 1.0, -2.0, 0.0 as bfloat16 bits
    arrays["empty"] = np.zeros(0, np.float32)
    header = {"schema": "x", "version": 6,
              "t": {k: {"dtype": "bfloat16" if k == "bfloat16" else ("float32" if k == "empty" else k),
                        "shape": [len(v)], "data": v} for k, v in arrays.items()}}
    record = framing.frame(header)
    obj, start, length = framing.read_header(record)
    area, size = framing.area_of(start, length, start)
    assert area % framing.ALIGN == 0
    assert framing.attach(obj, record, area, size, "x", views=True)
    for k, v in arrays.items():
        name, view = obj["t"][k]
        assert view.dtype.itemsize == v.dtype.itemsize and view.ctypes.data % view.dtype.itemsize == 0
        assert view.tobytes() == v.tobytes() and name == header["t"][k]["dtype"]


def reframed(record: bytes, header: dict) -> bytes:
    """A framed record of ``header`` (tensor maps with `at`) over ``record``'s payload area, as a writer
    of any key order would make it: the area aligned after the new header."""
    obj, start, length = framing.read_header(record)
    area, _ = framing.area_of(start, length, start)
    head = msgpack.packb({**header, "payload": None}, use_bin_type=True)[:-1]
    pad = -(len(head) + 5) % 8
    return head + b"\xc6" + (pad + len(record) - area).to_bytes(4, "big") + bytes(pad) + record[area:]


def test_another_writers_key_order_and_a_bytearray_decode_the_same(record):
    obj = framing.read_header(record)[0]
    other = reframed(record, {"batch_id": obj.pop("batch_id"), **obj})  # schema not first: read the slow way
    assert not framing.is_framed(other)
    assert decode(other) == decode(record) == decode(bytearray(record)) == decode(memoryview(record))


def patched(record: bytes, field: str, index: int, value: bytes) -> bytes:
    """``record`` with element ``index`` of ``field``'s values (or ``field`` = "rewards") overwritten."""
    obj, start, length = framing.read_header(record)
    area, _ = framing.area_of(start, length, start)
    t = obj[field] if "dtype" in obj[field] else obj[field]["values"]
    at = area + t["at"] + index * len(value)
    return record[:at] + value + record[at + len(value):]


def test_nan_inf_and_bad_bytes_are_refused_naming_field_and_sample(record):
    with pytest.raises(ValidationError, match=r"^SampleBatch\.values: non-finite .*\['q0#1'\]"):
        decode(patched(record, "values", WIDTH + 5, np.float32(np.nan).tobytes()))
    with pytest.raises(ValidationError, match=r"^SampleBatch\.rewards: non-finite .*\['q1#3'\]"):
        decode(patched(record, "rewards", 7, np.float32(-np.inf).tobytes()))
    with pytest.raises(ValidationError, match=r"SampleBatch\.action_mask\.values: bool tensor has bytes other than 0 and 1"):
        decode(patched(record, "action_mask", 3, b"\x02"))


def test_lying_lengths_and_offsets_are_refused(record):
    obj, start, length = framing.read_header(record)
    area, size = framing.area_of(start, length, start)

    def lying(mutate) -> bytes:
        o = framing.read_header(record)[0]
        mutate(o)
        return reframed(record, o)

    lens_at = area + obj["kl"]["lengths"]["at"]
    longer = record[:lens_at] + np.int32(WIDTH + 1).tobytes() + record[lens_at + 4:]
    with pytest.raises(ValidationError, match=r"SampleBatch\.kl: .*lengths"):
        decode(longer)  # kl's lengths no longer sum to its values / agree with action_ids
    negative = record[:lens_at] + np.int32(-1).tobytes() + record[lens_at + 4:]
    with pytest.raises(ValidationError, match="non-negative"):
        decode(negative)
    cases = {
        "beyond the payload": (lambda o: o["values"]["values"].update(at=size - 4), "inside the"),
        "misaligned": (lambda o: o["values"]["values"].update(at=o["values"]["values"]["at"] + 1), "multiple of 4"),
        "overlapping": (lambda o: o["values"]["values"].update(at=o["kl"]["values"]["at"]), "overlap"),
        "shape too big": (lambda o: o["rewards"].update(shape=[10 ** 9]), "inside the"),
        "unknown dtype": (lambda o: o["rewards"].update(dtype="float8"), "unknown dtype"),
        "inline data": (lambda o: o["rewards"].update(at=None), "must be an int"),
    }
    assert decode(lying(lambda o: None)) == decode(record)  # the helper itself makes good frames
    for name, (mutate, message) in cases.items():
        bad = lying(mutate)
        with pytest.raises(DecodeError, match=message):
            decode(bad)
        for views in (True, False):  # the error names the tensor, whichever way the record is read
            o, at, n = framing.read_header(bad)
            with pytest.raises(DecodeError, match=r"^SampleBatch\.(values\.values|rewards): "):
                framing.attach(o, bad, *framing.area_of(at, n, at), "SampleBatch", views=views)
        assert name


@pytest.mark.parametrize("cut", [0, 1, 10, 60, 300, -1, -4, -1000])
def test_truncated_frames_are_decode_errors(record, cut):
    with pytest.raises(DecodeError, match="truncated|not valid msgpack|expected the record"):
        decode(record[:cut])
    with pytest.raises(DecodeError, match="trailing bytes"):
        decode(record + b"\x00")


def test_payload_must_be_the_last_entry(record):
    obj = msgpack.unpackb(record, raw=False)
    moved = {"schema": obj.pop("schema"), "version": obj.pop("version"), "payload": obj.pop("payload"), **obj}
    with pytest.raises(DecodeError, match="last entry"):
        decode(msgpack.packb(moved, use_bin_type=True))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_bit_flips_and_cuts_never_crash(record, data):
    """Any damage: a message (the flip hit padding or a value that stays valid) or a SchemaError."""
    damaged = bytearray(record)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(record) - 1))
        damaged[i] ^= 1 << data.draw(st.integers(0, 7))
    if data.draw(st.booleans()):
        damaged = damaged[:data.draw(st.integers(0, len(damaged)))]
    try:
        out = decode(bytes(damaged))
    except SchemaError:
        return
    assert isinstance(out, SampleBatch) and len(out) == B


def test_encode_checks_reassigned_fields_and_decode_checks_every_value():
    batch = big_batch(width=20)
    bad = batch.values.values.copy()
    bad[3] = np.nan
    batch.values = Ragged(bad, batch.values.lengths)  # assigned after construction: encode checks it
    with pytest.raises(ValidationError, match=r"^SampleBatch\.values: non-finite"):
        encode(batch)
    batch = big_batch()
    batch.kl.values[5] = np.inf  # written in place after construction: not read again by encode ...
    data = encode(batch)
    with pytest.raises(ValidationError, match=r"^SampleBatch\.kl: non-finite .*\['q0#0'\]"):
        decode(data)  # ... but every reader checks every value
    with pytest.raises(ValidationError, match=r"^SampleBatch\.kl: non-finite"):
        batch.replace()  # a new message checks its arrays
