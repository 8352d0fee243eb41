"""Pixels for a model stage: recompute from the blob bytes, an LRU cache hit, or pixels on the wire.

A vision-language model stage needs ``pixel_values`` for every image of a micro-batch. Three ways
to get them (docs/vision.md, "The claim check"), timed here per image on the same images:

* **recompute**: the blob's bytes decoded (PIL) and run through the model's image processor, what
  ``expstream.models.vl.VisionInputs.image`` does on a cache miss;
* **cache hit**: the same call when the image was processed before in this process (the n samples
  of a group share their images, so most lookups hit);
* **inline**: the alternative to the claim check, the float32 patches travelling in the record:
  ``schemas`` encode + decode of a record holding them (per hop, on top of the broker moving them).

Usage: ``.venv/bin/python bench/vision_cache.py [--images 50] [--sizes 90x120,448x448] [--repeats 5]``.
Nothing is asserted; medians over ``--repeats`` passes, ratios printed against recompute.
"""

from __future__ import annotations

import argparse
import io
import tempfile
import time
from pathlib import Path

import numpy as np
from common import TINY_CACHE, fmt, machine, median, progress, save, table

from expstream.models.blobs import DirectoryBlobStore
from schemas.tensors import encode_tensor


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=50, help="random images per size")
    p.add_argument("--sizes", default="90x120,448x448", help="comma-separated WxH image sizes")
    p.add_argument("--repeats", type=int, default=5, help="passes (median)")
    return p.parse_args()


def random_pngs(count: int, size: tuple[int, int], seed: int) -> list[bytes]:
    from PIL import Image

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def main() -> int:
    args = parse_args()
    from expstream.models.vl import VisionInputs, build_tiny_vl

    paths = build_tiny_vl(TINY_CACHE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(paths["tokenizer"]))
    rows, summary = [], {"machine": machine(), "sizes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        store = DirectoryBlobStore(Path(tmp) / "blobs")
        for k, spec in enumerate(args.sizes.split(",")):
            w, h = (int(x) for x in spec.lower().split("x"))
            refs = [store.put(b) for b in random_pngs(args.images, (w, h), seed=k)]
            recompute, hit, inline, kib = [], [], [], 0.0
            for _ in range(args.repeats):
                vision = VisionInputs(paths["actor"], tok, store)  # an empty cache
                t0 = time.perf_counter()
                got = [vision.image(r, "bench") for r in refs]
                recompute.append((time.perf_counter() - t0) / len(refs))
                t0 = time.perf_counter()
                for r in refs:
                    vision.image(r, "bench")
                hit.append((time.perf_counter() - t0) / len(refs))
                t0 = time.perf_counter()
                for patches, _ in got:
                    raw = msgpack_patches(patches)
                    decode_patches(raw)
                inline.append((time.perf_counter() - t0) / len(refs))
                kib = float(np.mean([len(msgpack_patches(p)) for p, _ in got])) / 1024
            r_ms, h_ms, i_ms = median(recompute) * 1e3, median(hit) * 1e3, median(inline) * 1e3
            rows.append([spec, fmt(r_ms, ".3f"), fmt(h_ms * 1e3, ".2f"), fmt(i_ms, ".3f"), fmt(kib, ".1f"),
                         fmt(r_ms / h_ms if h_ms else float("nan"), ".0f")])
            summary["sizes"][spec] = {"recompute_ms": r_ms, "cache_hit_us": h_ms * 1e3, "inline_codec_ms": i_ms,
                                      "inline_kib": kib}
            progress(f"{spec}: recompute {r_ms:.3f} ms, hit {h_ms * 1e3:.2f} us, inline codec {i_ms:.3f} ms")
    print(table(["image WxH", "recompute ms", "cache hit us", "inline encode+decode ms", "inline KiB",
                 "recompute / hit"], rows, title="pixel_values per image (median of passes)"))
    print(f"load average: {summary['machine'].get('loadavg')}")
    save("vision_cache", summary)
    return 0


def msgpack_patches(patches: np.ndarray) -> bytes:
    """The patches as the wire carries a tensor (dtype, shape, raw bytes) in a msgpack map."""
    import msgpack

    return msgpack.packb({"pixel_values": encode_tensor(patches)}, use_bin_type=True)


def decode_patches(raw: bytes) -> np.ndarray:
    import msgpack

    from schemas.tensors import decode_tensor

    return decode_tensor(msgpack.unpackb(raw, raw=False)["pixel_values"], field="pixel_values")


if __name__ == "__main__":
    raise SystemExit(main())
