"""``expstream replay``: run recorded records through a stage span again, in process, into a new run directory.

A replay reads one recorded topic of a run directory (expstream/tools/recording.py) and calls a span of
contiguous enabled stages on it, the way LocalChain does, on a fresh MemoryState, with the recorded
configuration plus ``--set``. Protocol:

1. Load ``<run>/topology.yaml`` (``<run>/run/topology.yaml`` for older runs; ``--topology`` names
   another file) and apply ``--set``; resolve ``--stages S | A..B`` to enabled stages, the first of
   which must read ``--from TOPIC``.
2. Read TOPIC's recording in time order (partitions merged by timestamp; expstream/tools/replayinput.py).
   Decode each record; an undecodable one is reported (``topic[partition]@offset``), counted and skipped. ``--batches`` and
   ``--offsets`` select whole records, ``--samples`` and ``--groups`` select rows of a batch (on a
   PromptBatch: the prompts of those groups, so generate makes every sample of them).
3. Stage by stage: ``setup`` once, ``process`` per record in order, ``end_of_input`` after the input
   ended. Each output is encoded (validated) and written to the new recording at the next offset
   of its topic, partition = the partition of the record that produced it (key hash for outputs of
   ``end_of_input``), key as the stage runner writes it. A failing record is bisected like the
   runner does (``<batch_id>~<lo>-<hi>``) and what fails alone goes to ``<input>.dlq`` with the
   runner's dead-letter headers (expstream/kafka/letters.py).
4. Write ``topology.yaml`` (resolved), ``experiences.msgpack`` (when the span ends with the last
   enabled stage: the output values, a sample id kept once) and ``summary.json``.

Every replay runs with ``train.enabled=false`` (:data:`NO_LOOP_OVERRIDE`): it has no trainer, so a
continuous run's admission control would block generate for ever.

``--bootstrap-servers B`` (without ``--into``) runs the span as stage processes through a broker
instead: expstream/tools/replaybroker.py. ``--into TOPIC --bootstrap-servers B`` instead re-publishes the selected records into a live topic
(new ids under ``replay-<tag>/`` unless ``--keep-ids``), with confirmed sends.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from expstream.config.topology import STAGE_ORDER, Topology, load_topology
from expstream.errors import ConfigError
from expstream.kafka.letters import letter_headers
from expstream.kafka.topics import dlq_topic
from expstream.launch.outcome import dump_json
from expstream.state import MemoryState
from expstream.tools.recording import (
    RecordFrame,
    RecordingWriter,
)
from expstream.tools.replayinput import (
    SUMMARY_LIST_LIMIT,
    Filters,
    ReplayItem,
    selected_items,
)
from schemas import PromptBatch, SampleBatch, decode, encode, sample_id

log = logging.getLogger("expstream.replay")

#: Where a replay writes when --output is not given (plus a timestamp and a short random tag).
DEFAULT_OUTPUT_PREFIX = "runs/replay-"
#: How long `--into` waits for the broker to confirm every send before giving up (the sends are
#: flushed in one go; 60 s covers thousands of records on a slow broker).
INTO_CONFIRM_TIMEOUT_S = 60.0


# ----------------------------------------------------------------------------------------------
# Configuration and span
# ----------------------------------------------------------------------------------------------


def recorded_topology_path(run_dir: str | Path) -> Path:
    """``<run>/topology.yaml``, else ``<run>/run/topology.yaml`` (runs made before the recorder)."""
    run = Path(run_dir)
    for p in (run / "topology.yaml", run / "run" / "topology.yaml"):
        if p.is_file():
            return p
    raise ConfigError(f"{run}: no topology.yaml (looked at {run / 'topology.yaml'} and {run / 'run' / 'topology.yaml'})",
                      field="RUN_DIR", fix="give the directory `expstream run --output` wrote, or name the "
                                           "configuration with --topology")


def resolve_span(topo: Topology, from_topic: str, spec: str) -> list[str]:
    """``"advantage"`` or ``"postprocess..advantage"`` -> the enabled stage names of the span, in order.

    The span must be contiguous among the enabled stages and its first stage must read ``from_topic``.
    """
    enabled = [st.name for st in topo.enabled_stages()]
    readers = [st.name for st in topo.enabled_stages() if st.input == from_topic]
    first, dots, last = spec.partition("..")
    first, last = first.strip(), (last.strip() if dots else first.strip())
    for name in (first, last):
        if name not in STAGE_ORDER:
            raise ConfigError(f"--stages {spec!r}: unknown stage {name!r}", field="--stages",
                              fix=f"stages are {', '.join(STAGE_ORDER)}; write one or A..B")
        if name not in enabled:
            raise ConfigError(f"--stages {spec!r}: stage {name!r} is disabled in this configuration", field="--stages",
                              fix=f"the enabled stages are {', '.join(enabled)}")
    i, j = enabled.index(first), enabled.index(last)
    if j < i:
        raise ConfigError(f"--stages {spec!r}: {last} comes before {first}", field="--stages",
                          fix=f"write it in pipeline order: {last}..{first}")
    if topo.stages[first].input != from_topic:
        raise ConfigError(f"--from {from_topic!r}: stage {first} reads {topo.stages[first].input!r}, not {from_topic!r}",
                          field="--from", fix=f"replay {first} with --from {topo.stages[first].input}"
                          + (f", or replay {', '.join(readers)} (which read {from_topic})" if readers
                             else f"; no enabled stage reads {from_topic!r}"))
    return enabled[i: j + 1]


# ----------------------------------------------------------------------------------------------
# Reading the recording
# ----------------------------------------------------------------------------------------------


def output_key(batch: Any) -> bytes:
    """The key a stage runner gives an output record (stages/splitting.py ``record_key``): the first group id."""
    from stages.splitting import record_key  # not at the top: the stages package loads the models' modules

    return record_key(batch)


def key_partition(key: bytes, partitions: int) -> int:
    """The partition kafka-python's default partitioner picks for ``key`` (murmur2, positive)."""
    from kafka.partitioner.default import murmur2

    return (murmur2(key) & 0x7FFFFFFF) % max(1, partitions)


