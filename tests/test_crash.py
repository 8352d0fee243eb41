"""Crash resilience of `expstream run`: SIGKILL stage processes and count lost and doubled samples.

Every run here gets its own Tansu broker and redis-server (started by the test and handed to
`expstream run` with --bootstrap-servers/--redis-url), so that after the run the raw experiences
topic (every record, duplicates included) and the Redis state (reward moments, group buffers, KL
coefficient, stage statistics) can still be inspected.

* ``test_external_kill_*``: one group_norm run (two advantage replicas); every stage is SIGKILLed by
  the test once, right after its first process logged that it handled a record (more records are
  still on their way), and advantage[1] once more while advantage[0]'s replacement is joining the
  group (a kill during a rebalance). One run for all stages keeps the suite bounded; the per-stage
  tests read that run.
* ``test_fault_point_*``: one gae run (all eight stages, critic included); the runner's fault
  injection (EXPSTREAM_FAULT) makes every stage SIGKILL itself once, at before_produce,
  after_produce (between produce and commit) or after_commit; the critic's replacement is then
  SIGKILLed again by the test (fault injection is one-shot per replica: expstream/launch/supervisor.py
  gives a restarted process the variable without its own stage's entry).

Figures (kills, lost, doubled, raw duplicates, kill -> respawn / subscribed / first record of the
replacement) are printed (-s or -rA) and appended to ``<basetemp>/crash-figures.jsonl``.

Counting: ``lost`` = expected sample ids missing from ``experiences.msgpack`` read with the
documented dedupe; ``doubled`` = sample ids seen more than once after that dedupe; ``raw
duplicates`` = extra copies of sample ids on the experiences topic itself (at-least-once delivery;
information only, but every copy must carry the same tokens and advantages). The helpers here are
also used by tests/test_soak.py and tests/test_outages.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from expstream import read_experiences
from expstream.kafka.clients import read_topic
from expstream.launch.localservers import LocalBroker, LocalRedis
from expstream.procs import die_with_parent
from expstream.state import RedisState
from schemas import decode

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
N = 4  # samples per prompt group
OUTPUT_TOPIC = "experiences"
INIT_KL_COEF = 0.01  # topology.yaml algo.init_kl_coef

GROUP_NORM_STAGES = ["generate", "shard-preprocess", "actor-logprob", "reference", "reward", "postprocess",
                     "advantage"]
GAE_STAGES = ["generate", "shard-preprocess", "actor-logprob", "reference", "critic", "reward", "postprocess",
              "advantage"]

# Log lines (expstream/cli.py format "%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s").
_TS = r"(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ "
# "stage X <topic>[p]@offset batch=<id>: <n> samples -> <m> records[, <k> dead letters] in <s>s" (after the commit)
RECORD_RE = re.compile(_TS + r"expstream\.stage\.(?P<stage>[\w+-]+)\[(?P<pid>\d+)\]: .*batch=\S+: \d+ samples -> "
                       r"\d+ records")
CONSUMING_RE = re.compile(_TS + r"expstream\.stage\.(?P<stage>[\w+-]+)\[(?P<pid>\d+)\]: .*consuming ")
FAULT_RE = re.compile(_TS + r"expstream\.stage\.(?P<stage>[\w+-]+)\[(?P<pid>\d+)\]: .*fault injection .*"
                      r"SIGKILL at (?P<point>\w+)")
STARTED_RE = re.compile(_TS + r"expstream\.supervisor\[\d+\]: started (?P<label>\S+) pid (?P<pid>\d+)")
EXITED_RE = re.compile(_TS + r"expstream\.supervisor\[\d+\]: stage (?P<label>\S+) exited with code "
                       r"(?P<code>-?\d+)")


def parse_ts(text: str) -> float:
    """A log timestamp (local time, ms) as unix time."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def stage_of(label: str) -> str:
    return label.rsplit("[", 1)[0]


def log_path_of(label: str) -> str:
    name, _, replica = label.rstrip("]").partition("[")
    return f"{name}-{replica}.log"


