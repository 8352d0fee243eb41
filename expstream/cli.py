"""``expstream`` command line: run | stage | train | topics | models | dlq | record | show | diff | replay | rewind
| serve-reward.

Argument parsing and dispatch only; each command's work lives in its module (``expstream.launch.run``,
``expstream.launch.replica``, ``expstream.kafka.topics``, ``expstream.tools.dlq``), imported when the command runs.

Exit codes (``expstream.errors``): 0 done, 1 the run failed (a stage could not be kept alive, or a
timeout; or a service did not answer: one line saying so, never a traceback), 2 a configuration
error (the message names the field and the fix), 130 interrupted by Ctrl-C after a clean shutdown,
141 the reader of the output went away (``expstream ... | head``: standard output is closed quietly,
as a program killed by SIGPIPE would end).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from expstream.config.redaction import REDIS_URL_ENV, env_redis_url
from expstream.config.topology import Topology, find_topology, load_topology
from expstream.errors import EXIT_BROKEN_PIPE, EXIT_CONFIG, EXIT_FAILED, EXIT_OK, ConfigError, ExpstreamError
from expstream.models.resolve import check_models, model_dir


def _setup_logging(level: str = "INFO", stream=None) -> None:  # noqa: ANN001
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=stream or sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)


def _add_topology_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--topology", help="topology YAML (default: ./topology.yaml when present, else the packaged copy)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="override a topology value; repeatable")
    p.add_argument("--bootstrap-servers", help="Kafka HOST:PORT; default: start a local broker")
    p.add_argument("--redis-url", help=f"redis://[:PASSWORD@]HOST:PORT/DB; default: ${REDIS_URL_ENV}, else start a local "
                   f"redis-server (put a password in ${REDIS_URL_ENV}, not on the command line: `ps` shows it)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expstream", description="Streaming RLHF experience maker")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the whole pipeline on a prompt file")
    _add_topology_args(run)
    run.add_argument("--prompts", required=True, help="JSON-lines prompt file")
    run.add_argument("--media-root", metavar="DIR",
                     help="image/video paths of the prompt file must resolve inside DIR (default: the prompt file's "
                          "directory; = --set run.media_root=DIR; docs/vision.md)")
    run.add_argument("--output", help="output directory (default runs/<run id>)")
    run.add_argument("--run-id", help="names consumer groups and Redis keys (default: fresh)")
    reuse = run.add_mutually_exclusive_group()
    reuse.add_argument("--force", action="store_true",
                       help="--output holds a previous run: delete it and start fresh")
    reuse.add_argument("--resume", action="store_true",
                       help="--output holds a previous run: continue it (not supported yet: refused with the reason)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--no-report", action="store_true", help="do not write report.html at the end (expstream report)")
    run.add_argument("--continuous", action="store_true",
                     help="asynchronous RL: feed the prompts epoch after epoch and train on the experiences with "
                          "`expstream train` until train.max_steps (= --set train.enabled=true; docs/async.md)")

    stage = sub.add_parser("stage", help="run one stage replica (what `run` starts per stage)")
    _add_topology_args(stage)
    stage.add_argument("name", help="stage name, e.g. generate")
    stage.add_argument("--run-id", default="prod")
    stage.add_argument("--replica-id", default=os.environ.get("EXPSTREAM_REPLICA_ID") or socket.gethostname(),
                       help="names this replica in heartbeats (default: $EXPSTREAM_REPLICA_ID or the host name)")

    train = sub.add_parser("train", help="the reference trainer of the continuous loop (docs/async.md)")
    _add_topology_args(train)
    train.add_argument("--run-id", default="prod", help="the run whose experiences it trains on (Redis keys, group)")
    train.add_argument("--output", required=True,
                       help="directory for train.jsonl, train/checkpoint, final/ (and weights/ by default)")

    topics = sub.add_parser("topics", help="create or list the topology's topics (and .dlq twins); tail one")
    topics.add_argument("action", choices=["create", "list", "tail"])
    topics.add_argument("topic", nargs="?", help="tail: the topic to print, e.g. experiences or batches.dlq")
    _add_topology_args(topics)
    from expstream.tools.tail import add_tail_args

    add_tail_args(topics)

    models = sub.add_parser("models", help="build the built-in tiny offline models")
    models.add_argument("action", choices=["build"])
    _add_topology_args(models)

    from expstream.tools.dlq import add_dlq_parser

    add_dlq_parser(sub, _add_topology_args)
    from expstream.tools.diff import add_diff_parser
    from expstream.tools.recorder import add_record_parser
    from expstream.tools.replay import add_replay_parser
    from expstream.tools.show import add_show_parser

    add_show_parser(sub, _add_topology_args)
    add_diff_parser(sub, _add_topology_args)
    add_replay_parser(sub, _add_topology_args)
    add_record_parser(sub, _add_topology_args)
    from expstream.tools.rewind import add_rewind_parser

    add_rewind_parser(sub, _add_topology_args)
    from expstream.rewards.server import add_serve_reward_parser

    add_serve_reward_parser(sub)
    from expstream.launch.scale import add_scale_parser

    add_scale_parser(sub)
    from expstream.tools.status import add_status_parser

    add_status_parser(sub)
    from expstream.tools.report import add_report_parser

    add_report_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # inside the try: a reader gone since the last write fails here, not at exit
        return code
    except BrokenPipeError:
        # `expstream ... | head`: the reader has what it wanted. Point stdout at /dev/null so that the
        # interpreter's own flush at exit does not raise again, and end like a SIGPIPE'd program.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "redis_url", "absent") is None:  # the flag wins; a password need not be typed on it
        args.redis_url = env_redis_url()
    _setup_logging(os.environ.get("EXPSTREAM_LOG_LEVEL", "INFO"))
    try:
        if args.command == "show":  # these read a run directory: its recorded topology, not ./topology.yaml
            from expstream.tools.show import show_command

            return show_command(args)
        if args.command == "diff":
            from expstream.tools.diff import diff_command

            return diff_command(args)
        if args.command == "scale":  # talks to a running run through its directory (its own topology)
            from expstream.launch.scale import scale_command

            return scale_command(args)
        if args.command == "status":
            from expstream.tools.status import status_command

            return status_command(args)
        if args.command == "report":
            from expstream.tools.report import report_command

            return report_command(args)
        if args.command == "replay":  # reads the recorded configuration, not ./topology.yaml
            from expstream.tools.replay import replay_command
            from expstream.tools.replaybroker import broker_replay  # handed in: replaybroker imports replay

            return replay_command(args, broker_replay=broker_replay)
        if args.command == "serve-reward":  # no topology: the flags say everything
            from expstream.rewards.server import serve_reward_command

            return serve_reward_command(args)
        if getattr(args, "continuous", False):
            args.overrides.append("train.enabled=true")  # last, so it wins over a --set train.enabled=false
        topo = load_topology(find_topology(args.topology), args.overrides)
        if args.command == "run":
            if topo.run.spawn == "fork":  # the fork server's seconds of torch imports start now, beside
                from expstream.launch.forkserver import (
                    warm_up_for,  # ours and the checks (dies with this process)
                )

                warm_up_for(topo)
            check_models(topo)
            from expstream.launch.run import run_pipeline

            return run_pipeline(topo, args)
        if args.command in ("stage", "train"):
            return _run_process(topo, args)
        if args.command == "topics" and args.action == "tail":
            from expstream.tools.tail import tail_command

            return tail_command(topo, args)
        if args.command == "topics":
            from expstream.kafka.topics import topics_command

            return topics_command(topo, args)
        if args.command == "dlq":
            from expstream.tools.dlq import dlq_command

            return dlq_command(topo, args)
        if args.command == "rewind":
            from expstream.tools.rewind import rewind_command

            return rewind_command(topo, args)
        if args.command == "record":
            from expstream.tools.recorder import record_command

            return record_command(topo, args)
        if args.command == "models":
            for role in ("tokenizer", "actor", "critic", "reward"):
                if getattr(topo.models, role):
                    print(f"{role}: {model_dir(topo, role)}")
            return EXIT_OK
    except ConfigError as exc:
        print(f"expstream: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ExpstreamError as exc:  # a service away (not retried further here), a stop request: one line
        again = "retriable: try again once it answers" if exc.retriable else "not retriable"
        print(f"expstream: {type(exc).__name__}: {exc} ({again})", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_FAILED


def _run_process(topo: Topology, args: argparse.Namespace) -> int:
    """``stage`` and ``train``: the process a supervisor starts. Code that cannot be imported (a syntax
    error, a missing module) is reported as one line and exit 2, which the supervisor does not restart:
    the same import fails again however often it is retried (expstream/launch/supervisor.py)."""
    try:
        if args.command == "stage":
            from expstream.launch.replica import run_stage

            return run_stage(topo, args)
        from expstream.train import run_trainer

        return run_trainer(topo, args)
    except (ImportError, SyntaxError) as exc:  # a SyntaxError's text names the file and line
        what = f"stage {args.name}" if args.command == "stage" else "the trainer"
        print(f"expstream: {what}: cannot import its code: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_CONFIG


if __name__ == "__main__":
    sys.exit(main())
