"""Prometheus metrics of every process of a run (docs/observability.md "Prometheus metrics").

Each stage process has its own registry and serves it on its own HTTP port; ``expstream run``
sets ``EXPSTREAM_METRICS_DIR`` and each process writes its discovery file ``<stage>-<replica>.json``
there (the run's own process writes ``supervisor.json``), which tests, ``expstream status`` and
Prometheus' file-based discovery read. :func:`forget_replica` removes a replica's file when it is
gone for good; :func:`discovery_files` skips files whose ``pid`` is dead. One port per process
(not the library's multiprocess mode), metric objects per process (no globals): why, the names
and every series in the doc.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("expstream.metrics")

METRICS_DIR_ENV = "EXPSTREAM_METRICS_DIR"
METRICS_PORT_ENV = "EXPSTREAM_METRICS_PORT"
METRICS_OFF_ENV = "EXPSTREAM_METRICS"  # "0": no registry, no server (the overhead bench's switch)
#: Why these buckets: a micro-batch takes from ~1 ms (advantage) to seconds (generate on CPU).
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Why these buckets: staleness is counted in policy versions; the admission bound is a few.
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
#: Why 1 s: the announced policy version is read from Redis at most this often for the staleness
#: histogram, not once per record.
ANNOUNCED_REFRESH_S = 1.0

#: name -> (kind, help, extra labels); ``stage`` is always a label.
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "expstream_records_processed_total": ("counter", "input records (micro-batches) handled", ()),
    "expstream_samples_processed_total": ("counter", "samples in the records handled", ()),
    "expstream_batch_seconds": ("histogram", "time per micro-batch: decode, process, send, confirm", ()),
    "expstream_send_seconds": ("histogram", "produce + flush + confirm of a micro-batch's outputs", ()),
    "expstream_commit_seconds": ("histogram", "synchronous offset commit", ()),
    "expstream_state_wait_seconds": ("histogram", "the durability wait before a commit: replicas acknowledge the "
                                     "state writes (0 without replicas; docs/redis.md)", ()),
    "expstream_consumer_lag_records": ("gauge", "records behind the partitions' high watermark", ("topic",)),
    "expstream_dead_letters_total": ("counter", "dead letters (records) sent to the input's dead-letter topic", ()),
    "expstream_retries_total": ("counter", "retries after retriable errors", ("step",)),
    "expstream_model_reload_seconds": ("histogram", "weight reloads between micro-batches", ("role",)),
    "expstream_policy_version": ("gauge", "policy version of the last record handled", ()),
    "expstream_reward_mean": ("gauge", "mean reward of the last micro-batch scored", ()),
    "expstream_staleness_versions": ("histogram", "announced policy version - the input record's", ()),
    "expstream_record_age_seconds": ("histogram", "now - the input record's produced_at_ms header", ()),
    "expstream_restarts_total": ("counter", "stage replica restarts by the supervisor", ()),
    "expstream_replicas_wanted": ("gauge", "replicas the supervisor keeps running (after scale events)", ()),
}
#: The supervisor's series (its own registry), not a stage's.
SUPERVISOR_METRICS = ("expstream_restarts_total", "expstream_replicas_wanted")


def enabled() -> bool:
    return os.environ.get(METRICS_OFF_ENV, "1") != "0"


class StageMetrics:
    """One stage process's metrics (``labels(stage=...)`` bound once)."""

    def __init__(self, stage: str, replica: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.stage, self.replica = stage, replica
        self.registry = CollectorRegistry(auto_describe=True)
        made: dict[str, Any] = {}
        for name, (kind, doc, extra) in METRICS.items():
            if name in SUPERVISOR_METRICS:
                continue
            labels = ("stage", *extra)
            if kind == "counter":
                made[name] = Counter(name.removesuffix("_total"), doc, labels, registry=self.registry)
            elif kind == "gauge":
                made[name] = Gauge(name, doc, labels, registry=self.registry)
            else:
                buckets = STALENESS_BUCKETS if "staleness" in name else TIME_BUCKETS
                made[name] = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
        self._m = made
        own = {"stage": stage}
        self.records = made["expstream_records_processed_total"].labels(**own)
        self.samples = made["expstream_samples_processed_total"].labels(**own)
        self.batch_seconds = made["expstream_batch_seconds"].labels(**own)
        self.send_seconds = made["expstream_send_seconds"].labels(**own)
        self.commit_seconds = made["expstream_commit_seconds"].labels(**own)
        self.state_wait_seconds = made["expstream_state_wait_seconds"].labels(**own)
        self.dead_letters = made["expstream_dead_letters_total"].labels(**own)
        self.policy_version = made["expstream_policy_version"].labels(**own)
        self.policy_version.set(float("nan"))  # no version yet (0 would read as "on version 0")
        self.reward_mean = made["expstream_reward_mean"].labels(**own)
        self.staleness = made["expstream_staleness_versions"].labels(**own)
        self.record_age = made["expstream_record_age_seconds"].labels(**own)
        self._announced = (0, -1e9)  # (version, monotonic time read)
        self.port: int | None = None

    def for_stage(self, stage: str) -> StageView:
        """The series of a stage run inside this process's chain (stages/chain.py): ``stage=<its name>``,
        beside the chain's own (records, sends, commits, lag, letters) under ``stage=<the chain's name>``."""
        return StageView(self, stage)

    def lag(self, topic: str, records: int) -> None:
        self._m["expstream_consumer_lag_records"].labels(stage=self.stage, topic=topic).set(records)

    def retry(self, step: str) -> None:
        self._m["expstream_retries_total"].labels(stage=self.stage, step=step).inc()

    def reload(self, role: str, seconds: float) -> None:
        self._m["expstream_model_reload_seconds"].labels(stage=self.stage, role=role).observe(seconds)

    def announced(self, state: Any) -> int:
        """The announced policy version, read from ``state`` at most every ANNOUNCED_REFRESH_S."""
        version, at = self._announced
        now = time.monotonic()
        if now - at >= ANNOUNCED_REFRESH_S:
            try:
                version = int(state.policy_version())
            except Exception:  # noqa: BLE001 - measurement only
                pass
            self._announced = (version, now)
        return version

    def serve(self, out_dir: str | os.PathLike[str] | None = None, port: int | None = None) -> int:
        """Serve /metrics on 127.0.0.1 (``port``, else EXPSTREAM_METRICS_PORT, else a free one); write the
        discovery file into ``out_dir`` (else EXPSTREAM_METRICS_DIR) when given; returns the port."""
        return _serve(self.registry, discovery_name(self.stage, self.replica),
                      {"stage": self.stage, "replica": self.replica}, out_dir, port)


class StageView:
    """One inner stage's series in a chain process's registry (what a stage's ``ctx.metrics`` offers)."""

    def __init__(self, metrics: StageMetrics, stage: str) -> None:
        m, own = metrics._m, {"stage": stage}
        self.stage, self._parent = stage, metrics
        self.records = m["expstream_records_processed_total"].labels(**own)
        self.samples = m["expstream_samples_processed_total"].labels(**own)
        self.batch_seconds = m["expstream_batch_seconds"].labels(**own)
        self.policy_version = m["expstream_policy_version"].labels(**own)
        self.policy_version.set(float("nan"))
        self.reward_mean = m["expstream_reward_mean"].labels(**own)

    def observe_batches(self, batches: int, samples: int, seconds: float) -> None:
        """One input record's work in this stage: ``batches`` micro-batches of ``samples`` in ``seconds``."""
        self.records.inc(batches)
        self.samples.inc(samples)
        self.batch_seconds.observe(seconds)

    def reload(self, role: str, seconds: float) -> None:
        self._m_reload().labels(stage=self.stage, role=role).observe(seconds)

    def _m_reload(self) -> Any:
        return self._parent._m["expstream_model_reload_seconds"]

    def announced(self, state: Any) -> int:
        return self._parent.announced(state)


def discovery_name(stage: str, replica: str | int) -> str:
    """The discovery file of one replica's endpoint: ``<stage>-<replica>.json``."""
    return f"{stage}-{replica}.json"


def forget_replica(out_dir: str | os.PathLike[str], stage: str, replica: str | int) -> None:
    """Remove a replica's discovery file (its process is gone for good); a no-op when there is none."""
    (Path(out_dir) / discovery_name(stage, replica)).unlink(missing_ok=True)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def discovery_files(out_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The discovery files under ``out_dir`` whose process is alive, parsed, in name order. A file left
    by a process that is gone (killed: nobody removed it) is skipped with a debug line."""
    out = []
    for f in sorted(Path(out_dir).glob("*.json")):
        try:
            info = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(info, dict):
            continue
        if not _alive(info.get("pid")):
            log.debug("metrics: %s is stale (pid %s gone); skipped", f, info.get("pid"))
            continue
        out.append(info)
    return out


def _serve(registry: Any, name: str, info: dict[str, Any], out_dir: str | os.PathLike[str] | None,
           port: int | None) -> int:
    from prometheus_client import start_http_server

    if port is None:
        port = int(os.environ.get(METRICS_PORT_ENV, "0") or 0)
    addr = os.environ.get("EXPSTREAM_METRICS_ADDR", "127.0.0.1")
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    bound = int(server.server_port)
    where = out_dir or os.environ.get(METRICS_DIR_ENV)
    if where:
        d = Path(where)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.tmp"
        tmp.write_text(json.dumps({**info, "pid": os.getpid(), "port": bound,
                                   "url": f"http://127.0.0.1:{bound}/metrics"}) + "\n")
        os.replace(tmp, d / name)
    log.info("metrics: %s on http://%s:%d/metrics", name.removesuffix(".json"), addr, bound)
    return bound


class SupervisorCollector:
    """``expstream_restarts_total{stage}`` read from the supervisor's children at scrape time."""

    def __init__(self, supervisor: Any) -> None:
        self.supervisor = supervisor

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        fam = CounterMetricFamily("expstream_restarts", METRICS["expstream_restarts_total"][1], labels=["stage"])
        wanted = GaugeMetricFamily("expstream_replicas_wanted", METRICS["expstream_replicas_wanted"][1],
                                   labels=["stage"])
        counts: dict[str, int] = {}
        live: dict[str, int] = {}
        for child in list(getattr(self.supervisor, "children", [])):
            stage = child.label.split("[", 1)[0]
            counts[stage] = counts.get(stage, 0) + int(child.restarts)
            live[stage] = live.get(stage, 0) + (0 if getattr(child, "retired", False) else 1)
        for stage, n in sorted(counts.items()):
            fam.add_metric([stage], n)
            wanted.add_metric([stage], live[stage])
        yield fam
        yield wanted


def serve_supervisor(supervisor: Any, out_dir: str | os.PathLike[str]) -> int | None:
    """The run process's registry (restarts); None when metrics are switched off or cannot bind."""
    if not enabled():
        return None
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(supervisor))
    try:
        return _serve(registry, "supervisor.json", {"stage": "supervisor", "replica": "0"}, out_dir, 0)
    except OSError as exc:
        log.warning("metrics: the supervisor's endpoint did not start: %s", exc)
        return None


def exported_names() -> set[str]:
    """Every metric name (and histogram series name) the code exports, for dashboards and tests."""
    names = set()
    for name, (kind, _doc, _labels) in METRICS.items():
        names.add(name)
        if kind == "histogram":
            names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
    return names
