"""``expstream replay ... --bootstrap-servers B``: a stage span replayed through a broker, as stage processes.

The same replay as expstream/tools/replay.py (same input selection, same output directory layout), but
the span runs as ``expstream stage`` processes under the supervisor, exactly as ``expstream run``
starts them, reading and writing fresh topics of the broker. Protocol:

1. Steps 1-2 of expstream/tools/replay.py (configuration with the loop off, span, selected records).
2. Name fresh topics ``replay-<tag>.<topic>`` for the span's input and outputs; write
   ``run/topology.yaml``, the configuration the stages read: ``topics.input`` is the renamed input,
   every span stage writes its renamed output, every other stage is disabled (so the first span
   stage reads the input). ``<output>/topology.yaml`` is the configuration under the recorded names.
3. Create those topics and their ``.dlq`` twins (``topics.partitions`` each); start a local
   redis-server when no ``--redis-url`` is given.
4. Start the :class:`expstream.tools.recorder.Recorder` (follow mode, in a thread) on the outputs and
   every ``.dlq`` twin, and the span's stage replicas under the supervisor (stage_argv, stage_env).
5. Publish the selected records to the renamed input: original value bytes, key and headers, to
   the partition they were recorded in (a partition the topic lacks: the key's), every send confirmed.
6. Watch the last stage's output and the dead-letter twins until every input sample is accounted
   for: out of the last stage, dead-lettered, dropped by dynamic sampling (Redis counter), or in a
   group a group estimator cannot complete (a --samples filter took part of it). Held samples
   (a cross-batch window) are released with the stage's ``end_of_input`` as ``expstream run``
   does. Nothing new for ``run.timeout_s``: the replay fails, naming what is missing.
7. Stop the stages (SIGTERM, the supervisor's grace), then the recorder (it drains to the end
   offsets of that moment); copy its recording to ``<output>/topics/`` under the recorded topic
   names (offsets, timestamps, keys, headers as the broker had them); write ``experiences.msgpack``
   (span ends with the last enabled stage) and ``summary.json``; stop redis.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
import uuid
from collections.abc import Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kafka import TopicPartition

from expstream.config.kafka import KafkaConfig
from expstream.config.topology import Topology, load_topology
from expstream.errors import ExpstreamError
from expstream.kafka.clients import make_consumer, make_producer
from expstream.kafka.topics import dlq_topic
from expstream.launch.outcome import dump_json
from expstream.tools.recording import RecordFrame, RecordingWriter, iter_topic, recorded_topics
from expstream.tools.replay import (
    Filters,
    Prepared,
    ReplayItem,
    experiences_bytes,
    prepare_replay,
    summary_head,
)
from schemas import PromptBatch, decode, sample_id
from schemas.errors import SchemaError

log = logging.getLogger("expstream.replay")

#: Where the recorder writes under the replay's run/ (topics under their replay-<tag>. names).
BROKER_RECORDING_DIR = "broker-recording"
# Why 300 ms: the watch loop's poll; it only bounds how soon the end is noticed.
WATCH_POLL_MS = 300
# Why 30 s: the recorder joins after its drain (at most recorder.DRAIN_DEADLINE_S = 15 s) plus a
# poll; longer means it is stuck, and the replay says so instead of waiting for ever.
RECORDER_JOIN_S = 30.0
# Why 30 s: confirmed sends of a few hundred recorded micro-batches to a local broker take well
# under a second; 30 s covers a slow remote one.
PUBLISH_CONFIRM_S = 30.0


def replay_topic(tag: str, topic: str) -> str:
    """The fresh broker topic a replay uses for ``topic``: ``replay-<tag>.<topic>``."""
    return f"replay-{tag}.{topic}"


def broker_overrides(topo: Topology, span: list[str], from_topic: str, tag: str) -> list[str]:
    """Step 2: the --set entries that rename the span's topics and disable every other stage."""
    # unchained: every stage of the span its own process, so every hop of it is on a topic and recorded,
    # those a chain of the recorded run handed over in memory included (docs/replay.md "Chained stages")
    sets = [f"topics.input={replay_topic(tag, from_topic)}", "chains=[]"]
    for st in topo.enabled_stages():
        if st.name in span:
            sets.append(f"stages.{st.name}.output={replay_topic(tag, st.output)}")
        else:
            sets.append(f"stages.{st.name}.enabled=false")
    return sets


