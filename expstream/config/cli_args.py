"""The pieces of the command line that every command module shares: the :class:`Command` a module
contributes to the table in ``expstream/cli.py``, and the topology flags (``--topology``, ``--set``,
``--bootstrap-servers``, ``--redis-url``) most commands take. Layer 1, so that a command module of any
layer (``kafka``, ``rewards``, ``launch``, ``tools``) can use them without importing the CLI."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NamedTuple

from expstream.config.redaction import REDIS_URL_ENV


class Command(NamedTuple):
    """One ``expstream`` subcommand.

    ``add_arguments(parser)`` adds its flags to the subparser the CLI made for ``name``. With
    ``reads_topology`` the CLI loads the topology first (``--topology``, else ./topology.yaml, else the
    packaged copy; ``--set`` overrides) and calls ``run(topo, args)``; without it, ``run(args)``: the
    command reads a run directory's recorded topology itself, or needs none. ``run`` returns the exit
    code (``expstream.errors.EXIT_*``).
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[..., int]
    reads_topology: bool
    description: str | None = None


def add_topology_args(p: argparse.ArgumentParser) -> None:
    """``--topology``, ``--set``, ``--bootstrap-servers``, ``--redis-url``."""
    p.add_argument("--topology", help="topology YAML (default: ./topology.yaml when present, else the packaged copy)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="override a topology value; repeatable")
    p.add_argument("--bootstrap-servers", help="Kafka HOST:PORT; default: start a local broker")
    p.add_argument("--redis-url", help=f"redis://[:PASSWORD@]HOST:PORT/DB; default: ${REDIS_URL_ENV}, else start a local "
                   f"redis-server (put a password in ${REDIS_URL_ENV}, not on the command line: `ps` shows it)")
