"""Process memory of a run (bench/README.md item 5): what runs in which process.

Behavioural checks, not thresholds: the run's own process does not import torch even when the tiny models
must be built (they are built in a child: the fork server's, or a spawned one).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BUILD_APART = """
import sys
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.launch.modelbuild import build_models_apart
from expstream.models.cache import is_complete, tiny_root

cache, blocked, spawn = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    build_models_apart(load_topology(overrides=[f"models.cache_dir={blocked}", f"run.spawn={spawn}"]))
except ConfigError as exc:
    print("config error:", exc.field)
build_models_apart(load_topology(overrides=[f"models.cache_dir={cache}", f"run.spawn={spawn}"]))
print("complete:", is_complete(tiny_root(cache)))
print("torch here:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_tiny_models_are_built_outside_the_runs_process(tmp_path: Path, spawn: str) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    out = subprocess.run([sys.executable, "-c", BUILD_APART, str(tmp_path / "cache"), str(blocker / "models"), spawn],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert "config error: models.cache_dir" in lines  # a child's ConfigError comes back with its field
    assert "complete: True" in lines
    assert "torch here: False" in lines  # built, and torch never imported by the caller


def test_a_forked_process_finds_its_modules_in_the_servers_frozen_pages(tmp_path: Path) -> None:
    """A stage forked from the fork server imports its command line, replica and metrics modules from the
    server's pages (shared, not a private copy per process), and the server froze the GC (gc.freeze) first."""
    from expstream.launch.forkserver import ForkedProcess

    report = tmp_path / "report.json"
    proc = ForkedProcess("forkentries:report_fork_state", [sys.executable, "-m", "x", str(report)],
                         tmp_path / "child.log", {"PYTHONPATH": str(ROOT / "tests")})
    assert proc.wait(timeout=120) == 0, (tmp_path / "child.log").read_text()[-3000:]
    state = json.loads(report.read_text())
    assert state["after_fork"] == [], state["after_fork"]
    assert state["frozen"] > 10_000  # torch and transformers' objects, out of the collector's reach


WARM = """
import os, sys
os.environ["EXPSTREAM_FORKSERVER_WARM"] = "/nonexistent/actor"
import expstream.launch.forkwarm as fw  # a warm-up that fails is reported, the import (the server) goes on
import torch
from expstream.models.cache import tiny_root

def tasks():
    return len(os.listdir("/proc/self/task"))

import threading
started = []
start = threading.Thread.start
def counted_start(self):
    started.append(self.name)
    start(self)
threading.Thread.start = counted_start  # a thread started and gone again by the count below is still seen

torch.manual_seed(7)
before = (tasks(), torch.get_num_threads(), torch.get_rng_state())
fw.warm(str(tiny_root(sys.argv[1]) / "actor"))
after = (tasks(), torch.get_num_threads(), torch.get_rng_state())
print("threads", before[0], after[0], "torch threads", before[1], after[1],
      "rng kept", bool(torch.equal(before[2], after[2])))
print("started", len(started), started)
"""


def test_the_fork_servers_warm_up_leaves_no_thread_and_the_random_state_as_it_was(model_cache: Path) -> None:
    """expstream/launch/forkwarm.py loads the tiny actor once in the fork server: its children are forked, so
    no thread may be left running, and their sampling must not see a generator the warm-up moved."""
    out = subprocess.run([sys.executable, "-c", WARM, str(model_cache)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warming up with /nonexistent/actor failed" in out.stderr
    words = out.stdout.splitlines()[0].split()
    assert words[1] == words[2], out.stdout  # OS threads before and after
    assert words[5] == words[6], out.stdout  # torch's intra-op thread setting
    assert words[-1] == "True", out.stdout
    # transformers 5 loads weights on a thread pool it does not wait for: its workers could still be alive
    # at the count above (CI saw 2 -> 3) and when the server forks; the warm-up loads sequentially
    assert out.stdout.splitlines()[1].startswith("started 0 "), out.stdout
