"""Asynchronous vs. synchronous RL: the same trainer steps at async.max_staleness 0, 1, 2, 4.

Runs ``expstream run --continuous`` as a subprocess once per setting (each with its embedded
broker and redis-server: a shared broker would hand one run's prompts to the next run's fresh
consumer groups; the start-up cost is the same for every setting), with the same prompts, seed,
models and ``train.max_steps``, and reports per setting:

* wall: the whole command (what a user waits for) and the training span (the trainer's first
  step to its last, from ``train.jsonl`` ``time``: start-up and model loads excluded), with the
  ratio of k = 0's wall to each (> 1: faster than the synchronous shape);
* reward per step (``train.jsonl`` ``reward_mean``) and the mean of the last steps;
* the staleness histogram over the run (samples trained at each staleness u - v);
* time blocked by backpressure per stage (Redis counters ``blocked_s:<stage>``);
* weight reload time (counters ``reload_s:actor`` / ``reloads:actor``: generate and actor-logprob).

Writes ``bench/results/async.json`` (the one-line summary) and, when matplotlib is installed,
``bench/results/async-rewards.png`` (reward per step, one curve per k); otherwise says so.
Nothing is asserted: the script reports; it exits non-zero only when a run fails.

The task is the example task of docs/async.md (``examples/prompts.jsonl``, the rule reward
``expstream.rewards:target_char_rate`` instead of the reward model) unless ``--reward-model``.

``--long-tail`` (issue 26) measures in-flight weight updates instead: a long-tailed workload (responses up to
``--max-new-tokens`` = 256 tokens, whose lengths on the tiny model spread from a few dozen to the limit),
``generate.in_flight_updates`` off vs on at each k of ``--ks`` (default 1,2), and reports samples/s over the
training span, reward per step, generate's idle seconds (blocked by backpressure) and the share of trained
samples whose tokens span several versions (``mixed_version_samples``); ratios are on vs off at the same k.
Writes ``bench/results/async-inflight.json`` and ``async-inflight-rewards.png``.

Usage: ``.venv/bin/python bench/async.py [--steps 30] [--ks 0,1,2,4] [--reward-model] [--set key=value]``;
``.venv/bin/python bench/async.py --long-tail [--steps 8] [--ks 1,2] [--in-flight-mode keep]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS_DIR, ROOT, fmt, machine, progress, ratio, save, table

#: The example task (docs/async.md): reward = share of the response's characters that are "e".
EXAMPLE_TASK = ["models.reward=null", "models.reward_fn=expstream.rewards:target_char_rate"]
# Why 30 min: a setting of 20 steps takes a few minutes on 2 cores; a run 10x over that is stuck.
RUN_TIMEOUT_S = 1800
#: Steps averaged for "reward at the end" (the curves are noisy step by step).
LAST_STEPS = 5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="train.max_steps for every setting")
    p.add_argument("--ks", default="0,1,2,4", help="async.max_staleness values, comma-separated (0 first: the baseline)")
    p.add_argument("--prompts", type=Path, default=ROOT / "examples" / "prompts.jsonl", help="prompt file")
    p.add_argument("--reward-model", action="store_true",
                   help="score with the topology's reward model instead of the example task's rule reward")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="topology override passed to every run; repeatable")
    p.add_argument("--keep-runs", action="store_true", help="keep the runs' output directories")
    p.add_argument("--long-tail", action="store_true", help="in-flight updates off vs on on a long-tailed workload")
    p.add_argument("--max-new-tokens", type=int, default=256, help="--long-tail: generate.max_new_tokens")
    p.add_argument("--in-flight-mode", default="keep", help="--long-tail: generate.in_flight_mode (keep | recompute)")
    return p.parse_args()


def continuous_run(prompts: Path, k: int, steps: int, sets: list[str], out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "expstream", "run", "--continuous", "--prompts", str(prompts), "--output", str(out),
           "--no-progress", "--set", f"train.max_steps={steps}", "--set", f"async.max_staleness={k}"]
    for s in sets:
        cmd += ["--set", s]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"k={k}: expstream run took over {RUN_TIMEOUT_S}s (output in {out})") from None
    cmd_wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"k={k}: expstream run failed with exit code {proc.returncode} (output in {out})")
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines() if x.strip()]
    hist: dict[int, int] = {}
    for line in lines:
        for s, n in (line.get("staleness_hist") or {}).items():
            hist[int(s)] = hist.get(int(s), 0) + int(n)
    times = [line["time"] for line in lines if isinstance(line.get("time"), int | float)]
    counters = summary.get("counters", {})
    reloads = counters.get("reloads:actor", 0)
    return {
        "k": k,
        "steps": len(lines),
        "cmd_wall_s": round(cmd_wall, 3),
        "wall_s": summary["wall_s"],
        "train_span_s": round(times[-1] - times[0], 3) if len(times) > 1 else None,
        "samples_trained": summary["samples_trained"],
        "samples_generated": summary["samples_generated"],
        "reward": [line.get("reward_mean") for line in lines],
        "reward_last": _mean([line.get("reward_mean") for line in lines[-LAST_STEPS:]]),
        "staleness_hist": dict(sorted(hist.items())),
        "dropped_stale": summary["dropped_stale"],
        "blocked_s": {name.split(":", 1)[1]: round(v, 3) for name, v in counters.items() if name.startswith("blocked_s:")},
        "reloads_actor": int(reloads),
        "samples_per_s": round(summary["samples_trained"] / (times[-1] - times[0]), 3) if len(times) > 1 else None,
        "mixed_version_samples": sum(int(line.get("mixed_version_samples") or 0) for line in lines),
        "reload_s_mean": round(counters.get("reload_s:actor", 0.0) / reloads, 4) if reloads else None,
    }


def _mean(xs: list[Any]) -> float | None:
    vals = [float(x) for x in xs if isinstance(x, int | float)]
    return sum(vals) / len(vals) if vals else None


def plot(results: list[dict[str, Any]], path: Path,
         title: str = "reward per step, synchronous (k=0) vs asynchronous") -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed in this environment: no PNG written (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        label = r["k"] if isinstance(r["k"], str) else f"max_staleness={r['k']}"
        ax.plot(range(len(r["reward"])), r["reward"], marker=".", label=label)
    ax.set_xlabel("trainer step")
    ax.set_ylabel("reward (mean over the step's samples)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


def long_tail(args: argparse.Namespace, ks: list[int], sets: list[str], work: Path) -> int:
    """In-flight updates off vs on at each k, on responses of widely spread lengths (module docstring)."""
    workload = [f"generate.max_new_tokens={args.max_new_tokens}", "generate.min_new_tokens=1",
                f"generate.in_flight_mode={args.in_flight_mode}"]
    results = []
    for k in ks:
        for on in (False, True):
            name = f"k={k} in-flight {'on' if on else 'off'}"
            progress(f"{name}: expstream run --continuous, {args.steps} steps")
            r = continuous_run(args.prompts, k, args.steps, sets + workload + [f"generate.in_flight_updates={str(on).lower()}"],
                               work / f"k{k}-{int(on)}")
            r["name"], r["in_flight"] = name, on
            progress(f"{name}: {fmt(r['samples_per_s'], '.2f')} samples/s, reward last {fmt(r['reward_last'], '.4f')}")
            results.append(r)
    rows = []
    for r in results:
        off = next(x for x in results if x["k"] == r["k"] and not x["in_flight"])
        rows.append([r["name"], r["steps"], fmt(r["samples_per_s"], ".3f"),
                     ratio(r["samples_per_s"] or float("nan"), off["samples_per_s"] or float("nan")),
                     fmt(r["reward_last"], ".4f"), fmt(_mean(r["reward"]), ".4f"), r["blocked_s"].get("generate", 0.0),
                     f"{r['mixed_version_samples']}/{r['samples_trained']}",
                     " ".join(f"{s}:{n}" for s, n in r["staleness_hist"].items())])
    print(table(["setting", "steps", "samples/s", "x vs off", f"reward last {LAST_STEPS}", "reward mean",
                 "generate idle s", "mixed-version", "staleness hist"], rows,
                title=f"in-flight weight updates, long tail (max_new_tokens={args.max_new_tokens}, "
                      f"{args.in_flight_mode}): {args.steps} trainer steps per setting"))
    steps = max(len(r["reward"]) for r in results)
    print(table(["step"] + [r["name"] for r in results],
                [[str(i)] + [fmt(r["reward"][i], ".4f") if i < len(r["reward"]) else "" for r in results]
                 for i in range(steps)], title="reward per step"))
    for r in results:
        r["k"] = r["name"]  # the plot's legend
    note = plot(results, RESULTS_DIR / "async-inflight-rewards.png",
                title=f"reward per step, in-flight updates off vs on (max_new_tokens={args.max_new_tokens})")
    print(note)
    save("async-inflight", {"bench": "async-inflight", "steps": args.steps, "overrides": sets + workload,
                            "machine": machine(), "results": results, "png": note})
    return 0


def main() -> int:
    args = parse_args()
    if args.long_tail:
        work = Path(tempfile.mkdtemp(prefix="bench-async-inflight-"))
        try:
            return long_tail(args, [int(x) for x in args.ks.split(",") if x.strip()] if args.ks != "0,1,2,4" else [1, 2],
                             ([] if args.reward_model else EXAMPLE_TASK) + args.overrides, work)
        finally:
            if not args.keep_runs:
                shutil.rmtree(work, ignore_errors=True)
    ks = [int(x) for x in args.ks.split(",") if x.strip()]
    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    sets = ([] if args.reward_model else EXAMPLE_TASK) + args.overrides
    results = []
    try:
        for k in ks:
            progress(f"k={k}: expstream run --continuous, {args.steps} steps")
            r = continuous_run(args.prompts, k, args.steps, sets, work / f"k{k}")
            progress(f"k={k}: wall {r['wall_s']:.1f}s, training span {fmt(r['train_span_s'], '.1f')}s, "
                     f"reward {fmt(r['reward'][0] if r['reward'] else None, '.4f')} -> {fmt(r['reward_last'], '.4f')}")
            results.append(r)
    finally:
        if not args.keep_runs:
            shutil.rmtree(work, ignore_errors=True)
    base = results[0]
    rows = []
    for r in results:
        rows.append([f"k={r['k']}", r["steps"], r["wall_s"], ratio(base["wall_s"], r["wall_s"]),
                     r["train_span_s"], ratio(base["train_span_s"] or float("nan"), r["train_span_s"] or float("nan")),
                     r["samples_generated"], fmt(r["reward_last"], ".4f"),
                     " ".join(f"{s}:{n}" for s, n in r["staleness_hist"].items()),
                     " ".join(f"{s}={v:.1f}" for s, v in r["blocked_s"].items()) or "0",
                     fmt(r["reload_s_mean"], ".3f")])
    vs = f"x vs k={base['k']}"
    print(table(["setting", "steps", "wall s", vs, "train span s", vs, "generated",
                 f"reward last {LAST_STEPS}", "staleness hist", "blocked s", "reload s"], rows,
                title=f"async.max_staleness: the same {args.steps} trainer steps ({'k=' + str(base['k'])} is the baseline)"))
    print()
    steps = max(len(r["reward"]) for r in results)
    print(table(["step"] + [f"k={r['k']}" for r in results],
                [[str(i)] + [fmt(r["reward"][i], ".4f") if i < len(r["reward"]) else "" for r in results]
                 for i in range(steps)], title="reward per step"))
    note = plot(results, RESULTS_DIR / "async-rewards.png")
    print(note)
    save("async", {"bench": "async", "steps": args.steps, "overrides": sets, "machine": machine(),
                   "results": results, "wall_ratio_vs_k0": {r["k"]: ratio(base["wall_s"], r["wall_s"]) for r in results},
                   "train_span_ratio_vs_k0": {r["k"]: ratio(base["train_span_s"] or float("nan"),
                                                            r["train_span_s"] or float("nan")) for r in results},
                   "png": note})
    return 0


if __name__ == "__main__":
    sys.exit(main())
