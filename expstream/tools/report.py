"""``expstream report RUN_DIR``: ``report.html`` with PNG plots of a finished (or running) run.

Reads only the run directory:

* ``status.jsonl`` (expstream/tools/status.py, one snapshot per STATUS_INTERVAL_S): samples/s per stage,
  input lag per stage, and p50/p95 time per micro-batch, over time;
* the recording (``topics/``), when there is no status.jsonl: records per second per producing stage
  (the ``producer`` header, else the topic) from the records' broker timestamps;
* ``experiences.msgpack``: reward, processed reward, advantage and response-length distributions, and
  the staleness histogram (actor version behind the log-probs − the version that generated each
  sample); ``train.jsonl`` of a continuous run: the reward curve and the trainer's staleness histogram;
* ``summary.json``: the table at the top (samples, groups, dead letters, wall time, accounting).

A missing input leaves its section saying what is missing; the report never fails a run.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from expstream.config.cli_args import Command

log = logging.getLogger("expstream.report")

REPORT_HTML = "report.html"
PNG_DIR = "report"
#: Why 1 s: the recording's records are bucketed per second for the throughput-over-time fallback.
BUCKET_S = 1.0


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a crash
    except OSError:
        return []
    return out


def read_train_steps(path: Path) -> list[dict]:
    """The lines of ``train.jsonl`` the policy plots can use: JSON objects with an integer ``step`` and a
    numeric ``reward_mean``. Any other line (torn by a crash, written by hand, from another version) is
    left out with one warning naming ``train.jsonl:<line>`` and what it lacks; a ``staleness_hist`` that
    is not a map of integers is ignored for that line, with a warning too."""
    steps = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for no, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            log.warning("report: %s:%d is not JSON (a line torn by a crash?); skipped", path, no)
            continue
        if not isinstance(obj, dict):
            log.warning("report: %s:%d is not a JSON object; skipped", path, no)
            continue
        missing = [key for key, kind in (("step", int), ("reward_mean", int | float))
                   if not isinstance(obj.get(key), kind) or isinstance(obj.get(key), bool)]
        if missing:
            log.warning("report: %s:%d has no numeric %s; skipped", path, no, " and no ".join(map(repr, missing)))
            continue
        hist = obj.get("staleness_hist")
        try:
            obj["staleness_hist"] = {int(k): int(v) for k, v in (hist or {}).items()}
        except (AttributeError, TypeError, ValueError):
            log.warning("report: %s:%d: staleness_hist %r is not a map of integers; ignored", path, no, hist)
            obj["staleness_hist"] = {}
        steps.append(obj)
    return steps


def _fig(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig: Any, out: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out / name)
    plt.close(fig)
    return f"{PNG_DIR}/{name}"


#: Why 2: a line over time needs two points at least; a shorter run's flow is plotted from its recording instead.
MIN_SNAPSHOTS = 2


def _series_plot(snaps: list[dict], key: str, title: str, ylabel: str, out: Path, name: str,
                 scale: float = 1.0, by_topic: bool = False) -> str | None:
    """One line per stage of ``key`` over the snapshots (``by_topic``: labelled by the stage's input topic)."""
    if not snaps:
        return None
    t0 = snaps[0]["t"]
    fig, ax = _fig(title, "seconds since the first snapshot", ylabel)
    stages = sorted({s for snap in snaps for s in snap.get("stages", {})})
    for stage in stages:
        xs, ys = [], []
        for snap in snaps:
            v = snap.get("stages", {}).get(stage, {}).get(key)
            if v is not None:
                xs.append(snap["t"] - t0)
                ys.append(v * scale)
        if xs:
            topic = next((snap["stages"][stage].get("input_topic") for snap in snaps if stage in snap.get("stages", {})),
                         None)
            label = f"{topic} (read by {stage})" if by_topic and topic else stage
            ax.plot(xs, ys, label=label, marker=".", linewidth=1)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out, name)