def input_sample_ids(items: list[ReplayItem], n: int) -> list[str]:
    """The sample ids the input stands for (a prompt: its n samples), each once, in input order."""
    ids: dict[str, None] = {}
    for it in items:
        b = it.batch
        if isinstance(b, PromptBatch):
            ids.update((sample_id(g, k), None) for g in b.prompt_id for k in range(n))
        else:
            ids.update((s, None) for s in b.sample_ids())
    return list(ids)


class SpanWatch:
    """Step 6: what came out of the span (last output, dead letters), from outside any group."""

    def __init__(self, bootstrap: str, topo: Topology, output: str, dlqs: list[str]) -> None:
        self.output, self.n = output, topo.generate.n_samples_per_prompt
        self.consumer = make_consumer(bootstrap, None, topo.kafka)
        tps = [TopicPartition(t, p) for t in [output, *dlqs] for p in sorted(self.consumer.partitions_for_topic(t) or [])]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.out: set[str] = set()
        self.dead: set[str] = set()
        self.unreadable: list[str] = []

    def poll(self, timeout_ms: int) -> int:
        """New records taken (outputs and letters); a record that does not decode is named, never fatal."""
        new = 0
        for tp, recs in self.consumer.poll(timeout_ms=timeout_ms).items():
            for rec in recs:
                new += 1
                try:
                    batch = decode(rec.value)
                except SchemaError as exc:
                    self.unreadable.append(f"{rec.topic}[{rec.partition}]@{rec.offset}: {exc}")
                    log.warning("replay: %s[%d]@%d undecodable (%s)", rec.topic, rec.partition, rec.offset, exc)
                    continue
                if isinstance(batch, PromptBatch):  # a prompt's letter: every sample of its groups
                    ids = [sample_id(g, k) for g in batch.prompt_id for k in range(self.n)]
                else:
                    ids = batch.sample_ids()
                (self.out if tp.topic == self.output else self.dead).update(ids)
        return new

    def close(self) -> None:
        self.consumer.close()


def unreachable_samples(topo: Topology, span: list[str], ids: Iterable[str]) -> set[str]:
    """Samples of groups a group estimator in the span never emits: fewer than n of the group in the input."""
    if "advantage" not in span or not topo.is_group_estimator:
        return set()
    n = topo.generate.n_samples_per_prompt
    per_group: dict[str, list[str]] = {}
    for sid in ids:
        per_group.setdefault(sid.rpartition("#")[0], []).append(sid)
    return {s for members in per_group.values() if len(members) < n for s in members}


def _publish(bootstrap: str, topo: Topology, topic: str, items: list[ReplayItem]) -> int:
    """Step 5: the recorded records, original bytes/key/headers, to their recorded partition."""
    from kafka.errors import KafkaError

    from expstream.errors import ProduceError
    from expstream.tools.replay import key_partition

    parts = topo.all_topics().get(topic, topo.topics.partitions)  # a stage's input may have more (replicas)
    producer = make_producer(bootstrap, topo.kafka)
    try:
        futures = []
        for it in items:
            f = it.frame
            p = f.partition if f.partition < parts else key_partition(f.key or b"", parts)
            futures.append((f, producer.send(topic, value=f.value, key=f.key, headers=list(f.headers) or None,
                                             partition=p)))
        producer.flush(timeout=PUBLISH_CONFIRM_S)
        for f, fut in futures:
            try:
                fut.get(timeout=PUBLISH_CONFIRM_S)
            except KafkaError as exc:
                raise ProduceError(f"replay: {f.where} not acknowledged by {topic}: {exc!r}", cause=exc) from exc
    finally:
        producer.close(timeout=10)
    return len(items)


