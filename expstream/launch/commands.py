"""The commands that start processes: ``expstream run`` (the whole pipeline), ``stage`` (one stage
replica, what ``run`` starts per replica) and ``train`` (the reference trainer of the continuous loop).

Their arguments and entry functions, for the table in ``expstream/cli.py``. The work is imported when
the command runs (``expstream.launch.run``, ``.replica``, ``expstream.train``): building the parser
imports no torch.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from expstream.config.cli_args import Command, add_topology_args
from expstream.config.topology import Topology
from expstream.errors import EXIT_CONFIG
from expstream.models.resolve import check_models


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    add_topology_args(run)
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


def run_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream run`` (``--continuous`` has become ``--set train.enabled=true`` in the CLI)."""
    if topo.run.spawn == "fork":  # the fork server's seconds of torch imports start now, beside
        from expstream.launch.forkserver import warm_up_for  # ours and the checks (dies with this process)

        warm_up_for(topo)
    check_models(topo)
    from expstream.launch.run import run_pipeline

    return run_pipeline(topo, args)


def start_fork_server_early(argv: list[str]) -> bool:
    """``expstream run ARGV``: start the fork server now, before the command line is imported and parsed
    (expstream/__main__.py); True when started. Only ``--topology``, ``--set`` and ``--continuous`` are
    read here, with logging off; anything unusual (no topology, a bad value, ``--help``, ``run.spawn:
    exec``) leaves the start to :func:`run_command`, which reports errors as always. A run that then
    stops at a configuration error has started the server for nothing (it dies with this process)."""
    import logging

    if any(a in ("-h", "--help") for a in argv):
        return False
    parser = argparse.ArgumentParser(add_help=False)
    add_topology_args(parser)
    parser.add_argument("--continuous", action="store_true")
    logging.disable(logging.CRITICAL)  # load_topology's lines come once, from the real start
    try:
        args, _ = parser.parse_known_args(argv)
        from expstream.config.topology import find_topology, load_topology

        topo = load_topology(find_topology(args.topology),
                             [*args.overrides, *(["train.enabled=true"] if args.continuous else [])])
    except (Exception, SystemExit):  # noqa: BLE001 - reported by the real parse and load
        return False
    finally:
        logging.disable(logging.NOTSET)
    if topo.run.spawn != "fork":
        return False
    from expstream.launch.forkserver import warm_up_for

    warm_up_for(topo)
    return True


def add_stage_arguments(stage: argparse.ArgumentParser) -> None:
    add_topology_args(stage)
    stage.add_argument("name", help="stage name, e.g. generate, or a chain of the topology's chains: (its stages "
                       "joined by +, e.g. postprocess+advantage)")
    stage.add_argument("--run-id", default="prod")
    stage.add_argument("--replica-id", default=os.environ.get("EXPSTREAM_REPLICA_ID") or socket.gethostname(),
                       help="names this replica in heartbeats (default: $EXPSTREAM_REPLICA_ID or the host name)")
    stage.add_argument("--assign", metavar="INDEX/COUNT",
                       help="take the input partitions p with p %% COUNT == INDEX instead of joining the consumer "
                            "group (what `expstream run` starts replicas with; stages/assigning.py)")


def add_train_arguments(train: argparse.ArgumentParser) -> None:
    add_topology_args(train)
    train.add_argument("--run-id", default="prod", help="the run whose experiences it trains on (Redis keys, group)")
    train.add_argument("--output", required=True,
                       help="directory for train.jsonl, train/checkpoint, final/ (and weights/ by default)")


def stage_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream stage NAME``: the process a supervisor starts per replica (see :func:`cannot_import`)."""
    try:
        from expstream.launch.replica import run_stage

        return run_stage(topo, args)
    except (ImportError, SyntaxError) as exc:
        return cannot_import(f"stage {args.name}", exc)


def train_command(topo: Topology, args: argparse.Namespace) -> int:
    """``expstream train``: the trainer process (see :func:`cannot_import`)."""
    try:
        from expstream.train import run_trainer

        return run_trainer(topo, args)
    except (ImportError, SyntaxError) as exc:
        return cannot_import("the trainer", exc)


def cannot_import(what: str, exc: ImportError | SyntaxError) -> int:
    """Code that cannot be imported (a syntax error, a missing module) is reported as one line and exit
    2, which the supervisor does not restart: the same import fails again however often it is retried
    (expstream/launch/supervisor.py). A SyntaxError's text names the file and line."""
    print(f"expstream: {what}: cannot import its code: {type(exc).__name__}: {exc}", file=sys.stderr)
    return EXIT_CONFIG


RUN = Command("run", "run the whole pipeline on a prompt file", add_run_arguments, run_command, reads_topology=True)
STAGE = Command("stage", "run one stage replica (what `run` starts per stage)", add_stage_arguments, stage_command,
                reads_topology=True)
TRAIN = Command("train", "the reference trainer of the continuous loop (docs/async.md)", add_train_arguments,
                train_command, reads_topology=True)
