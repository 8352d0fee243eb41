"""The run's services as one context manager (expstream/launch/services.py RunServices): whatever ends
the block, the outputs are written while Redis still answers, then the stages, redis-server and the
broker stop, in that order; the topology the child processes read is the resolved one."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from expstream.config.topology import load_topology
from expstream.errors import EXIT_FAILED, EXIT_INTERRUPTED
from expstream.launch.outcome import RunOutcome
from expstream.launch.services import RunServices

pytestmark = [pytest.mark.integration]


def args(bootstrap: str | None = None, redis_url: str | None = None) -> argparse.Namespace:
    return argparse.Namespace(bootstrap_servers=bootstrap, redis_url=redis_url)


def alive(pid: int | None) -> bool:
    try:
        os.kill(pid or 0, 0)
    except ProcessLookupError:
        return False
    return True


def test_an_exception_in_the_block_writes_the_outputs_with_redis_up_then_stops_the_servers(tmp_path: Path):
    topo = load_topology(None, ["record.enabled=false", "run.spawn=exec"])
    out_dir = tmp_path / "out"
    (out_dir / "run").mkdir(parents=True)
    out = RunOutcome(topo=topo, run_id="svc-1", out_dir=out_dir, rows=0, started=time.monotonic())
    seen: dict = {}

    def before_the_stages_stop() -> None:
        seen["summary"] = (out_dir / "summary.json").is_file()
        seen["redis"] = svc.state.counters() is not None  # Redis still answers
        seen["servers"] = [alive(p) for p in svc.pids.values()]

    with pytest.raises(RuntimeError, match="boom"):
        with RunServices.start(topo, args(), out_dir, out) as svc:
            svc.callback(before_the_stages_stop)
            assert (json.loads((out_dir / "run" / "services.json").read_text())["bootstrap_servers"]
                    == svc.bootstrap)
            raise RuntimeError("boom")
    assert seen == {"summary": True, "redis": True, "servers": [True, True]}
    assert sorted(svc.pids) == ["broker_pid", "redis_pid"]
    deadline = time.monotonic() + 30
    while any(alive(p) for p in svc.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in svc.pids.values()), "the local broker and redis-server stopped"
    summary = json.loads((out_dir / "summary.json").read_text())
    assert (out.status, summary["status"], summary["error"]) == (EXIT_FAILED, "failed", "RuntimeError: boom")
    assert load_topology(out_dir / "run" / "topology.yaml").stages == topo.stages


def test_given_services_are_used_and_ctrl_c_in_the_block_is_an_interrupted_run(tmp_path: Path, broker: str,
                                                                              redis_url: str):
    topo = load_topology(None, ["record.enabled=false", "run.spawn=exec"])
    out = RunOutcome(topo=topo, run_id="svc-2", out_dir=tmp_path, rows=0, started=time.monotonic())
    (tmp_path / "run").mkdir()
    with pytest.raises(KeyboardInterrupt):
        with RunServices.start(topo, args(broker, redis_url), tmp_path, out) as svc:
            assert (svc.bootstrap, svc.pids, out.bootstrap) == (broker, {}, broker)
            assert [c.label for c in svc.supervisor.children] == [
                f"{s.name}[{r}]" for s in topo.enabled_stages() for r in range(s.replicas)]
            raise KeyboardInterrupt
    assert out.status == EXIT_INTERRUPTED
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "interrupted"
