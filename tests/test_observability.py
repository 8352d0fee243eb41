"""Seeing the pipeline work (issue 14): provenance headers, Prometheus metrics, status, accounting, report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from expstream.kafka.provenance import read_provenance
from expstream.observe.metrics import METRICS, exported_names
from expstream.tools.accounting import accounting
from expstream.tools.status import bottleneck, render_status, window_stats

ROOT = Path(__file__).resolve().parents[1]


# -- pure ------------------------------------------------------------------------------------------
def test_provenance_headers_read_back_and_tolerate_other_clients():
    from expstream.kafka.provenance import provenance_headers

    p = read_provenance(provenance_headers("reward", 7, now_ms=1_700_000_000_123) + [("x", b"y")])
    assert (p.producer, p.policy_version, p.produced_at_ms) == ("reward", 7, 1_700_000_000_123)
    assert p.age_s(now_ms=1_700_000_002_123) == 2.0
    assert read_provenance([("other", b"1")]) is None and read_provenance(None) is None
    garbled = read_provenance([("producer", b"\xff\xfe"), ("policy_version", b"seven"), ("produced_at_ms", None)])
    assert garbled == type(p)(None, None, None)


def test_window_rates_percentiles_and_accounting_from_hand_numbers():
    now = 1000.0
    recent = [(999.0, 0.5, 8), (990.0, 0.1, 8), (980.0, 0.2, 8), (900.0, 9.0, 8)]  # the last is outside 60 s
    w = window_stats(recent, now)
    assert w["records_per_s"] == round(3 / 20, 3) and w["samples_per_s"] == round(24 / 20, 3)
    assert w["batch_p50_s"] == 0.2 and w["batch_p95_s"] == 0.5 and w["last_progress_s"] == 1.0
    assert w["busy_share"] == round(0.8 / 20, 3)
    assert accounting({"in": 32, "out": 20, "dead": 4}, dropped=4) == {
        "samples_in": 32, "samples_out": 20, "samples_dead": 4, "samples_dropped": 4, "in_flight": 4,
        "balanced": False}
    assert accounting({"in": 8, "out": 8})["balanced"]


def _snap(**lags):
    base = {"replicas_alive": 1, "replicas_wanted": 1, "restarts": 0, "records_per_s": 1.0, "samples_per_s": 8.0,
            "batch_p50_s": 0.01, "batch_p95_s": 0.02, "busy_share": 0.1, "last_progress_s": 0.5,
            "input_lag_s": 0.3, "dead_letters": 0, "samples_in": 8, "samples_out": 8, "samples_dead": 0,
            "samples_dropped": 0, "in_flight": 0, "balanced": True, "policy_version_seen": 0,
            "staleness_versions": 0.0}
    stages = {name: {**base, "input_lag_records": lag} for name, lag in lags.items()}
    return {"t": time.time(), "run_id": "r1", "policy_version": 3, "stages": stages, "topics": {},
            "bottleneck": bottleneck(stages)}


def test_a_finished_run_waits_for_the_last_statistics_before_its_final_accounting():
    """The last experience can reach the run before its stage wrote the commit group's statistics: the
    final snapshot and summary.json wait for every stage to balance, and give up after the timeout."""
    import threading

    from expstream.config.topology import load_topology
    from expstream.state.memory import MemoryState
    from expstream.tools.accounting import wait_balanced

    topo = load_topology(None, [])
    state = MemoryState()
    for st in topo.enabled_stages():
        state.record_batches(st.name, [("b0", {"in": 4, "out": 4}, 0.01, 4)])
    last = topo.enabled_stages()[-1].name
    state.record_batches(last, [("b1", {"in": 4}, 0.01, 4)])  # taken in, its output not yet recorded
    assert not wait_balanced(state, topo, timeout_s=0.2)  # in flight stays in flight: no wait forever
    late = threading.Timer(0.3, lambda: state.record_batches(last, [("b1-out", {"out": 4}, None, 0)]))
    late.start()
    try:
        assert wait_balanced(state, topo, collected=8, timeout_s=30)
    finally:
        late.cancel()
    assert state.flows()[last] == {"in": 8, "out": 8}
    # balanced, but the run collected more than the last stage has counted: its last records are not in yet
    assert not wait_balanced(state, topo, collected=12, timeout_s=0.2)
    state.record_batches(last, [("b2", {"in": 4, "out": 4}, 0.01, 4)])
    assert wait_balanced(state, topo, collected=12, timeout_s=30)


def test_the_bottleneck_is_the_stage_with_input_waiting_and_status_renders_it():
    from rich.console import Console

    snap = _snap(generate=0, reward=12, advantage=1)
    assert snap["bottleneck"]["stage"] == "reward" and "12 input records waiting" in snap["bottleneck"]["why"]
    console = Console(width=140, record=True)
    console.print(render_status(snap))
    text = console.export_text()
    assert "bottleneck: reward (12 input records waiting" in text
    assert all(name in text for name in ("generate", "reward", "advantage")) and "policy v3" in text
    idle = _snap(generate=0, reward=0)
    idle["stages"]["generate"]["busy_share"] = 0.9
    assert bottleneck(idle["stages"])["stage"] == "generate"
    # a run's last snapshot: samples still "in flight" after it ended are flagged (and only then)
    done = _snap(generate=0, reward=0)
    done["stages"]["reward"]["in_flight"] = 3
    console = Console(width=160, record=True)
    console.print(render_status(done))
    assert "ended" not in console.export_text()  # a live run: 3 in flight is normal
    done["finished"] = True
    console = Console(width=160, record=True)
    console.print(render_status(done))
    assert "the run has ended: reward do not balance" in console.export_text()
    done["stages"]["reward"]["in_flight"] = 0
    console = Console(width=160, record=True)
    console.print(render_status(done))
    assert "the run has ended: every stage balances" in console.export_text()


# -- the dashboard and the compose profile -----------------------------------------------------------
def test_every_dashboard_panel_queries_a_metric_the_code_exports():
    dash = json.loads((ROOT / "deploy/monitoring/grafana/dashboards/expstream.json").read_text())
    exported = exported_names()
    titles = []
    for panel in dash["panels"]:
        names = {m for t in panel["targets"] for m in re.findall(r"\bexpstream_[a-z_]+", t["expr"])}
        assert names, f"panel {panel['title']!r} queries no expstream metric"
        assert names <= exported, f"panel {panel['title']!r} queries {sorted(names - exported)}, not exported"
        titles.append(panel["title"].lower())
    for need in ("samples per second", "lag", "time per micro-batch", "dead letters", "reward mean", "staleness"):
        assert any(need in t for t in titles), f"no panel for {need}"
    assert all(n.startswith("expstream_") for n in METRICS)
    assert all(n.endswith("_total") for n, (kind, _, _) in METRICS.items() if kind == "counter")


def test_the_monitoring_profile_scrapes_the_stages_and_keeps_secrets_out():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    svcs = compose["services"]
    assert svcs["prometheus"]["profiles"] == ["monitoring"] == svcs["grafana"]["profiles"]
    assert svcs["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"] == "${GRAFANA_ADMIN_PASSWORD:-}"
    # a blank password stops grafana at its start, not every `docker compose up` (the profile may be off)
    assert "GF_SECURITY_ADMIN_PASSWORD" in " ".join(svcs["grafana"]["entrypoint"])
    prom = yaml.safe_load((ROOT / "deploy/monitoring/prometheus.yml").read_text())
    sd = prom["scrape_configs"][0]["dns_sd_configs"][0]
    from expstream.config.topology import STAGE_ORDER

    assert set(sd["names"]) == set(STAGE_ORDER) and sd["port"] == 9400
    assert compose["x-stage"]["environment"]["EXPSTREAM_METRICS_PORT"] == "9400"


# -- a live run ------------------------------------------------------------------------------------
def _wait(pred, timeout_s: float, what: str, proc=None):
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}: {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.2)


@pytest.mark.e2e
def test_a_live_run_is_visible_in_metrics_status_headers_accounting_and_report(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    # enough work that the run is still live while status scrapes it (120 prompts could end within the
    # status command's own start-up since stages no longer wait for a group join)
    n_prompts, n = 600, 2
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "label": str(2 * i)}) + "\n"
                               for i in range(n_prompts)))
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started_ms = int(time.time() * 1000)
    proc = subprocess.Popen([sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
                             "--no-progress", "--set", f"generate.n_samples_per_prompt={n}", "--set",
                             "generate.max_new_tokens=24", "--set", "run.prompt_batch_size=1"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "run" / "metrics"
        _wait(lambda: (metrics / "advantage-0.json").exists() and (metrics / "supervisor.json").exists(), 120,
              "metrics files", proc)
        _wait(lambda: (out / "status.jsonl").exists() and (out / "status.jsonl").read_text().count("\n") >= 1, 60,
              "a status snapshot", proc)
        # scrape generate while it works: the exposition parses, counters agree with what it was fed
        url = json.loads((metrics / "generate-0.json").read_text())["url"]

        def scraped() -> dict:
            import urllib.request

            text = urllib.request.urlopen(url, timeout=5).read().decode()
            return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                    if s.labels.get("stage") == "generate"}

        live = _wait(lambda: (m := scraped()).get("expstream_records_processed_total", 0) >= 2 and m, 60,
                     "processed records", proc)
        assert live["expstream_samples_processed_total"] == n * live["expstream_records_processed_total"]
        assert live["expstream_batch_seconds_count"] == live["expstream_records_processed_total"]
        assert live["expstream_batch_seconds_sum"] > 0 and live["expstream_send_seconds_count"] >= 1
        # status on the live run: JSON and the table
        res = subprocess.run([sys.executable, "-m", "expstream", "status", "--run-dir", str(out), "--json"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr[-2000:]
        snap = json.loads(res.stdout)
        assert proc.poll() is None, "the run ended before status looked at it: give the test more work"
        assert list(snap["stages"])[:2] == ["generate", "shard-preprocess"] and snap["bottleneck"]["stage"]
        # the policy version each stage's replicas handled last (their gauges): 0, no trainer in this run
        assert snap["stages"]["generate"]["policy_version_seen"] == 0 and snap["policy_version"] == 0
        for name, s in snap["stages"].items():
            assert s["replicas_alive"] >= 1 and s["input_lag_records"] >= 0 and s["samples_out"] <= s["samples_in"] \
                + (s["samples_in"] if name == "advantage" else 0), (name, s)
        res = subprocess.run([sys.executable, "-m", "expstream", "status", "--run-dir", str(out)], cwd=ROOT,
                             env={**env, "COLUMNS": "140"}, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and "bottleneck:" in res.stdout and "advantage" in res.stdout, res.stdout
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_complete"] == n_prompts
    acc = summary["accounting"]
    assert set(acc) >= {"generate", "reward", "advantage"}
    for name, a in acc.items():
        assert a["balanced"] and a["samples_in"] == a["samples_out"] == n_prompts * n, (name, a)
    # every recorded record names its producer, the policy version and a production time in the run
    from expstream.tools.recording import iter_topic

    producer_of = {"rollouts": "generate", "experiences": "advantage", "prompts": "feeder", "rewarded": "reward"}
    ended_ms = int(time.time() * 1000)
    for topic, producer in producer_of.items():
        frames = list(iter_topic(out, topic))
        assert frames, topic
        for f in frames:
            p = read_provenance(f.headers)
            assert p is not None and p.producer == producer and p.policy_version == 0, (topic, f.headers)
            # stamped when the record was built for sending: inside the run, and no later than the Kafka
            # timestamp the producer client gave the record at send() (an order, not a closeness in seconds)
            assert started_ms <= p.produced_at_ms <= f.timestamp <= ended_ms, (topic, p, f.timestamp)
    # the report, written at the end of the run
    html = (out / "report.html").read_text()
    pngs = re.findall(r"src='(report/[^']+\.png)'", html)
    from expstream.tools.report import MIN_SNAPSHOTS

    snapshots = (out / "status.jsonl").read_text().count("\n")
    flow = ({"report/samples_per_s.png", "report/lag.png", "report/batch_p95.png"} if snapshots >= MIN_SNAPSHOTS
            else {"report/records_per_s.png"})  # a run shorter than two sampling intervals: from the recording
    assert flow | {"report/reward.png", "report/advantage.png", "report/response_length.png"} <= set(pngs), snapshots
    for p in pngs:
        assert (out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"<td>groups_complete</td><td>{n_prompts}</td>" in html


def test_the_report_of_a_run_dir_with_only_a_trainer_log_and_no_experiences(tmp_path):
    """Missing inputs leave their section saying so; a continuous run's train.jsonl gives the reward curve
    and the trainer's staleness histogram."""
    from expstream.tools.report import write_report

    lines = [{"step": i, "reward_mean": 0.1 * i, "staleness_hist": {"0": 4, "1": 2}} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{torn")
    (tmp_path / "summary.json").write_text(json.dumps({"run_id": "hand", "samples": 40, "accounting": {
        "reward": {"samples_in": 10, "samples_out": 8, "samples_dead": 1, "samples_dropped": 0, "in_flight": 1,
                   "balanced": False}}}))
    html = write_report(tmp_path).read_text()
    assert "report/reward_curve.png" in html and "report/staleness.png" in html
    assert "no status.jsonl" in html and "experiences.msgpack not readable" in html
    assert "<td>samples</td><td>40</td>" in html
    assert "in 10 = out 8 + dead 1 + dropped 0 + in flight 1  ✗ imbalance" in html


def test_expstream_report_command_plots_a_continuous_run_from_its_recorded_experiences(tmp_path):
    """A continuous run's experiences went to the trainer (no experiences.msgpack): the distributions
    come from the recorded ``experiences`` topic; the command writes report.html and its PNGs."""
    import numpy as np

    from expstream.cli import main
    from expstream.tools.recording import RecordFrame, RecordingWriter
    from schemas import Ragged, SampleBatch, encode

    def batch(group: str, rewards: list[float]) -> SampleBatch:
        b = len(rewards)
        ids = Ragged.from_rows([np.arange(4 + i, dtype=np.int32) for i in range(b)], "int32")
        return SampleBatch(batch_id=f"g/{group}", policy_version=0, n_samples_per_prompt=b, eos_token_id=3,
                           pad_token_id=0, prompt_id=[group] * b, group_id=[group] * b, sample_index=list(range(b)),
                           prompt=["q"] * b, label=[""] * b, reference=[""] * b, response=["r"] * b,
                           prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)] * b, "int32"), response_ids=ids,
                           layout="padded", action_ids=ids,
                           action_mask=Ragged.from_rows([np.ones(4 + i, bool) for i in range(b)], "bool"),
                           advantages=Ragged.from_rows([np.full(4 + i, r, np.float32) for i, r in enumerate(rewards)],
                                                       "float32"),
                           rewards=np.asarray(rewards, np.float32))

    with RecordingWriter(tmp_path) as w:
        for k, b in enumerate([batch("a", [0.0, 1.0]), batch("b", [0.5, 0.25]), batch("a", [0.0, 1.0])]):
            w.append(RecordFrame("experiences", 0, k, 1_764_000_000_000 + k, b"k", encode(b)))
    (tmp_path / "train.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.4}) + "\n")
    assert main(["report", str(tmp_path)]) == 0
    html = (tmp_path / "report.html").read_text()
    assert "from the recorded experiences topic" in html
    for png in ("reward.png", "advantage.png", "response_length.png", "reward_curve.png"):
        assert f"report/{png}" in html and (tmp_path / "report" / png).read_bytes()[:4] == b"\x89PNG", png
    from expstream.tools.report import experience_arrays

    arr = experience_arrays(tmp_path)  # the repeated group "a" record is counted once (dedupe by sample id)
    assert sorted(arr["reward"].tolist()) == [0.0, 0.25, 0.5, 1.0]
    assert arr["advantage"].size == 4 + 5 + 4 + 5


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path, capsys):
    from expstream.cli import main

    (tmp_path / "notes.txt").write_text("my files")
    assert main(["report", str(tmp_path)]) == 2  # was: report.html and report/ written into it
    err = capsys.readouterr().err
    assert "RUN_DIR" in err and "is not a run directory" in err and "summary.json" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