def _letter_ids(batch: Any) -> list[str] | None:
    """The ``sample_ids`` of a letter: sample ids of a SampleBatch, prompt ids of a PromptBatch."""
    from stages.splitting import sample_ids

    return sample_ids(batch) or None


# ----------------------------------------------------------------------------------------------
# The in-process replay
# ----------------------------------------------------------------------------------------------


@dataclass
class StageTally:
    batches: int = 0
    seconds: float = 0.0
    outputs: int = 0
    dead_letters: int = 0
    samples_out: int = 0


class InProcessReplay:
    """A stage span over a list of input items on one MemoryState, writing the new recording."""

    def __init__(self, topo: Topology, span: list[str], out_dir: Path, run_id: str) -> None:
        from stages.context import make_context

        self.topo, self.span, self.out_dir = topo, span, out_dir
        self.state = MemoryState(run_id)
        self.writer = RecordingWriter(out_dir)
        self.next_offset: dict[tuple[str, int], int] = defaultdict(int)
        self.tally = {name: StageTally() for name in span}
        self.letters: list[dict[str, Any]] = []
        self.contexts = {name: make_context(topo, name, state=self.state, run_id=run_id) for name in span}

    def setup(self) -> None:
        from stages import STAGES

        for name in self.span:
            STAGES[name].setup(self.contexts[name])

    def write(self, topic: str, partition: int, value: bytes, key: bytes | None,
              headers: Iterable[tuple[str, bytes]] = ()) -> RecordFrame:
        off = self.next_offset[(topic, partition)]
        self.next_offset[(topic, partition)] = off + 1
        frame = RecordFrame(topic, partition, off, int(time.time() * 1000), key, value, tuple(headers), 0)
        self.writer.append(frame)
        return frame

    def _process(self, name: str, batch: Any) -> list[Any]:
        from stages import STAGES

        outs = STAGES[name].process(batch, self.contexts[name])
        if isinstance(outs, (SampleBatch, PromptBatch)):
            outs = [outs]
        return [(o, encode(o)) for o in outs]  # encode validates: a bad output is a failure of process

    def _process_or_split(self, name: str, item: ReplayItem) -> tuple[list[Any], list[tuple[Any, Exception, str | None,
                                                                                      dict[str, str] | None]]]:
        """(outputs, failures); failures are (batch, error, split_from, each sample's own error when the record
        goes whole after every sample failed alone) as the runner bisects them (stages/splitting.py)."""
        from stages.splitting import process_or_split, sample_errors

        batch = item.batch
        # every failure of process is a dead letter, as in the runner (a replay retries nothing)
        split = process_or_split(batch, lambda b: self._process(name, b))
        if split.first is None:
            return split.outputs, []
        if split.samples <= 1:
            return [], [(batch, split.first, None, None)]
        if split.whole:
            return [], [(batch, split.first, None, sample_errors(split.bad, lambda exc: type(exc).__name__))]
        return split.outputs, [(sub, exc, batch.batch_id, None) for sub, exc in split.bad]

    def _letter(self, name: str, item: ReplayItem, batch: Any, exc: Exception, split_from: str | None,
                errors: dict[str, str] | None = None) -> None:
        value = item.frame.value if split_from is None else encode(batch)
        headers = letter_headers(item.frame, stage=name, replica="replay", error_class=type(exc).__name__,
                                 error_message=str(exc), value=value, sample_ids=_letter_ids(batch),
                                 split_from=split_from, errors=errors)
        letter = self.write(dlq_topic(item.frame.topic), 0, value or b"", item.frame.key, headers)
        self.tally[name].dead_letters += 1
        bid = getattr(batch, "batch_id", None)
        log.warning("replay %s %s batch=%s: dead-lettered to %s (%s: %s)", name, item.frame.where, bid, letter.where,
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
        if len(self.letters) < SUMMARY_LIST_LIMIT:
            self.letters.append({"stage": name, "record": item.frame.where, "letter": letter.where, "batch_id": bid,
                                 "error_class": type(exc).__name__, "error_message": str(exc)[:500]})

    def run_stage(self, name: str, items: list[ReplayItem]) -> list[ReplayItem]:
        from stages import end_of_input

        st, tally, out = self.topo.stages[name], self.tally[name], []
        for item in items:
            started = time.perf_counter()
            outputs, failures = self._process_or_split(name, item)
            tally.seconds += time.perf_counter() - started
            tally.batches += 1
            for batch, value in outputs:
                frame = self.write(st.output, item.frame.partition, value, output_key(batch))
                out.append(ReplayItem(frame, decode(value)))
            for batch, exc, split_from, errors in failures:
                self._letter(name, item, batch, exc, split_from, errors)
        for batch in end_of_input(self.contexts[name]):
            value, key = encode(batch), output_key(batch)
            frame = self.write(st.output, key_partition(key, self.topo.all_topics().get(st.output, self.topo.topics.partitions)),
                               value, key)
            out.append(ReplayItem(frame, decode(value)))
        tally.outputs += len(out)
        tally.samples_out += sum(len(i.batch) for i in out if isinstance(i.batch, SampleBatch))
        self.writer.flush()
        return out

    def run(self, items: list[ReplayItem]) -> list[ReplayItem]:
        for name in self.span:
            items = self.run_stage(name, items)
        self.writer.close()
        return items


# ----------------------------------------------------------------------------------------------
# The command
# ----------------------------------------------------------------------------------------------


def experiences_bytes(items: list[ReplayItem]) -> tuple[bytes, int, int]:
    """experiences.msgpack: every output value, a record whose samples were all seen before left out."""
    seen: set[str] = set()
    chunks, samples = [], 0
    for it in items:
        ids = [sample_id(g, int(k)) for g, k in zip(it.batch.group_id, it.batch.sample_index, strict=True)]
        new = [s for s in ids if s not in seen]
        if not new:
            continue
        seen.update(new)
        samples += len(new)
        chunks.append(it.frame.value)
    return b"".join(chunks), len(chunks), samples


#: Appended to every replay's --set: a replay has no trainer, so the continuous loop's admission
#: control (generate waits for policy versions a trainer publishes) would block it for ever.
NO_LOOP_OVERRIDE = "train.enabled=false"


@dataclass
class Prepared:
    """Steps 1-2, shared by the in-process and the broker replay."""

    run_dir: Path
    topo: Topology  # the recorded configuration, --set and NO_LOOP_OVERRIDE applied
    topo_path: Path  # where it was read from
    overrides: list[str]  # the user's --set (without NO_LOOP_OVERRIDE)
    loop_disabled: bool  # the recorded (or --set) configuration had train.enabled true
    span: list[str]
    out_dir: Path
    items: list[ReplayItem]
    counts: dict[str, Any]


def prepare_replay(run_dir: str | Path, from_topic: str, stages: str, *, overrides: Iterable[str] = (),
                   output: str | Path | None = None, filters: Filters | None = None,
                   topology: str | Path | None = None) -> Prepared:
    """Steps 1-2: configuration (loop off), span, a new output directory, the selected input records."""
    run_dir, filters, overrides = Path(run_dir), filters or Filters(), list(overrides)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory", field="RUN_DIR",
                          fix="give the directory `expstream run --output` (or `expstream record`) wrote")
    topo_path = Path(topology) if topology else recorded_topology_path(run_dir)
    loop_on = load_topology(topo_path, overrides).train.enabled
    topo = load_topology(topo_path, [*overrides, NO_LOOP_OVERRIDE])
    _follow_moved_blobs(topo, run_dir, overrides)
    if loop_on:
        log.info("replay: the configuration has train.enabled true (a continuous run); a replay has no trainer, "
                 "so it runs with train.enabled=false (no admission control, no weight reloading)")
    span = resolve_span(topo, from_topic, stages)
    out_dir = Path(output) if output else Path(f"{DEFAULT_OUTPUT_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-"
                                               f"{uuid.uuid4().hex[:4]}")
    if out_dir.resolve() == run_dir.resolve():
        raise ConfigError(f"--output {out_dir}: is the run being replayed", field="--output",
                          fix="give a new directory; a replay never writes into its source")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"--output {out_dir}: exists and is not empty", field="--output",
                          fix="give a new directory (or remove that one)")
    counts: dict[str, Any] = {"records_read": 0, "records_undecodable": 0, "undecodable": []}
    items = selected_items(run_dir, from_topic, filters, counts)
    out_dir.mkdir(parents=True, exist_ok=True)
    return Prepared(run_dir, topo, topo_path, overrides, loop_on, span, out_dir, items, counts)


