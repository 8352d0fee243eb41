"""Process memory of a run (bench/README.md item 5): what runs in which process.

Behavioural checks, not thresholds: the run's own process does not import torch even when the tiny models
must be built (they are built in a child: the fork server's, or a spawned one).
"""

from __future__ import annotations

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
