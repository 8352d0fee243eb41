"""``expstream stage NAME``: one stage replica process (what ``expstream run`` starts per replica,
and what docker-compose runs per container).

It names itself in ``ps`` first (``expstream stage reward[1] run=<id>``), installs the SIGTERM
handler before the slow model load, then hands the stage's ``process`` to the shared runner.

Stopping. SIGTERM/SIGINT finish the micro-batch in hand and commit it, except a generation in
progress: the generator checks ``ctx.should_stop`` between tokens and abandons the micro-batch
uncommitted (it is redelivered), so a stop takes one decoding step, not a whole long generation.
Started by the supervisor (``EXPSTREAM_EXIT_WITH_PARENT=1``), the process also stops itself when
its parent is gone (SIGTERM to itself; ``os._exit`` after ``ORPHAN_EXIT_S`` if that hangs), the
belt and braces behind ``PDEATHSIG`` (expstream/procs.py).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import threading
import time
from typing import Any

from expstream.config.chains import CHAIN_SEP, Unit, unit_of
from expstream.config.topology import Topology
from expstream.errors import EXIT_FAILED, EXIT_OK, ConfigError, ExpstreamError
from expstream.faults import RUNNER_POINTS, fault_plan
from expstream.launch.supervisor import STOP_GRACE_S
from expstream.procs import EXIT_WITH_PARENT_ENV, set_stage_title, watch_parent

log = logging.getLogger("expstream")

# Why the supervisor's grace: an orphaned stage gets the time a supervised stop would give it (one
# forward pass, a producer flush against a broker that may be gone too) before it exits hard.
ORPHAN_EXIT_S = STOP_GRACE_S


def _stop_when_orphaned(label: str) -> None:
    """The parent is gone: stop like on SIGTERM, and exit hard if that has not ended us in ORPHAN_EXIT_S."""

    def on_orphan(parent: int) -> None:
        log.error("stage %s: parent process %d is gone (now %d); stopping", label, parent, os.getppid())
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(ORPHAN_EXIT_S, os._exit, args=(EXIT_FAILED,)).start()

    watch_parent(on_orphan)


def stage_unit(topo: Topology, name: str) -> Unit:
    """The unit ``expstream stage NAME`` runs: a stage alone, or a chain named ``a+b`` (expstream/config/chains.py)."""
    from stages import STAGES

    unit = unit_of(topo, name)
    if unit is not None and (name == unit.name or not unit.chained):
        return unit
    if unit is not None:
        raise ConfigError(f"stage {name}: runs in the chain {unit.name} of this topology; start the chain",
                          field="NAME", fix=f"expstream stage {unit.name}")
    if all(n in STAGES for n in name.split(CHAIN_SEP)) and all(n in topo.stages for n in name.split(CHAIN_SEP)):
        if any(not topo.stages[n].enabled for n in name.split(CHAIN_SEP)):
            raise ConfigError(f"stage {name}: switched off by this topology (e.g. critic is used by gae only)")
        raise ConfigError(f"stage {name}: no such chain in this topology's chains: {topo.chains}", field="NAME",
                          fix="name a stage, or a chain as its enabled stages joined by '+'")
    raise ConfigError(f"stage {name!r}: unknown; stages are {', '.join(STAGES)}")


def run_stage(topo: Topology, args: argparse.Namespace) -> int:
    """One replica of a stage (or of a chain of stages): set up models, then the shared runner until SIGTERM."""
    set_stage_title(args.name, args.replica_id, args.run_id)  # before the seconds of imports below
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":
        _stop_when_orphaned(f"{args.name}[{args.replica_id}]")
    import torch

    from stages import STAGES, teardown
    from stages.assigning import parse_assignment
    from stages.chain import Chain
    from stages.context import StageContext
    from stages.runner import StageRunner

    if args.name in STAGES and args.name not in topo.stages:  # the environment stage without an environment block
        raise ConfigError(f"stage {args.name}: this topology has no environment block (docs/multi_turn.md)")
    unit = stage_unit(topo, args.name)
    if not args.bootstrap_servers:
        raise ConfigError("--bootstrap-servers: a stage process needs the broker address")
    assignment = parse_assignment(args.assign) if getattr(args, "assign", None) else None  # before Redis is tried
    torch.set_num_threads(topo.run.torch_threads)
    from expstream.state import MemoryState, RedisState, State

    state: State
    if args.redis_url:
        state = RedisState(args.redis_url, args.run_id, group_ttl_s=topo.redis.group_ttl_s,
                           dedupe_window_s=topo.redis.dedupe_window_s, wait_replicas=topo.redis.wait_replicas,
                           wait_timeout_ms=topo.redis.wait_timeout_ms)
    else:
        state = MemoryState(args.run_id, group_ttl_s=topo.redis.group_ttl_s,
                            dedupe_window_s=topo.redis.dedupe_window_s)
        log.warning("stage %s replica %s: no --redis-url, so its state (groups, moments, KL) is private to "
                    "this process: run one replica per stage or pass --redis-url", args.name, args.replica_id)
    stage = Chain.runner_stage(unit, topo) if unit.chained else topo.stages[unit.head]
    ctx = StageContext(topology=topo, stage=stage, state=state, log=logging.getLogger(f"expstream.stage.{unit.name}"),
                       run_id=args.run_id, replica_id=args.replica_id)
    if unit.chained:
        chain = Chain(unit, ctx)
        runner = StageRunner(ctx, chain.process, args.bootstrap_servers, committed=chain.committed,
                             stage_rows=chain.rows, produced_by=unit.last, label=unit.name, assignment=assignment)
        runner.fault = fault_plan(unit.name, RUNNER_POINTS)  # EXPSTREAM_FAULT names the chain, as the supervisor
        chain.bind(ctx)
        setup, close = chain.setup, chain.teardown
    else:
        module = STAGES[unit.head]
        runner = StageRunner(ctx, module.process, args.bootstrap_servers, committed=getattr(module, "committed", None),
                             assignment=assignment)
        setup, close = functools.partial(module.setup, ctx), functools.partial(teardown, ctx)
    ctx.should_stop = lambda: runner.stop_requested  # checked between generated tokens
    runner.install_signal_handlers()  # before the (slow) model load so SIGTERM is never lost
    turns = None if unit.chained else turns_runner(ctx, module.process, runner, args.bootstrap_servers, assignment)
    started = time.monotonic()
    # setup inside the try/finally: what it built before a SIGTERM (the handler lets it finish) or an
    # error, such as a vLLM engine, is torn down too; every stage's teardown copes with a partial setup
    runner.start_joining()  # the group join (seconds on a new group) overlaps the model load
    if turns is not None:
        turns.start_joining()
    try:
        setup()
        log.info("stage %s replica %s: ready in %.2fs", args.name, args.replica_id, time.monotonic() - started)
        if runner.stop_requested:
            runner.stop_before_run()
            if turns is not None:
                turns.stop_before_run()
            return EXIT_OK
        try:
            return run_both(runner, turns)
        except ExpstreamError as exc:
            log.error("stage %s: %s: %s", args.name, type(exc).__name__, exc)
            return EXIT_FAILED
    finally:
        close()  # the stage's own resources (HTTP sessions, thread pools, an engine), after the last commit


def turns_runner(ctx: Any, process: Any, main: Any, bootstrap: str, assignment: tuple[int, int] | None = None) -> Any:
    """generate of a multi-turn run (docs/multi_turn.md): a second runner in the replica, consuming the turns
    topic as the consumer group ``<generate's>.turns`` and sharing the models, so that an unfinished episode
    never waits behind a prompt record that admission control holds back (the episodes in flight are what
    must finish for the trainer to step and admission to open again). None for any other stage.
    ``assignment``: the replica's ``--assign``, applied to the turns topic's partitions alike."""
    if ctx.stage.name != "generate" or ctx.topology.environment is None:
        return None
    import dataclasses

    from expstream.kafka.topics import TURNS_GROUP_SUFFIX
    from stages.runner import StageRunner

    tctx = dataclasses.replace(ctx, stage=dataclasses.replace(ctx.stage, input=ctx.topology.environment.turns_topic))
    return StageRunner(tctx, process, bootstrap, group_suffix=TURNS_GROUP_SUFFIX, metrics=False, stop=main.stop_event,
                       assignment=assignment)


def run_both(runner: Any, turns: Any) -> int:
    """``runner.run()``, with ``turns.run()`` (when there is one) on a thread beside it until both stop."""
    if turns is None:
        return runner.run()
    result: list[BaseException] = []

    def run_turns() -> None:
        try:
            turns.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            result.append(exc)
            runner.stop_event.set()

    thread = threading.Thread(target=run_turns, name="generate-turns", daemon=True)
    thread.start()
    try:
        code = runner.run()
    finally:
        runner.stop_event.set()
        thread.join()
    if result:
        raise result[0]
    return code
