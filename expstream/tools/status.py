"""``expstream status``: where the samples are, per stage, on a live run; and the run's status.jsonl.

One snapshot (:func:`collect_status`) reads

* Redis (the run's state): heartbeats (replicas alive), the recent micro-batches of every stage
  (records and samples per second and p50/p95 time per micro-batch over the last
  ``STATUS_WINDOW_S``), the sample accounting (``in = out + dead + dropped + in flight``), the
  announced policy version, dynamic sampling's dropped groups;
* the broker: per stage, the records of its input topic its consumer group has not committed (lag),
  and the dead letters on the input's ``.dlq`` twin (end offsets);
* the run directory when given: replicas wanted (topology, scale events), restarts (the
  supervisor's metrics endpoint), and each stage's Prometheus endpoint for the record age (lag in
  time) and staleness histograms.

The **bottleneck** is the stage with the largest input lag (records waiting); with no lag anywhere,
the one with the largest share of busy time. ``expstream run`` runs a :class:`StatusSampler` that
appends one snapshot per ``STATUS_INTERVAL_S`` to ``<run>/status.jsonl`` (what ``expstream report``
plots); ``expstream status --run-dir`` prints the newest (or collects one when the run is gone).
"""

from __future__ import annotations

import argparse
import json
import logging
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from expstream.config.cli_args import Command
from expstream.errors import ConfigError
from expstream.tools.accounting import accounting

log = logging.getLogger("expstream.status")

#: Why 60 s: "the last minute" — long enough to smooth micro-batch jitter, short enough to show a stall.
STATUS_WINDOW_S = 60.0
#: Why 5 s: a snapshot costs ~0.04 s of CPU (admin requests, Redis reads, scraping the stages); every 2 s
#: that was ~4 % of a short run's CPU (bench/pipeline.py --metrics), every 5 s it is under 2 %.
STATUS_INTERVAL_S = 5.0
#: Why 15 s: a replica's heartbeat comes every few seconds; three missed ones mean it is gone.
ALIVE_WITHIN_S = 15.0
#: Why 1 s: a metrics endpoint on loopback answers in milliseconds; a dead one must not stall status.
SCRAPE_TIMEOUT_S = 1.0
STATUS_FILE = "status.jsonl"
#: Why 2 s: Redis on loopback answers at once; a finished run's is gone, and status then shows its last snapshot.
GONE_CHECK_S = 2.0


def _last_line(path: Path) -> dict | None:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return None


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def window_stats(recent: list[tuple[float, float, int]], now: float, window_s: float = STATUS_WINDOW_S) -> dict:
    """Rates and p50/p95 time per micro-batch over the last ``window_s`` from (time, seconds, samples).

    ``last_progress_s`` ("idle s"): seconds since the newest micro-batch ended, never negative. The
    times are the replicas' clocks when they recorded a batch; one that ends while the snapshot is
    being read, or a replica whose clock runs ahead of this host's, counts as "just now" (0), and the
    newest time wins whatever order several replicas' entries arrived in."""
    inside = [r for r in recent if now - r[0] <= window_s]
    span = min(window_s, max(1e-9, now - min((r[0] for r in inside), default=now))) if inside else window_s
    span = max(span, 1.0)
    secs = [r[1] for r in inside]
    return {"records_per_s": round(len(inside) / span, 3), "samples_per_s": round(sum(r[2] for r in inside) / span, 3),
            "batch_p50_s": _percentile(secs, 0.5), "batch_p95_s": _percentile(secs, 0.95),
            "busy_share": round(min(1.0, sum(secs) / span), 3),
            "last_progress_s": round(max(0.0, now - max(r[0] for r in recent)), 3) if recent else None}


def _scrape(url: str) -> dict[str, dict]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as resp:  # noqa: S310 - loopback, our own port
        text = resp.read().decode()
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out.setdefault(smp.name, {})[tuple(sorted(smp.labels.items()))] = smp.value
    return out


def _hist_mean(series: dict[tuple, float] | None, count: dict[tuple, float] | None) -> float | None:
    if not series or not count:
        return None
    n = sum(count.values())
    return round(sum(series.values()) / n, 3) if n else None


