"""``expstream run``: the embedded default (or existing services), end to end.

0. Lock the output directory (expstream.launch.rundir): a second run on it, or a directory holding a
   previous run without ``--force``, exits 2 before anything is started or written.
1. Build the built-in tiny models once, before any stage starts (the reward function and the
   model directories were checked by expstream.models.resolve right after loading the topology).
2. Start a local broker and redis-server on free loopback ports unless addresses were given.
3. Create every topic of the topology and its ``.dlq`` twin explicitly; write the resolved
   configuration to ``run/topology.yaml`` (what the stages read) and ``<output>/topology.yaml``.
4. Start every enabled stage replica as its own process under the supervisor. From here on the
   loop also answers ``expstream scale`` requests and runs the autoscalers (expstream/launch/scale.py);
   every scale event goes into ``summary.json`` (``scale_events``).
5. Feed the prompt file into the input topic (every send confirmed).
6. Collect experiences (deduped by sample id) until every prompt group is accounted for:
   emitted complete, dropped by dynamic sampling, or dead-lettered.
7. Stop stages (SIGTERM, then SIGKILL after a grace period), then redis and the broker. With
   ``record`` on, the supervised ``recorder`` (started in step 4 with the stages, writing
   ``<output>/topics/``) is stopped after the stages, so it drains what they wrote last, and
   before the summary, which counts what it recorded.
8. Write ``experiences.msgpack`` and ``summary.json`` whatever happened (expstream.launch.outcome: a run
   that lost more than ``run.max_lost_group_share`` of its fed groups fails); print the summary.

With ``train.enabled`` (``--continuous``) steps 3-8 differ as expstream/launch/continuous.py describes:
the ``policy`` topic and the trainer process are added, the prompt file is fed epoch after epoch
under flow control instead of step 5-6, and the run ends when the trainer finishes; the trainer
and the stages are stopped before ``summary.json`` is written, and nothing is collected.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import signal
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from expstream.config.paths import resolve_run_paths
from expstream.config.redaction import (
    REDACTED,
    REDIS_URL_ENV,
    TOPOLOGY_SECRETS_ENV,
    redact_url,
    split_secrets,
    url_password,
)
from expstream.config.topology import Topology
from expstream.errors import EXIT_CONFIG, EXIT_INTERRUPTED, ConfigError
from expstream.kafka.topics import create_topics, dlq_topic, loop_topics
from expstream.launch.collector import REJECTED_FILE, ExperienceCollector
from expstream.launch.continuous import TRAINER, run_continuous, trainer_argv
from expstream.launch.outcome import ContinuousOutcome, RunOutcome, dump_json
from expstream.launch.preflight import check_output_dir, check_services
from expstream.launch.prompts import dead_letter_refused, feed_prompts, has_media, read_prompts, store_media
from expstream.launch.rundir import claim_run_dir
from expstream.launch.scale import Scaler, lag_reader
from expstream.launch.supervisor import Supervisor, SupervisorError
from expstream.models.media import MIB
from expstream.models.resolve import build_builtin_models
from expstream.observe.metrics import METRICS_DIR_ENV, forget_replica, serve_supervisor
from expstream.observe.metrics import enabled as metrics_enabled
from expstream.observe.timeline import STARTUP_DIR, STARTUP_DIR_ENV, Timeline
from expstream.tools.recorder import RECORDER, record_topics, recorder_argv
from expstream.tools.recording import TOPICS_DIR
from expstream.tools.status import StatusSampler

if TYPE_CHECKING:
    from expstream.state import State
    from stages.context import StageContext

log = logging.getLogger("expstream.run")
# Why 5 s: often enough to see progress in a CI log, rare enough not to flood it.
PROGRESS_LOG_INTERVAL_S = 5.0
MONITOR_POLL_MS = 300
#: What a stage process forked from the fork server runs (the ``python -m expstream`` entry point):
#: named here, so the fork server never imports the command line that imports this module.
FORK_ENTRY = "expstream.cli:main"


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def write_resolved_topology(topo: Topology, path: Path) -> None:
    """The topology as the stages read it, every URL's credentials redacted (the stages get them from
    :func:`stage_env`; expstream/config/redaction.py)."""
    path.write_text(yaml.safe_dump(split_secrets(topo.to_raw())[0], sort_keys=False))


def install_interrupt_handler() -> dict[str, bool]:
    flag = {"stop": False}

    def _handler(signum: int, _frame) -> None:  # noqa: ANN001
        flag["stop"] = True
        print(f"\nexpstream: got signal {signum}; stopping every stage cleanly", file=sys.stderr)

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    return flag


def stage_argv(topo_path: Path, name: str, replica: int, bootstrap: str, run_id: str) -> list[str]:
    """A stage's command line. No Redis URL here (it may hold a password, and every user can read
    ``/proc/<pid>/cmdline``): stages get it from :func:`stage_env`."""
    return [sys.executable, "-m", "expstream", "stage", name, "--topology", str(topo_path),
            "--bootstrap-servers", bootstrap, "--run-id", run_id, "--replica-id", str(replica)]


def stage_env(redis_url: str, topo: Topology | None = None) -> dict[str, str]:
    """What a stage's environment adds: the real Redis URL (``/proc/<pid>/environ`` is owner-only), the
    credentials of ``topo``'s URLs that the written topology holds redacted, and for a stage started as a
    fresh interpreter the fork server's malloc settings (expstream/launch/forkserver.py MALLOC_ENV; a forked
    stage inherits them from the server), unless the environment sets its own."""
    from expstream.launch.forkserver import malloc_env

    secrets = split_secrets(topo.to_raw())[1] if topo is not None else {}
    return {**malloc_env(), REDIS_URL_ENV: redis_url,
            **({TOPOLOGY_SECRETS_ENV: json.dumps(secrets)} if secrets else {})}


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.last_log = 0.0
        self.started = time.monotonic()

    def update(self, done: int, samples: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and not force and now - self.last_log < PROGRESS_LOG_INTERVAL_S:
            return
        self.last_log = now
        width = 30
        filled = int(width * done / max(self.total, 1))
        rate = samples / max(now - self.started, 1e-9)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} groups  {samples} samples  " \
               f"{rate:.2f} samples/s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


def run_pipeline(topo: Topology, args: argparse.Namespace) -> int:
    # Configuration first: a bad prompt file, model directory or reward function stops the run here
    # (exit 2 from cli.main) before any directory, broker, redis-server or stage is started.
    try:
        rows = read_prompts(args.prompts, media_root=getattr(args, "media_root", None) or topo.run.media_root,
                            media_max_mb=topo.run.media_max_mb)
    except OSError as exc:
        raise ConfigError(f"cannot read the prompt file {args.prompts!r} ({exc.strerror or exc})", field="--prompts",
                          fix="give an existing JSON-lines file, e.g. --prompts examples/prompts.jsonl") from exc
    run_id = args.run_id or new_run_id()
    out_dir = Path(args.output or f"runs/{run_id}")
    # The outside world next, still before anything slow: a writable --output, and the broker and
    # Redis given on the command line answer (one line and exit 2, not 34 s of retries).
    check_output_dir(out_dir)
    check_services(args.bootstrap_servers, args.redis_url, topo.kafka)
    # Held until the summary is written (released last by the ExitStack below, or at process exit).
    run_lock = claim_run_dir(out_dir, force=args.force, resume=args.resume)
    timeline = Timeline()
    timeline.mark("config_checked")
    if topo.run.spawn == "fork":
        from expstream.launch.forkserver import warm_up_for

        # imports torch/transformers once, while the models are checked and the broker and redis start
        # (the longest step before a stage can start); started already by `expstream run` (cli.py): a
        # no-op then
        warm_up_for(topo)
        timeline.mark("fork_server_started")
    build_builtin_models(topo)  # torch-free when the cache has them (expstream/models/cache.py)
    timeline.mark("models_ready")
    resolve_run_paths(topo, out_dir, media=has_media(rows))  # the one place (the stages read topo.to_raw())
    run_dir = out_dir / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    stop = install_interrupt_handler()
    started = time.monotonic()
    continuous = topo.train.enabled
    outcome = ContinuousOutcome if continuous else RunOutcome
    out = outcome(topo=topo, run_id=run_id, out_dir=out_dir, rows=len(rows), started=started)
    out.timeline = timeline
    with ExitStack() as stack:
        stack.callback(run_lock.release)
        stack.push(out.on_exit)  # outputs even when setting up fails (a no-op once written)
        bootstrap, redis_url = args.bootstrap_servers, args.redis_url
        if not bootstrap:
            from expstream.launch.localservers import LocalBroker

            broker = LocalBroker(run_dir)
            bootstrap = broker.start()
            timeline.mark("broker_ready")
            stack.callback(broker.stop)
            log.info("local broker at %s (log %s)", bootstrap, run_dir / "broker.log")
        out.bootstrap = bootstrap
        if not redis_url:
            from expstream.launch.localservers import LocalRedis

            redis = LocalRedis(run_dir)
            redis_url = redis.start()
            timeline.mark("redis_ready")
            stack.callback(redis.stop)
            log.info("local redis at %s", redact_url(redis_url))
        # Once more, now that Redis is up: a failure from here to the loop below writes the outputs while
        # Redis still answers (the first hook, after the servers stopped, waited out Redis retries for a
        # minute reading the stage statistics). Whichever runs first writes; the other is a no-op.
        stack.push(out.on_exit)
        from expstream.state import RedisState

        out.redis_url, out.secret = redact_url(redis_url), url_password(redis_url)
        # Shown, so redacted: whoever resumes or inspects the run passes the password again.
        services = {"run_id": run_id, "bootstrap_servers": bootstrap, "redis_url": redact_url(redis_url)}
        if not args.bootstrap_servers:
            services["broker_pid"] = broker.pid
        if not args.redis_url:
            services["redis_pid"] = redis.pid
        dump_json(services, run_dir / "services.json")

        create_topics(bootstrap, topo.all_topics(), with_dlq=True)
        if continuous:
            create_topics(bootstrap, loop_topics(topo), with_dlq=False)
            store = topo.train.weight_store
            log.info("run %s: continuous; weight store %s, trainer output %s", run_id, store, out_dir)
        if has_media(rows):  # images and video frames by claim check, before the stages read the topology
            from expstream.models.blobs import open_blob_store

            blobs = open_blob_store(topo.run.blob_store or "")
            stored = store_media(rows, blobs, max_bytes=int(topo.run.media_max_mb * MIB))
            log.info("run %s: %d images/videos stored in %s", run_id, stored, blobs)
        timeline.mark("topics_created")
        state = out.state = RedisState(redis_url, run_id)
        topo_path = run_dir / "topology.yaml"
        write_resolved_topology(topo, topo_path)
        write_resolved_topology(topo, out_dir / "topology.yaml")  # the run directory's copy (replay reads it)
        recording = topo.record.is_on(own_broker=not args.bootstrap_servers)
        sup = Supervisor(run_dir / "logs", max_restarts=topo.run.max_restarts, spawn=topo.run.spawn,
                         fork_entry=FORK_ENTRY, env={"OMP_NUM_THREADS": str(topo.run.torch_threads), "TOKENIZERS_PARALLELISM": "false",
                                                     METRICS_DIR_ENV: str(run_dir / "metrics"),
                                                     STARTUP_DIR_ENV: str(run_dir / STARTUP_DIR), **stage_env(redis_url, topo)},
                         # a replica gone for good leaves no metrics file behind (expstream/observe/metrics.py)
                         on_gone=functools.partial(forget_replica, run_dir / "metrics"))
        serve_supervisor(sup, run_dir / "metrics")  # expstream_restarts_total (docs/observability.md)
        for st in topo.enabled_stages():
            for replica in range(st.replicas):
                sup.add(st.name, replica, stage_argv(topo_path, st.name, replica, bootstrap, run_id))
        if continuous:
            sup.add(TRAINER, 0, trainer_argv(topo_path, bootstrap, run_id, out_dir), one_shot=True)
        if recording:  # stopped after the stages, so it drains what they wrote last (expstream/tools/recorder.py)
            topics = record_topics(topo)
            sup.add(RECORDER, 0, recorder_argv(topo_path, bootstrap, topics, out_dir, run_id), stop_last=True)
            out.recording_dir = out_dir
            log.info("run %s: recording %s into %s", run_id, ", ".join(topics), out_dir / TOPICS_DIR)
        out.supervisor = sup
        # `expstream scale` requests and the autoscalers, answered from the loop below (expstream/launch/scale.py)
        scaler = out.scaler = Scaler(topo, sup, out_dir, lambda name, replica: stage_argv(
            topo_path, name, replica, bootstrap, run_id), lag_reader(topo, bootstrap, run_id), started=started)
        stack.callback(sup.stop)  # before the start: a start that fails half-way stops what it started
        # one status snapshot per STATUS_INTERVAL_S into <output>/status.jsonl (expstream status, report)
        sampler = StatusSampler(topo, bootstrap, redis_url, run_id, out_dir)
        try:
            sup.start()  # inside the try: a stage that cannot be started fails the run with its reason
            timeline.mark("stages_spawned")
            if metrics_enabled():
                sampler.start()
            if continuous:
                # prompts whose media were refused: dead-lettered once; the epochs feed the others
                fed_rows = dead_letter_refused(bootstrap, topo.kafka, topo.topics.input, rows)
                run_continuous(topo, fed_rows, out, sup, state, bootstrap, stop, scaler=scaler)
            else:
                dlqs = [dlq_topic(t) for t in topo.all_topics()]
                collector = out.collector = ExperienceCollector(
                    bootstrap, topo.kafka, topo.output_topic, topo.generate.n_samples_per_prompt, dlq_topics=dlqs,
                    group_mode=topo.is_group_estimator, rejected_path=out_dir / REJECTED_FILE)
                stack.callback(collector.close)
                plan = out.plan = FeedPlan(topo, len(rows))
                fed, records = 0, 0
                progress = out.progress = Progress(plan.target, enabled=not args.no_progress)
                last_new = time.monotonic()
                while True:
                    if stop["stop"]:
                        out.status = EXIT_INTERRUPTED
                        break
                    lost = out.dropped + len(collector.lost_groups())
                    if plan.wanted(lost) > fed:  # first feed, or a top-up for groups dynamic sampling dropped
                        want = plan.wanted(lost)
                        collector.expect_groups(r.prompt_id for r in rows[fed:want])  # before they can come out
                        records += feed_prompts(bootstrap, topo.kafka, topo.topics.input, rows[fed:want],
                                                topo.run.prompt_batch_size, first_index=records)
                        timeline.mark("prompts_fed")
                        log.info("run %s: fed prompts %d..%d to %s", run_id, fed, want - 1, topo.topics.input)
                        fed = out.fed = want
                    if collector.poll(MONITOR_POLL_MS):
                        last_new = time.monotonic()
                    sup.poll()
                    scaler.tick()
                    out.dropped = int(state.counters().get("dynamic_sampling_dropped_groups", 0))
                    flush_last_window(topo, state, collector, fed, out.dropped, bootstrap)
                    done = collector.complete_groups + lost
                    progress.update(min(collector.complete_groups, plan.target), len(collector.samples))
                    if collector.complete_groups >= plan.target or (fed == len(rows) and done >= fed):
                        progress.update(min(collector.complete_groups, plan.target), len(collector.samples), force=True)
                        out.finished = True
                        break
                    if time.monotonic() - last_new > topo.run.timeout_s:
                        out.fail(f"no experience arrived for {topo.run.timeout_s:.0f}s (run.timeout_s); "
                                 f"see {run_dir}/logs")
                        break
        except SupervisorError as exc:
            out.fail(str(exc))
        except KeyboardInterrupt:
            out.status = EXIT_INTERRUPTED
        except Exception as exc:  # noqa: BLE001 - whatever broke, what was collected is written below
            text = f"{type(exc).__name__}: {exc}"
            # The traceback goes to the log only without a secret in it (a Redis URL in the text).
            if out.secret and out.secret in text:
                log.error("run %s: %s", run_id, text.replace(out.secret, REDACTED))
            else:
                log.exception("run %s: %s", run_id, exc)
            out.fail(f"{type(exc).__name__}: {exc}")
        finally:
            timeline.mark("stopping")
            sampler.stop()
            if continuous or recording:
                # the trainer's last steps are in train.jsonl, the recorder has drained and closed its
                # files, before the summary reads them
                sup.stop()
            summary = out.write()  # experiences.msgpack and summary.json, whatever happened
    print_summary(summary, out_dir)
    if not getattr(args, "no_report", False):
        try:
            from expstream.tools.report import write_report

            print(f"  wrote {write_report(out_dir)}")
        except Exception as exc:  # noqa: BLE001 - a report never fails a run
            log.warning("run %s: report not written: %s", run_id, exc)
    if out.error:
        print(f"expstream: run failed: {out.error}", file=sys.stderr)
    return out.status


class FeedPlan:
    """How many prompts to have fed, given how many groups were lost (dropped or dead-lettered).

    The run wants ``run.target_groups`` complete groups (default: one per prompt). With dynamic
    sampling it feeds ``ceil(target · (1 + dynamic_sampling_over_provision))`` prompts up front
    and one more prompt for every group lost, while the file has prompts left, so the
    experience rate holds when constant-reward groups are dropped.
    """

    def __init__(self, topo: Topology, available: int) -> None:
        self.available = available
        self.target = min(topo.run.target_groups or available, available)
        extra = topo.algo.dynamic_sampling_over_provision if topo.algo.dynamic_sampling else 0.0
        self.upfront = math.ceil(self.target * (1 + extra))

    def wanted(self, lost: int) -> int:
        return min(self.available, self.upfront + lost)


def flush_last_window(topo: Topology, state: State, collector: ExperienceCollector, prompts: int, dropped: int,
                      bootstrap: str) -> None:
    """Release what the last stage holds back once every other sample has come out.

    In a continuous deployment a stage may hold samples across micro-batches (the advantage
    stage's cross-batch normalisation window closes when it holds ``algo.rollout_batch_size``
    samples); a finite run's last window never fills. So once the held samples are the only ones
    missing, the run calls the stage's ``end_of_input`` hook and publishes what it returns.
    """
    from expstream.config.estimators import uses_window

    last = topo.enabled_stages()[-1].name
    if last == "advantage" and not uses_window(topo.algo):
        return  # nothing held back; and the stage modules (torch) stay out of this process
    from stages import held_samples
    from stages.context import make_context

    ctx = make_context(topo, last, state=state)
    pending = held_samples(ctx)
    n = topo.generate.n_samples_per_prompt
    expected = (prompts - dropped) * n - len(collector.dead_samples - collector.samples)
    if pending == 0 or len(collector.samples) + pending < expected:
        return
    publish_end_of_input(topo, ctx, bootstrap, pending)


def publish_end_of_input(topo: Topology, ctx: StageContext, bootstrap: str, held: int) -> int:
    """Call the last stage's ``end_of_input`` and publish what it returns to the output topic (every send
    confirmed); returns the number of micro-batches published."""
    from expstream.kafka.clients import make_producer, send_all_and_confirm
    from expstream.kafka.provenance import provenance_headers
    from schemas import encode
    from stages import end_of_input

    outputs = end_of_input(ctx)
    producer = make_producer(bootstrap, topo.kafka)
    try:
        send_all_and_confirm(producer, [(topo.output_topic, encode(b), b.batch_id.encode(),
                                         provenance_headers(ctx.stage.name, b.policy_version)) for b in outputs],
                             topo.kafka.produce_timeout_s)
    finally:
        producer.close(timeout=10)
    log.info("%s end of input: published %d held micro-batches, %d samples", ctx.stage.name, len(outputs), held)
    return len(outputs)


def print_summary(summary: dict, out_dir: Path) -> None:
    if summary.get("mode") == "continuous":
        print_continuous_summary(summary, out_dir)
        return
    print(f"run {summary['run_id']}: {summary['status']}")
    print(f"  prompts {summary['prompts']}, groups complete {summary['groups_complete']}, "
          f"samples {summary['samples']}, dropped (dynamic sampling) {summary['groups_dropped_dynamic_sampling']}, "
          f"dead letters {len(summary['dead_letters'])}")
    if summary["lost_groups"] or summary["foreign_samples"] or summary["rejected_records"]["count"]:
        print(f"  lost groups {len(summary['lost_groups'])} of {summary['prompts_fed']} fed "
              f"(allowed share {summary['max_lost_group_share']:g}), foreign samples {summary['foreign_samples']}, "
              f"rejected records {summary['rejected_records']['count']}"
              + (f" (kept in {out_dir / REJECTED_FILE})" if summary["rejected_records"]["count"] else ""))
    steady = summary["steady_samples_per_s"]
    first = summary["first_experience_after_s"]
    print(f"  first experience after {'n/a (none came)' if first is None else f'{first}s'}; steady state "
          + (f"{steady:.2f} samples/s" if steady is not None else "n/a (arrivals spanned under a second)"))
    print(f"  wall {summary['wall_s']:.1f}s, {summary['samples_per_s']:.2f} samples/s, "
          f"duplicates dropped {summary['duplicate_samples_dropped']}, restarts {summary['stage_restarts'] or 0}")
    print_scale_events(summary)
    for name, s in summary["stages"].items():
        print(f"  {name:<17} {s['batches']:>4} batches {s['samples']:>5} samples  {s['ms_per_batch']} ms/batch")
    print(f"  wrote {out_dir / 'experiences.msgpack'} and {out_dir / 'summary.json'}")



def print_scale_events(summary: dict) -> None:
    events = summary.get("scale_events") or []
    if events:
        print(f"  scale events {len(events)}: " + ", ".join(
            f"{e['stage']} {e['from']}->{e['to']} ({e['reason']}, {e['t_s']:.0f}s)" for e in events))


def print_continuous_summary(summary: dict, out_dir: Path) -> None:
    def reward(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    print(f"run {summary['run_id']} (continuous): {summary['status']}")
    print(f"  steps {summary['steps']}/{summary['max_steps']}, policy version {summary['final_policy_version']}, "
          f"max staleness {summary['max_staleness']}, reward first step {reward(summary['reward_first_step'])} "
          f"-> last step {reward(summary['reward_last_step'])}")
    print(f"  prompts fed {summary['prompts_fed']} ({summary['epochs_started']} epochs begun), samples generated "
          f"{summary['samples_generated']}, trained {summary['samples_trained']}, dropped stale "
          f"{summary['dropped_stale']}, wall {summary['wall_s']:.1f}s, restarts {summary['stage_restarts'] or 0}")
    print_scale_events(summary)
    for name, s in summary["stages"].items():
        print(f"  {name:<17} {s['batches']:>4} batches {s['samples']:>5} samples  {s['ms_per_batch']} ms/batch")
    print(f"  wrote {summary['train_jsonl'] + ', ' if Path(summary['train_jsonl']).exists() else ''}"
          f"{out_dir / 'summary.json'}"
          + (f", final weights {summary['final_weights']}" if summary["final_weights"] else ""))


__all__ = ["run_pipeline", "EXIT_CONFIG", "ConfigError"]