def _follow_moved_blobs(topo: Topology, run_dir: Path, overrides: list[str]) -> None:
    """A run directory copied or moved elsewhere keeps its images in ``<run>/blobs``, while its
    topology names the absolute directory it was written to: use the run's own copy when that one is
    gone (unless ``--set run.blob_store=...`` says where to look)."""
    recorded = topo.run.blob_store
    if not recorded or any(o.startswith("run.blob_store=") for o in overrides) or "://" in recorded:
        return
    own = run_dir / "blobs"
    if not Path(recorded).is_dir() and own.is_dir():
        log.info("replay: the recorded blob store %s is gone; reading the run directory's copy %s", recorded, own)
        topo.run.blob_store = str(own.resolve())


def summary_head(prep: Prepared, from_topic: str, filters: Filters, run_id: str) -> dict[str, Any]:
    """The summary.json fields both replay modes write."""
    return {
        "mode": "replay",
        "status": "ok",
        "run_id": run_id,
        "source_run": str(prep.run_dir.resolve()),
        "output": str(prep.out_dir),
        "from_topic": from_topic,
        "span": prep.span,
        "overrides": prep.overrides,
        "loop_disabled": prep.loop_disabled,
        "topology": str(prep.topo_path.resolve()),
        "filters": filters.as_dict(),
        "records_read": prep.counts["records_read"],
        "records_undecodable": prep.counts["records_undecodable"],
        "undecodable": prep.counts["undecodable"],
        "torn_tails": prep.counts["torn_tails"],
        "records_in": len(prep.items),
        "estimator": prep.topo.algo.advantage_estimator,
        "n_samples_per_prompt": prep.topo.generate.n_samples_per_prompt,
    }


