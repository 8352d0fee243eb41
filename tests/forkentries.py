"""Entry points for processes forked from the fork server in tests (``"forkentries:NAME"``)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

#: What the process keeps until it exits, as tqdm keeps its lock in a class attribute.
KEPT: list[object] = []


def make_named_lock(argv: list[str]) -> int:
    """What tqdm does in the trainer (``save_pretrained``'s progress bar): a multiprocessing lock, a named
    POSIX semaphore, kept for the life of the process; its name is written to ``argv[0]``. Returns 0."""
    lock = multiprocessing.RLock()
    KEPT.append(lock)
    Path(argv[0]).write_text(lock._semlock.name)
    return 0


def report_fork_state(argv: list[str]) -> int:
    """What a stage process does first after the fork (its command line parsed, the replica's and the metrics
    endpoint's modules imported), then writes to ``argv[0]`` as JSON: the modules that imported here, after
    the fork (private pages in every child, bench/README.md item 5), and the server's frozen object count."""
    import contextlib
    import gc
    import io
    import json
    import sys

    before = set(sys.modules)
    from expstream import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        cli.main(["stage", "--help"])
    import http.server  # noqa: F401 - what the metrics endpoint serves with

    import prometheus_client.exposition  # noqa: F401
    import setproctitle  # noqa: F401

    import expstream.launch.replica  # noqa: F401
    import stages.chain  # noqa: F401
    Path(argv[0]).write_text(json.dumps({"after_fork": sorted(set(sys.modules) - before),
                                         "frozen": gc.get_freeze_count()}))
    return 0
