"""The services of one ``expstream run``, started together and stopped in order (:class:`RunServices`).

Steps 2-4 of expstream/launch/run.py: the broker and redis-server (local ones unless addresses were
given), the run's state in Redis, the topics, the resolved topology the child processes read, the
supervisor with the stages (and the trainer, the recorder), the scaler and the status sampler.
Both the finite run (expstream/launch/collect.py) and the continuous one
(expstream/launch/continuous.py) run inside ``with RunServices.start(topo, args, out_dir, out) as
svc:``. Leaving the block, whatever ended it, first stops the status sampler (and, when their
output goes into the summary, the trainer and the recorder with the stages), then writes the
run's outputs (expstream/launch/outcome.py) while Redis still answers, then stops the stages,
redis-server and the broker, in that order.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from expstream.config.redaction import (
    REDIS_URL_ENV,
    TOPOLOGY_SECRETS_ENV,
    redact_url,
    split_secrets,
    url_password,
)
from expstream.config.topology import Topology
from expstream.kafka.topics import create_topics, loop_topics
from expstream.launch.continuous import TRAINER, trainer_argv
from expstream.launch.outcome import RunOutcome, dump_json
from expstream.launch.scale import Scaler, lag_reader
from expstream.launch.supervisor import Supervisor
from expstream.observe.metrics import METRICS_DIR_ENV, forget_replica, serve_supervisor
from expstream.observe.metrics import enabled as metrics_enabled
from expstream.observe.timeline import STARTUP_DIR, STARTUP_DIR_ENV, Timeline
from expstream.tools.recorder import RECORDER, record_topics, recorder_argv
from expstream.tools.recording import TOPICS_DIR
from expstream.tools.status import StatusSampler

if TYPE_CHECKING:
    from expstream.state import RedisState

log = logging.getLogger("expstream.run")
#: What a stage process forked from the fork server runs (the ``python -m expstream`` entry point):
#: named here, so the fork server never imports the command line that imports this module.
FORK_ENTRY = "expstream.cli:main"


def write_resolved_topology(topo: Topology, path: Path) -> None:
    """The topology as the stages read it (``Topology.to_raw``), every URL's credentials redacted (the
    stages get them from :func:`stage_env`; expstream/config/redaction.py)."""
    path.write_text(yaml.safe_dump(split_secrets(topo.to_raw())[0], sort_keys=False))


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


def assigns_partitions(topo: Topology, *, own_broker: bool) -> bool:
    """Whether the run starts replicas with ``--assign`` (stages/assigning.py): ``run.assign_partitions``;
    null: only with the run's own broker. On a shared one (``--bootstrap-servers``) replicas started
    elsewhere may join a stage's group (docs/deploy.md "Adding machines"): membership is not known."""
    assign = topo.run.assign_partitions
    return bool(assign) if assign is not None else own_broker