def _recording_rates(run_dir: Path, out: Path) -> str | None:
    from expstream.kafka.provenance import read_provenance
    from expstream.tools.recording import iter_topic, recorded_topics

    per: dict[str, Counter] = defaultdict(Counter)
    t0 = None
    for topic in recorded_topics(run_dir):
        if topic.endswith(".dlq"):
            continue
        for frame in iter_topic(run_dir, topic, strict=False):  # damage: logged, the rest plotted
            prov = read_provenance(frame.headers)
            who = prov.producer if prov is not None and prov.producer else f"→{topic}"
            t = frame.timestamp / 1000.0
            t0 = t if t0 is None else min(t0, t)
            per[who][int(t // BUCKET_S)] += 1
    if not per or t0 is None:
        return None
    fig, ax = _fig("records written per second, by producing stage (from the recording)",
                   "seconds since the first record", "records/s")
    base = int(t0 // BUCKET_S)
    for who, c in sorted(per.items()):
        xs = list(range(0, max(c) - base + 1))
        ax.step(xs, [c.get(base + x, 0) / BUCKET_S for x in xs], where="post", label=who, linewidth=1)
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, out, "records_per_s.png")


def _hist(values: np.ndarray, title: str, xlabel: str, out: Path, name: str, bins: int = 40,
          ylabel: str = "samples") -> str | None:
    if values.size == 0:
        return None
    fig, ax = _fig(title, xlabel, ylabel)
    ax.hist(values, bins=bins, color="#4477aa")
    ax.axvline(float(values.mean()), color="k", linestyle="--", linewidth=1, label=f"mean {values.mean():.3g}")
    ax.legend(fontsize=7)
    return _save(fig, out, name)


def experience_arrays(run_dir: Path) -> dict[str, np.ndarray]:
    """Per-sample reward, processed reward, response length, staleness and the per-token advantages
    (from the SampleBatch records of experiences.msgpack, deduped by sample id; a continuous run, whose
    experiences went to the trainer, from the recording of its ``experiences`` topic)."""
    cols: dict[str, list] = defaultdict(list)
    seen: set[str] = set()
    for b in _experience_batches(run_dir):
        rows = [i for i, sid in enumerate(b.sample_ids()) if sid not in seen]
        seen.update(b.sample_ids())
        if not rows:
            continue
        for name, field in (("reward", "rewards"), ("processed_reward", "processed_rewards")):
            v = getattr(b, field)
            if v is not None:
                cols[name].append(np.asarray(v, np.float64)[rows])
        if b.advantages is not None:
            cols["advantage"] += [np.asarray(b.advantages.row(i), np.float64) for i in rows]
        if b.action_ids is not None:
            cols["response_length"].append(np.asarray(b.action_ids.lengths, np.float64)[rows])
        if b.rollout_version and b.logprob_version:
            cols["staleness"].append(np.asarray(b.logprob_version)[rows] - np.asarray(b.rollout_version)[rows])
    return {k: np.concatenate(v) if v else np.zeros(0) for k, v in cols.items()}


def _experience_batches(run_dir: Path) -> Any:
    """The run's experience SampleBatches: experiences.msgpack, else the recorded ``experiences`` topic."""
    from expstream.rl.expfile import iter_experience_batches

    if (run_dir / "experiences.msgpack").is_file() or not (run_dir / "topics" / "experiences").is_dir():
        yield from iter_experience_batches(run_dir / "experiences.msgpack")
        return
    from expstream.tools.recording import iter_topic
    from schemas import SampleBatch, decode
    from schemas.errors import SchemaError

    for frame in iter_topic(run_dir, "experiences", strict=False):
        try:
            b = decode(frame.value) if frame.value else None
        except SchemaError:
            continue  # the stage dead-letters such records; the report only reads
        if isinstance(b, SampleBatch):
            yield b


def write_report(run_dir: str | Path) -> Path:
    """Write ``run_dir/report.html`` and ``run_dir/report/*.png``; returns the HTML path."""
    run_dir = Path(run_dir)
    out = run_dir / PNG_DIR
    for old in out.glob("*.png"):  # a report written again shows only what this one plotted
        old.unlink(missing_ok=True)
    sections: list[tuple[str, list[str], str]] = []  # (title, images, note)
    summary = {}
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    snaps = _read_jsonl(run_dir / "status.jsonl")
    flow: list[str] = []
    if len(snaps) >= MIN_SNAPSHOTS:
        flow = [p for p in (
            _series_plot(snaps, "samples_per_s", "samples per second per stage (last 60 s window)", "samples/s",
                         out, "samples_per_s.png"),
            _series_plot(snaps, "input_lag_records", "lag per topic (records its consumer group has not committed)",
                         "records", out, "lag.png", by_topic=True),
            _series_plot(snaps, "batch_p50_s", "time per micro-batch per stage, p50", "ms", out, "batch_p50.png", 1000),
            _series_plot(snaps, "batch_p95_s", "time per micro-batch per stage, p95", "ms", out, "batch_p95.png", 1000),
        ) if p]
        sections.append(("Flow over time", flow, f"{len(snaps)} status snapshots (status.jsonl)"))
    else:
        rec = _recording_rates(run_dir, out) if (run_dir / "topics").is_dir() else None
        why = (f"only {len(snaps)} status snapshot(s): the run was shorter than a few sampling intervals"
               if snaps else "no status.jsonl (the run predates it, or was not started by expstream run)")
        sections.append(("Flow over time", [rec] if rec else [],
                         why + "; " + ("records per second from the recording" if rec else "and no recording either")))
    dist: list[str] = []
    note = ""
    try:
        arr = experience_arrays(run_dir)
        for key, title, xlabel, ylabel in (("reward", "reward per sample", "reward", "samples"),
                                           ("processed_reward", "processed reward per sample", "processed reward",
                                            "samples"),
                                           ("advantage", "advantage per action token", "advantage", "tokens"),
                                           ("response_length", "response length", "tokens", "samples")):
            p = _hist(arr.get(key, np.zeros(0)), title, xlabel, out, f"{key}.png", ylabel=ylabel)
            if p:
                dist.append(p)
        stale = arr.get("staleness", np.zeros(0))
    except Exception as exc:  # noqa: BLE001 - a report section, never the run
        note = f"experiences.msgpack not readable ({exc})"
        stale = np.zeros(0)
    source = "experiences.msgpack" if (run_dir / "experiences.msgpack").is_file() else "the recorded experiences topic"
    sections.append(("Distributions", dist, note or f"from {source}"))
    train = read_train_steps(run_dir / "train.jsonl")
    learn: list[str] = []
    if train:
        fig, ax = _fig("reward per training step (continuous run)", "step", "mean reward of the step's samples")
        ax.plot([x["step"] for x in train], [x["reward_mean"] for x in train], marker=".", linewidth=1)
        learn.append(_save(fig, out, "reward_curve.png"))
        hist: Counter = Counter()
        for x in train:
            hist.update(x["staleness_hist"])
        if hist:
            fig, ax = _fig("staleness of trained samples (trainer step − generating version)", "versions", "samples")
            ks = sorted(hist)
            ax.bar(ks, [hist[k] for k in ks], color="#cc6677")
            learn.append(_save(fig, out, "staleness.png"))
    elif stale.size:
        p = _hist(stale.astype(np.float64), "staleness (log-prob version − generating version)", "versions", out,
                  "staleness.png", bins=max(1, int(stale.max() - stale.min()) + 1))
        if p:
            learn.append(p)
    sections.append(("Policy", learn, "train.jsonl" if train else "no train.jsonl (not a continuous run)"))
    path = run_dir / REPORT_HTML
    path.write_text(_html(run_dir, summary, snaps, sections))
    return path


def _summary_rows(summary: dict, snaps: list[dict]) -> list[tuple[str, str]]:
    rows = [(k, str(summary[k])) for k in ("run_id", "status", "prompts", "groups_complete", "samples", "wall_s",
                                           "samples_per_s", "first_experience_after_s") if k in summary]
    if "dead_letters" in summary:
        rows.append(("dead letters", str(len(summary["dead_letters"]))))
    if snaps:
        lags: dict[str, list[float]] = defaultdict(list)
        for snap in snaps:
            for stage, s in snap.get("stages", {}).items():
                if s.get("input_lag_records") is not None:
                    lags[stage].append(s["input_lag_records"])
        if lags:
            worst = max(lags, key=lambda k: np.mean(lags[k]))
            rows.append(("bottleneck (largest mean input lag)", f"{worst}: {np.mean(lags[worst]):.1f} records"))
    for stage, acc in (summary.get("accounting") or {}).items():
        rows.append((f"accounting {stage}", f"in {acc['samples_in']} = out {acc['samples_out']} + dead "
                                            f"{acc['samples_dead']} + dropped {acc['samples_dropped']} + in flight "
                                            f"{acc['in_flight']}" + ("" if acc.get("balanced") else "  ✗ imbalance")))
    return rows


def _html(run_dir: Path, summary: dict, snaps: list[dict], sections: list[tuple[str, list[str], str]]) -> str:
    e = html.escape
    parts = [f"<!doctype html><meta charset='utf-8'><title>expstream report {e(run_dir.name)}</title>",
             "<style>body{font-family:sans-serif;max-width:1600px;margin:1em auto}img{max-width:49%;margin:2px}"
             "td{padding:2px 10px}</style>", f"<h1>expstream run {e(str(summary.get('run_id', run_dir.name)))}</h1>",
             "<table>"]
    parts += [f"<tr><td>{e(k)}</td><td>{e(v)}</td></tr>" for k, v in _summary_rows(summary, snaps)]
    parts.append("</table>")
    for title, images, note in sections:
        parts.append(f"<h2>{e(title)}</h2><p>{e(note)}</p>")
        parts += [f"<img src='{e(p)}' alt='{e(p)}'>" for p in images]
    return "\n".join(parts) + "\n"


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR")


#: What report reads: a directory holding none of these is not a run, and gets no report.html.
RUN_INPUTS = ("summary.json", "status.jsonl", "experiences.msgpack", "train.jsonl", "topics")


def report_command(args: argparse.Namespace) -> int:
    from expstream.errors import ConfigError

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"RUN_DIR: {run_dir} is not a directory; give a run's --output", field="RUN_DIR")
    if not any((run_dir / name).exists() for name in RUN_INPUTS):
        raise ConfigError(f"{run_dir} is not a run directory: it holds none of {', '.join(RUN_INPUTS)}, so a report "
                          "would be empty; nothing written", field="RUN_DIR",
                          fix="give the directory `expstream run --output` (or replay/record) wrote, e.g. runs/<name>")
    path = write_report(run_dir)
    print(f"wrote {path}")
    return 0


REPORT = Command("report", "write RUN_DIR/report.html with plots of the run", add_report_arguments, report_command,
                 reads_topology=False)