def scrape_run(run_dir: Path, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per stage from the metrics endpoints under ``run_dir/run/metrics``: mean record age and staleness
    (since ``previous``, an earlier scrape's result, when given: the last interval instead of the
    whole run), the oldest policy version its replicas handled last; the supervisor's restarts per stage.
    The histograms' raw sums and counts stay in ``raw`` for the next call."""
    from expstream.observe.metrics import discovery_files

    out: dict[str, Any] = {"stages": {}, "restarts": {}, "wanted": {}}
    for info in discovery_files(Path(run_dir) / "run" / "metrics"):  # files of processes gone are skipped
        try:
            m = _scrape(info["url"])
        except (OSError, ValueError, KeyError):
            continue
        if info.get("stage") == "supervisor":
            for labels, v in (m.get("expstream_restarts_total") or {}).items():
                out["restarts"][dict(labels)["stage"]] = int(v)
            for labels, v in (m.get("expstream_replicas_wanted") or {}).items():
                out["wanted"][dict(labels)["stage"]] = int(v)
            continue
        row = out["stages"].setdefault(info["stage"], {"age": [0.0, 0.0], "stale": [0.0, 0.0], "version": None})
        for key, name in (("age", "expstream_record_age_seconds"), ("stale", "expstream_staleness_versions")):
            row[key][0] += sum((m.get(f"{name}_sum") or {}).values())
            row[key][1] += sum((m.get(f"{name}_count") or {}).values())
        # NaN until a replica has a version (expstream/observe/metrics.py): nothing to show for it yet
        versions = [int(v) for v in (m.get("expstream_policy_version") or {}).values() if v == v]
        if versions:
            row["version"] = min(versions) if row["version"] is None else min(row["version"], min(versions))
    raw: dict[str, Any] = {}
    before = (previous or {}).get("raw", {})
    for stage, row in out["stages"].items():
        raw[stage] = {key: list(row[key]) for key in ("age", "stale")}
        for key in ("age", "stale"):
            s, n = row.pop(key)
            s0, n0 = before.get(stage, {}).get(key, (0.0, 0.0))
            if previous is not None and n - n0 > 0 and n0 <= n:
                s, n = s - s0, n - n0  # only what was handled since the previous scrape
            row[key] = round(s / n, 3) if n else None
    out["raw"] = raw
    return out


def collect_status(topo: Any, *, bootstrap: str, redis_url: str, run_id: str, run_dir: Path | None = None,
                   state: Any = None, admin: Any = None, previous: dict[str, Any] | None = None) -> dict[str, Any]:
    """One snapshot (the format of status.jsonl; docs/observability.md). ``previous``: the last
    snapshot's ``scrape`` (record age and staleness are then over the interval since it)."""
    from expstream.kafka.clients import make_admin
    from expstream.state import RedisState

    own_state = state is None
    state = state or RedisState(redis_url, run_id)
    own_admin = admin is None
    admin = admin or make_admin(bootstrap, topo.kafka)
    try:
        beats = state.heartbeats()
        flows = state.flows()
        counters = state.counters()
        announced = int(state.policy_version())
        recents = {st.name: state.stage_recent(st.name) for st in topo.enabled_stages()}
        now = time.time()  # after the Redis reads: no batch recorded before it is "in the future"
        scraped = scrape_run(run_dir, previous) if run_dir is not None else {"stages": {}, "restarts": {}, "wanted": {}}
        wanted = scraped["wanted"]
        stages: dict[str, Any] = {}
        topics: dict[str, Any] = {}
        n = topo.generate.n_samples_per_prompt
        lags, deads = _broker_view(topo, bootstrap, run_id, admin)
        unit_of = {name: u for u in topo.units() for name in u.stages}  # a chain: one process, its first stage's group
        for st in topo.enabled_stages():
            unit = unit_of[st.name]
            lag, dead = lags.get(st.name), deads.get(st.name)
            ids = sorted(r for (stage, r), t in beats.items() if stage == unit.head and now - t <= ALIVE_WITHIN_S)
            alive = len(ids)
            dropped = int(counters.get("dynamic_sampling_dropped_groups", 0)) * n if st.name == "advantage" else 0
            extra = scraped["stages"].get(unit.name, {})  # a chain's endpoint is its process's
            stages[st.name] = {
                "replicas_alive": alive, "replicas_wanted": wanted.get(unit.name, st.replicas),
                "replica_ids": ids,  # --replica-id:pid of each live replica, this host's and other machines'
                "restarts": int(scraped["restarts"].get(unit.name, 0)),
                **({"chain": unit.name} if unit.chained else {}),
                **window_stats(recents[st.name], now),
                # a stage inside a chain reads no topic: its input is handed over in memory
                "input_topic": st.input if unit.head == st.name else None,
                "input_lag_records": lag, "input_lag_s": extra.get("age"),
                "dead_letters": dead, **accounting(flows.get(st.name, {}), dropped),
                # the oldest policy version the stage's replicas handled last (their gauges); without
                # the metrics endpoints (no --run-dir) only the announced version is known
                "policy_version_seen": extra.get("version") if run_dir is not None else None,
                "staleness_versions": extra.get("stale"),
            }
            if unit.head == st.name:
                topics.setdefault(st.input, {"lag": {}})["lag"][st.name] = lag
        return {"t": round(now, 3), "run_id": run_id, "policy_version": announced, "stages": stages,
                "topics": topics, "bottleneck": bottleneck(stages), "scrape": {"raw": scraped.get("raw", {})}}
    finally:
        if own_admin:
            admin.close()
        if own_state:
            state.close()


def _broker_view(topo: Any, bootstrap: str, run_id: str, admin: Any) -> tuple[dict, dict]:
    """Per stage: input records its group has not committed, and records on its input's dead-letter
    twin. One metadata request, one end-offset probe for every partition, one committed-offset request
    per group: a snapshot costs a handful of round trips, not one probe per topic."""
    from expstream.kafka.clients import end_offsets, partitions_of
    from expstream.kafka.topics import dlq_topic, stage_group

    stages = [topo.stages[u.head] for u in topo.units()]  # a chain reads only its first stage's input
    tps: dict[str, list] = {}
    for name in {st.input for st in stages} | {dlq_topic(st.input) for st in stages}:
        try:
            tps[name] = partitions_of(admin, name)
        except Exception as exc:  # noqa: BLE001 - not created yet: shown as unknown
            log.debug("partitions of %s: %r", name, exc)
    every = [tp for v in tps.values() for tp in v]
    try:
        ends = end_offsets(bootstrap, topo.kafka, every, timeout_s=5) if every else {}
        from kafka.admin import OffsetSpec

        starts = admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in every}) if every else {}
    except Exception as exc:  # noqa: BLE001 - a broker hiccup: unknown this time
        log.debug("end offsets: %r", exc)
        return {}, {}
    lags: dict[str, int | None] = {}
    deads: dict[str, int | None] = {}
    for st in stages:
        dlq = tps.get(dlq_topic(st.input))
        deads[st.name] = int(sum(ends.get(tp, 0) for tp in dlq)) if dlq is not None else None
        parts = tps.get(st.input)
        if parts is None:
            lags[st.name] = None
            continue
        group = stage_group(run_id, st.name)
        try:
            committed = admin.list_group_offsets({group: parts}).get(group, {})
        except Exception:  # noqa: BLE001 - a group that never committed (or a broker without it)
            committed = {}
        lag = 0
        for tp in parts:
            c = committed.get(tp)
            pos = c.offset if c is not None and c.offset is not None and c.offset >= 0 else starts[tp].offset
            lag += max(0, ends.get(tp, 0) - pos)
        lags[st.name] = lag
    return lags, deads