class RunServices:
    """What one run has started; built by :meth:`start` only (a context manager), read by the run loops."""

    def __init__(self, topo: Topology, args: argparse.Namespace, out_dir: Path, out: RunOutcome,
                 stack: ExitStack) -> None:
        self.topo, self.out_dir, self.out, self.stack = topo, out_dir, out, stack
        self.run_id = out.run_id
        self.run_dir = out_dir / "run"
        self.topo_path = self.run_dir / "topology.yaml"
        self.own_broker, self.own_redis = not args.bootstrap_servers, not args.redis_url
        self.bootstrap: str = args.bootstrap_servers or ""
        self.redis_url: str = args.redis_url or ""
        self.recording = topo.record.is_on(own_broker=self.own_broker)
        self.pids: dict[str, int | None] = {}
        # unit -> the replica count it was started with, while its replicas take their partitions by hand
        # (run.assign_partitions, stages/assigning.py); a scale restarts the unit with the new count (reassign)
        self.assigned: dict[str, int] = {}
        self.timeline = out.timeline if out.timeline is not None else Timeline()
        # set by start(), before the block is entered
        self.state: RedisState
        self.supervisor: Supervisor
        self.scaler: Scaler
        self.sampler: StatusSampler

    @classmethod
    @contextmanager
    def start(cls, topo: Topology, args: argparse.Namespace, out_dir: Path, out: RunOutcome) -> Iterator[RunServices]:
        """Steps 2-4 up to the stages' start (:meth:`launch` starts them); the module docstring says what
        leaving the block stops and writes, in which order, whatever ended it."""
        with ExitStack() as stack:
            stack.push(out.on_exit)  # outputs even when setting up fails (a no-op once written)
            svc = cls(topo, args, out_dir, out, stack)
            svc.start_servers()
            # Once more, now that Redis is up: a failure from here on writes the outputs while Redis still
            # answers (the hook above runs after the servers stopped, and would wait out Redis retries for
            # a minute reading the stage statistics). Whichever runs first writes; the other is a no-op.
            stack.push(out.on_exit)
            svc.prepare()
            svc.build_supervisor()
            try:
                yield svc
            except BaseException as exc:
                out.note_exception(exc)
                raise
            finally:
                svc.wind_down()

    def start_servers(self) -> None:
        """The local broker and redis-server unless addresses were given; each stopped when the block is left."""
        timeline = self.timeline
        if self.own_broker:
            from expstream.launch.localservers import LocalBroker

            broker = LocalBroker(self.run_dir)
            self.bootstrap = broker.start()
            timeline.mark("broker_ready")
            self.stack.callback(broker.stop)
            self.pids["broker_pid"] = broker.pid
            log.info("local broker at %s (log %s)", self.bootstrap, self.run_dir / "broker.log")
        self.out.bootstrap = self.bootstrap
        if self.own_redis:
            from expstream.launch.localservers import LocalRedis

            redis = LocalRedis(self.run_dir)
            self.redis_url = redis.start()
            timeline.mark("redis_ready")
            self.stack.callback(redis.stop)
            self.pids["redis_pid"] = redis.pid
            log.info("local redis at %s", redact_url(self.redis_url))
        self.out.redis_url, self.out.secret = redact_url(self.redis_url), url_password(self.redis_url)

    def prepare(self) -> None:
        """services.json, the topics, the run's state, and the topology the child processes read."""
        topo, out_dir = self.topo, self.out_dir
        # Shown, so redacted: whoever resumes or inspects the run passes the password again.
        dump_json({"run_id": self.run_id, "bootstrap_servers": self.bootstrap, "redis_url": redact_url(self.redis_url),
                   **self.pids}, self.run_dir / "services.json")
        create_topics(self.bootstrap, topo.all_topics(), with_dlq=True)
        if topo.train.enabled:
            create_topics(self.bootstrap, loop_topics(topo), with_dlq=False)
            log.info("run %s: continuous; weight store %s, trainer output %s", self.run_id, topo.train.weight_store,
                     out_dir)
        self.timeline.mark("topics_created")
        from expstream.state import RedisState

        self.state = self.out.state = RedisState(self.redis_url, self.run_id)
        write_resolved_topology(topo, self.topo_path)
        write_resolved_topology(topo, out_dir / "topology.yaml")  # the run directory's copy (replay reads it)

    def build_supervisor(self) -> None:
        """Every enabled stage replica, the trainer (continuous), the recorder (recording); the scaler and
        the status sampler. Nothing is started yet (:meth:`launch`)."""
        topo, run_dir, out_dir = self.topo, self.run_dir, self.out_dir
        env = {"OMP_NUM_THREADS": str(topo.run.torch_threads), "TOKENIZERS_PARALLELISM": "false",
               METRICS_DIR_ENV: str(run_dir / "metrics"), STARTUP_DIR_ENV: str(run_dir / STARTUP_DIR),
               **stage_env(self.redis_url, topo)}
        sup = self.supervisor = self.out.supervisor = Supervisor(
            run_dir / "logs", max_restarts=topo.run.max_restarts, spawn=topo.run.spawn, fork_entry=FORK_ENTRY, env=env,
            # a replica gone for good leaves no metrics file behind (expstream/observe/metrics.py)
            on_gone=functools.partial(forget_replica, run_dir / "metrics"))
        serve_supervisor(sup, run_dir / "metrics")  # expstream_restarts_total (docs/observability.md)
        if assigns_partitions(topo, own_broker=self.own_broker):
            self.assigned = {u.name: topo.stages[u.head].replicas for u in topo.units()}
        for unit in topo.units():  # a chain is one process per replica (expstream/config/chains.py)
            for replica in range(topo.stages[unit.head].replicas):
                sup.add(unit.name, replica, self.stage_argv(unit.name, replica))
        if topo.train.enabled:
            sup.add(TRAINER, 0, trainer_argv(self.topo_path, self.bootstrap, self.run_id, out_dir), one_shot=True)
        if self.recording:  # stopped after the stages, so it drains what they wrote last (expstream/tools/recorder.py)
            topics = record_topics(topo)
            sup.add(RECORDER, 0, recorder_argv(self.topo_path, self.bootstrap, topics, out_dir, self.run_id),
                    stop_last=True)
            self.out.recording_dir = out_dir
            log.info("run %s: recording %s into %s", self.run_id, ", ".join(topics), out_dir / TOPICS_DIR)
        # `expstream scale` requests and the autoscalers, answered from the run loops (expstream/launch/scale.py)
        self.scaler = self.out.scaler = Scaler(topo, sup, out_dir, self.stage_argv,
                                               lag_reader(topo, self.bootstrap, self.run_id), started=self.out.started,
                                               reassign=self.reassign)
        self.stack.callback(sup.stop)  # before the start: a start that fails half-way stops what it started
        # one status snapshot per STATUS_INTERVAL_S into <output>/status.jsonl (expstream status, report)
        self.sampler = StatusSampler(topo, self.bootstrap, self.redis_url, self.run_id, out_dir)

    def stage_argv(self, name: str, replica: int) -> list[str]:
        """Replica ``replica`` of unit ``name``'s command line; ``--assign replica/n`` while the unit's
        partitions are assigned by hand (stages/assigning.py)."""
        argv = stage_argv(self.topo_path, name, replica, self.bootstrap, self.run_id)
        count = self.assigned.get(name)
        return argv if count is None else [*argv, "--assign", f"{replica}/{count}"]

    def reassign(self, name: str, count: int) -> int | None:
        """A change of unit ``name``'s replica count while its partitions are assigned by hand: every
        replica is stopped and ``count`` start again, each with its new share (Supervisor.reassign).
        Returns the count before, or None for a unit whose replicas are consumer-group members (the
        caller scales it the group's way: started or retired, the group's rebalances share the partitions)."""
        if name not in self.assigned:
            return None
        log.info("run %s: %s is scaled to %d replicas: each takes its new share of the partitions", self.run_id,
                 name, count)
        self.assigned[name] = count  # before the start: stage_argv reads it
        return self.supervisor.reassign(name, count, lambda replica: self.stage_argv(name, replica))

    def launch(self) -> None:
        """Start every supervised process (one that cannot be started raises SupervisorError with its
        reason) and the status sampler."""
        self.supervisor.start()
        self.timeline.mark("stages_spawned")
        if metrics_enabled():
            self.sampler.start()

    def callback(self, fn: Callable[[], object]) -> None:
        """Call ``fn`` when the block is left, after the outputs are written, before the stages stop."""
        self.stack.callback(fn)

    def wind_down(self) -> None:
        """Leaving the block: the sampler; the trainer and the recorder with the stages when the summary
        reads their output (the trainer's last steps in train.jsonl, the recorder's closed files); then
        the outputs, written while Redis still answers. The stack stops the rest."""
        self.timeline.mark("stopping")
        self.sampler.stop()
        if self.topo.train.enabled or self.recording:
            self.supervisor.stop()
        self.out.write()  # experiences.msgpack and summary.json, whatever happened
