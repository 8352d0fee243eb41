"""`expstream run` with a bad configuration: exit code 2 and one message naming the field and the fix,
before any broker, redis-server or stage is started (so each case takes about a second)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?", "label": "4"}\n')
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
           "--no-progress", "--set", f"models.cache_dir={tmp_path / 'models'}", *args]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    return proc, time.monotonic() - started


def bad_topology(tmp_path: Path) -> list[str]:
    path = tmp_path / "topology.yaml"
    path.write_text("algo:\n  advantage_estimater: gae\n")
    return ["--topology", str(path)]


def empty_model_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "not-a-model").mkdir()
    return ["--set", f"models.critic={tmp_path / 'not-a-model'}", "--set", "algo.advantage_estimator=gae"]


CASES = {
    "unknown topology key": (bad_topology, "algo.advantage_estimater", "Did you mean algo.advantage_estimator"),
    "missing model directory": (lambda t: ["--set", "models.actor=/nonexistent/actor-model"], "models.actor",
                                "save_pretrained"),
    "model directory without config.json": (empty_model_dir, "models.critic", "config.json"),
    "reward function module does not import": (lambda t: ["--set", "models.reward_fn=no_such_module_x:score"],
                                               "models.reward_fn", "make it importable"),
    "reward function missing in its module": (lambda t: ["--set", "models.reward_fn=tests.rewardfns:no_such_fn"],
                                              "models.reward_fn", "package.module:function"),
    "gae without a critic": (lambda t: ["--set", "algo.advantage_estimator=gae", "--set", "models.critic=null"],
                             "algo.advantage_estimator", "set models.critic"),
    "missing prompt file": (lambda t: ["--prompts", str(t / "missing.jsonl")], "--prompts",
                            "existing JSON-lines file"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_configuration_exits_2_with_field_and_fix(tmp_path, case):
    make_args, field, fix = CASES[case]
    proc, seconds = run_cli(tmp_path, *make_args(tmp_path))
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    message = [line for line in proc.stderr.splitlines() if "configuration error" in line]
    assert len(message) == 1, proc.stderr
    assert field in message[0] and fix in message[0], message[0]
    assert "Traceback" not in proc.stderr
    # nothing was started: no run directory, no broker/redis log, no services file
    assert not (tmp_path / "out").exists(), sorted(p.name for p in (tmp_path / "out").rglob("*"))
    assert "local broker" not in proc.stderr and "local redis" not in proc.stderr
    assert seconds < 10, f"{case}: {seconds:.1f}s; preflight must fail before anything slow starts"
