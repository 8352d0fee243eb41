"""What the engine tests (tests/test_vllm.py, tests/test_sglang.py) share: the prompts, the comparison of
log-probs, the published-version round trip through a PolicyFollower, and the /proc views the end-to-end
runs use to show that nothing an engine started outlives it.

Each module keeps its own tolerance and its own recomputation of the log-probs (vLLM's is the actor-logprob
stage's left-padded forward, SGLang's an independent forward per row); the checks here take them as
arguments.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def prompts(tok) -> list[list[int]]:
    """The three short prompts every equivalence check generates from."""
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ("def add(a, b):", "hello world", "x = [i for")]


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest absolute difference between two equally shaped lists of log-prob rows."""
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def perturbed_actor(actor_dir: Path, seed: int, scale: float):
    """The tiny actor with Gaussian noise (``scale`` x N(0, 1), generator seeded ``seed``) on every weight:
    weights whose greedy tokens differ from the original's."""
    from expstream.models.hf import load_causal_lm

    new = load_causal_lm(actor_dir)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return new


def assert_a_published_version_is_served(engine: Any, hf: Any, actor_dir: Path, store_dir: Path, weights: Any,
                                         ps: list[list[int]],
                                         check_log_probs: Callable[[Any, list[list[int]], list[list[float]]], None]
                                         ) -> None:
    """The continuous loop's path on a session engine: the trainer publishes a perturbed actor, the stage's
    follower (``weights``: the engine's EngineWeights) loads it in place. After the refresh the engine's
    greedy tokens are the new weights' (and differ from the old ones'); ``check_log_probs(new_model, outs,
    log_probs)`` checks the log-probs against the new weights. A version of another architecture is refused
    before anything is loaded. The engine gets its original weights back (the session engine is shared) and
    then generates what it did before."""
    from expstream.models.hf import TransformersGenerator, load_causal_lm
    from expstream.state import MemoryState
    from expstream.train.weights import DirectoryWeightStore, PolicyFollower

    greedy = dict(temperature=0, max_new_tokens=10, ignore_eos=True, return_log_probs=True)
    before, _ = engine.generate(ps, 1, **greedy)
    new = perturbed_actor(actor_dir, seed=3, scale=0.1)
    store, state = DirectoryWeightStore(store_dir), MemoryState()
    store.publish("actor", 1, new.state_dict(), step=1, offsets={}, run_id="t")
    state.set_policy_version(1)
    follower = PolicyFollower(store, state, "actor", weights)
    try:
        assert follower.refresh() == 1 and engine.last_reload_s is not None
        after, lp = engine.generate(ps, 1, **greedy)
        assert after != before, "the perturbed weights change the greedy tokens"
        want, _ = TransformersGenerator(new, hf.tokenizer).generate(ps, 1, **greedy)
        assert after == want
        check_log_probs(new, after, lp)
        # a version of another architecture is refused before anything is loaded
        store.publish("actor", 2, {"model.embed_tokens.weight": torch.zeros(3, 3)}, step=2, offsets={}, run_id="t")
        state.set_policy_version(2)
        assert follower.refresh() == 1
    finally:
        engine.reload(state_dict=load_causal_lm(actor_dir).state_dict())  # the session engine's weights back
    restored, _ = engine.generate(ps, 1, **greedy)
    assert restored == before


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``python -m expstream ARGS`` from the checkout, to its end (output captured)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "expstream", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def proc_stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command: [state, ppid, pgrp, session, ...] (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def processes() -> dict[int, list[str]]:
    """Every live process -> its /proc stat fields (see :func:`proc_stat`)."""
    return {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := proc_stat(int(e))) is not None}


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``."""
    return [p for p, st in processes().items() if int(st[1]) == pid]


def session_members(sid: int) -> list[int]:
    """The live processes of session ``sid`` (a server started in a session of its own: its scheduler,
    detokenizer and whatever else it forked)."""
    return [p for p, st in processes().items() if int(st[3]) == sid]


def start_example_run(tmp_path: Path, out: Path, cache: Path, *sets: str) -> tuple[subprocess.Popen, Path]:
    """``expstream run`` of the example prompts into ``out`` with the model cache and ``--set``s, from the checkout,
    stdout dropped and stderr to ``tmp_path / "stderr.log"``; returns the process and that file."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", "examples/prompts.jsonl", "--output", str(out),
           "--no-progress"]
    for x in (*sets, f"models.cache_dir={cache}"):
        cmd += ["--set", x]
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    return proc, stderr_path


def stop_problems(stderr: str) -> list[str]:
    """The supervisor's lines about a generate replica SIGKILLed after the grace ("did not stop within ...;
    killing it") or exiting with an error code on stop ("exited with code N on stop")."""
    return [line for line in stderr.splitlines() if "generate[" in line and ("on stop" in line or "did not stop" in line)]


class GenerateProcesses:
    """The generate stage processes of an ``expstream run`` writing to ``out`` (run/pids.json, every one seen
    -> its label) and every process they started (children and grandchildren seen while :meth:`watch` is
    called during the run)."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pids: dict[int, str] = {}
        self.started: set[int] = set()

    def watch(self) -> None:
        import json

        try:
            pids = json.loads((self.out / "run" / "pids.json").read_text())
        except (OSError, ValueError):
            return
        self.pids.update({pid: label for label, pid in pids.items() if label.startswith("generate[")})
        procs = processes()
        for _ in range(2):  # children, then grandchildren
            self.started.update(p for p, st in procs.items() if int(st[1]) in self.pids or int(st[1]) in self.started)

    def wait_for_end(self, proc: subprocess.Popen, timeout_s: float) -> None:
        """Watch until the run ``proc`` exits (at most ``timeout_s``)."""
        import time

        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            assert time.monotonic() < deadline, f"the run did not finish within {timeout_s:.0f} s"
            self.watch()
            time.sleep(0.2)

    def assert_none_left(self) -> None:
        """No generate process and nothing it started is alive, nor any process of their sessions (a stage
        is its session's leader: an orphaned engine would keep it)."""
        alive = processes()
        assert not [p for p in [*self.pids, *self.started] if p in alive], (self.pids, self.started)
        assert not [p for p, st in alive.items() if int(st[3]) in self.started | set(self.pids)], \
            "a process of a generate stage's session survives"


def assert_every_sample_out_once(out: Path, groups: int = 6, samples: int = 24) -> dict:
    """The run at ``out`` ended ok with every group complete and every sample in experiences.msgpack once
    (no dedupe); returns its summary."""
    import json

    from expstream.rl.experience import read_experiences

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["groups_complete"] == groups and summary["samples"] == samples, \
        summary
    ids = [sid for e in read_experiences(out / "experiences.msgpack", dedupe=False) for sid in e.sample_ids]
    assert len(ids) == len(set(ids)) == samples, "every sample out once"
    return summary