@dataclass
class Kill:
    label: str
    pid: int
    at: float  # unix time
    how: str  # "sigkill" (by the test) or "fault:<point>" (the stage, through EXPSTREAM_FAULT)


@dataclass
class Recovery:
    """Seconds from a kill to: the supervisor seeing the exit, the replacement's spawn, the
    replacement consuming (group joined), the replacement's first handled record (None: it had
    nothing left to do, or did not get there before the run ended)."""

    kill: Kill
    exit_seen_s: float | None = None
    respawned_s: float | None = None
    consuming_s: float | None = None
    resumed_s: float | None = None
    new_pid: int | None = None
    exit_code: int | None = None


@dataclass
class Accounting:
    expected: int
    lost: list[str]
    doubled: int
    unexpected: list[str]
    raw_records: int
    raw_duplicates: int
    inconsistent: list[str]
    summary: dict = field(default_factory=dict)

    def line(self) -> str:
        return (f"expected {self.expected} samples, lost {len(self.lost)}, doubled after dedupe {self.doubled}, "
                f"unexpected {len(self.unexpected)}; raw topic: {self.raw_records} records, "
                f"{self.raw_duplicates} duplicate sample copies (summary.duplicate_samples_dropped "
                f"{self.summary.get('duplicate_samples_dropped')}), {len(self.inconsistent)} inconsistent")


