"""record.max_bytes / record.max_age_s (issue 28 item 6): the oldest records dropped first, files still readable.

Pure file work on a RecordingWriter in a temporary directory (no broker): the recorder calls the
same ``enforce_bounds`` after its flushes (expstream/tools/retention.py).
"""

from __future__ import annotations

import pytest

from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.tools.recording import PartitionReader, RecordFrame, RecordingWriter, partition_path

VALUE = bytes(range(256)) * 4  # 1 KiB per record


def frame(partition: int, offset: int, ts: int) -> RecordFrame:
    return RecordFrame("scored", partition, offset, ts, b"k", VALUE, (("h", b"v"),), 0)


def recorded(root, partition: int) -> list[RecordFrame]:
    reader = PartitionReader(partition_path(root, "scored", partition), "scored", partition)
    frames = list(reader)
    assert reader.damage is None, reader.damage
    return frames


def total_bytes(root) -> int:
    return sum(partition_path(root, "scored", p).stat().st_size for p in (0, 1))


def test_max_bytes_keeps_the_newest_records_of_every_partition_and_the_files_readable(tmp_path):
    bound = 40 * 1024
    writer = RecordingWriter(tmp_path, max_bytes=bound)
    for i in range(200):  # 2 x 200 KiB written against a 40 KiB bound
        for p in (0, 1):
            writer.append(frame(p, i, 1_000 + i))
        writer.flush()
        writer.enforce_bounds()  # the writer's own check runs at most once a second
        assert total_bytes(tmp_path) <= bound
    writer.close()
    for p in (0, 1):
        offsets = [f.offset for f in recorded(tmp_path, p)]
        assert offsets[-1] == 199, "the newest record is kept"
        assert offsets == list(range(offsets[0], 200)), "a suffix of the partition, in order, nothing skipped"
        assert 10 <= len(offsets) < 20, f"about 3/4 to all of 20 KiB per partition kept: {len(offsets)}"
        assert all(f.value == VALUE for f in recorded(tmp_path, p))
    assert writer.trimmed == 2 * 200 - sum(len(recorded(tmp_path, p)) for p in (0, 1))


def test_max_age_drops_records_older_than_the_bound_and_appending_goes_on(tmp_path, monkeypatch):
    now_ms = 10_000_000
    monkeypatch.setattr("expstream.tools.recording.time.time", lambda: now_ms / 1000)
    writer = RecordingWriter(tmp_path, max_age_s=60)
    for i in range(10):  # one record every 50 s up to now: the 8 older than 60 s go
        writer.append(frame(0, i, now_ms - (9 - i) * 50_000))
    writer.flush()
    writer.enforce_bounds()
    writer.append(frame(0, 10, now_ms))
    writer.close()
    assert [f.offset for f in recorded(tmp_path, 0)] == [8, 9, 10]


def test_without_bounds_nothing_is_dropped(tmp_path):
    with RecordingWriter(tmp_path) as writer:
        for i in range(50):
            writer.append(frame(0, i, i))
        writer.flush()
        writer.enforce_bounds()
    assert len(recorded(tmp_path, 0)) == 50 and writer.trimmed == 0


@pytest.mark.parametrize("item", ["record.max_bytes=0", "record.max_bytes=-5", "record.max_age_s=0",
                                  "record.max_age_s=abc"])
def test_a_bad_bound_is_refused_naming_the_field(item):
    with pytest.raises(ConfigError, match=item.split("=")[0].replace(".", r"\.")):
        load_topology(overrides=[item])
