"""What a replay reads (expstream/tools/replay.py, step 2): the filters, the recording in time order, the selected records.

``--batches`` and ``--offsets`` select whole records, ``--samples`` and ``--groups`` select rows of a
batch (on a PromptBatch: the prompts of those groups, so generate makes every sample of them). An
undecodable record is reported (``topic[partition]@offset``), counted and skipped; filters that
select nothing are an error naming what the topic holds (docs/replay.md).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expstream.errors import ConfigError
from expstream.tools.recording import Damage, RecordFrame, RecordingError, iter_topic, recorded_topics
from schemas import PromptBatch, SampleBatch, decode, encode, sample_id
from schemas.errors import SchemaError

log = logging.getLogger("expstream.replay")

#: Undecodable records and dead letters named one by one in summary.json (the counts are exact).
SUMMARY_LIST_LIMIT = 50


def parse_ids(text: str | None, flag: str) -> frozenset[str]:
    """``"a,b"`` -> {"a", "b"}; None -> empty (no filter). An empty item is an error naming ``flag``."""
    if text is None:
        return frozenset()
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise ConfigError(f"{flag} {text!r}: an empty id in the list", field=flag,
                          fix=f"give comma-separated ids, e.g. {flag} " + ("17#0,17#3" if flag == "--samples" else "a,b"))
    return frozenset(items)


def parse_offsets(text: str | None) -> dict[int, list[tuple[int, int]]]:
    """``"0:12-40,1:7"`` -> {0: [(12, 40)], 1: [(7, 7)]} (inclusive ranges per partition)."""
    if text is None:
        return {}
    out: dict[int, list[tuple[int, int]]] = defaultdict(list)
    fix = "write partition:first-last, e.g. --offsets 0:12-40,1:0-9 (or 1:7 for one record)"
    for item in text.split(","):
        part, sep, rng = item.strip().partition(":")
        lo, dash, hi = rng.partition("-")
        try:
            p, a = int(part), int(lo)
            b = int(hi) if dash else a
        except ValueError:
            raise ConfigError(f"--offsets {item!r}: not partition:first-last", field="--offsets", fix=fix) from None
        if not sep or p < 0 or a < 0 or b < a:
            raise ConfigError(f"--offsets {item!r}: needs a partition >= 0 and 0 <= first <= last", field="--offsets",
                              fix=fix)
        out[p].append((a, b))
    return dict(out)


@dataclass(frozen=True)
class Filters:
    """What of the recorded input a replay takes; empty sets / dicts mean "everything"."""

    samples: frozenset[str] = frozenset()  # sample ids "<group_id>#<sample_index>": rows
    groups: frozenset[str] = frozenset()  # group ids (= prompt ids): rows
    batches: frozenset[str] = frozenset()  # batch ids: whole records
    offsets: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # partition -> inclusive ranges

    def keeps_record(self, frame: RecordFrame, batch_id: str) -> bool:
        if self.offsets and not any(a <= frame.offset <= b for a, b in self.offsets.get(frame.partition, [])):
            return False
        return not self.batches or batch_id in self.batches

    def rows(self, batch: Any) -> Any | None:
        """The batch cut to the selected rows (the same object when all are kept; None when none are)."""
        if not self.samples and not self.groups:
            return batch
        if isinstance(batch, PromptBatch):
            groups = self.groups | {s.rpartition("#")[0] for s in self.samples}
            keep = [i for i, p in enumerate(batch.prompt_id) if p in groups]
            if len(keep) == len(batch.prompt_id):
                return batch
            return PromptBatch(batch_id=batch.batch_id, prompt_id=[batch.prompt_id[i] for i in keep],
                               prompt=[batch.prompt[i] for i in keep], label=[batch.label[i] for i in keep],
                               reference=[batch.reference[i] for i in keep]) if keep else None
        keep = [i for i, (g, k) in enumerate(zip(batch.group_id, batch.sample_index, strict=True))
                if g in self.groups or sample_id(g, int(k)) in self.samples]
        if len(keep) == len(batch):
            return batch
        return batch.select(keep) if keep else None

    def as_dict(self) -> dict[str, Any]:
        return {"samples": sorted(self.samples), "groups": sorted(self.groups), "batches": sorted(self.batches),
                "offsets": {str(p): [f"{a}-{b}" for a, b in r] for p, r in sorted(self.offsets.items())}}

    def given(self) -> list[str]:
        """The flags of the filters that are set, e.g. ``["--samples", "--offsets"]``."""
        return [flag for flag, v in (("--samples", self.samples), ("--groups", self.groups),
                                     ("--batches", self.batches), ("--offsets", self.offsets)) if v]

    def matched_nothing(self, topic: str, records: int, seen: Seen) -> ConfigError:
        """The error for filters that selected none of ``records`` records: a replay of nothing
        would exit 0 and write an empty run, which looks like a replay that worked."""
        flags = self.given()
        return ConfigError(
            f"{' '.join(flags)} selected none of the {records} record(s) of {topic}", field=flags[0],
            fix=f"{topic} holds e.g. batch ids {', '.join(seen.batches) or 'none'}; sample ids "
                f"{', '.join(seen.samples) or 'none'}; group ids {', '.join(seen.groups) or 'none'}; offsets "
                f"{', '.join(f'{p}:{lo}-{hi}' for p, (lo, hi) in sorted(seen.offsets.items())) or 'none'} "
                f"(`expstream show RUN_DIR --topic {topic} --offset P:O` shows a record)")


#: Ids named per kind in the error for filters that match nothing.
LISTED_IDS = 5


@dataclass
class Seen:
    """A few ids and the offset range per partition of what a recorded topic holds (for that error)."""

    batches: list[str] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)
    groups: list[str] = field(default_factory=list)
    offsets: dict[int, tuple[int, int]] = field(default_factory=dict)

    def add(self, frame: RecordFrame, batch: Any) -> None:
        lo, hi = self.offsets.get(frame.partition, (frame.offset, frame.offset))
        self.offsets[frame.partition] = (min(lo, frame.offset), max(hi, frame.offset))
        for out, ids in ((self.batches, [batch.batch_id]),
                         (self.samples, batch.sample_ids() if isinstance(batch, SampleBatch) else []),
                         (self.groups, list(getattr(batch, "group_id", None) or batch.prompt_id))):
            for i in ids:
                if len(out) < LISTED_IDS and i not in out:
                    out.append(i)


@dataclass
class ReplayItem:
    """One record as a stage reads it: where it is (for letters and logs) and its decoded batch."""

    frame: RecordFrame
    batch: Any


def read_recorded(run_dir: Path, topic: str, torn: list[str]) -> Iterator[RecordFrame]:
    """Every frame of ``topic`` in time order. A partition file that ends in a torn frame (a killed
    run) is read up to it, named in ``torn`` and warned about (file and byte position); a corrupt one
    is a ConfigError naming the file and the byte position (a replay of what is left would be
    silently partial)."""
    if topic not in recorded_topics(run_dir):
        raise ConfigError(f"--from {topic!r}: {run_dir} has no recording of that topic", field="--from",
                          fix=f"recorded topics: {', '.join(recorded_topics(run_dir)) or 'none'}")

    def on_damage(d: Damage) -> None:
        torn.append(f"{topic}[{d.path.stem.removeprefix('partition-')}]")
        log.warning("replay: %s; replaying what is complete", d.message())

    try:
        yield from iter_topic(run_dir, topic, order="time", on_damage=on_damage)
    except RecordingError as exc:
        raise ConfigError(str(exc), field="RUN_DIR",
                          fix="the recording was modified or damaged after it was written: restore it (a copy), or "
                              "replay another topic; `expstream show RUN_DIR --topic T --offset P:O` shows what is "
                              "readable before the damage") from exc


def selected_items(run_dir: Path, topic: str, filters: Filters, counts: dict[str, Any]) -> list[ReplayItem]:
    """Step 2: the recorded records of ``topic`` that pass the filters, decoded (rows cut)."""
    items: list[ReplayItem] = []
    torn: list[str] = []
    seen = Seen()
    for frame in read_recorded(run_dir, topic, torn):
        counts["records_read"] += 1
        try:
            batch = decode(frame.value)
        except SchemaError as exc:
            counts["records_undecodable"] += 1
            log.warning("replay: %s undecodable (%s: %s); skipped", frame.where, type(exc).__name__, exc)
            if len(counts["undecodable"]) < SUMMARY_LIST_LIMIT:
                counts["undecodable"].append({"record": frame.where, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        seen.add(frame, batch)
        if not filters.keeps_record(frame, batch.batch_id):
            continue
        cut = filters.rows(batch)
        if cut is None:
            continue
        if cut is not batch:  # the stage reads the cut batch; the letter of a failure carries those bytes
            frame = RecordFrame(frame.topic, frame.partition, frame.offset, frame.timestamp, frame.key, encode(cut),
                                frame.headers, frame.timestamp_type)
        items.append(ReplayItem(frame, cut))
    counts["torn_tails"] = torn
    if not items and filters.given():
        raise filters.matched_nothing(topic, counts["records_read"], seen)
    return items
