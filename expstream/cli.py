"""``expstream`` command line: run | stage | topics | models | dlq.

Exit codes: 0 done, 1 the run failed (a stage could not be kept alive, or a timeout), 2 a
configuration error (the message names the field and the fix), 130 interrupted by Ctrl-C after
a clean shutdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import yaml

from expstream.errors import ConfigError, ExpstreamError
from expstream.topology import Topology, load_topology

log = logging.getLogger("expstream")
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 0, 1, 2, 130


def _setup_logging(level: str = "INFO", stream=None) -> None:  # noqa: ANN001
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=stream or sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", help="topology YAML (default: the packaged expstream/topology.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="override a topology value; repeatable")
    p.add_argument("--bootstrap-servers", help="Kafka HOST:PORT; default: start a local broker")
    p.add_argument("--redis-url", help="redis://HOST:PORT/DB; default: start a local redis-server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expstream", description="Streaming RLHF experience maker")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the whole pipeline on a prompt file")
    _add_topology_args(run)
    run.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    run.add_argument("--output", help="output directory (default runs/<run id>)")
    run.add_argument("--run-id", help="names consumer groups and Redis keys (default: fresh)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    stage = sub.add_parser("stage", help="run one stage replica (what `run` starts per stage)")
    _add_topology_args(stage)
    stage.add_argument("name", help="stage name, e.g. generate")
    stage.add_argument("--run-id", default="prod")
    stage.add_argument("--replica-id", default=os.environ.get("EXPSTREAM_REPLICA_ID") or socket.gethostname(),
                       help="names this replica in heartbeats (default: $EXPSTREAM_REPLICA_ID or the host name)")

    topics = sub.add_parser("topics", help="create the topology's topics (and .dlq twins)")
    topics.add_argument("action", choices=["create", "list"])
    _add_topology_args(topics)

    models = sub.add_parser("models", help="build the built-in tiny offline models")
    models.add_argument("action", choices=["build"])
    _add_topology_args(models)

    from expstream.dlq import add_dlq_parser

    add_dlq_parser(sub, _add_topology_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(os.environ.get("EXPSTREAM_LOG_LEVEL", "INFO"))
    try:
        topo = load_topology(args.topology, args.overrides)
        if args.command == "run":
            from expstream.run import run_pipeline

            return run_pipeline(topo, args)
        if args.command == "stage":
            return run_stage(topo, args)
        if args.command == "topics":
            return topics_command(topo, args)
        if args.command == "dlq":
            from expstream.dlq import dlq_command

            return dlq_command(topo, args)
        if args.command == "models":
            from stages.common import model_dir

            for role in ("tokenizer", "actor", "critic", "reward"):
                if getattr(topo.models, role):
                    print(f"{role}: {model_dir(topo, role)}")
            return EXIT_OK
    except ConfigError as exc:
        print(f"expstream: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return EXIT_FAILED


def topics_command(topo: Topology, args: argparse.Namespace) -> int:
    from expstream.localservers import create_topics

    if not args.bootstrap_servers:
        raise ConfigError("--bootstrap-servers: needed to create topics, e.g. --bootstrap-servers kafka:9092")
    topics = topo.all_topics()
    if args.action == "create":
        create_topics(args.bootstrap_servers, topics, with_dlq=True)
    for name, parts in topics.items():
        print(f"{name}\t{parts} partitions (+ {name}.dlq)")
    return EXIT_OK


def run_stage(topo: Topology, args: argparse.Namespace) -> int:
    """One stage replica: set up models, then the shared runner until SIGTERM."""
    import torch

    from stages import STAGES
    from stages.context import StageContext
    from stages.runner import StageRunner

    if args.name not in STAGES:
        raise ConfigError(f"stage {args.name!r}: unknown; stages are {', '.join(STAGES)}")
    if not topo.stages[args.name].enabled:
        raise ConfigError(f"stage {args.name}: switched off by this topology (e.g. critic is used by gae only)")
    if not args.bootstrap_servers:
        raise ConfigError("--bootstrap-servers: a stage process needs the broker address")
    torch.set_num_threads(topo.run.torch_threads)
    state = None
    if args.redis_url:
        from expstream.state import RedisState

        state = RedisState(args.redis_url, args.run_id)
    module = STAGES[args.name]
    ctx = StageContext(topology=topo, stage=topo.stages[args.name], state=state,
                       log=logging.getLogger(f"expstream.stage.{args.name}"), run_id=args.run_id,
                       replica_id=args.replica_id)
    runner = StageRunner(ctx, module.process, args.bootstrap_servers)
    runner.install_signal_handlers()  # before the (slow) model load so SIGTERM is never lost
    started = time.monotonic()
    module.setup(ctx)
    log.info("stage %s replica %s: ready in %.2fs", args.name, args.replica_id, time.monotonic() - started)
    if runner.stop_requested:
        return EXIT_OK
    try:
        return runner.run()
    except ExpstreamError as exc:
        log.error("stage %s: %s: %s", args.name, type(exc).__name__, exc)
        return EXIT_FAILED


def new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:6]


def write_resolved_topology(topo: Topology, path: Path) -> None:
    path.write_text(yaml.safe_dump(topo.raw, sort_keys=False))


def install_interrupt_handler() -> dict[str, bool]:
    flag = {"stop": False}

    def _handler(signum: int, _frame) -> None:  # noqa: ANN001
        flag["stop"] = True
        print(f"\nexpstream: got signal {signum}; stopping every stage cleanly", file=sys.stderr)

    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)
    return flag


def dump_json(obj: object, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