def bottleneck(stages: dict[str, Any]) -> dict[str, Any] | None:
    """The stage with the most input records waiting; without any lag, the busiest one."""
    if not stages:
        return None
    lagged = {k: v["input_lag_records"] or 0 for k, v in stages.items()}
    name = max(lagged, key=lambda k: (lagged[k], stages[k]["busy_share"]))
    if lagged[name] == 0:
        name = max(stages, key=lambda k: stages[k]["busy_share"])
        return {"stage": name, "why": f"busiest: {stages[name]['busy_share']:.0%} of the last minute processing, "
                                      "no input waiting anywhere"}
    age = stages[name].get("input_lag_s")
    return {"stage": name, "why": f"{lagged[name]} input records waiting" + (f", records {age:.1f}s old on arrival"
                                                                             if age is not None else "")}


#: The columns of the two tables: (header, justify) in display order, and which ones go first when the
#: console is too narrow (least useful first). stage, lag / in, out, dead, flight always stay: they are
#: what "where are my samples" needs.
FLOW_COLUMNS = ("stage", "repl", "lag", "age s", "rec/s", "smp/s", "p50ms", "p95ms", "busy", "idle s")
FLOW_DROP_ORDER = ("p50ms", "rec/s", "age s", "p95ms", "repl", "busy", "idle s", "smp/s")
ACCT_COLUMNS = ("stage", "in", "out", "dead", "drop", "flight", "DLQ rec", "policy v", "stale v", "restarts")
ACCT_DROP_ORDER = ("stale v", "policy v", "DLQ rec", "drop", "restarts")


