"""Per-token policy versions (schema version 5, ``SampleBatch.token_versions``): reading and aligning them.

With in-flight weight updates (``generate.in_flight_updates``, docs/async.md "In-flight updates") one
sample's tokens may come from several policy versions. ``token_versions`` holds the version of each
generated token; a record without it (every record before schema version 5, and every record of a
generate without in-flight updates) means every token of sample b is of ``rollout_version[b]`` (or the
batch's ``policy_version`` when the record has no per-sample versions either).

Staleness is bounded by the *oldest* token (:func:`oldest_versions`); ``train.jsonl`` counts the trained
samples whose tokens span more than one version (:func:`mixed_rows`). numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["align_token_versions", "mixed_rows", "oldest_versions", "token_version_rows"]


def _sample_versions(batch: Any) -> list[int]:
    versions = list(getattr(batch, "rollout_version", None) or [])
    if versions:
        return [int(v) for v in versions]
    return [int(batch.policy_version)] * len(batch.group_id)


def token_version_rows(batch: Any) -> list[np.ndarray]:
    """One int64 row per sample: the version of each token (the lengths of ``action_ids`` once the record has
    them, else of ``response_ids``); filled with the sample's version when the record carries none."""
    tv = getattr(batch, "token_versions", None)
    if tv is not None:
        return [np.asarray(r, dtype=np.int64) for r in tv.rows()]
    ids = batch.action_ids if getattr(batch, "action_ids", None) is not None else batch.response_ids
    lengths = [0] * len(batch.group_id) if ids is None else [int(n) for n in ids.lengths]
    return [np.full(n, v, dtype=np.int64) for n, v in zip(lengths, _sample_versions(batch), strict=True)]


def oldest_versions(batch: Any) -> list[int]:
    """Per sample: the version of its oldest token (the staleness bound's version), else its rollout version."""
    base = _sample_versions(batch)
    tv = getattr(batch, "token_versions", None)
    if tv is None:
        return base
    return [min(int(r.min()), b) if r.size else b for r, b in zip(tv.rows(), base, strict=True)]


def mixed_rows(batch: Any) -> list[bool]:
    """Per sample: True when its tokens were sampled under more than one policy version."""
    tv = getattr(batch, "token_versions", None)
    if tv is None:
        return [False] * len(batch.group_id)
    return [bool(r.size) and int(r.min()) != int(r.max()) for r in tv.rows()]


def align_token_versions(
    response_rows: list[np.ndarray], version_rows: list[np.ndarray], action_rows: list[np.ndarray]
) -> list[np.ndarray]:
    """Per-token versions (response-level, o_b per row) moved onto the repaired actions (a_b per row).

    Action t is response token t (docs/numerics.md §1.2), so it keeps that token's version for t < o_b; an
    EOS the repair appended past o_b gets the version of the row's last response token (the weights loaded
    when the sequence ended). A token the repair overwrote keeps its position's version: it is masked out of
    the loss anyway (docs/numerics.md §14.12). Returns int32 rows.
    """
    if not len(response_rows) == len(version_rows) == len(action_rows):
        raise ValueError(f"row counts differ: {len(response_rows)} responses, {len(version_rows)} version rows, "
                         f"{len(action_rows)} action rows")
    out = []
    for b, (resp, ver, act) in enumerate(zip(response_rows, version_rows, action_rows, strict=True)):
        ver = np.asarray(ver, dtype=np.int32)
        if len(resp) != len(ver):
            raise ValueError(f"row {b}: {len(resp)} response tokens but {len(ver)} token versions")
        fill = int(ver[-1]) if ver.size else 0
        row = np.full(len(act), fill, dtype=np.int32)
        n = min(len(ver), len(act))
        row[:n] = ver[:n]
        out.append(row)
    return out
