"""The ``experiences.msgpack`` file: its records, and their SampleBatches, read without torch.

A run writes the experiences it collected as one msgpack record after another (the bytes each
record had on the ``experiences`` topic). Reading them back needs msgpack and the wire schema only,
so the tools that only look (``expstream report``, ``expstream show``) start without importing
torch; expstream/rl/experience.py turns the batches into tensors for a trainer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack

_CHUNK = 1 << 20  # bytes read at a time from an experiences file


def iter_records(path: str | Path, chunk_size: int = _CHUNK) -> Iterator[bytes]:
    """The raw bytes of each msgpack object in a file of concatenated records, streaming.

    A ``msgpack.Unpacker`` finds the record boundaries (``skip()`` + ``tell()``); only the bytes
    of records not yet handed out are kept in memory. A truncated last record raises ValueError.
    """
    unpacker = msgpack.Unpacker(max_buffer_size=0)  # 0: no limit on one record's size (large tensors)
    pending = bytearray()
    base = 0  # file offset of pending[0]
    with open(path, "rb") as f:
        while True:
            chunk = f.read(chunk_size)
            if not chunk:
                break
            unpacker.feed(chunk)
            pending += chunk
            while True:
                # a record starts where the previous one ended (`base`); after OutOfData the
                # unpacker resumes a half-parsed record, so tell() is only read after a success
                try:
                    unpacker.skip()
                except msgpack.OutOfData:
                    break
                end = unpacker.tell()
                yield bytes(pending[: end - base])
                del pending[: end - base]
                base = end
    if pending:
        raise ValueError(
            f"{path}: {len(pending)} trailing bytes at offset {base} are not a whole msgpack record "
            "(the file was cut while being written?)"
        )


def iter_experience_batches(path: str | Path) -> Iterator[Any]:
    """Each record of a recorded ``experiences.msgpack`` file, decoded to a ``SampleBatch``."""
    from schemas import decode

    for record in iter_records(path):
        yield decode(record)