class FittedTable:
    """A rich table that leaves out its least important columns until it fits the console's width.

    rich squeezes every column of a table wider than the console, so at 80 columns each number was
    cut to ``1…`` (the in/out counts vanished). This lays the table out compactly (no outer frame,
    one space between columns) and drops whole columns in ``drop_order`` until it fits, naming what
    it left out; ``--json`` and a wider terminal show everything.
    """

    def __init__(self, title: str, columns: tuple[str, ...], rows: list[list[Any]], drop_order: tuple[str, ...]) -> None:
        self.title, self.columns, self.rows, self.drop_order = title, columns, rows, drop_order

    def table(self, keep: list[int]) -> Any:
        from rich import box
        from rich.table import Table

        t = Table(title=self.title, title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False,
                  padding=(0, 0))  # the box's blank vertical is the one space between columns
        for i in keep:
            name = self.columns[i]
            t.add_column(name, justify="left" if i == 0 else "right", no_wrap=True)
        for row in self.rows:
            t.add_row(*(row[i] for i in keep))
        return t

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement
        from rich.text import Text

        keep = list(range(len(self.columns)))
        dropped: list[str] = []
        table = self.table(keep)
        unbounded = options.update_width(1 << 16)  # the width it wants (a measurement is capped at the console's)
        for name in self.drop_order:
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break
            keep.remove(self.columns.index(name))
            dropped.append(name)
            table = self.table(keep)
        yield table
        if dropped:
            yield Text(f"(left out at {options.max_width} columns: {', '.join(dropped)}; a wider terminal or --json "
                       "shows them)", style="dim")


def render_status(snap: dict[str, Any]) -> Any:
    """A rich renderable: the bottleneck line, a flow table and an accounting table (one row per stage),
    each fitted to the console's width (:class:`FittedTable`)."""
    from rich.console import Group
    from rich.text import Text

    def f(x: Any, spec: str = ".1f") -> str:
        return "-" if x is None else (format(x, spec) if isinstance(x, float) else str(x))

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    b = (snap.get("bottleneck") or {}).get("stage")
    finished = bool(snap.get("finished"))
    when = time.strftime("%H:%M:%S", time.localtime(snap["t"]))
    flow_rows, acct_rows = [], []
    for name, s in snap["stages"].items():
        style = "bold red" if name == b else ""
        shown = f"{name} ({s['chain']})" if s.get("chain") else name  # a stage inside a chain's process
        flow_rows.append([Text(shown, style=style), f"{s['replicas_alive']}/{s['replicas_wanted']}",
                          f(s["input_lag_records"]), f(s["input_lag_s"]), f(s["records_per_s"]), f(s["samples_per_s"]),
                          ms(s["batch_p50_s"]), ms(s["batch_p95_s"]), f"{s['busy_share']:.0%}", f(s["last_progress_s"])])
        acct_rows.append([Text(name, style=style), f(s["samples_in"]), f(s["samples_out"]), f(s["samples_dead"]),
                          f(s["samples_dropped"]),
                          Text(str(s["in_flight"]), style=_flight_style(s["in_flight"], finished)),
                          f(s["dead_letters"]), f(s.get("policy_version_seen")), f(s["staleness_versions"]),
                          f(s["restarts"])])
    flow = FittedTable(f"run {snap['run_id']}  policy v{snap['policy_version']}  {when}", FLOW_COLUMNS, flow_rows,
                       FLOW_DROP_ORDER)
    acct = FittedTable("samples: in = out + dead + dropped + in flight", ACCT_COLUMNS, acct_rows, ACCT_DROP_ORDER)
    head = Text(f"bottleneck: {b} ({snap['bottleneck']['why']})" if b else "bottleneck: -", style="bold")
    parts = [head, flow, acct]
    if finished:
        unbalanced = [name for name, s in snap["stages"].items() if s["in_flight"] != 0]
        parts.append(Text(f"the run has ended: {', '.join(unbalanced)} do not balance (samples neither out, "
                          "dead-lettered nor dropped)" if unbalanced else "the run has ended: every stage balances",
                          style="bold red" if unbalanced else ""))
    return Group(*parts)


def _flight_style(in_flight: int, finished: bool) -> str:
    """Red when the accounting cannot be right: negative, or samples still "in flight" after the run ended."""
    return "bold red" if in_flight < 0 or (finished and in_flight != 0) else ""