def _translate(raw_root: Path, out_dir: Path, names: dict[str, str]) -> dict[str, int]:
    """Step 7: the recorder's frames under the recorded topic names (``names``: broker name -> recorded)."""
    counts: dict[str, int] = {}
    with RecordingWriter(out_dir) as writer:
        for topic in recorded_topics(raw_root):
            original = names.get(topic, topic)
            for f in iter_topic(raw_root, topic, order="partition"):
                writer.append(RecordFrame(original, f.partition, f.offset, f.timestamp, f.key, f.value, f.headers,
                                          f.timestamp_type))
                counts[f"{original}[{f.partition}]"] = counts.get(f"{original}[{f.partition}]", 0) + 1
    return counts


def broker_replay(run_dir: str | Path, from_topic: str, stages: str, bootstrap: str, *,
                  redis_url: str | None = None, overrides: Iterable[str] = (), output: str | Path | None = None,
                  filters: Filters | None = None, topology: str | Path | None = None,
                  tag: str | None = None) -> dict[str, Any]:
    """Steps 1-7 of the module doc; returns the summary it wrote (``status`` ``ok`` or ``failed``)."""
    from expstream.kafka.topics import create_topics
    from expstream.launch.preflight import check_services
    from expstream.launch.supervisor import SupervisorError

    started = time.monotonic()
    filters = filters or Filters()
    check_services(bootstrap, redis_url, KafkaConfig())
    prep: Prepared = prepare_replay(run_dir, from_topic, stages, overrides=overrides, output=output,
                                    filters=filters, topology=topology)
    topo, span, out_dir, items = prep.topo, prep.span, prep.out_dir, prep.items
    tag = tag or f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:4]}"
    run_id = f"replay-{tag}"
    btopo, names, run_dir_, topo_path = _broker_configuration(prep, from_topic, tag)  # step 2
    n = topo.generate.n_samples_per_prompt
    wanted = input_sample_ids(items, n)
    unreachable = unreachable_samples(topo, span, wanted)
    summary = summary_head(prep, from_topic, filters, run_id)
    summary.update(via="broker", bootstrap_servers=bootstrap, topics={v: k for k, v in names.items()})
    error: str | None = None
    with ExitStack() as stack:
        if not redis_url:  # step 3
            from expstream.launch.localservers import LocalRedis

            redis = LocalRedis(run_dir_)
            redis_url = redis.start()
            stack.callback(redis.stop)
        create_topics(bootstrap, btopo.all_topics(), with_dlq=True, kafka_config=btopo.kafka)
        from expstream.state import RedisState

        state = RedisState(redis_url, run_id)
        recorder, rec_error = _start_recorder(stack, bootstrap, btopo, names, run_dir_)  # step 4
        sup = _start_stages(stack, btopo, topo_path, bootstrap, run_id, redis_url, run_dir_)
        watch = SpanWatch(bootstrap, btopo, btopo.stages[span[-1]].output,
                          [dlq_topic(t) for t in names if not t.endswith(".dlq")])
        stack.callback(watch.close)
        summary["records_published"] = _publish(bootstrap, btopo, btopo.topics.input, items)  # step 5
        log.info("replay %s: published %d records to %s; %s running as %d process(es)", run_id, len(items),
                 btopo.topics.input, "..".join(dict.fromkeys([span[0], span[-1]])), len(sup.children))
        missing = set(wanted)
        try:
            error = _await_accounted(watch, sup, state, btopo, bootstrap, wanted, unreachable, n, missing,
                                     run_dir_ / "logs")  # step 6
        except (SupervisorError, ExpstreamError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        summary.update(samples_in=len(wanted), samples_out=len(watch.out), samples_dead=len(watch.dead - watch.out),
                       samples_unreachable=sorted(unreachable)[:50], samples_missing=sorted(missing)[:50],
                       dynamic_sampling_dropped_groups=int(state.counters().get("dynamic_sampling_dropped_groups", 0)),
                       unreadable=watch.unreadable[:50], stage_restarts=sup.total_restarts)
    # the stages are stopped, the recorder drained, redis stopped: the recording is complete
    _write_outputs(summary, topo, span, out_dir, run_dir_ / BROKER_RECORDING_DIR, names)
    error = error or (rec_error[0] if rec_error else None)
    if not recorder.stats.drained:
        error = error or "the recorder's drain deadline passed: the recording misses the last records"
    if error:
        summary.update(status="failed", error=error)
    summary["wall_s"] = round(time.monotonic() - started, 3)
    dump_json(summary, out_dir / "summary.json")
    return summary


def _broker_configuration(prep: Prepared, from_topic: str, tag: str) -> tuple[Topology, dict[str, str], Path, Path]:
    """Step 2: the configuration the stages read, under the replay's topic names, written to
    ``run/topology.yaml`` (the recorded names to ``topology.yaml``); its models checked and built.
    Returns it, replay topic -> recorded topic, the ``run/`` directory and the stages' topology path."""
    from expstream.launch.run import write_resolved_topology
    from expstream.models.resolve import build_builtin_models, check_models

    topo, span, out_dir = prep.topo, prep.span, prep.out_dir
    btopo = load_topology(prep.topo_path, [*prep.overrides, "train.enabled=false",
                                           *broker_overrides(topo, span, from_topic, tag)])
    if [s.name for s in btopo.enabled_stages()] != span:  # a bug here, not a user error: say what came out
        raise ExpstreamError(f"replay: the broker topology enables {[s.name for s in btopo.enabled_stages()]}, "
                             f"not the span {span}")
    names = {btopo.topics.input: from_topic, dlq_topic(btopo.topics.input): dlq_topic(from_topic)}
    for name in span:
        names[btopo.stages[name].output] = topo.stages[name].output
        names[dlq_topic(btopo.stages[name].output)] = dlq_topic(topo.stages[name].output)
    run_dir_ = out_dir / "run"
    run_dir_.mkdir(parents=True, exist_ok=True)
    topo_path = run_dir_ / "topology.yaml"
    write_resolved_topology(btopo, topo_path)
    write_resolved_topology(topo, out_dir / "topology.yaml")
    check_models(btopo)
    build_builtin_models(btopo)
    return btopo, names, run_dir_, topo_path


def _start_recorder(stack: ExitStack, bootstrap: str, btopo: Topology, names: dict[str, str],
                    run_dir_: Path) -> tuple[Any, list[str]]:
    """Step 4: the recorder in a thread on the outputs and dead-letter twins (stopped by ``stack``);
    returns it and the list its failure is appended to."""
    from expstream.tools.recorder import Recorder

    recorder = Recorder(bootstrap, btopo.kafka, [t for t in names if t != btopo.topics.input],
                        run_dir_ / BROKER_RECORDING_DIR, follow=True)
    rec_error: list[str] = []

    def record() -> None:
        try:
            recorder.run()
        except Exception as exc:  # noqa: BLE001 - reported in summary.json as the replay's failure
            log.exception("replay: the recorder failed")
            rec_error.append(f"recorder: {type(exc).__name__}: {exc}")

    rec_thread = threading.Thread(target=record, name="replay-recorder", daemon=True)
    rec_thread.start()

    def stop_recorder() -> None:
        recorder.request_stop()
        rec_thread.join(RECORDER_JOIN_S)
        if rec_thread.is_alive():
            log.error("replay: the recorder did not stop within %.0fs; the recording may miss the last records",
                      RECORDER_JOIN_S)

    stack.callback(stop_recorder)
    return recorder, rec_error


def _start_stages(stack: ExitStack, btopo: Topology, topo_path: Path, bootstrap: str, run_id: str, redis_url: str,
                  run_dir_: Path) -> Any:
    """Step 4: the span's stage replicas under a supervisor, stopped by ``stack`` before the recorder."""
    from expstream.launch.run import FORK_ENTRY, stage_argv, stage_env
    from expstream.launch.supervisor import Supervisor

    sup = Supervisor(run_dir_ / "logs", max_restarts=btopo.run.max_restarts, spawn=btopo.run.spawn,
                     fork_entry=FORK_ENTRY, env={"OMP_NUM_THREADS": str(btopo.run.torch_threads),
                                                 "TOKENIZERS_PARALLELISM": "false", **stage_env(redis_url, btopo)})
    for st in btopo.enabled_stages():
        for replica in range(st.replicas):
            sup.add(st.name, replica, stage_argv(topo_path, st.name, replica, bootstrap, run_id))
    sup.start()
    stack.callback(sup.stop)  # step 7: the stages stop before the recorder (callbacks run last-in first)
    return sup


def _await_accounted(watch: SpanWatch, sup: Any, state: Any, btopo: Topology, bootstrap: str, wanted: list[str],
                     unreachable: set[str], n: int, missing: set[str], logs: Path) -> str | None:
    """Step 6: until every input sample is accounted for, or nothing new for ``run.timeout_s``.
    ``missing`` is kept up to date in place (the summary reports it after an error too); returns the
    error (None: all accounted for)."""
    last_new = time.monotonic()
    while True:
        if watch.poll(WATCH_POLL_MS):
            last_new = time.monotonic()
        sup.poll()
        dropped = int(state.counters().get("dynamic_sampling_dropped_groups", 0))
        now_missing = set(wanted) - watch.out - watch.dead - unreachable
        missing.clear()
        missing.update(now_missing)
        if len(missing) <= dropped * n:
            return None
        if _release_held(btopo, state, len(missing) - dropped * n, bootstrap):
            last_new = time.monotonic()
        if time.monotonic() - last_new > btopo.run.timeout_s:
            return (f"nothing new for {btopo.run.timeout_s:.0f}s (run.timeout_s) with {len(missing)} input "
                    f"samples unaccounted for, e.g. {sorted(missing)[:5]}; see {logs}")


def _write_outputs(summary: dict[str, Any], topo: Topology, span: list[str], out_dir: Path, raw: Path,
                   names: dict[str, str]) -> None:
    """Step 7: the recording copied under the recorded names, the per-topic counts, experiences.msgpack."""
    summary["records_out"] = _translate(raw, out_dir, names)
    shutil.rmtree(raw, ignore_errors=True)
    summary["dead_letters"] = sum(k for where, k in summary["records_out"].items()
                                  if where.rpartition("[")[0].endswith(".dlq"))
    summary["stages"] = {s: {"outputs": sum(k for where, k in summary["records_out"].items()
                                            if where.rpartition("[")[0] == topo.stages[s].output)} for s in span}
    if span[-1] == topo.enabled_stages()[-1].name:
        final = [ReplayItem(f, decode(f.value)) for f in iter_topic(out_dir, topo.stages[span[-1]].output)] \
            if topo.stages[span[-1]].output in recorded_topics(out_dir) else []
        data, records, samples = experiences_bytes(final)
        (out_dir / "experiences.msgpack").write_bytes(data)
        summary.update(experience_records=records, samples=samples)


def _release_held(topo: Topology, state: Any, outstanding: int, bootstrap: str) -> bool:
    """Step 6: when the only samples missing are those the last stage holds (a cross-batch window),
    call its ``end_of_input`` and publish what it returns (as ``expstream run`` does)."""
    from expstream.launch.collect import publish_end_of_input
    from stages import held_samples
    from stages.context import make_context

    ctx = make_context(topo, topo.enabled_stages()[-1].name, state=state)
    held = held_samples(ctx)
    if held == 0 or held < outstanding:
        return False
    return publish_end_of_input(topo, ctx, bootstrap, held) > 0
