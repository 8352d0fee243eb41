"""Test helpers shared by the vision-language tests: a small PNG, and in-process stage contexts over
the tiny-vl family sharing one MemoryState and one blob store."""

from __future__ import annotations

import io
from pathlib import Path

from PIL import Image

from expstream.models.blobs import DirectoryBlobStore


def png(size=(64, 64), colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def vl_stage_contexts(tmp: Path, sets: list[str], stages: tuple[str, ...], cache: Path | None = None):
    """``(topology, blob store, {stage: context})``: ``models.actor=builtin:tiny-vl`` with its models
    cached in ``cache`` (the session's, tests/conftest.py ``model_cache``; default: under ``tmp``) and its
    blobs stored under ``tmp``, 6 new tokens, 2 samples per prompt, plus ``sets``; each of ``stages`` set
    up, in order, on one shared state."""
    from expstream.config.topology import load_topology
    from expstream.models.resolve import build_builtin_models
    from stages import STAGES
    from stages.context import make_context

    store = DirectoryBlobStore(tmp / "blobs")
    topo = load_topology(None, ["models.actor=builtin:tiny-vl", f"models.cache_dir={cache or tmp / 'models'}",
                                f"run.blob_store={tmp / 'blobs'}", "generate.max_new_tokens=6",
                                "generate.n_samples_per_prompt=2", *sets])
    build_builtin_models(topo)
    ctxs, state = {}, None
    for name in stages:
        ctx = make_context(topo, name, state=state)
        state = ctx.state
        STAGES[name].setup(ctx)
        ctxs[name] = ctx
    return topo, store, ctxs