class StatusSampler:
    """Appends a snapshot to ``path`` every ``interval_s`` on a daemon thread; :meth:`stop` writes a last one."""

    def __init__(self, topo: Any, bootstrap: str, redis_url: str, run_id: str, run_dir: Path,
                 interval_s: float = STATUS_INTERVAL_S) -> None:
        self.topo, self.bootstrap, self.redis_url, self.run_id = topo, bootstrap, redis_url, run_id
        self.run_dir, self.interval_s = Path(run_dir), interval_s
        self.path = self.run_dir / STATUS_FILE
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status-sampler", daemon=True)
        self.snapshots = 0
        self._previous: dict[str, Any] | None = None  # the last snapshot's raw histogram sums

    def start(self) -> StatusSampler:
        self._thread.start()
        return self

    def _one(self, state: Any, admin: Any, final: bool = False) -> None:
        try:
            snap = collect_status(self.topo, bootstrap=self.bootstrap, redis_url=self.redis_url, run_id=self.run_id,
                                  run_dir=self.run_dir, state=state, admin=admin, previous=self._previous)
        except Exception as exc:  # noqa: BLE001 - observability never stops a run
            log.debug("status snapshot failed: %r", exc)
            return
        self._previous = snap.get("scrape")
        if final:  # the run has ended: in flight should be 0 everywhere (render_status flags it otherwise)
            snap["finished"] = True
        with self.path.open("a") as fh:
            fh.write(json.dumps(snap, separators=(",", ":")) + "\n")
        self.snapshots += 1

    def _loop(self) -> None:
        from expstream.kafka.clients import make_admin
        from expstream.state import RedisState

        try:
            state, admin = RedisState(self.redis_url, self.run_id), make_admin(self.bootstrap, self.topo.kafka)
        except Exception as exc:  # noqa: BLE001
            log.warning("status sampler not started: %s", exc)
            return
        try:
            while not self._stop.wait(self.interval_s):
                self._one(state, admin)
            self._one(state, admin, final=True)  # the final state, after the last experience
        finally:
            admin.close()
            state.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)


# ---- the command -----------------------------------------------------------------------------
def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="a run's --output directory (reads its services, topology, metrics)")
    p.add_argument("--bootstrap-servers", help="the broker, without --run-dir")
    p.add_argument("--redis-url", help="the run's Redis, without --run-dir (or EXPSTREAM_REDIS_URL)")
    p.add_argument("--run-id", help="the run id, without --run-dir")
    p.add_argument("--topology", help="topology YAML, without --run-dir (default lookup as expstream run)")
    p.add_argument("--watch", action="store_true", help="redraw in place until Ctrl-C")
    p.add_argument("--interval", type=float, default=STATUS_INTERVAL_S, help="seconds between redraws (--watch)")
    p.add_argument("--json", action="store_true", help="print the snapshot as JSON (status.jsonl's format)")


def status_command(args: argparse.Namespace) -> int:
    from expstream.state import RedisState

    run_dir, bootstrap, run_id, redis_url, topo = _status_target(args)
    gone = _redis_gone(redis_url)
    if gone is not None:  # the run is over: its last snapshot, or why there is none
        return _print_last_snapshot(args, run_dir, redis_url, gone)

    # a short retry budget: a Redis that stops answering means the run ended, not an outage to wait out
    state = RedisState(redis_url, run_id, connect_timeout_s=GONE_CHECK_S, retry_deadline_s=GONE_CHECK_S)
    previous: list[dict[str, Any] | None] = [None]

    def snap() -> dict[str, Any]:
        got = collect_status(topo, bootstrap=bootstrap, redis_url=redis_url, run_id=run_id, run_dir=run_dir,
                             state=state, previous=previous[0])
        previous[0] = got.get("scrape")  # --watch: age and staleness over each redraw interval
        return got

    try:
        if args.json:
            print(json.dumps(snap(), indent=1))
            return 0
        from rich.console import Console

        console = Console()
        if not args.watch:
            console.print(render_status(snap()))
            return 0
        try:
            return _watch(console, snap, run_dir, redis_url, args.interval)
        except KeyboardInterrupt:
            return 0
    finally:
        state.close()


