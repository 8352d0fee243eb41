"""The codec against a memcpy: one SampleBatch record of ~2.5 MB, encoded and decoded (validation included).

Prints, in one run, encode, decode, the round trip (encode + decode), a memcpy of the record's bytes into
a preallocated buffer and the ratio memcpy / round trip (1.0 = as fast as copying the bytes once), for

* ``framed``: what the writer does for this record, schema version 6 (schemas/frame.py): a msgpack
  header, the tensor bytes appended, decoded as views of the record, the floats checked in one pass;
* ``plain map``: the same message as one msgpack map with a ``bin`` per tensor (versions 1-5, what
  every record was before version 6 and what records under ``FRAME_MIN_BYTES`` still are), with the
  same validation code: the best alternative, measured in the same run, interleaved.

The message is built once, outside the timing (a stage builds its outputs, validated, then the runner
encodes them); every timed ``encode`` and ``decode`` validates. Each repeat times both framings and the
memcpy back to back, so the machine's noise hits them alike. Medians over ``--repeats``.

Usage: ``.venv/bin/python bench/codec.py [--bytes 2500000] [--repeats 200]``. Run it with the stage
processes' malloc settings (expstream/launch/forkserver.py MALLOC_ENV) to measure what a stage pays:
bench/pipeline.py's codec row does (:func:`pipeline.codec_in_stage_env`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas import Ragged, SampleBatch, decode, encode  # noqa: E402
from schemas import frame as framing  # noqa: E402


def record_batch(target_bytes: int = 2_500_000, b: int = 64) -> SampleBatch:
    """A batch of ``b`` samples whose record is ~``target_bytes``: 3 int32 id fields, 8 float32
    action-level fields, the bool mask (the fields a record has after advantage)."""
    per_token = 4 * 3 + 4 * 8 + 1  # bytes per token: 3 int32 id fields + 8 float32 action fields + the bool mask
    width = max(1, target_bytes // (b * per_token))
    rng = np.random.default_rng(0)
    ids = Ragged.from_rows([rng.integers(0, 500, width, dtype=np.int32) for _ in range(b)], "int32")

    def floats() -> Ragged:
        return Ragged.from_rows([rng.standard_normal(width).astype(np.float32) for _ in range(b)], "float32")

    return SampleBatch(batch_id="bench", policy_version=0, n_samples_per_prompt=4, eos_token_id=1, pad_token_id=0,
                       prompt_id=[f"p{i // 4}" for i in range(b)], group_id=[f"p{i // 4}" for i in range(b)],
                       sample_index=[i % 4 for i in range(b)], prompt=["q"] * b, label=[""] * b, reference=[""] * b,
                       response=["r"] * b, prompt_ids=ids, response_ids=ids, layout="padded", action_ids=ids,
                       action_mask=Ragged.from_rows([np.ones(width, bool) for _ in range(b)], "bool"),
                       action_log_probs=floats(), base_action_log_probs=floats(), values=floats(),
                       rollout_log_probs=floats(), kl=floats(), token_rewards=floats(), advantages=floats(),
                       returns=floats(), rewards=rng.standard_normal(b).astype(np.float32))


def measure(target_bytes: int = 2_500_000, repeats: int = 200) -> dict[str, Any]:
    """Medians (ms) of encode, decode, round trip for both framings, and of a memcpy of the framed record."""
    batch = record_batch(target_bytes)
    threshold = framing.FRAME_MIN_BYTES
    plain_limit = 1 << 62  # no record is framed
    raw = encode(batch)
    src = np.frombuffer(raw, np.uint8)
    dst = np.empty_like(src)
    times: dict[str, dict[str, list[float]]] = {"framed": {"encode": [], "decode": []},
                                                "plain map": {"encode": [], "decode": []}}
    copies: list[float] = []
    try:
        for _ in range(repeats):
            for name, limit in (("framed", threshold), ("plain map", plain_limit)):
                framing.FRAME_MIN_BYTES = limit
                t0 = time.perf_counter()
                data = encode(batch)
                t1 = time.perf_counter()
                back = decode(data)
                t2 = time.perf_counter()
                times[name]["encode"].append(t1 - t0)
                times[name]["decode"].append(t2 - t1)
                assert back.batch_id == batch.batch_id
            t0 = time.perf_counter()
            np.copyto(dst, src)
            copies.append(time.perf_counter() - t0)
    finally:
        framing.FRAME_MIN_BYTES = threshold
    memcpy = median(copies)
    out: dict[str, Any] = {"bytes": len(raw), "memcpy_ms": 1000 * memcpy}
    for name, t in times.items():
        trip = [e + d for e, d in zip(t["encode"], t["decode"], strict=True)]
        out[name] = {"encode_ms": 1000 * median(t["encode"]), "decode_ms": 1000 * median(t["decode"]),
                     "roundtrip_ms": 1000 * median(trip), "ratio": memcpy / median(trip)}
    return out


def report(result: dict[str, Any]) -> str:
    lines = [f"codec of one {result['bytes'] / 1e6:.2f} MB SampleBatch record; memcpy of its bytes "
             f"{result['memcpy_ms']:.3f} ms (ratio = memcpy / round trip)",
             f"  {'framing':<12} {'encode ms':>10} {'decode ms':>10} {'round trip':>11} {'ratio':>7}"]
    for name in ("framed", "plain map"):
        r = result[name]
        lines.append(f"  {name:<12} {r['encode_ms']:>10.3f} {r['decode_ms']:>10.3f} {r['roundtrip_ms']:>11.3f} "
                     f"{r['ratio']:>7.2f}")
    lines.append(f"  framed / plain map round trip: {result['plain map']['roundtrip_ms'] / result['framed']['roundtrip_ms']:.2f}x faster")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=int, default=2_500_000)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    args = parser.parse_args(argv)
    result = measure(args.bytes, args.repeats)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
