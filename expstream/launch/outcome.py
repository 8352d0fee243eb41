"""How ``expstream run`` ended: status, lost groups, and the two output files, written whatever happened.

:class:`RunOutcome` collects what the run loop learns as it goes (fed prompts, the collector, the
supervisor, the state) so that :meth:`RunOutcome.write` can run from a ``finally``: after a normal
end, a timeout, Ctrl-C, a stage that used up its restarts, or an unexpected exception, it

1. writes ``experiences.msgpack`` first (the finished samples are the valuable part),
2. names the lost groups and why (:meth:`expstream.launch.collector.ExperienceCollector.lost_group_reasons`),
3. fails a run that ended ``ok`` when lost / fed groups exceed ``run.max_lost_group_share``
   (one line: ``3 of 8 groups lost (over run.max_lost_group_share=0): ...``),
4. writes ``summary.json`` with ``status`` ``ok`` | ``failed`` | ``interrupted`` and ``error``.

No step raises: a step that cannot be done (Redis gone for the stage statistics, ...) is noted in
the summary instead.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from expstream.config.redaction import REDACTED
from expstream.config.topology import Topology
from expstream.errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from expstream.launch.collector import REJECTED_FILE, ExperienceCollector
from expstream.launch.continuous import DONE_FILE, FINAL_DIR, TRAIN_LOG, TrainLog

if TYPE_CHECKING:
    from expstream.launch.prompts import EpochFeeder
    from expstream.launch.scale import Scaler
    from expstream.launch.supervisor import Supervisor
    from expstream.observe.timeline import Timeline
    from expstream.state import State

log = logging.getLogger("expstream.run")
#: Groups named per reason, and reasons, in the one-line failure message (summary.json has all).
LINE_GROUPS_PER_REASON = 5
LINE_REASONS = 2
STATUS_NAMES = {EXIT_OK: "ok", EXIT_INTERRUPTED: "interrupted"}


def write_summary(summary: dict, out_dir: Path, run_id: str) -> dict:
    """``summary.json`` in ``out_dir``; a write error is logged, never raised (the run's outcome stands)."""
    try:
        dump_json(summary, out_dir / "summary.json")
    except OSError as exc:
        log.error("run %s: cannot write summary.json: %s", run_id, exc)
    return summary


def dump_json(obj: object, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def loss_verdict(lost: dict[str, str], fed: int, share: float) -> str | None:
    """The one-line reason a run fails for its losses, or None when lost / fed <= share."""
    if not lost or fed <= 0 or len(lost) / fed <= share:
        return None
    by_reason: dict[str, list[str]] = {}
    for group, reason in sorted(lost.items()):
        by_reason.setdefault(reason, []).append(group)
    parts = []
    for reason, groups in sorted(by_reason.items(), key=lambda kv: -len(kv[1]))[:LINE_REASONS]:
        more = f" and {len(groups) - LINE_GROUPS_PER_REASON} more" if len(groups) > LINE_GROUPS_PER_REASON else ""
        parts.append(f"{', '.join(groups[:LINE_GROUPS_PER_REASON])}{more}: {reason}")
    if len(by_reason) > LINE_REASONS:
        parts.append(f"{len(by_reason) - LINE_REASONS} more reasons")
    return (f"{len(lost)} of {fed} groups lost (over run.max_lost_group_share={share:g}): " + "; ".join(parts)
            + " (summary.json lost_groups)")


@dataclass
class RunOutcome:
    """What ``expstream run`` knows about itself; filled in as the run goes, written at the end."""

    topo: Topology
    run_id: str
    out_dir: Path
    rows: int
    started: float
    status: int = EXIT_OK
    error: str | None = None
    bootstrap: str | None = None
    redis_url: str | None = None  # redacted (expstream.config.redaction.redact_url): summary.json is shown
    secret: str | None = None  # the Redis password, masked in any error text that reaches the summary
    state: State | None = None  # once connected (expstream.launch.services)
    supervisor: Supervisor | None = None  # once built
    scaler: Scaler | None = None  # once built: its events are summary.json's scale_events
    collector: ExperienceCollector | None = None
    target_groups: int | None = None  # complete groups the finite run wants (expstream.launch.collect.FeedPlan)
    fed: int = 0
    dropped: int = 0
    finished: bool = False  # the loop stopped because every fed group was accounted for or the target met
    summary: dict | None = None  # once written
    recording_dir: Path | None = None  # the run directory, when the recorder ran (summary.json "recording")
    timeline: Timeline | None = None  # of the run (summary.json "startup")

    def fail(self, error: str) -> None:
        """Mark the run failed; the first error is the one reported (a Redis password in it masked)."""
        if self.status != EXIT_FAILED:
            if self.secret:
                error = error.replace(self.secret, REDACTED)
            self.status, self.error = EXIT_FAILED, error

    def recording(self, problems: list[str]) -> dict | None:
        """summary.json's ``recording`` (expstream.tools.recorder.recording_summary), None when not recorded."""
        if self.recording_dir is None:
            return None
        try:
            from expstream.tools.recorder import recording_summary

            return recording_summary(self.recording_dir)
        except Exception as exc:  # noqa: BLE001 - a bad recording is reported, never worth losing the summary
            problems.append(f"recording not read: {type(exc).__name__}: {exc}")
            return None

    def note_exception(self, exc: BaseException) -> None:
        """What ended the run, when an exception did: Ctrl-C interrupts it, anything else fails it."""
        if isinstance(exc, KeyboardInterrupt):
            self.status = EXIT_INTERRUPTED
        else:
            self.fail(f"{type(exc).__name__}: {exc}")

    def unexpected(self, exc: Exception) -> None:
        """An exception nobody expected: logged with its traceback (only without a secret in its text: a
        Redis URL), and the run failed with it; what was collected is still written."""
        text = f"{type(exc).__name__}: {exc}"
        if self.secret and self.secret in text:
            log.error("run %s: %s", self.run_id, text.replace(self.secret, REDACTED))
        else:
            log.exception("run %s: %s", self.run_id, exc)
        self.fail(text)

    def on_exit(self, exc_type: type[BaseException] | None, exc: BaseException | None, _tb: object) -> bool:
        """``ExitStack.push`` hook: an exception while setting up still writes the outputs; never swallows it."""
        if self.summary is None:
            if exc is not None:
                self.note_exception(exc)
            self.write()
        return False

    def write(self) -> dict:
        """Write experiences.msgpack and summary.json (steps 1-4 of the module docstring); never raises."""
        if self.summary is not None:
            return self.summary
        topo = self.topo
        problems: list[str] = []
        col = self.collector
        try:
            (self.out_dir / "experiences.msgpack").write_bytes(b"".join(col.records) if col else b"")
        except OSError as exc:
            log.error("run %s: cannot write experiences.msgpack: %s", self.run_id, exc)
            problems.append(f"experiences.msgpack not written: {exc}")
        lost: dict[str, str] = {}
        try:
            if col is not None:
                lost = col.lost_group_reasons(finished=self.finished, dropped=self.dropped)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"lost groups not computed: {type(exc).__name__}: {exc}")
        share = topo.run.max_lost_group_share
        if self.status == EXIT_OK and (verdict := loss_verdict(lost, self.fed, share)):
            self.fail(verdict)
        try:
            stage_stats = self.state.stage_stats() if self.state is not None else {}
        except Exception as exc:  # noqa: BLE001 - Redis may be what failed
            stage_stats = {}
            problems.append(f"stage statistics not read: {type(exc).__name__}: {exc}")
        accounting = self.accounting(problems)
        wall = time.monotonic() - self.started
        samples = len(col.samples) if col else 0
        rate = col.steady_rate() if col else None
        summary = {
            "run_id": self.run_id,
            "status": STATUS_NAMES.get(self.status, "failed"),
            "error": self.error,
            "problems": problems,
            "prompts": self.rows,
            "prompts_fed": self.fed,
            "target_groups": self.target_groups,
            "groups_complete": col.complete_groups if col else 0,
            "groups_dropped_dynamic_sampling": self.dropped,
            "groups_dead_lettered": sorted(col.lost_groups()) if col else [],
            "lost_groups": lost,
            "max_lost_group_share": share,
            "samples": samples,
            "experience_records": len(col.records) if col else 0,
            "duplicate_samples_dropped": col.duplicates if col else 0,
            "foreign_samples": col.foreign_samples if col else 0,
            "rejected_records": {"count": col.rejected_count if col else 0,
                                 "first": list(col.rejected) if col else [],
                                 "file": REJECTED_FILE if col and col.rejected_count else None},
            "dead_letters": col.dead_letters if col else [],
            "dead_letters_before_run": col.dead_letters_before_run if col else 0,
            "stage_restarts": {c.label: c.restarts for c in self.supervisor.children if c.restarts}
            if self.supervisor is not None else {},
            "scale_events": list(self.scaler.events) if self.scaler is not None else [],
            "wall_s": round(wall, 3),
            "samples_per_s": round(samples / wall, 4) if wall > 0 else 0.0,
            "steady_samples_per_s": round(rate, 4) if rate is not None else None,
            "first_experience_after_s": round(col.first_at - self.started, 3) if col and col.first_at else None,
            "stages": {
                name: {**s, "ms_per_batch": round(1000 * s["seconds"] / s["batches"], 3) if s["batches"] else None}
                for name, s in stage_stats.items()
            },
            "estimator": topo.algo.advantage_estimator,
            "n_samples_per_prompt": topo.generate.n_samples_per_prompt,
            "bootstrap_servers": self.bootstrap,
            "redis_url": self.redis_url,
            "topology": topo.source,
            "recording": self.recording(problems),
            "accounting": accounting,
            "startup": self.startup(col, problems),
        }
        self.summary = write_summary(summary, self.out_dir, self.run_id)
        return summary

    def print_summary(self) -> None:
        """What the run prints at its end, from the written summary (:meth:`write` first)."""
        summary, out_dir = self.write(), self.out_dir
        print(f"run {summary['run_id']}: {summary['status']}")
        print(f"  prompts {summary['prompts']}, groups complete {summary['groups_complete']}, "
              f"samples {summary['samples']}, dropped (dynamic sampling) {summary['groups_dropped_dynamic_sampling']}, "
              f"dead letters {len(summary['dead_letters'])}")
        if summary["lost_groups"] or summary["foreign_samples"] or summary["rejected_records"]["count"]:
            print(f"  lost groups {len(summary['lost_groups'])} of {summary['prompts_fed']} fed "
                  f"(allowed share {summary['max_lost_group_share']:g}), foreign samples {summary['foreign_samples']}, "
                  f"rejected records {summary['rejected_records']['count']}"
                  + (f" (kept in {out_dir / REJECTED_FILE})" if summary["rejected_records"]["count"] else ""))
        steady = summary["steady_samples_per_s"]
        first = summary["first_experience_after_s"]
        print(f"  first experience after {'n/a (none came)' if first is None else f'{first}s'}; steady state "
              + (f"{steady:.2f} samples/s" if steady is not None else "n/a (arrivals spanned under a second)"))
        print(f"  wall {summary['wall_s']:.1f}s, {summary['samples_per_s']:.2f} samples/s, "
              f"duplicates dropped {summary['duplicate_samples_dropped']}, restarts {summary['stage_restarts'] or 0}")
        print_stages(summary)
        print(f"  wrote {out_dir / 'experiences.msgpack'} and {out_dir / 'summary.json'}")

    def startup(self, col: ExperienceCollector | None, problems: list[str]) -> dict | None:
        """summary.json's ``startup`` (expstream/observe/timeline.py): the run's and every replica's marks."""
        if self.timeline is None:
            return None
        try:
            from expstream.observe.timeline import startup_summary

            now_minus = time.time() - time.monotonic()  # monotonic -> wall clock for the collector's times
            if col is not None and col.first_at is not None:
                self.timeline.mark("first_experience", col.first_at + now_minus)
                self.timeline.mark("last_experience", col.last_at + now_minus)
            self.timeline.mark("summary_written")
            out = startup_summary(self.timeline, self.out_dir / "run")
            first = out["timeline_s"].get("first_experience")
            out["first_experience_after_process_start_s"] = first
            return out
        except Exception as exc:  # noqa: BLE001 - a timeline is never worth losing the summary
            problems.append(f"start-up timeline not written: {type(exc).__name__}: {exc}")
            return None

    def accounting(self, problems: list[str]) -> dict:
        """Per stage: samples in = out + dead-lettered + dropped + in flight (expstream/tools/status.py)."""
        try:
            from expstream.tools.accounting import accounting_block

            return accounting_block(self.state, self.topo, log) if self.state is not None else {}
        except Exception as exc:  # noqa: BLE001 - Redis may be what failed
            problems.append(f"accounting not read: {type(exc).__name__}: {exc}")
            return {}


@dataclass
class ContinuousOutcome(RunOutcome):
    """How ``expstream run --continuous`` ended; :meth:`write` writes ``summary.json`` only.

    Nothing is collected in continuous mode (the trainer consumes ``experiences``), so there is no
    ``experiences.msgpack`` and no lost-group verdict; the summary reports the training instead:
    steps, final policy version, samples generated / trained, reward of the first and last step,
    where ``train.jsonl`` and the final weights are. Call it after the trainer and the stages were
    stopped, so the trainer's last lines are in (expstream.launch.services.RunServices does).
    """

    feeder: EpochFeeder | None = None  # once feeding
    train_log: TrainLog | None = None  # once following train.jsonl

    def write(self) -> dict:
        if self.summary is not None:
            return self.summary
        topo, problems = self.topo, []
        train_log = self.train_log or TrainLog(self.out_dir / TRAIN_LOG)
        try:
            train_log.read_new()
        except OSError as exc:
            problems.append(f"{TRAIN_LOG} not read: {exc}")
        totals = train_log.totals()
        version, stage_stats, counters = None, {}, {}
        try:
            if self.state is not None:
                version, stage_stats, counters = (self.state.policy_version(), self.state.stage_stats(),
                                                  self.state.counters())
        except Exception as exc:  # noqa: BLE001 - Redis may be what failed
            problems.append(f"run state not read: {type(exc).__name__}: {exc}")
        first, last = totals["first"], totals["last"]
        wall = time.monotonic() - self.started
        final = self.out_dir / FINAL_DIR
        feeder = self.feeder
        summary = {
            "mode": "continuous",
            "run_id": self.run_id,
            "status": STATUS_NAMES.get(self.status, "failed"),
            "error": self.error,
            "problems": problems,
            "steps": totals["steps"],
            "max_steps": topo.train.max_steps,
            "trainer_done": (self.out_dir / DONE_FILE).exists(),
            "final_policy_version": version,
            "max_staleness": topo.async_.max_staleness,
            "train_batch_size": topo.train.batch_size,
            "prompts": self.rows,
            "prompts_fed": feeder.prompts_fed if feeder else 0,
            "records_fed": feeder.records_fed if feeder else 0,
            "epochs_started": feeder.epochs_started if feeder else 0,
            "samples_generated": int(stage_stats.get("generate", {}).get("samples", 0)),
            "samples_trained": totals["samples"],
            "dropped_stale": totals["dropped_stale"],
            "nonfinite_steps": totals["skipped"],
            "reward_first_step": first.get("reward_mean"),
            "reward_last_step": last.get("reward_mean"),
            "wall_s": round(wall, 3),
            "train_jsonl": str(self.out_dir / TRAIN_LOG),
            "final_weights": str(final) if final.is_dir() else None,
            "weight_store": topo.train.weight_store,
            "stage_restarts": {c.label: c.restarts for c in self.supervisor.children if c.restarts}
            if self.supervisor is not None else {},
            "scale_events": list(self.scaler.events) if self.scaler is not None else [],
            "stages": {
                name: {**s, "ms_per_batch": round(1000 * s["seconds"] / s["batches"], 3) if s["batches"] else None}
                for name, s in stage_stats.items()
            },
            "counters": counters,
            "bootstrap_servers": self.bootstrap,
            "redis_url": self.redis_url,
            "topology": topo.source,
            "recording": self.recording(problems),
            "accounting": self.accounting(problems),
        }
        self.summary = write_summary(summary, self.out_dir, self.run_id)
        return summary

    def print_summary(self) -> None:
        def reward(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.4f}"

        summary, out_dir = self.write(), self.out_dir
        print(f"run {summary['run_id']} (continuous): {summary['status']}")
        print(f"  steps {summary['steps']}/{summary['max_steps']}, policy version {summary['final_policy_version']}, "
              f"max staleness {summary['max_staleness']}, reward first step {reward(summary['reward_first_step'])} "
              f"-> last step {reward(summary['reward_last_step'])}")
        print(f"  prompts fed {summary['prompts_fed']} ({summary['epochs_started']} epochs begun), samples generated "
              f"{summary['samples_generated']}, trained {summary['samples_trained']}, dropped stale "
              f"{summary['dropped_stale']}, wall {summary['wall_s']:.1f}s, restarts {summary['stage_restarts'] or 0}")
        print_stages(summary)
        print(f"  wrote {summary['train_jsonl'] + ', ' if Path(summary['train_jsonl']).exists() else ''}"
              f"{out_dir / 'summary.json'}"
              + (f", final weights {summary['final_weights']}" if summary["final_weights"] else ""))


def print_stages(summary: dict) -> None:
    """The summary's scale events and per-stage lines, as both outcomes print them."""
    events = summary.get("scale_events") or []
    if events:
        print(f"  scale events {len(events)}: " + ", ".join(
            f"{e['stage']} {e['from']}->{e['to']} ({e['reason']}, {e['t_s']:.0f}s)" for e in events))
    for name, s in summary["stages"].items():
        print(f"  {name:<17} {s['batches']:>4} batches {s['samples']:>5} samples  {s['ms_per_batch']} ms/batch")