def _status_target(args: argparse.Namespace) -> tuple[Path | None, str, str, str | None, Any]:
    """``(run_dir, bootstrap, run_id, redis_url, topology)``: from --run-dir's services.json and recorded
    topology (flags win), or from the flags alone."""
    import os

    from expstream.config.redaction import REDIS_URL_ENV
    from expstream.config.topology import load_topology

    run_dir = Path(args.run_dir) if args.run_dir else None
    if run_dir is not None:
        services = run_dir / "run" / "services.json"
        if not services.is_file():
            raise ConfigError(f"--run-dir: {run_dir} has no run/services.json; give the --output of an expstream run",
                              field="--run-dir")
        svc = json.loads(services.read_text())
        bootstrap, run_id = args.bootstrap_servers or svc["bootstrap_servers"], args.run_id or svc["run_id"]
        redis_url = args.redis_url or os.environ.get(REDIS_URL_ENV) or svc["redis_url"]
        return run_dir, bootstrap, run_id, redis_url, load_topology(str(run_dir / "run" / "topology.yaml"), [])
    redis_url = args.redis_url or os.environ.get(REDIS_URL_ENV)
    if not (args.bootstrap_servers and redis_url and args.run_id):
        raise ConfigError("status needs --run-dir, or --bootstrap-servers, --redis-url and --run-id",
                          field="--run-dir", fix="e.g. expstream status --run-dir runs/demo")
    return None, args.bootstrap_servers, args.run_id, redis_url, load_topology(args.topology, [])


def _print_last_snapshot(args: argparse.Namespace, run_dir: Path | None, redis_url: str | None, gone: str) -> int:
    """The run's services are gone: print its last snapshot of status.jsonl, or why there is none."""
    import sys

    from expstream.errors import EXIT_FAILED

    last = _last_line(run_dir / STATUS_FILE) if run_dir is not None else None
    if last is None:
        if run_dir is None or args.redis_url:  # a Redis the user named does not answer: say so, naming the flag
            from expstream.launch.preflight import check_redis

            check_redis(redis_url, timeout_s=GONE_CHECK_S)
        print(f"expstream status: the run in {run_dir} is not running ({gone}), and it left no {STATUS_FILE} "
              "snapshot to show (it ended or was killed before its first one)", file=sys.stderr)
        return EXIT_FAILED
    print(f"the run's services are gone; its last snapshot ({time.strftime('%H:%M:%S', time.localtime(last['t']))}"
          f", {run_dir / STATUS_FILE}):", file=sys.stderr if args.json else sys.stdout)  # --json: JSON only
    last["finished"] = True
    if args.json:
        print(json.dumps(last, indent=1))
    else:
        from rich.console import Console

        Console().print(render_status(last))
    return 0


def _watch(console: Any, snap: Any, run_dir: Path | None, redis_url: str | None, interval: float) -> int:
    """``--watch``: redraw in place until the run ends (then its final snapshot, when it wrote one)."""
    from rich.live import Live

    with Live(render_status(snap()), console=console, refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(max(0.2, interval))
            ended = _run_ended(run_dir, redis_url)
            if ended is None:
                try:
                    live.update(render_status(snap()))
                    continue
                except Exception:  # noqa: BLE001 - the run ending under the snapshot: looked at below
                    ended = _run_ended(run_dir, redis_url)
                    if ended is None:
                        raise
            last = _last_line(run_dir / STATUS_FILE) if run_dir is not None else None
            if last is not None:  # the run's own final snapshot (accounting after the last sample)
                last["finished"] = True
                live.update(render_status(last))
            break
    console.print(f"the run has ended ({ended}); the last snapshot above"
                  + (f" is its final one, from {run_dir / STATUS_FILE}" if last is not None else ""))
    return 0


def _redis_gone(redis_url: str) -> str | None:
    """Why the run's Redis is out of reach (None when it answers PING within GONE_CHECK_S). A refused
    password is not "gone": that AuthError is raised."""
    from expstream.errors import AuthError
    from expstream.launch.preflight import check_redis

    try:
        check_redis(redis_url, timeout_s=GONE_CHECK_S)
    except AuthError:
        raise
    except ConfigError as exc:
        return f"its Redis does not answer: {exc.message}"
    return None


def _run_ended(run_dir: Path | None, redis_url: str) -> str | None:
    """Why a watched run is over (None while it runs): no process holds its directory's lock any more
    (expstream/launch/rundir.py; the run releases it last), or its Redis stopped answering."""
    from expstream.launch.rundir import LOCK_NAME, is_locked

    lock = run_dir / LOCK_NAME if run_dir is not None else None
    if lock is not None and lock.exists() and not is_locked(lock):
        return f"no process holds {lock} any more"
    return _redis_gone(redis_url)


STATUS = Command("status", "per-stage replicas, lag, rates, time per batch, dead letters, accounting",
                 add_status_arguments, status_command, reads_topology=False)