def replay_run(run_dir: str | Path, from_topic: str, stages: str, *, overrides: Iterable[str] = (),
               output: str | Path | None = None, filters: Filters | None = None,
               topology: str | Path | None = None) -> dict[str, Any]:
    """The in-process replay (steps 1-4 of the module docstring); returns the summary it wrote."""
    from expstream.launch.services import write_resolved_topology
    from expstream.models.resolve import build_builtin_models, check_models

    started = time.monotonic()
    filters = filters or Filters()
    prep = prepare_replay(run_dir, from_topic, stages, overrides=overrides, output=output, filters=filters,
                          topology=topology)
    topo, span, out_dir, items, counts = prep.topo, prep.span, prep.out_dir, prep.items, prep.counts
    write_resolved_topology(topo, out_dir / "topology.yaml")
    check_models(topo)
    build_builtin_models(topo)
    import torch

    # As many intra-op threads as the recorded stage processes had (expstream/launch/replica.py): a float
    # reduction split over another number of threads can round differently, and bytes would differ.
    torch.set_num_threads(topo.run.torch_threads)
    run_id = f"replay-{out_dir.name}"
    log.info("replay %s: %s from %s (%d of %d records) into %s", prep.run_dir,
             "..".join(dict.fromkeys([span[0], span[-1]])), from_topic, len(items), counts["records_read"], out_dir)
    engine = InProcessReplay(topo, span, out_dir, run_id)
    engine.setup()
    final = engine.run(items)
    summary = summary_head(prep, from_topic, filters, run_id)
    summary.update({
        "via": "process",
        "records_out": {f"{t}[{p}]": n for (t, p), n in sorted(engine.next_offset.items())},
        "stages": {name: {"batches": t.batches, "seconds": round(t.seconds, 6), "outputs": t.outputs,
                          "samples_out": t.samples_out, "dead_letters": t.dead_letters,
                          "ms_per_batch": round(1000 * t.seconds / t.batches, 3) if t.batches else None}
                   for name, t in engine.tally.items()},
        "dead_letters": sum(t.dead_letters for t in engine.tally.values()),
        "dead_letter_records": engine.letters,
    })
    if span[-1] == topo.enabled_stages()[-1].name:
        data, records, samples = experiences_bytes(final)
        (out_dir / "experiences.msgpack").write_bytes(data)
        summary.update(experience_records=records, samples=samples)
    summary["wall_s"] = round(time.monotonic() - started, 3)
    dump_json(summary, out_dir / "summary.json")
    return summary


