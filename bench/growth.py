"""What a continuous run keeps as it goes: Redis keys and memory, and the weight store's size.

Runs ``expstream run --continuous`` (embedded broker and redis-server, the built-in tiny models) for
``--steps`` trainer steps and, while it runs, samples once a second: the trainer's step (lines of
``train.jsonl``), Redis ``DBSIZE`` and ``INFO memory`` ``used_memory``, the run's keys by kind
(``group``, ``window``, ...: the part of the key after the run prefix, up to its first ``:``), and
the weight store's versions and bytes. Prints the sample nearest each of ``--at`` (steps) as a
table and the summary line as JSON (also written to ``bench/results/growth.json``). Nothing is
asserted; tests/test_growth.py checks the plateau.

    .venv/bin/python bench/growth.py                          # 500 steps, ~4-6 min on 2 cores
    .venv/bin/python bench/growth.py --steps 120 --at 40,80,120 --set train.keep_versions=0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def store_size(path: Path) -> tuple[int, int]:
    """(actor versions, bytes of every file under ``path``)."""
    versions, size = 0, 0
    if not path.is_dir():
        return 0, 0
    for entry in path.iterdir():
        if entry.name.startswith("v") and entry.is_dir():
            versions += 1
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                size += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return versions, size


def redis_sample(url: str, run_id: str) -> dict:
    import redis

    r = redis.Redis.from_url(url, socket_timeout=5)
    try:
        prefix = f"expstream:{{{run_id}}}:"
        kinds: Counter[str] = Counter()
        kind_bytes: Counter[str] = Counter()
        group_prefix = f"expstream:{{{run_id}{{"  # a group's keys: expstream:{<run>{<group>}:group... (issue 24)
        keys = [*r.scan_iter(match=prefix + "*", count=1000), *r.scan_iter(match=group_prefix + "*", count=1000)]
        for key in keys:
            name = key.decode()
            kind = (name[len(prefix):].split(":", 1)[0] if name.startswith(prefix)
                    else name.rsplit("}:", 1)[-1])  # a group's: group, group:meta, done
            kinds[kind] += 1
            kind_bytes[kind] += int(r.memory_usage(key, samples=0) or 0)
        return {"keys": int(r.dbsize()), "used_memory": int(r.info("memory")["used_memory"]),
                "kinds": dict(sorted(kinds.items())), "kind_kb": {k: round(v / 1024, 1) for k, v in sorted(kind_bytes.items())}}
    finally:
        r.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--at", default="100,250,500", help="steps to report (comma-separated)")
    ap.add_argument("--prompts", default=str(ROOT / "examples" / "prompts.jsonl"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--output", default=None, help="run directory (default: a temporary one, removed)")
    ap.add_argument("--name", default="growth")
    args = ap.parse_args()
    at = [int(x) for x in args.at.split(",")]
    tmp = None
    if args.output is None:
        tmp = tempfile.TemporaryDirectory(prefix="growth-")
        out = Path(tmp.name) / "run"
    else:
        out = Path(args.output)
    run_id = f"growth{int(time.time()) % 100000}"
    cmd = [sys.executable, "-m", "expstream", "run", "--continuous", "--prompts", args.prompts, "--output", str(out),
           "--no-progress", "--run-id", run_id, "--set", f"train.max_steps={args.steps}",
           "--set", "run.timeout_s=600"]
    for s in args.sets:
        cmd += ["--set", s]
    print(" ".join(cmd), file=sys.stderr)
    started = time.monotonic()
    samples: list[dict] = []
    with open(Path(tmp.name if tmp else out.parent) / f"{args.name}.stdout", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                time.sleep(1.0)
                services = out / "run" / "services.json"
                jsonl = out / "train.jsonl"
                if not services.exists():
                    continue
                step = len(jsonl.read_text().splitlines()) if jsonl.exists() else 0
                try:
                    red = redis_sample(json.loads(services.read_text())["redis_url"], run_id)
                except Exception as exc:  # noqa: BLE001 - the run is ending: redis is gone
                    print(f"redis sample failed at step {step}: {exc}", file=sys.stderr)
                    continue
                versions, size = store_size(out / "weights")
                samples.append({"step": step, "t": round(time.monotonic() - started, 1), **red,
                                "store_versions": versions, "store_mb": round(size / 2**20, 2)})
                if step and step % 50 == 0:
                    print(f"step {step}: {samples[-1]}", file=sys.stderr)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    if proc.returncode != 0:
        print(f"run failed with exit {proc.returncode}; see {log.name}", file=sys.stderr)
    rows = []
    for target in at:
        near = [s for s in samples if s["step"] <= target]
        if near:
            rows.append({"target": target, **near[-1]})
    print(f"{'step':>6} {'t s':>7} {'keys':>7} {'used_memory MB':>15} {'store versions':>15} {'store MB':>9}  keys by kind")
    for row in rows:
        print(f"{row['step']:>6} {row['t']:>7} {row['keys']:>7} {row['used_memory'] / 2**20:>15.2f} "
              f"{row['store_versions']:>15} {row['store_mb']:>9.2f}  {row['kinds']}")
        print(f"{'':>6} KB by kind: {row['kind_kb']}")
    summary = {"bench": "growth", "steps": args.steps, "sets": args.sets, "exit": proc.returncode, "rows": rows,
               "load": os.getloadavg()}
    print(json.dumps(summary))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(summary) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
