"""What `expstream status` shows (issue 21 item 13): generate's policy version, "idle s" never negative,
the tables at 80 columns, no stale metrics endpoints of replicas that are gone."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from expstream.config.topology import load_topology
from expstream.launch.supervisor import Supervisor
from expstream.observe.metrics import StageMetrics, discovery_name, forget_replica
from expstream.tools.status import render_status, scrape_run, window_stats
from schemas import PromptBatch
from stages import generate
from stages.context import make_context

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.05)"]


def served(tmp_path: Path, stage: str, replica: str, *, pid: int | None = None) -> StageMetrics:
    """A stage's metrics endpoint served from this process, its discovery file in <tmp>/run/metrics
    (``pid``: the process the file claims to be, default this one)."""
    m = StageMetrics(stage, replica)
    metrics_dir = tmp_path / "run" / "metrics"
    m.port = m.serve(metrics_dir, port=0)
    if pid is not None:
        path = metrics_dir / discovery_name(stage, replica)
        path.write_text(json.dumps({**json.loads(path.read_text()), "pid": pid}))
    return m


def test_generate_shows_the_version_it_generates_with_before_it_handled_a_record():
    topo = load_topology(None, [f"models.cache_dir={ROOT / '.cache' / 'expstream' / 'models'}", "generate.max_new_tokens=2",
                                "generate.n_samples_per_prompt=2"])
    ctx = make_context(topo, "generate")
    ctx.metrics = StageMetrics("generate", "0")
    assert math.isnan(ctx.metrics.policy_version._value.get())  # no version yet: not "version 0"
    generate.setup(ctx)
    ctx.state.set_policy_version(198)  # the trainer announced v198 (no store: the announced one is used)
    generate.process(PromptBatch(batch_id="p000000", prompt_id=["a"], prompt=["Say hi"], label=[""],
                                 reference=[""]), ctx)
    assert ctx.metrics.policy_version._value.get() == 198


def test_status_shows_a_version_as_soon_as_the_gauge_has_one_not_only_after_a_record(tmp_path):
    loading = served(tmp_path, "generate", "0")  # it has not handled a record: a long first generation
    loading.policy_version.set(198)
    fresh = served(tmp_path, "reward", "0")  # no version yet at all
    scraped = scrape_run(tmp_path)
    assert scraped["stages"]["generate"]["version"] == 198
    assert scraped["stages"]["reward"]["version"] is None
    assert math.isnan(fresh.policy_version._value.get())


def test_idle_seconds_are_never_negative_and_count_from_the_newest_batch():
    now = 1000.0
    # a batch recorded while the snapshot was read (or by a replica whose clock runs ahead), listed first,
    # and entries of two replicas in the order their pushes arrived (not newest first)
    assert window_stats([(1000.4, 0.1, 2), (990.0, 0.1, 2)], now)["last_progress_s"] == 0.0
    assert window_stats([(995.0, 0.1, 2), (998.0, 0.1, 2), (990.0, 0.1, 2)], now)["last_progress_s"] == 2.0
    assert window_stats([], now)["last_progress_s"] is None


def big_snapshot() -> dict:
    names = ["generate", "shard-preprocess", "actor-logprob", "reference", "reward", "postprocess", "advantage"]
    stage = {"replicas_alive": 2, "replicas_wanted": 2, "input_lag_records": 12345, "input_lag_s": 12.3,
             "records_per_s": 1.234, "samples_per_s": 12.5, "batch_p50_s": 0.1234, "batch_p95_s": 1.5,
             "busy_share": 0.5, "last_progress_s": 3.2, "samples_in": 1234567, "samples_out": 1234400,
             "samples_dead": 12, "samples_dropped": 4, "in_flight": 151, "dead_letters": 3,
             "policy_version_seen": 198, "staleness_versions": 1.5, "restarts": 1}
    return {"t": time.time(), "run_id": "20261125-201919-aa9f19", "policy_version": 198,
            "stages": {n: dict(stage) for n in names}, "bottleneck": {"stage": "generate", "why": "x"}}


def rendered(snap: dict, width: int) -> list[str]:
    console = Console(width=width, record=True, force_terminal=False)
    console.print(render_status(snap))
    return console.export_text().splitlines()


def test_at_80_columns_the_tables_fit_and_keep_every_count_whole():
    lines = rendered(big_snapshot(), 80)
    assert max(len(line) for line in lines) <= 80
    assert not any("…" in line for line in lines), "\n".join(lines)  # nothing cut to an ellipsis
    header = next(line for line in lines if line.startswith("stage") and " in " in line)
    assert header.split()[:6] == ["stage", "in", "out", "dead", "drop", "flight"], header
    row = next(line for line in lines if line.startswith("shard-preprocess") and "1234567" in line)
    assert row.split()[1:6] == ["1234567", "1234400", "12", "4", "151"], row
    flow = next(line for line in lines if line.startswith("stage") and "lag" in line)
    assert {"repl", "lag", "smp/s", "busy", "idle"} <= set(flow.split()), flow
    assert any(line.startswith("(left out at 80 columns:") for line in lines)  # it says what it left out
    wide = rendered(big_snapshot(), 200)
    assert not any("left out" in line for line in wide)
    assert "restarts" in next(line for line in wide if line.startswith("stage") and " in " in line)


def test_status_skips_the_metrics_file_of_a_process_that_is_gone(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone_pid = int(dead.stdout)  # exited: nothing runs under this pid now
    # its port still answers (here: another registry took it over), yet it is not the replica's
    ghost = served(tmp_path, "reward", "1", pid=gone_pid)
    live = served(tmp_path, "reward", "0")
    for m, version in ((ghost, 5), (live, 7)):  # both handled records: only the file's staleness tells them apart
        m.policy_version.set(version)
        m.records.inc()
    assert scrape_run(tmp_path)["stages"]["reward"]["version"] == 7


def test_the_metrics_file_of_a_retired_replica_is_removed(tmp_path):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    sup = Supervisor(tmp_path / "logs", on_gone=lambda name, replica: forget_replica(metrics_dir, name, replica))
    for i in range(2):
        sup.add("reward", i, SLEEPER)
    sup.start()
    try:
        for i in range(2):  # what each replica's StageMetrics.serve writes
            (metrics_dir / discovery_name("reward", i)).write_text(json.dumps({"pid": sup.pids()[f"reward[{i}]"]}))
        sup.scale_to("reward", 1, lambda replica: SLEEPER)
        deadline = time.monotonic() + 30
        while "reward[1]" in sup.pids():
            sup.poll()
            assert time.monotonic() < deadline, "the retired replica did not leave"
            time.sleep(0.05)
        sup.poll()
        assert sorted(p.name for p in metrics_dir.iterdir()) == [discovery_name("reward", 0)]
    finally:
        sup.stop(grace_s=5)
    assert list(metrics_dir.iterdir()) == []  # a clean stop removes the rest

