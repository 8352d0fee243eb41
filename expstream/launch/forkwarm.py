"""Imported by the fork server after its preloads, before ``gc.freeze()``: one ``from_pretrained`` of the
built-in tiny actor, so that the first model load of every forked stage finds transformers' lazily built
state (its first-use imports, caches and tables) in the server's shared pages.

Measured (bench/README.md item 5): a forked process's first ``from_pretrained`` of the tiny model made 11.6 MiB
of private memory (0.05 s of CPU), 6.1 MiB (0.02 s) when the server had loaded a model once. Every model stage
(5 in the demo) pays that at its start. The server's own rules hold:
the model is dropped again, one torch thread and transformers' sequential weight loading (no thread left
for a fork to copy), torch's random generator left as it was (a child's sampling
is as if no warm-up happened), and a failure is reported on the run's stderr, never fatal to the server.
Only when the tiny models are in the cache already (the directory comes in ``EXPSTREAM_FORKSERVER_WARM``);
a run with other models loads the same transformers code, so the warm-up is useful to it too. Not with
``generate.backend: vllm`` (``warm_up_for``): vLLM's in-process engine deadlocks in a child of a process
that ran torch multithreaded (docs/vllm.md), and that server stays one that only imports.
"""

from __future__ import annotations

import os
import sys
import threading

#: Set (the tiny actor's directory) only in the environment the fork server starts with.
WARM_ENV = "EXPSTREAM_FORKSERVER_WARM"
#: transformers' switch from its thread-pool weight loading to a sequential one.
SYNC_LOAD_ENV = "HF_DEACTIVATE_ASYNC_LOAD"


def warm(actor_dir: str) -> None:
    import torch

    from expstream.models.hf import load_causal_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no thread pool in the server: its children are forked
    # transformers 5 loads weights on a ThreadPoolExecutor it shuts down without waiting: its idle workers
    # could outlive the load and be alive when the server forks (seen in CI). Sequential loading here.
    async_load = os.environ.get(SYNC_LOAD_ENV)
    os.environ[SYNC_LOAD_ENV] = "1"
    before = set(threading.enumerate())
    try:
        with torch.random.fork_rng(devices=[]):
            model = load_causal_lm(actor_dir)
            del model
    finally:
        torch.set_num_threads(threads)
        if async_load is None:
            os.environ.pop(SYNC_LOAD_ENV, None)
        else:
            os.environ[SYNC_LOAD_ENV] = async_load
        for left in set(threading.enumerate()) - before:  # any other library's helper thread: gone first
            left.join(timeout=5.0)


def _warm_from_env() -> None:
    actor_dir = os.environ.pop(WARM_ENV, None)
    if not actor_dir:
        return
    try:
        warm(actor_dir)
    except Exception as exc:  # noqa: BLE001 - a warm-up that fails only costs the children their first load
        print(f"expstream fork server: warming up with {actor_dir} failed ({type(exc).__name__}: {exc}); "
              "stages load their models without it", file=sys.stderr, flush=True)


_warm_from_env()
