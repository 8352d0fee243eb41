"""Reward at scale: a slow remote judge, reward replicas 1/2/4, in-flight 1 vs 8, and the autoscaler.

Starts one ``expstream serve-reward --fn expstream.rewards:response_length --latency-ms 200`` (a
judge that answers every request after a fixed latency) on a free loopback port, then runs
``expstream run`` as a subprocess once per setting (each with its embedded broker and
redis-server, the same prompts, seed and knobs), with ``rewards.sources`` = that one http source:

* **replicas**: ``stages.reward.replicas`` 1, 2, 4 at ``max_in_flight`` 1 (``batch_size`` 1, so a
  micro-batch of 8 samples costs 8 sequential requests of one item: the judge's latency is the
  reward stage's work);
* **in-flight**: one replica at ``max_in_flight`` 8 against the replicas=1 setting above (the same
  run: ``max_in_flight`` 1, ``batch_size`` 1): the 8 requests of a micro-batch overlap;
* **autoscale**: ``stages.reward.autoscale: {min: 1, max: 4, target_lag_per_replica, cooldown_s}``
  on the same workload (``max_in_flight`` 1): replicas and lag over time, the time to reach steady
  state and the final throughput against the best fixed replica count.

Every run uses ``topics.partitions`` = 4 (the most replicas any setting runs: a replica without a
partition idles) and small generation knobs (``max_new_tokens``, ``n_samples_per_prompt``) so that
generate is not the bottleneck; the output names the bottleneck stage of every run (runner time
per replica over the run's wall, and the reward stage's backlog).

Throughput is summary.json's ``steady_samples_per_s`` (first to last experience arrival: start-up
excluded). A sampler thread in this script reads, every second, the reward group's lag on its input
topic (``expstream.kafka.clients.topic_lag``), the records on the reward stage's output topic, and the
group's member count (the replicas actually consuming); the autoscaled run's scale events come
from its summary.json (``scale_events``). Ratios are measured in the same invocation, never
asserted; the script exits non-zero only when a run fails.

Writes ``bench/results/reward_scale.json`` (the one-line summary) and, with matplotlib (optional
extra ``bench``), ``bench/results/reward_scale-autoscale.png``.

Usage: ``.venv/bin/python bench/reward_scale.py [--prompts 64] [--latency-ms 200] [--replicas 1,2,4]
[--in-flight 8] [--no-autoscale] [--set key=value] [--keep-runs]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, ROOT, fmt, machine, progress, ratio, rounded, save, table, write_prompts

SCORE_FN = "expstream.rewards:response_length"
SOURCE = "judge"  # the one reward source's name (its key in reward_metrics)
#: Every setting's partitions (--partitions): the most replicas of any setting (4) each get one.
PARTITIONS = 4
#: Knobs that keep generation and the other stages well ahead of the reward stage (see the docstring).
BASE_SETS = [
    "generate.max_new_tokens=8",
    "generate.n_samples_per_prompt=4",
    "run.prompt_batch_size=2",           # 2 groups x 4 samples = one micro-batch of 8 per record
    "algo.micro_rollout_batch_size=8",
    "models.reward=null",                # the http source replaces the reward model
    "record.enabled=false",              # the recorder's CPU is not what is measured here
]
# Why 30 min: the slowest setting (1 replica, 1 request in flight) takes ~1 min at the defaults.
RUN_TIMEOUT_S = 1800
# Why 1 s: the issue's cadence for the lag sampler; a tick costs an admin round trip and one probe fetch.
SAMPLE_EVERY_S = 1.0
# Why 20 s: the judge's start is an interpreter plus aiohttp import; 20 s is ~5x that on a busy machine.
JUDGE_START_TIMEOUT_S = 20.0
# Why 60 s: services.json is written once the broker and redis answer (~2-5 s); past 60 s the run failed.
SERVICES_TIMEOUT_S = 60.0
#: The autoscaled run is "steady" from the first window at this share of its own plateau (best window).
STEADY_SHARE = 0.9
# Why 5 s: a micro-batch takes ~1.6 s on one replica at in-flight 1; 5 s holds several of them.
RATE_WINDOW_S = 5.0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="generated prompts per run (x n_samples_per_prompt samples)")
    p.add_argument("--latency-ms", type=int, default=200, help="the judge's fixed latency per request")
    p.add_argument("--replicas", default="1,2,4", help="reward replica counts (1 first: the baseline)")
    p.add_argument("--in-flight", type=int, default=8, help="max_in_flight of the in-flight setting (vs 1)")
    p.add_argument("--partitions", type=int, default=PARTITIONS,
                   help="topics.partitions of every run (at least the largest replica count)")
    p.add_argument("--batch-size", type=int, default=1, help="items per request (several requests per micro-batch)")
    p.add_argument("--target-lag", type=int, default=2, help="autoscale target_lag_per_replica (records)")
    p.add_argument("--cooldown-s", type=float, default=4.0, help="autoscale cooldown_s")
    p.add_argument("--no-autoscale", action="store_true", help="skip the autoscaled run")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="topology override passed to every run; repeatable")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' output directories")
    return p.parse_args()


# -- the judge --------------------------------------------------------------------------------------------

class Judge:
    """``expstream serve-reward`` on a free loopback port, stopped by its pid."""

    def __init__(self, latency_ms: int, log_path: Path) -> None:
        from expstream.launch.localservers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_path.open("w")
        cmd = [sys.executable, "-m", "expstream", "serve-reward", "--fn", SCORE_FN, "--host", "127.0.0.1",
               "--port", str(self.port), "--latency-ms", str(latency_ms)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        self.health = self._wait_healthy(log_path)

    def _wait_healthy(self, log_path: Path) -> dict[str, Any]:
        deadline = time.monotonic() + JUDGE_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve-reward exited with {self.proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                    return json.loads(resp.read())
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise SystemExit(f"serve-reward did not answer GET /health within {JUDGE_START_TIMEOUT_S:.0f}s "
                         f"(log: {log_path.read_text()[-3000:]})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def source_set(url: str, in_flight: int, batch_size: int) -> str:
    spec = {SOURCE: {"kind": "http", "url": url, "timeout_s": 10, "max_in_flight": in_flight,
                     "batch_size": batch_size, "retries": 3}}
    return "rewards.sources=" + json.dumps(spec)  # JSON is YAML: --set parses the value as YAML


# -- the sampler ------------------------------------------------------------------------------------------

@dataclass
class Tick:
    t: float           # seconds since the `expstream run` process started
    lag: int           # records of the reward stage's input not committed by its group
    lag_parts: dict[int, int]
    out_records: int   # records on the reward stage's output topic
    in_parts: dict[int, int]  # records on each partition of the reward stage's input topic
    replicas: int      # live reward replica processes (by their process title)


@dataclass
class Sampler:
    """Every second: the reward group's lag, its input's and output's records, its live replicas."""

    out_dir: Path
    t0: float
    ticks: list[Tick] = field(default_factory=list)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="lag-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        try:
            self._sample()
        except Exception as exc:  # noqa: BLE001 - reported with the results, the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def _sample(self) -> None:
        from kafka import TopicPartition

        from expstream.config.topology import load_topology
        from expstream.kafka.clients import end_offsets, make_admin, topic_lag

        services = self.out_dir / "run" / "services.json"
        topo_file = self.out_dir / "run" / "topology.yaml"
        deadline = time.monotonic() + SERVICES_TIMEOUT_S
        while not (services.exists() and topo_file.exists()):
            if self._stop.wait(0.2) or time.monotonic() > deadline:
                return
        time.sleep(0.5)  # topics are created right after services.json
        info = json.loads(services.read_text())
        topo = load_topology(topo_file)
        reward = topo.stages["reward"]
        group = f"expstream.{info['run_id']}.reward"
        bootstrap = info["bootstrap_servers"]
        admin = make_admin(bootstrap, topo.kafka)
        out_tps = [TopicPartition(reward.output, p) for p in range(topo.topics.partitions)]
        in_tps = [TopicPartition(reward.input, p) for p in range(topo.topics.partitions)]
        try:
            while not self._stop.is_set():
                began = time.monotonic()
                try:
                    lag = topic_lag(bootstrap, topo.kafka, group, reward.input, admin=admin, timeout_s=5)
                    ends = end_offsets(bootstrap, topo.kafka, out_tps + in_tps, timeout_s=5)
                except Exception as exc:  # noqa: BLE001 - topics not there yet or the broker stopping
                    self.error = f"{type(exc).__name__}: {exc}"
                else:
                    self.ticks.append(Tick(round(began - self.t0, 3), sum(lag.values()), lag,
                                           sum(ends[tp] for tp in out_tps), {tp.partition: ends[tp] for tp in in_tps},
                                           replica_processes("reward", info["run_id"])))
                self._stop.wait(max(0.0, SAMPLE_EVERY_S - (time.monotonic() - began)))
        finally:
            admin.close()