# ----------------------------------------------------------------------------------------------
# --into: re-publish into a live pipeline
# ----------------------------------------------------------------------------------------------

#: The header a re-published record carries: where it was recorded (``topic[partition]@offset``).
H_REPLAY_OF = "replay_of"


def renamed(batch: Any, tag: str) -> Any:
    """``batch`` under the replay namespace: batch, prompt and group ids prefixed ``replay-<tag>/``."""
    ns = f"replay-{tag}/"
    if isinstance(batch, PromptBatch):
        return batch.replace(batch_id=ns + batch.batch_id, prompt_id=[ns + p for p in batch.prompt_id])
    return batch.replace(batch_id=ns + batch.batch_id, prompt_id=[ns + p for p in batch.prompt_id],
                         group_id=[ns + g for g in batch.group_id])


def republish(run_dir: str | Path, from_topic: str, into: str, bootstrap: str, *, filters: Filters | None = None,
              keep_ids: bool = False, tag: str | None = None, kafka_cfg: Any = None) -> dict[str, Any]:
    """Send the selected recorded records of ``from_topic`` to the live topic ``into`` (confirmed).

    Without ``keep_ids`` every record gets new ids under ``replay-<tag>/`` (so downstream dedupe by
    sample id keeps them apart from the originals); with it, an unfiltered record goes out byte for
    byte. Every record carries ``replay_of=<topic>[<partition>]@<offset>``. Returns the report.
    """
    from expstream.kafka.clients import OutRecord, make_producer, send_all_and_confirm

    run_dir, filters = Path(run_dir), filters or Filters()
    tag = tag or time.strftime("%Y%m%d-%H%M%S")
    counts: dict[str, Any] = {"records_read": 0, "records_undecodable": 0, "undecodable": []}
    items = selected_items(run_dir, from_topic, filters, counts)
    producer = make_producer(bootstrap, kafka_cfg)
    try:
        if into not in _broker_topics(bootstrap, kafka_cfg):  # never create a topic by publishing to it
            raise ConfigError(f"--into {into!r}: no such topic on {bootstrap}", field="--into",
                              fix="name a topic of the live pipeline (`expstream topics list`); replay never creates one")
        out = []
        for it in items:
            batch = it.batch if keep_ids else renamed(it.batch, tag)
            value = it.frame.value if batch is it.batch else encode(batch)
            headers = [*[(k, v) for k, v in it.frame.headers if k != H_REPLAY_OF], (H_REPLAY_OF, it.frame.where.encode())]
            out.append(OutRecord(into, value, output_key(batch), headers))
        send_all_and_confirm(producer, out, timeout_s=INTO_CONFIRM_TIMEOUT_S)
    finally:
        producer.close()
    log.info("replay: re-published %d records of %s to %s (%s)", len(items), from_topic, into,
             "ids kept" if keep_ids else f"ids under replay-{tag}/")
    return {"mode": "into", "source_run": str(run_dir.resolve()), "from_topic": from_topic, "into": into,
            "bootstrap_servers": bootstrap, "sent": len(items), "keep_ids": keep_ids,
            "namespace": None if keep_ids else f"replay-{tag}/", "records_read": counts["records_read"],
            "records_undecodable": counts["records_undecodable"], "torn_tails": counts["torn_tails"],
            "filters": filters.as_dict()}


def _broker_topics(bootstrap: str, cfg: Any) -> set[str]:
    from expstream.kafka.clients import make_admin

    admin = make_admin(bootstrap, cfg)
    try:
        return set(admin.list_topics())
    finally:
        admin.close()
