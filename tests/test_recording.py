"""The recording format (expstream/tools/recording.py): round trip, torn tails, corruption, order."""

from __future__ import annotations

import re
import struct
import zlib

import msgpack
import pytest

from expstream.tools.recording import (
    MAGIC,
    PartitionReader,
    RecordFrame,
    RecordingError,
    RecordingWriter,
    iter_topic,
    partition_path,
    recorded_partitions,
    recorded_topics,
)


def frame(p: int, o: int, ts: int, value: bytes | None = b"v", topic: str = "scored") -> RecordFrame:
    return RecordFrame(topic, p, o, ts, b"k%d" % o, value, (("batch_id", b"b%d" % o), ("x", b"\xff\x00")), 0)


def test_round_trip_keeps_every_field_and_the_bytes(tmp_path):
    frames = [frame(0, 0, 10), frame(0, 1, 30, value=None), frame(1, 5, 20, value=bytes(range(256)) * 40)]
    with RecordingWriter(tmp_path) as w:
        assert w.extend(frames) == 3
    assert recorded_topics(tmp_path) == ["scored"] and recorded_partitions(tmp_path, "scored") == [0, 1]
    assert list(iter_topic(tmp_path, "scored", order="partition")) == frames
    # merged by broker timestamp across partitions
    assert [f.offset for f in iter_topic(tmp_path, "scored")] == [0, 5, 1]
    assert partition_path(tmp_path, "scored", 0).read_bytes().startswith(MAGIC)


def test_the_documented_layout_by_hand(tmp_path):
    """A reader in another language sees: magic, then (len, crc32, msgpack map) frames."""
    with RecordingWriter(tmp_path) as w:
        w.append(frame(0, 7, 99))
    data = partition_path(tmp_path, "scored", 0).read_bytes()
    length, crc = struct.unpack(">II", data[8:16])
    payload = data[16:16 + length]
    assert len(data) == 16 + length and zlib.crc32(payload) == crc
    obj = msgpack.unpackb(payload, raw=False)
    assert obj == {"offset": 7, "timestamp": 99, "timestamp_type": 0, "key": b"k7",
                   "headers": [["batch_id", b"b7"], ["x", b"\xff\x00"]], "value": b"v"}


def test_a_killed_writer_leaves_a_readable_prefix(tmp_path):
    with RecordingWriter(tmp_path) as w:
        w.extend([frame(0, i, i) for i in range(5)])
    path = partition_path(tmp_path, "scored", 0)
    full = path.read_bytes()
    for cut in (len(full) - 1, len(full) - 20, len(full) - 30):
        path.write_bytes(full[:cut])
        reader = PartitionReader(path, "scored", 0)
        got = [f.offset for f in reader]
        assert got == [0, 1, 2, 3] and reader.torn_tail
    # appending after a torn tail is refused nowhere, but the reader still stops at the tear
    path.write_bytes(full)
    reader = PartitionReader(path, "scored", 0)
    assert [f.offset for f in reader] == [0, 1, 2, 3, 4] and not reader.torn_tail


def test_corruption_before_the_end_is_an_error_naming_the_file(tmp_path):
    with RecordingWriter(tmp_path) as w:
        w.extend([frame(0, i, i) for i in range(3)])
    path = partition_path(tmp_path, "scored", 0)
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF  # inside the first frame's payload
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError, match=r"partition-0\.rec: corrupt at byte 8"):
        list(PartitionReader(path, "scored", 0))
    path.write_bytes(b"NOTAREC!" + bytes(data[8:]))
    with pytest.raises(RecordingError, match="not an expstream recording"):
        list(PartitionReader(path, "scored", 0))


def test_a_restarted_writer_records_nothing_twice(tmp_path):
    with RecordingWriter(tmp_path) as w:
        w.extend([frame(0, i, i) for i in range(3)])
    with RecordingWriter(tmp_path) as w:  # a recorder restarted from older positions
        assert w.extend([frame(0, i, i) for i in range(1, 6)]) == 3
        assert w.skipped == 2
    assert [f.offset for f in iter_topic(tmp_path, "scored")] == [0, 1, 2, 3, 4, 5]


def test_unknown_topic_and_bad_names_are_refused(tmp_path):
    with pytest.raises(RecordingError, match="no recording of topic 'nope'"):
        list(iter_topic(tmp_path, "nope"))
    with pytest.raises(RecordingError, match="cannot name"):
        partition_path(tmp_path, "../x", 0)


def _three_frames(tmp_path):
    with RecordingWriter(tmp_path) as w:
        w.extend([frame(0, i, i) for i in range(3)])
    path = partition_path(tmp_path, "scored", 0)
    return path, path.read_bytes()


@pytest.mark.parametrize("tail, says", [
    (bytes(100), "announcing 0 payload bytes (zero bytes)"),  # zero padding after the last frame
    (bytes(5), "announcing 0 payload bytes (zero bytes)"),  # shorter than a header, still not one
    (struct.pack(">II", 40_000, 7) + b"garbage that is no msgpack map", "cannot start a frame payload"),
    (struct.pack(">II", 30, zlib.crc32(b"x" * 30)) + b"x" * 30, "fewer than the smallest frame"),
])
def test_bytes_after_the_last_frame_that_no_writer_leaves_are_corruption(tmp_path, tail, says):
    path, whole = _three_frames(tmp_path)
    path.write_bytes(whole + tail)
    with pytest.raises(RecordingError, match=rf"partition-0\.rec: corrupt at byte {len(whole)} \(.*{re.escape(says)}"):
        list(PartitionReader(path, "scored", 0))
    reader = PartitionReader(path, "scored", 0, strict=False)  # show: read up to there, say where
    assert [f.offset for f in reader] == [0, 1, 2]
    assert reader.corrupt and not reader.torn_tail
    assert (reader.damage.position, reader.damage.records_before) == (len(whole), 3)


def test_a_whole_last_frame_with_a_bad_crc_is_corruption_not_a_torn_tail(tmp_path):
    path, whole = _three_frames(tmp_path)
    data = bytearray(whole)
    data[-3] ^= 0x01  # inside the last frame's payload: its length is complete, its CRC fails
    path.write_bytes(bytes(data))
    reader = PartitionReader(path, "scored", 0, strict=False)
    assert [f.offset for f in reader] == [0, 1] and reader.corrupt
    assert "CRC mismatch on a complete frame" in reader.damage.message()
    with pytest.raises(RecordingError, match="CRC mismatch"):
        list(iter_topic(tmp_path, "scored"))


def test_every_cut_of_a_frame_is_a_torn_tail_and_reported(tmp_path):
    path, whole = _three_frames(tmp_path)
    first_two = len(whole) - (len(whole) - 8) // 3
    for cut in range(first_two + 1, len(whole)):  # every byte position inside the last frame
        path.write_bytes(whole[:cut])
        reader = PartitionReader(path, "scored", 0)
        assert [f.offset for f in reader] == [0, 1] and reader.torn_tail, cut
        assert reader.damage.position == first_two
    seen = []
    assert [f.offset for f in iter_topic(tmp_path, "scored", on_damage=seen.append)] == [0, 1]
    assert len(seen) == 1 and seen[0].kind == "torn" and f"torn last frame at byte {first_two}" in seen[0].message()
