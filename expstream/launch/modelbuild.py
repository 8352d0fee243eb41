"""The built-in tiny models built in a child process, so that ``expstream run``'s own process never imports torch.

Building them (the first run in a checkout, or a fresh ``models.cache_dir``) imports torch and
transformers; done in the run's process, that kept ~225 MiB of private memory there for the whole
run (the one demo run of bench/README.md's item 5 that peaked at 960 MiB of PSS instead of ~760).
With ``run.spawn: fork`` the child is a fork of the fork server (torch imported already, no second
import); with ``exec`` it is a fresh interpreter (``spawn``). A failure comes back as the same
:class:`ConfigError` (field, fix) or as a one-line error naming the child's exception.
"""

from __future__ import annotations

import multiprocessing
import traceback
from multiprocessing.connection import Connection

from expstream.config.topology import Topology
from expstream.errors import ConfigError
from expstream.models.resolve import build_builtin_models, builtin_models_missing
from expstream.procs import die_with_parent


class ModelBuildError(RuntimeError):
    """Building the built-in tiny models failed in the child with something other than a ConfigError."""


def build_models_apart(topo: Topology) -> None:
    """:func:`build_builtin_models` in a child process (a no-op, and no child, when the cache has them)."""
    if not builtin_models_missing(topo):
        return
    if topo.run.spawn == "fork":
        from expstream.launch.forkserver import server_context

        ctx = server_context()
    else:
        ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_build, args=(topo, theirs), name="expstream-models-build", daemon=True)
    proc.start()
    theirs.close()
    try:
        answer = ours.recv()
    except EOFError:  # the child died without a word (killed, out of memory)
        answer = ("error", f"the process building the built-in tiny models exited with code {proc.exitcode}")
    finally:
        ours.close()
        proc.join()
    if answer is None:
        return
    kind, *rest = answer
    if kind == "config":
        message, field, fix = rest
        raise ConfigError(message, field=field, fix=fix)
    raise ModelBuildError(f"building the built-in tiny models failed: {rest[0]}")


def _build(topo: Topology, conn: Connection) -> None:
    """The child: build, then answer None, ("config", message, field, fix) or ("error", text)."""
    die_with_parent()  # a forked child of the server dies with it, a spawned one with the run
    try:
        build_builtin_models(topo)
        answer: tuple[str, ...] | None = None
    except ConfigError as exc:
        answer = ("config", exc.message, exc.field, exc.fix)
    except Exception as exc:  # noqa: BLE001 - reported to the run's process, which fails with it
        answer = ("error", "".join(traceback.format_exception_only(exc)).strip())
    conn.send(answer)
    conn.close()
