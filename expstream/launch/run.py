"""``expstream run``: the embedded default (or existing services), end to end.

0. Lock the output directory (expstream.launch.rundir): a second run on it, or a directory holding a
   previous run without ``--force``, exits 2 before anything is started or written.
1. Build the built-in tiny models once, before any stage starts (the reward function and the
   model directories were checked by expstream.models.resolve right after loading the topology).
2. Start a local broker and redis-server on free loopback ports unless addresses were given
   (steps 2-4 and the stopping in step 7: expstream.launch.services.RunServices, a context manager).
3. Create every topic of the topology and its ``.dlq`` twin explicitly; write the resolved
   configuration to ``run/topology.yaml`` (what the stages read) and ``<output>/topology.yaml``.
4. Start every enabled stage replica as its own process under the supervisor. From here on the
   loop also answers ``expstream scale`` requests and runs the autoscalers (expstream/launch/scale.py);
   every scale event goes into ``summary.json`` (``scale_events``).
5. Feed the prompt file into the input topic (every send confirmed).
6. Collect experiences (deduped by sample id) until every prompt group is accounted for:
   emitted complete, dropped by dynamic sampling, or dead-lettered (steps 5-6:
   expstream/launch/collect.py).
7. Stop stages (SIGTERM, then SIGKILL after a grace period), then redis and the broker. With
   ``record`` on, the supervised ``recorder`` (started in step 4 with the stages, writing
   ``<output>/topics/``) is stopped after the stages, so it drains what they wrote last, and
   before the summary, which counts what it recorded.
8. Write ``experiences.msgpack`` and ``summary.json`` whatever happened (expstream.launch.outcome: a run
   that lost more than ``run.max_lost_group_share`` of its fed groups fails); print the summary
   (the outcome prints itself) and write the report.

With ``train.enabled`` (``--continuous``) steps 3-8 differ as expstream/launch/continuous.py describes:
the ``policy`` topic and the trainer process are added, the prompt file is fed epoch after epoch
under flow control instead of step 5-6, and the run ends when the trainer finishes; the trainer
and the stages are stopped before ``summary.json`` is written, and nothing is collected.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

from expstream.config.paths import resolve_run_paths
from expstream.config.topology import Topology
from expstream.errors import EXIT_CONFIG, EXIT_INTERRUPTED, ConfigError
from expstream.launch.collect import (
    FeedPlan,
    Progress,
    collect_experiences,
    flush_last_window,
    publish_end_of_input,
)
from expstream.launch.continuous import run_continuous
from expstream.launch.modelbuild import build_models_apart
from expstream.launch.outcome import ContinuousOutcome, RunOutcome
from expstream.launch.preflight import check_output_dir, check_services, check_stores
from expstream.launch.prompts import PromptRow, dead_letter_refused, has_media, read_prompts, store_media
from expstream.launch.rundir import claim_run_dir
from expstream.launch.services import FORK_ENTRY, RunServices, stage_argv, stage_env, write_resolved_topology
from expstream.launch.supervisor import SupervisorError
from expstream.models.media import MIB
from expstream.observe.timeline import Timeline

log = logging.getLogger("expstream.run")


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def install_interrupt_handler() -> dict[str, bool]:
    flag = {"stop": False}

    def _handler(signum: int, _frame) -> None:  # noqa: ANN001
        flag["stop"] = True
        print(f"\nexpstream: got signal {signum}; stopping every stage cleanly", file=sys.stderr)

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    return flag


def read_run_prompts(topo: Topology, args: argparse.Namespace) -> list[PromptRow]:
    """The prompt file; a bad one stops the run here (exit 2 from cli.main) before anything is started."""
    try:
        return read_prompts(args.prompts, media_root=getattr(args, "media_root", None) or topo.run.media_root,
                            media_max_mb=topo.run.media_max_mb)
    except OSError as exc:
        raise ConfigError(f"cannot read the prompt file {args.prompts!r} ({exc.strerror or exc})", field="--prompts",
                          fix="give an existing JSON-lines file, e.g. --prompts examples/prompts.jsonl") from exc


def run_pipeline(topo: Topology, args: argparse.Namespace) -> int:
    # Configuration first: a bad prompt file, model directory or reward function stops the run here
    # (exit 2 from cli.main) before any directory, broker, redis-server or stage is started.
    rows = read_run_prompts(topo, args)
    run_id = args.run_id or new_run_id()
    out_dir = Path(args.output or f"runs/{run_id}")
    # The outside world next, still before anything slow: a writable --output, and the broker and
    # Redis given on the command line answer (one line and exit 2, not 34 s of retries).
    check_output_dir(out_dir)
    check_services(args.bootstrap_servers, args.redis_url, topo.kafka)
    # the object stores this run will use (an s3:// store it would not touch is not a reason to stop it)
    check_stores({"train.weight_store": topo.train.weight_store if topo.train.enabled else None,
                  "run.blob_store": topo.run.blob_store if has_media(rows) else None})
    timeline = Timeline()
    with ExitStack() as stack:
        # Held until the summary is written (released last, or at process exit).
        stack.callback(claim_run_dir(out_dir, force=args.force, resume=args.resume).release)
        timeline.mark("config_checked")
        if topo.run.spawn == "fork":
            from expstream.launch import forkserver

            # imports torch/transformers once, while the models are checked and the broker and redis start
            # (the longest step before a stage can start); started already by `expstream run`
            # (expstream/__main__.py, before the command line's imports): a no-op then
            forkserver.warm_up_for(topo)
            timeline.mark("fork_server_started", at=forkserver.STARTED_AT)
        build_models_apart(topo)  # a child process builds them when the cache lacks them (torch stays out of here)
        timeline.mark("models_ready")
        resolve_run_paths(topo, out_dir, media=has_media(rows))  # the one place; the stages read topo.to_raw()
        (out_dir / "run").mkdir(parents=True, exist_ok=True)
        stop = install_interrupt_handler()
        outcome = ContinuousOutcome if topo.train.enabled else RunOutcome
        out = outcome(topo=topo, run_id=run_id, out_dir=out_dir, rows=len(rows), started=time.monotonic(),
                      timeline=timeline)
        report = not getattr(args, "no_report", False)
        with RunServices.start(topo, args, out_dir, out) as svc:
            store_run_media(svc, rows)
            run_loop(svc, rows, out, stop, progress_on=not args.no_progress)
    return finish(out, report=report)


def run_loop(svc: RunServices, rows: list[PromptRow], out: RunOutcome, stop: dict[str, bool],
             progress_on: bool) -> None:
    """Start the stages and run the finite or the continuous loop; whatever ends it is recorded in ``out``
    (never raised: the services' block then writes the outputs and stops everything)."""
    topo = svc.topo
    try:
        svc.launch()  # inside the try: a stage that cannot be started fails the run with its reason
        if isinstance(out, ContinuousOutcome):
            # prompts whose media were refused: dead-lettered once; the epochs feed the others
            fed_rows = dead_letter_refused(svc.bootstrap, topo.kafka, topo.topics.input, rows)
            run_continuous(topo, fed_rows, out, svc.supervisor, svc.state, svc.bootstrap, stop, scaler=svc.scaler)
        else:
            collect_experiences(svc, rows, out, stop, progress_on=progress_on)
    except SupervisorError as exc:
        out.fail(str(exc))
    except KeyboardInterrupt:
        out.status = EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - whatever broke, what was collected is written
        out.unexpected(exc)


def store_run_media(svc: RunServices, rows: list[PromptRow]) -> None:
    """The prompts' images and video frames into the run's blob store (claim checks), before the stages start."""
    if has_media(rows):
        from expstream.models.blobs import open_blob_store

        topo = svc.topo
        blobs = open_blob_store(topo.run.blob_store or "")
        stored = store_media(rows, blobs, max_bytes=int(topo.run.media_max_mb * MIB))
        log.info("run %s: %d images/videos stored in %s", svc.run_id, stored, blobs)


def finish(out: RunOutcome, report: bool) -> int:
    """Print the summary, write the report (never failing the run for it), say why the run failed."""
    out.print_summary()
    if report:
        try:
            from expstream.tools.report import write_report

            print(f"  wrote {write_report(out.out_dir)}")
        except Exception as exc:  # noqa: BLE001 - a report never fails a run
            log.warning("run %s: report not written: %s", out.run_id, exc)
    if out.error:
        print(f"expstream: run failed: {out.error}", file=sys.stderr)
    return out.status


__all__ = ["run_pipeline", "EXIT_CONFIG", "ConfigError", "FORK_ENTRY", "stage_argv", "stage_env",
           "write_resolved_topology", "FeedPlan", "Progress", "flush_last_window", "publish_end_of_input"]
