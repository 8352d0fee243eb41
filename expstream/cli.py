"""``expstream`` command line: run | stage | train | topics | models | dlq | record | show | diff | replay | rewind
| serve-reward | scale | status | report | k8s | feed.

Argument parsing and dispatch only, from a table: each command module contributes an
``expstream.config.cli_args.Command`` (its name, help, arguments, entry function, and whether it reads
the topology: ``./topology.yaml`` / ``--topology`` / ``--set``, or a run directory's recorded one).
The modules of the table import no torch; a command's heavy work is imported when it runs.

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
import sys

from expstream.config.cli_args import Command
from expstream.config.redaction import env_redis_url
from expstream.config.topology import find_topology, load_topology
from expstream.errors import EXIT_BROKEN_PIPE, EXIT_CONFIG, EXIT_FAILED, ConfigError, ExpstreamError
from expstream.kafka.logfilter import install_close_race_filter
from expstream.launch.commands import RUN, STAGE, TRAIN
from expstream.launch.feed import FEED
from expstream.launch.k8s import K8S
from expstream.launch.scale import SCALE
from expstream.models.resolve import MODELS
from expstream.rewards.server import SERVE_REWARD
from expstream.tools.diff import DIFF
from expstream.tools.dlq import DLQ
from expstream.tools.recorder import RECORD
from expstream.tools.replay_command import REPLAY
from expstream.tools.report import REPORT
from expstream.tools.rewind import REWIND
from expstream.tools.show import SHOW
from expstream.tools.status import STATUS
from expstream.tools.tail import TOPICS

#: The subcommands, in the order ``expstream --help`` lists them.
COMMANDS: tuple[Command, ...] = (RUN, STAGE, TRAIN, TOPICS, MODELS, DLQ, SHOW, DIFF, REPLAY, RECORD, REWIND,
                                 SERVE_REWARD, SCALE, STATUS, REPORT, K8S, FEED)


def setup_logging(level: str = "INFO", stream=None) -> None:  # noqa: ANN001
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), stream=stream or sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)
    install_close_race_filter()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expstream", description="Streaming RLHF experience maker")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_arguments(sub.add_parser(command.name, help=command.help, description=command.description))
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
    setup_logging(os.environ.get("EXPSTREAM_LOG_LEVEL", "INFO"))
    command = next(c for c in COMMANDS if c.name == args.command)
    try:
        if not command.reads_topology:  # a run directory's recorded topology, or none
            return command.run(args)
        if getattr(args, "continuous", False):
            args.overrides.append("train.enabled=true")  # last, so it wins over a --set train.enabled=false
        return command.run(load_topology(find_topology(args.topology), args.overrides), args)
    except ConfigError as exc:
        print(f"expstream: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except ExpstreamError as exc:  # a service away (not retried further here), a stop request: one line
        again = "retriable: try again once it answers" if exc.retriable else "not retriable"
        print(f"expstream: {type(exc).__name__}: {exc} ({again})", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