def replica_processes(stage: str, run_id: str) -> int:
    """Live processes titled ``expstream stage <stage>[i] run=<run_id>`` (expstream.procs.stage_title).

    Counted from /proc rather than the consumer group: kafka-python 3.0's DescribeGroups cannot
    parse Tansu's answer (its authorized_operations bits are not valid ACL operations).
    """
    head, tail = f"expstream stage {stage}[".encode(), f" run={run_id}".encode()
    n = 0
    for pid_dir in Path("/proc").glob("[0-9]*"):
        try:
            title = (pid_dir / "cmdline").read_bytes().split(b"\0")[0].rstrip()
        except OSError:  # the process ended while we looked
            continue
        n += title.startswith(head) and title.endswith(tail)
    return n


# -- one run ------------------------------------------------------------------------------------------------

def run_setting(label: str, prompts: Path, sets: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
           "--run-id", f"rs-{label}", "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    t0, t0_epoch = time.monotonic(), time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(out, t0)
    sampler.start()
    try:
        stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise SystemExit(f"{label}: expstream run took over {RUN_TIMEOUT_S}s (output in {out})") from None
    finally:
        sampler.stop()
    cmd_wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.stderr.write(stdout[-3000:] + stderr[-6000:])
        raise SystemExit(f"{label}: expstream run failed with exit code {proc.returncode} (output in {out})")
    summary = json.loads((out / "summary.json").read_text())
    topo = summary_topology(out)
    ups = [e["to"] for e in summary.get("scale_events") or [] if e.get("stage") == "reward" and isinstance(e.get("to"), int)]
    if ups:  # an autoscaled run: the busy share over the most replicas it ran
        topo["replicas"]["reward"] = max([topo["replicas"]["reward"], *ups])
    return {
        "label": label,
        "t0_epoch": t0_epoch,
        "cmd_wall_s": round(cmd_wall, 3),
        "wall_s": summary["wall_s"],
        "samples": summary["samples"],
        "steady_samples_per_s": summary.get("steady_samples_per_s"),
        "samples_per_s": summary.get("samples_per_s"),
        "first_experience_after_s": summary.get("first_experience_after_s"),
        "dead_letters": len(summary.get("dead_letters") or []),
        "stage_restarts": summary.get("stage_restarts") or {},
        "scale_events": summary.get("scale_events") or [],
        "stages": busy_shares(summary, topo, active_span(summary)),
        "samples_per_record": topo["mrb"],
        "ticks": [t.__dict__ for t in sampler.ticks],
        "sampler_error": sampler.error,
        "input_partition_records": sampler.ticks[-1].in_parts if sampler.ticks else {},
    }


def summary_topology(out: Path) -> dict[str, Any]:
    from expstream.config.topology import load_topology

    topo = load_topology(out / "topology.yaml")
    return {"replicas": {st.name: st.replicas for st in topo.enabled_stages()},
            "mrb": topo.algo.micro_rollout_batch_size}


def active_span(summary: dict[str, Any]) -> float:
    """Seconds the pipeline worked: first to last experience (steady rate) when known, else the wall
    after the first experience; start-up (process start, model loads, group joins) left out."""
    steady = summary.get("steady_samples_per_s")
    if steady:
        return summary["samples"] / steady
    return max(summary["wall_s"] - (summary.get("first_experience_after_s") or 0.0), 1e-3)


def busy_shares(summary: dict[str, Any], topo: dict[str, Any], span: float) -> dict[str, dict[str, Any]]:
    """Per stage: runner seconds per replica over the active span (1.0 = every replica always busy).

    A stage's runner time includes waiting on the judge, so the reward stage's share is its
    occupancy, not CPU. The stage with the highest share is the bottleneck. The share can pass
    1.0 a little: the first micro-batches are worked on before the first experience arrives.
    """
    wall = span
    out = {}
    for name, s in (summary.get("stages") or {}).items():
        replicas = topo["replicas"].get(name, 1)
        out[name] = {"replicas": replicas, "batches": s.get("batches"), "ms_per_batch": s.get("ms_per_batch"),
                     "busy": round(s.get("seconds", 0.0) / (replicas * wall), 3)}
    return out


def bottleneck(r: dict[str, Any]) -> str:
    stages = r["stages"]
    if not stages:
        return "n/a"
    name = max(stages, key=lambda n: stages[n]["busy"])
    return f"{name} ({stages[name]['busy']:.0%} busy)"


def backlog(r: dict[str, Any]) -> tuple[int | None, float | None]:
    """The reward group's largest lag and its mean over the ticks with work in flight (records)."""
    lags = [t["lag"] for t in r["ticks"]]
    busy = [x for x in lags if x > 0]
    return (max(lags) if lags else None, sum(busy) / len(busy) if busy else None)


# -- the autoscaler's curves -----------------------------------------------------------------------------

def windowed_rates(ticks: list[dict[str, Any]], per_record: int) -> list[tuple[float, float]]:
    """(t, samples/s of the reward stage's output over the last RATE_WINDOW_S) at each tick."""
    out = []
    for i, t in enumerate(ticks):
        j = i
        while j > 0 and t["t"] - ticks[j - 1]["t"] <= RATE_WINDOW_S:
            j -= 1
        span = t["t"] - ticks[j]["t"]
        if span >= RATE_WINDOW_S / 2:
            out.append((t["t"], (t["out_records"] - ticks[j]["out_records"]) * per_record / span))
    return out


def event_time(ev: dict[str, Any], t0_epoch: float) -> float | None:
    """A scale event's time on the sampler's clock (seconds since `expstream run` started).

    summary.json's events carry ``time`` (unix) and ``t_s`` (since the run's scaler started, a
    clock this script does not see): the unix time is the one to align with the ticks.
    """
    t = ev.get("time")
    return float(t) - t0_epoch if isinstance(t, int | float) else None


def peak_window_rate(r: dict[str, Any]) -> float:
    """The reward stage's best RATE_WINDOW_S output rate in a run (samples/s): its speed while
    every replica has a backlog, without the start-up and the tail of the run."""
    return max((v for _, v in windowed_rates(r["ticks"], r["samples_per_record"])), default=float("nan"))


def autoscale_report(r: dict[str, Any], best: dict[str, Any] | None) -> dict[str, Any]:
    """Replicas, time to steady state and throughput of the autoscaled run against ``best``.

    * work arrives: the first tick with records on the reward stage's input topic (or the first
      scale-up, if the autoscaler saw them first);
    * time to peak replicas: from then to the scale event that reached the largest count;
    * time to steady: from then to the end of the first RATE_WINDOW_S window whose rate is
      STEADY_SHARE of the run's own plateau (its best window): the settling time, conservative
      by up to one window;
    * final throughput: steady samples/s and the plateau against the best fixed replica count.
    """
    ticks = r["ticks"]
    rates = windowed_rates(ticks, r["samples_per_record"])
    events = [(event_time(e, r["t0_epoch"]), e) for e in r["scale_events"] if e.get("stage") == "reward"]
    ups = [(t, e) for t, e in events if t is not None and _to(e) is not None and _to(e) > (_from(e) or 0)]
    downs = [(t, e) for t, e in events if t is not None and _to(e) is not None and _to(e) < (_from(e) or 0)]
    first_work = next((t["t"] for t in ticks if t["lag"] > 0 or sum(t["in_parts"].values()) > 0), None)
    start = min([x for x in (first_work, ups[0][0] if ups else None) if x is not None], default=None)
    peak = max((_to(e) for _, e in ups), default=r["stages"].get("reward", {}).get("replicas"))
    at_peak = next((t for t, e in ups if _to(e) == peak), None)
    best_window = peak_window_rate(best) if best else float("nan")
    plateau = peak_window_rate(r)
    target = STEADY_SHARE * plateau if plateau == plateau else None
    reached = next((t for t, v in rates if target is not None and v >= target), None)
    alive = [t["replicas"] for t in ticks]
    return {
        "work_arrived_at_s": start,
        "peak_replicas": peak,
        "max_replica_processes_seen": max(alive, default=None),
        "time_to_peak_replicas_s": rounded(at_peak - start, 1) if at_peak is not None and start is not None else None,
        "time_to_steady_s": rounded(reached - start, 1) if reached is not None and start is not None else None,
        "steady_target_samples_per_s": rounded(target or float("nan")),
        "peak_window_rate": rounded(plateau),
        "best_fixed_peak_window_rate": rounded(best_window),
        "peak_window_vs_best_fixed": rounded(ratio(peak_window_rate(r), best_window)),
        "scale_ups": len(ups),
        "scale_downs": len(downs),
        "steady_vs_best_fixed": rounded(ratio(r["steady_samples_per_s"] or float("nan"),
                                              (best or {}).get("steady_samples_per_s") or float("nan"))),
        "rates": [(round(t, 2), round(v, 2)) for t, v in rates],
    }


def _to(ev: dict[str, Any]) -> int | None:
    return ev["to"] if isinstance(ev.get("to"), int) else None


def _from(ev: dict[str, Any]) -> int | None:
    return ev["from"] if isinstance(ev.get("from"), int) else None


def plot(r: dict[str, Any], rep: dict[str, Any], best_fixed: float | None, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment: no PNG written (pip install 'expstream[bench]')"
    ticks = r["ticks"]
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    mt = [(t["t"], t["replicas"]) for t in ticks if t["replicas"] is not None]
    if mt:
        ax1.plot([t for t, _ in mt], [m for _, m in mt], ".", label="live reward replica processes (sampled)")
    steps = _replica_steps(r)
    if steps:
        ax1.step([t for t, _ in steps], [n for _, n in steps], where="post", label="replicas (scale events)")
    ax1.set_ylabel("reward replicas")
    ax1.legend(loc="center right", fontsize=8)
    ax2.plot([t["t"] for t in ticks], [t["lag"] for t in ticks], label="lag (records)")
    ax2.set_ylabel("reward input lag (records)")
    ax3.plot([t for t, _ in rep["rates"]], [v for _, v in rep["rates"]], label=f"output rate ({RATE_WINDOW_S:.0f} s window)")
    if best_fixed:
        ax3.axhline(best_fixed, linestyle="--", color="grey", label="best fixed replica count (steady)")
    if rep.get("best_fixed_peak_window_rate"):
        ax3.axhline(rep["best_fixed_peak_window_rate"], linestyle=":", color="black",
                    label="best fixed replica count (peak window)")
    ax3.set_ylabel("samples/s")
    ax3.set_xlabel("seconds since `expstream run` started")
    ax3.legend(loc="lower right", fontsize=8)
    ax1.set_title("reward autoscaler: replicas, backlog and throughput")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def _replica_steps(r: dict[str, Any]) -> list[tuple[float, int]]:
    start = r["stages"].get("reward", {}).get("replicas")
    events = [(event_time(e, r["t0_epoch"]), _to(e)) for e in r["scale_events"]]
    events = [(t, n) for t, n in events if t is not None and n is not None]
    if not events:
        return []
    first = _from(r["scale_events"][0]) or start or 1
    last_t = r["ticks"][-1]["t"] if r["ticks"] else events[-1][0]
    return [(0.0, first)] + events + [(last_t, events[-1][1])]


# -- main ---------------------------------------------------------------------------------------------------

def main() -> int:
    args = parse_args()
    replicas = [int(x) for x in args.replicas.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-reward-scale-"))
    prompts = write_prompts(work / "prompts.jsonl", args.prompts)
    info = machine()
    progress(f"machine: {info}")
    judge = Judge(args.latency_ms, work / "judge.log")
    progress(f"judge at {judge.url} ({args.latency_ms} ms per request): {judge.health}")
    base = BASE_SETS + [f"topics.partitions={args.partitions}"] + args.overrides
    results: dict[str, dict[str, Any]] = {}
    try:
        plan = [(f"r{n}", n, 1) for n in replicas] + [(f"r1-if{args.in_flight}", 1, args.in_flight)]
        for label, n, in_flight in plan:
            progress(f"{label}: {n} reward replica(s), max_in_flight {in_flight}, batch_size {args.batch_size}")
            sets = base + [source_set(judge.url, in_flight, args.batch_size), f"stages.reward.replicas={n}"]
            r = run_setting(label, prompts, sets, work / label)
            results[label] = r
            progress(f"{label}: steady {fmt(r['steady_samples_per_s'])} samples/s, wall {r['wall_s']:.1f}s, "
                     f"bottleneck {bottleneck(r)}")
        fixed = {f"r{n}": results[f"r{n}"]["steady_samples_per_s"] or 0.0 for n in replicas}
        best_label = max(fixed, key=lambda k: fixed[k])  # the best fixed replica count at in-flight 1
        if not args.no_autoscale:
            label = "autoscale"
            spec = {"min": 1, "max": max(replicas), "target_lag_per_replica": args.target_lag,
                    "cooldown_s": args.cooldown_s}
            progress(f"{label}: stages.reward.autoscale={spec}")
            sets = base + [source_set(judge.url, 1, args.batch_size), "stages.reward.replicas=1",
                           "stages.reward.autoscale=" + json.dumps(spec)]
            results[label] = run_setting(label, prompts, sets, work / label)
            results[label]["autoscale"] = spec
            progress(f"{label}: steady {fmt(results[label]['steady_samples_per_s'])} samples/s, "
                     f"{len(results[label]['scale_events'])} scale events")
    finally:
        judge.stop()
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
        else:
            progress(f"runs kept in {work}")
    return report(args, replicas, results, best_label, info)


def _x(a: float | None, b: float | None) -> float:
    return ratio(a if a is not None else float("nan"), b if b is not None else float("nan"))


def report(args: argparse.Namespace, replicas: list[int], results: dict[str, dict[str, Any]],
           best_label: str, info: dict[str, Any]) -> int:
    base = results[f"r{replicas[0]}"]
    base_window = peak_window_rate(base)
    rows = []
    for label, r in results.items():
        peak, mean = backlog(r)
        parts = r["input_partition_records"]
        spread = "/".join(str(parts[p]) for p in sorted(parts)) if parts else "n/a"
        n = r["stages"].get("reward", {}).get("replicas", 1) if label != "autoscale" else max(replicas)
        window = peak_window_rate(r)
        rows.append([label, r["samples"], r["wall_s"], r["steady_samples_per_s"],
                     _x(r["steady_samples_per_s"], base["steady_samples_per_s"]), window, _x(window, base_window),
                     ideal_ratio(parts, n), fmt(peak), fmt(mean, ".1f"), spread, bottleneck(r), r["dead_letters"]])
    print(table(["setting", "samples", "wall s", "steady samples/s", f"x vs {base['label']}",
                 f"peak {RATE_WINDOW_S:.0f}s window", f"x vs {base['label']}", "key-spread cap x", "max lag",
                 "mean lag", "records per partition", "bottleneck (busy)", "dead letters"], rows,
                title=f"reward stage behind a {args.latency_ms} ms judge (batch_size {args.batch_size}; "
                      f"r<N> = N replicas at max_in_flight 1; lag in records of "
                      f"{base['samples_per_record']} samples)"))
    print("steady = summary.json steady_samples_per_s (first to last experience); peak window = the reward stage's "
          "output rate over the best window (every replica busy); key-spread cap = total records / the busiest "
          "replica's records under range assignment of the partitions (the most N replicas can gain on this workload)")
    print()
    names = list(base["stages"])
    print(table(["stage"] + list(results), [[n] + [f"{r['stages'].get(n, {}).get('busy', float('nan')):.0%}"
                                                    for r in results.values()] for n in names],
                title="busy share per stage (runner seconds / (replicas x first-to-last-experience span)); "
                      "the highest is the bottleneck (autoscale: over the most replicas it ran)"))
    print()
    inflight = f"r1-if{args.in_flight}"
    ratios: dict[str, Any] = {}
    for n in replicas[1:]:
        r = results[f"r{n}"]
        ratios[f"replicas {n}/{replicas[0]}"] = {
            "steady": rounded(_x(r["steady_samples_per_s"], base["steady_samples_per_s"])),
            "peak_window": rounded(_x(peak_window_rate(r), base_window)),
            "key_spread_cap": rounded(ideal_ratio(r["input_partition_records"], n))}
    r = results[inflight]
    ratios[f"in_flight {args.in_flight}/1"] = {
        "steady": rounded(_x(r["steady_samples_per_s"], results["r1"]["steady_samples_per_s"])),
        "peak_window": rounded(_x(peak_window_rate(r), peak_window_rate(results["r1"])))}
    for k, v in ratios.items():
        print(f"{k}: " + ", ".join(f"{kk} {fmt(vv)}x" for kk, vv in v.items()))
    print("goals (printed, never asserted): replicas 4/1 >= 3.5x, in_flight 8/1 >= 4x (end-to-end steady samples/s)")
    auto = None
    note = "no autoscaled run"
    if "autoscale" in results:
        r, best = results["autoscale"], results[best_label]
        auto = autoscale_report(r, best)
        print()
        print(f"autoscale {r['autoscale']}: best fixed = {best_label} at {fmt(best['steady_samples_per_s'])} samples/s "
              f"steady, {fmt(auto['best_fixed_peak_window_rate'])} peak window")
        print(f"  final throughput: steady {fmt(r['steady_samples_per_s'])} samples/s = "
              f"{fmt(auto['steady_vs_best_fixed'])}x the best fixed; peak window {fmt(auto['peak_window_rate'])} = "
              f"{fmt(auto['peak_window_vs_best_fixed'])}x")
        print(f"  work arrived at {fmt(auto['work_arrived_at_s'], '.1f')} s (since the command started); "
              f"{fmt(auto['peak_replicas'])} replicas after {fmt(auto['time_to_peak_replicas_s'], '.1f')} s; "
              f"steady state ({STEADY_SHARE:.0%} of its plateau) after "
              f"{fmt(auto['time_to_steady_s'], '.1f')} s; scale-ups {auto['scale_ups']}, "
              f"scale-downs {auto['scale_downs']}")
        for ev in r["scale_events"]:
            t = event_time(ev, r["t0_epoch"])
            print(f"  scale event at {fmt(t, '.1f')} s: {json.dumps(ev, default=str)}")
        note = plot(r, auto, best["steady_samples_per_s"], RESULTS_DIR / "reward_scale-autoscale.png")
        print(note)
    for label, r in results.items():
        if r["sampler_error"] and not r["ticks"]:
            print(f"{label}: the lag sampler read nothing: {r['sampler_error']}")
    save("reward_scale", {
        "bench": "reward_scale", "latency_ms": args.latency_ms, "batch_size": args.batch_size,
        "prompts": args.prompts,
        "sets": BASE_SETS + [f"topics.partitions={args.partitions}"] + args.overrides, "machine": info,
        "machine_end": {"loadavg": machine()["loadavg"]},
        "steady_samples_per_s": {k: v["steady_samples_per_s"] for k, v in results.items()},
        "ratios": ratios, "bottleneck": {k: bottleneck(v) for k, v in results.items()},
        "input_partition_records": {k: v["input_partition_records"] for k, v in results.items()},
        "autoscale": auto, "scale_events": results.get("autoscale", {}).get("scale_events"),
        "results": {k: {kk: vv for kk, vv in v.items() if kk != "ticks"} for k, v in results.items()},
        "ticks": {k: v["ticks"] for k, v in results.items()}, "png": note,
    })
    return 0


def ideal_ratio(parts: dict[int, int], n: int) -> float:
    """Total records / the busiest of ``n`` replicas' records under Kafka's range assignment
    (contiguous partition blocks, the first ``P % n`` one partition larger): the most ``n``
    replicas can gain over one when records are keyed (here by group id) onto partitions."""
    if not parts:
        return float("nan")
    order = [parts[p] for p in sorted(parts)]
    size, extra = divmod(len(order), n)
    loads, i = [], 0
    for k in range(n):
        take = size + (1 if k < extra else 0)
        loads.append(sum(order[i:i + take]))
        i += take
    return sum(order) / max(loads) if max(loads) else float("nan")


if __name__ == "__main__":
    sys.exit(main())