class PipelineRun:
    """`python -m expstream run` as a subprocess with its own broker and redis-server."""

    def __init__(self, workdir: Path, cache: Path, n_prompts: int, sets: list[str] | tuple[str, ...] = (),
                 env: dict[str, str] | None = None, timeout_s: int = 120) -> None:
        self.dir = Path(workdir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.out = self.dir / "out"
        self.run_id = f"crash-{uuid.uuid4().hex[:10]}"
        self.prompt_ids = [f"q{i:04d}" for i in range(n_prompts)]
        self.prompts = self.dir / "prompts.jsonl"
        self.prompts.write_text("".join(
            json.dumps({"id": pid, "prompt": f"What is {i} + {i + 1}?", "label": str(2 * i + 1)}) + "\n"
            for i, pid in enumerate(self.prompt_ids)))
        self.sets = [f"models.cache_dir={cache}", f"generate.n_samples_per_prompt={N}",
                     "generate.max_new_tokens=8", f"run.timeout_s={timeout_s}", "run.max_restarts=50",
                     # the counts below assume one micro-batch per group and one generate replica
                     "algo.micro_rollout_batch_size=4", "stages.generate.replicas=1", *sets]
        self.env = {**os.environ, **(env or {})}
        self.broker = LocalBroker(self.dir / "broker")
        self.redis = LocalRedis(self.dir / "redis", appendonly=True)
        self.kills: list[Kill] = []
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.ended_at: float | None = None
        self._log_fh = None
        self._log_cache: dict[str, tuple[int, list[str]]] = {}

    # --- lifecycle -------------------------------------------------------------------------------
    def start(self) -> PipelineRun:
        self.bootstrap = self.broker.start()
        self.redis_url = self.redis.start()
        cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(self.prompts), "--output", str(self.out),
               "--no-progress", "--run-id", self.run_id, "--bootstrap-servers", self.bootstrap,
               "--redis-url", self.redis_url]
        for s in self.sets:
            cmd += ["--set", s]
        self._log_fh = open(self.dir / "run.log", "wb")  # noqa: SIM115 - closed in close()
        self.started_at = time.time()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log_fh, stderr=subprocess.STDOUT, env=self.env,
                                     stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait(self, timeout_s: float) -> int:
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            raise AssertionError(
                f"expstream run did not finish within {timeout_s:.0f}s\n{self.diagnostics()}") from None
        self.ended_at = time.time()
        return rc

    def close(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.broker.stop()
        self.redis.stop()
        if self._log_fh is not None:
            self._log_fh.close()

    # --- observing -------------------------------------------------------------------------------
    def pids(self) -> dict[str, int]:
        """Live stage replicas (label "name[replica]" -> pid) from run/pids.json."""
        try:
            return json.loads((self.out / "run" / "pids.json").read_text())
        except (OSError, ValueError):
            return {}

    def lines(self, name: str) -> list[str]:
        """Lines of a stage log file ("generate-0.log") or "run.log" (supervisor, feeder, summary)."""
        path = self.dir / "run.log" if name == "run.log" else self.out / "run" / "logs" / name
        try:
            size = path.stat().st_size
        except OSError:
            return []
        cached = self._log_cache.get(name)
        if cached is not None and cached[0] == size:
            return cached[1]
        lines = path.read_bytes().decode("utf-8", "replace").splitlines()
        self._log_cache[name] = (size, lines)
        return lines

    def matches(self, name: str, pattern: re.Pattern) -> list[re.Match]:
        return [m for m in map(pattern.search, self.lines(name)) if m]

    def handled(self, label: str, pid: int | None = None) -> int:
        """Records the replica (optionally: its process ``pid``) logged as handled."""
        return sum(1 for m in self.matches(log_path_of(label), RECORD_RE) if pid is None or int(m["pid"]) == pid)

    def consuming(self, label: str, pid: int | None = None) -> bool:
        """The replica (optionally: its process ``pid``) has subscribed to its input topic."""
        return any(pid is None or int(m["pid"]) == pid for m in self.matches(log_path_of(label), CONSUMING_RE))

    def kills_of(self, label: str) -> list[Kill]:
        return [k for k in self.kills if k.label == label]

    def kill(self, label: str, pid: int | None = None) -> Kill | None:
        pid = pid or self.pids().get(label)
        if pid is None:
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return None
        k = Kill(label, pid, time.time(), "sigkill")
        self.kills.append(k)
        return k

    def fault_kills(self) -> list[Kill]:
        """Kills the stages did themselves (fault injection), from their logs."""
        out = []
        for path in sorted((self.out / "run" / "logs").glob("*.log")):
            for m in self.matches(path.name, FAULT_RE):
                label = f"{m['stage']}[{path.stem.rsplit('-', 1)[1]}]"
                out.append(Kill(label, int(m["pid"]), parse_ts(m["ts"]), f"fault:{m['point']}"))
        return out

    def all_kills(self) -> list[Kill]:
        return sorted(self.kills + self.fault_kills(), key=lambda k: k.at)

    def recovery(self, kill: Kill) -> Recovery:
        rec = Recovery(kill)
        slack = 0.002  # log timestamps have ms resolution
        for m in self.matches("run.log", EXITED_RE):
            if m["label"] == kill.label and parse_ts(m["ts"]) >= kill.at - slack:
                rec.exit_seen_s, rec.exit_code = parse_ts(m["ts"]) - kill.at, int(m["code"])
                break
        for m in self.matches("run.log", STARTED_RE):
            if m["label"] == kill.label and int(m["pid"]) != kill.pid and parse_ts(m["ts"]) >= kill.at - slack:
                rec.respawned_s, rec.new_pid = parse_ts(m["ts"]) - kill.at, int(m["pid"])
                break
        if rec.new_pid is not None:
            name = log_path_of(kill.label)
            for m in self.matches(name, CONSUMING_RE):
                if int(m["pid"]) == rec.new_pid:
                    rec.consuming_s = parse_ts(m["ts"]) - kill.at
                    break
            for m in self.matches(name, RECORD_RE):
                if int(m["pid"]) == rec.new_pid:
                    rec.resumed_s = parse_ts(m["ts"]) - kill.at
                    break
        return rec

    def diagnostics(self, tail: int = 3000) -> str:
        parts = ["--- run.log (tail) ---\n" + "\n".join(self.lines("run.log"))[-tail:]]
        for path in sorted((self.out / "run" / "logs").glob("*.log")):
            text = "\n".join(line for line in self.lines(path.name) if not RECORD_RE.search(line))
            parts.append(f"--- {path.name} (tail, record lines left out) ---\n{text[-1500:]}")
        return "\n".join(parts)

    # --- results ---------------------------------------------------------------------------------
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def expected_ids(self) -> set[str]:
        return {f"{p}#{i}" for p in self.prompt_ids for i in range(N)}

    def account(self) -> Accounting:
        """Lost / doubled counting; needs the broker still up (raw topic)."""
        expected = self.expected_ids()
        exps = read_experiences(self.out / "experiences.msgpack")  # the documented dedupe by sample id
        ids = Counter(s for e in exps for s in e.sample_ids)
        first: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        raw = Counter()
        inconsistent: set[str] = set()
        n_records = 0
        for rec in read_topic(self.bootstrap, None, OUTPUT_TOPIC, timeout_s=60):
            n_records += 1
            batch = decode(rec.value)
            adv = batch.advantages.rows()
            resp = batch.response_ids.rows()
            for row, sid in enumerate(batch.sample_ids()):
                raw[sid] += 1
                now = (np.asarray(resp[row]), np.asarray(adv[row]))
                if sid not in first:
                    first[sid] = now
                elif not (np.array_equal(first[sid][0], now[0]) and np.array_equal(first[sid][1], now[1])):
                    inconsistent.add(sid)
        return Accounting(
            expected=len(expected),
            lost=sorted(expected - set(ids)),
            doubled=sum(c - 1 for c in ids.values()),
            unexpected=sorted(set(ids) - expected),
            raw_records=n_records,
            raw_duplicates=sum(c - 1 for c in raw.values()),
            inconsistent=sorted(inconsistent),
            summary=self.summary(),
        )

    def state(self) -> RedisState:
        return RedisState(self.redis_url, self.run_id)


def redis_checks(run: PipelineRun, *, running_norm: bool, group_buffers: bool) -> list[str]:
    """Redis updates applied once per batch id: returns the problems found (empty: all good)."""
    problems = []
    n_samples = len(run.prompt_ids) * N
    n_micro = n_samples // 4  # algo.micro_rollout_batch_size = 4: one micro-batch per group of 4
    with run.state() as st:
        if running_norm:
            m = st.get_moments()
            applied = st.client.hlen(st.key("moments", "reward", "applied"))
            if m.count != n_samples:
                problems.append(f"reward moments count {m.count}, expected {n_samples} (one merge per batch id)")
            if applied != n_micro:
                problems.append(f"{applied} batch ids merged into the reward moments, expected {n_micro}")
        raw_kl = st.client.get(st.key("kl_coef"))
        if raw_kl is None or float(raw_kl) != INIT_KL_COEF:
            problems.append(f"kl_coef {raw_kl!r}, expected {INIT_KL_COEF} (no adaptive controller configured)")
        if group_buffers:
            for pid in run.prompt_ids:
                if st.group_done(pid):  # freed once every record carrying it was committed (the usual end)
                    continue
                have, n, completer = st.group_status(pid)  # or complete, left by a kill before its release
                if (have, n) != (N, N) or completer is None:
                    problems.append(f"group {pid}: buffer {have}/{n}, completer {completer}")
    return problems


def expected_stage_stats(run: PipelineRun, stages: list[str]) -> dict[str, tuple[int, int]]:
    """stage -> (batches, samples) that a run counts once per (stage, batch id)."""
    n_samples = len(run.prompt_ids) * N
    n_prompt_records = -(-len(run.prompt_ids) // 2)  # run.prompt_batch_size = 2
    want = {s: (n_samples // 4, n_samples) for s in stages}
    want["generate"] = (n_prompt_records, n_samples)  # samples generated from the prompt records
    want["shard-preprocess"] = (n_prompt_records, n_samples)
    return want


def stage_stat_problems(run: PipelineRun, stages: list[str]) -> list[str]:
    """Stage statistics missing or counted twice (each (stage, batch id) counts once)."""
    with run.state() as st:
        stats = st.stage_stats()
    out = []
    for s, (b, n) in expected_stage_stats(run, stages).items():
        got = (stats.get(s, {}).get("batches"), stats.get(s, {}).get("samples"))
        if got != (b, n):
            out.append(f"{s}: {got[0]} batches / {got[1]} samples counted, expected {b} / {n}")
    return out


def fmt_recoveries(recs: list[Recovery]) -> str:
    out = []
    for r in recs:
        f = lambda v: "-" if v is None else f"{v:.1f}s"  # noqa: E731
        out.append(f"{r.kill.label:<20} {r.kill.how:<22} exit seen {f(r.exit_seen_s)}, respawned "
                   f"{f(r.respawned_s)}, consuming {f(r.consuming_s)}, first record {f(r.resumed_s)}")
    resumed = [r.resumed_s for r in recs if r.resumed_s is not None]
    if resumed:
        out.append(f"kill -> first record of the replacement: median {statistics.median(resumed):.1f}s, "
                   f"max {max(resumed):.1f}s over {len(resumed)} kills")
    return "\n".join(out)


def figures_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every crash/soak/outage test appends its figures (one JSON object a line)."""
    return tmp_path_factory.getbasetemp() / "crash-figures.jsonl"


def record_figures(tmp_path_factory: pytest.TempPathFactory, name: str, run: PipelineRun, rc: int,
                   acct: Accounting | None, recs: list[Recovery], **extra) -> None:
    resumed = [r.resumed_s for r in recs if r.resumed_s is not None]
    fig = {
        "test": name, "rc": rc, "wall_s": round((run.ended_at or time.time()) - run.started_at, 1),
        "kills": len(recs), "kills_by_stage": dict(Counter(stage_of(r.kill.label) for r in recs)),
        "lost": len(acct.lost) if acct else None, "doubled": acct.doubled if acct else None,
        "raw_duplicates": acct.raw_duplicates if acct else None,
        "inconsistent": len(acct.inconsistent) if acct else None,
        "respawn_s": [round(r.respawned_s, 2) for r in recs if r.respawned_s is not None],
        "resume_s": [round(v, 2) for v in resumed],
        "resume_median_s": round(statistics.median(resumed), 2) if resumed else None,
        "resume_max_s": round(max(resumed), 2) if resumed else None,
        **extra,
    }
    with figures_file(tmp_path_factory).open("a") as fh:
        fh.write(json.dumps(fig) + "\n")
    print(f"\n[{name}] {json.dumps(fig)}")
    if acct:
        print(f"[{name}] {acct.line()}")
    print(fmt_recoveries(recs))


@dataclass
class Outcome:
    run: PipelineRun
    rc: int
    acct: Accounting | None
    recs: list[Recovery]
    redis_problems: list[str]
    stat_problems: list[str]
    overcount_problems: list[str]


def finish(run: PipelineRun, tmp_path_factory: pytest.TempPathFactory, name: str, *, stages: list[str],
           running_norm: bool, group_buffers: bool, timeout_s: float = 300, **extra) -> Outcome:
    """Wait for the run, then count (broker and redis still up). Callable ``extra`` values are
    called after the run ended (figures that need its logs)."""
    rc = run.wait(timeout_s)
    extra = {k: (v() if callable(v) else v) for k, v in extra.items()}
    acct = run.account() if (run.out / "experiences.msgpack").exists() else None
    recs = [run.recovery(k) for k in run.all_kills()]
    redis_problems = redis_checks(run, running_norm=running_norm, group_buffers=group_buffers)
    stat_problems = stage_stat_problems(run, stages)
    with run.state() as st:
        stats = st.stage_stats()
    over = [f"{s}: {stats.get(s)} counted, at most {b} batches / {n} samples expected"
            for s, (b, n) in expected_stage_stats(run, stages).items()
            if stats.get(s, {}).get("batches", 0) > b or stats.get(s, {}).get("samples", 0) > n]
    record_figures(tmp_path_factory, name, run, rc, acct, recs, **extra)
    return Outcome(run, rc, acct, recs, redis_problems, stat_problems, over)


def assert_exactly_once(o: Outcome) -> None:
    assert o.rc == 0, f"expstream run exited {o.rc}\n{o.run.diagnostics()}"
    assert o.acct is not None
    s = o.acct.summary
    assert s["status"] == "ok" and s["groups_complete"] == len(o.run.prompt_ids), s
    assert not s["dead_letters"], f"nothing should be dead-lettered by a crash: {s['dead_letters']}"
    assert o.acct.lost == [], f"lost samples: {o.acct.lost[:20]} ({o.acct.line()})"
    assert o.acct.doubled == 0, o.acct.line()
    assert o.acct.unexpected == [], o.acct.unexpected[:20]
    assert o.acct.inconsistent == [], f"redelivered copies differ from the first: {o.acct.inconsistent[:20]}"


# ------------------------------------------------------------------------------------------------
# One group_norm run; every stage SIGKILLed once by the test, mid-flow.
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def external_kills(tmp_path_factory: pytest.TempPathFactory, model_cache: Path):
    run = PipelineRun(tmp_path_factory.mktemp("kill-each-stage"), model_cache, n_prompts=48,
                      sets=["algo.advantage_estimator=group_norm", "algo.reward_running_norm=true",
                            "stages.advantage.replicas=2"])
    try:
        run.start()
        pending = [f"{s}[0]" for s in GROUP_NORM_STAGES]
        rebalance_kill: Kill | None = None
        deadline = time.monotonic() + 300
        while (pending or rebalance_kill is None) and run.alive and time.monotonic() < deadline:
            pids = run.pids()
            for label in list(pending):
                pid = pids.get(label)
                # mid-flow: its first process has handled a record, more are on their way
                if pid is not None and run.handled(label, pid) >= 1 and run.kill(label, pid):
                    pending.remove(label)
            if rebalance_kill is None and "advantage[0]" not in pending:
                # during a rebalance: advantage[0]'s replacement has subscribed and is joining the
                # group (no record yet) when the other replica is killed
                new = pids.get("advantage[0]")
                if new is not None and new != run.kills_of("advantage[0]")[0].pid and \
                        run.consuming("advantage[0]", new) and run.handled("advantage[0]", new) == 0:
                    rebalance_kill = run.kill("advantage[1]")
            time.sleep(0.05)
        yield finish(run, tmp_path_factory, "kill-each-stage", stages=GROUP_NORM_STAGES, running_norm=True,
                     group_buffers=True, not_killed=pending, killed_in_rebalance=rebalance_kill is not None)
    finally:
        run.close()


@pytest.mark.parametrize("stage", GROUP_NORM_STAGES)
def test_external_kill_stage_replaced_and_resumed(external_kills: Outcome, stage: str) -> None:
    label = f"{stage}[0]"
    recs = [r for r in external_kills.recs if r.kill.label == label]
    assert recs, f"{label} was never killed (the run ended first?)\n{external_kills.run.diagnostics()}"
    r = recs[0]
    assert r.exit_code == -signal.SIGKILL, f"supervisor saw exit code {r.exit_code} for {label}"
    assert r.respawned_s is not None, f"{label} was not restarted\n{external_kills.run.diagnostics()}"
    assert r.consuming_s is not None, f"the replacement of {label} never joined its group"
    assert external_kills.acct is not None
    assert external_kills.acct.summary["stage_restarts"].get(label) == 1


def test_external_kill_during_rebalance(external_kills: Outcome) -> None:
    """advantage[1] was killed while advantage[0]'s replacement was joining the group."""
    recs = [r for r in external_kills.recs if r.kill.label == "advantage[1]"]
    assert recs, f"advantage[1] was never killed\n{external_kills.run.diagnostics()}"
    assert recs[0].exit_code == -signal.SIGKILL and recs[0].respawned_s is not None
    assert recs[0].consuming_s is not None, "the replacement of advantage[1] never joined its group"
    assert external_kills.acct is not None
    assert external_kills.acct.summary["stage_restarts"].get("advantage[1]") == 1


def test_external_kills_lose_and_double_nothing(external_kills: Outcome) -> None:
    assert_exactly_once(external_kills)
    resumed = [r for r in external_kills.recs if r.resumed_s is not None]
    assert resumed, "no replacement had work left: the kills were not mid-flow"


def test_external_kills_redis_updates_applied_once(external_kills: Outcome) -> None:
    assert external_kills.rc == 0
    assert external_kills.redis_problems == []
    assert external_kills.overcount_problems == []


# ------------------------------------------------------------------------------------------------
# One gae run (critic on): every stage kills itself once at a fault point; the critic's
# replacement is then SIGKILLed by the test too.
# ------------------------------------------------------------------------------------------------

FAULTS = {
    "generate": ("after_produce", 2),
    "shard-preprocess": ("before_produce", 2),
    "actor-logprob": ("after_commit", 3),
    "reference": ("after_produce", 3),
    "critic": ("before_produce", 2),
    "reward": ("after_produce", 4),
    "postprocess": ("after_produce", 2),
    "advantage": ("after_commit", 2),
}


@pytest.fixture(scope="module")
def fault_points(tmp_path_factory: pytest.TempPathFactory, model_cache: Path):
    spec = ",".join(f"{s}:{p}:{k}" for s, (p, k) in FAULTS.items())
    run = PipelineRun(tmp_path_factory.mktemp("fault-points"), model_cache, n_prompts=48,
                      # partitions assigned by the run, as in the demo on the embedded broker (a run given
                      # --bootstrap-servers joins the groups by default; external_kills covers that)
                      sets=["algo.advantage_estimator=gae", "algo.reward_running_norm=true",
                            "run.assign_partitions=true"],
                      env={"EXPSTREAM_FAULT": spec})
    try:
        run.start()
        first_critic = None
        deadline = time.monotonic() + 300
        while run.alive and time.monotonic() < deadline:
            pid = run.pids().get("critic[0]")
            if first_critic is None and pid is not None:
                first_critic = pid
            if pid is not None and pid != first_critic and run.handled("critic[0]", pid) >= 1:
                run.kill("critic[0]", pid)  # the replacement (fault injection is off in it): once more
                break
            time.sleep(0.05)
        yield finish(run, tmp_path_factory, "fault-points", stages=GAE_STAGES, running_norm=True,
                     group_buffers=False, faults=spec)
    finally:
        run.close()


@pytest.mark.parametrize("stage", GAE_STAGES)
def test_fault_point_stage_replaced_and_resumed(fault_points: Outcome, stage: str) -> None:
    label = f"{stage}[0]"
    point, k = FAULTS[stage]
    faults = [r for r in fault_points.recs if r.kill.label == label and r.kill.how.startswith("fault:")]
    assert [r.kill.how for r in faults] == [f"fault:{point}"], \
        f"{label}: expected one fault at {point} (the replacement runs without it)\n{fault_points.run.diagnostics()}"
    r = faults[0]
    assert r.exit_code == -signal.SIGKILL and r.respawned_s is not None
    assert r.resumed_s is not None, f"the replacement of {label} handled no record after the {point} fault"
    assert fault_points.acct is not None
    assert fault_points.acct.summary["stage_restarts"].get(label) == (2 if stage == "critic" else 1)


def test_fault_points_lose_and_double_nothing(fault_points: Outcome) -> None:
    assert_exactly_once(fault_points)
    critic = [r for r in fault_points.recs if r.kill.label == "critic[0]" and r.kill.how == "sigkill"]
    assert critic and critic[0].respawned_s is not None, "the critic's replacement was killed and replaced"


def test_fault_points_redis_updates_applied_once(fault_points: Outcome) -> None:
    assert fault_points.rc == 0
    assert fault_points.redis_problems == []
    assert fault_points.overcount_problems == []


def test_fault_points_stage_stats_complete(fault_points: Outcome) -> None:
    assert fault_points.rc == 0
    assert fault_points.stat_problems == []
