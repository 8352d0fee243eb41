"""What a continuous run keeps as it goes: Redis, every process's memory, the recording, the weights.

Runs ``expstream run --continuous`` (embedded broker and redis-server, the built-in tiny models) for
``--steps`` trainer steps and, while it runs, samples once a second: the trainer's step and samples
(``train.jsonl``), Redis ``DBSIZE`` and ``INFO memory`` ``used_memory``, the run's keys by kind
(``group``, ``window``, ...: the part of the key after the run prefix, up to its first ``:``), the
weight store's versions and bytes, the RSS of every process of the run's tree (by its title: stage
replicas, recorder, fork server, broker, redis-server, the CLI), the recording's bytes
(``<output>/topics``) and samples/s (trained samples over the last ~10 s). Prints the sample nearest
each of ``--at`` (steps) as a table, the growth per 100 steps of every curve between the first
``--at`` and the end, and the summary line as JSON (also written to ``bench/results/growth.json``);
with matplotlib, the curves to ``bench/results/<name>.png``. Nothing is asserted;
tests/test_growth.py checks the plateau.

    .venv/bin/python bench/growth.py                          # 500 steps, ~4-6 min on 2 cores
    .venv/bin/python bench/growth.py --prompt-counts 48,96,192,384,768   # the finite run's throughput
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
sys.path.insert(0, str(ROOT / "bench"))


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


TICK = os.sysconf("SC_CLK_TCK")


def tree_stats(root: int, labels: dict[int, str] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """(RSS MiB, CPU seconds) of every process under ``root`` (Linux /proc), keyed by a short name from
    its title, or ``labels`` (pid -> the supervisor's label, ``run/pids.json``: a process forked from the fork
    server, the trainer, keeps the fork server's title). CPU is user + system of the process itself (its
    children are in the tree)."""
    parent: dict[int, int] = {}
    cpu_of: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    data = fh.read()
                f = data[data.rfind(")") + 2:].split()
                parent[int(entry)], cpu_of[int(entry)] = int(f[1]), (int(f[11]) + int(f[12])) / TICK
            except (OSError, ValueError, IndexError):
                continue
    kids: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        kids.setdefault(ppid, []).append(pid)
    rss_out: dict[str, float] = {}
    cpu_out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        todo.extend(kids.get(pid, []))
        try:
            title = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
            rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            continue
        name = (labels or {}).get(pid) or process_name(pid, root, title, parent.get(pid))
        if name in rss_out:  # two processes of one name are two curves, never one overwriting the other
            name = f"{name} ({pid})"
        rss_out[name] = round(rss / 1024, 1)
        cpu_out[name] = round(cpu_of.get(pid, 0.0), 2)
    return rss_out, cpu_out


def process_name(pid: int, root: int, title: str, ppid: int | None = None) -> str:
    """``cli``, ``broker``, ``redis``, ``stage <name>[i]``, ``trainer``, ``recorder``, ``forkserver`` or the
    title's start. Only the CLI's own child with the fork server's command line is ``forkserver``: a child of
    the server that has not set a title of its own carries the server's command line too (the trainer did, and
    its curve was taken for the server's), so it is ``forked (<pid>)``."""
    if pid == root:
        return "cli"
    if "tansu" in title:
        return "broker"
    if "redis-server" in title:
        return "redis"
    if title.startswith("expstream stage "):
        return "stage " + title.split()[2]
    if title.startswith("expstream trainer"):
        return "trainer"
    if "multiprocessing.forkserver" in title:
        return "forkserver" if ppid == root else f"forked ({pid})"
    if "multiprocessing.resource_tracker" in title:
        return "resource tracker"
    for word in ("record", "supervisor"):
        if word in title:
            return word
    return f"{title[:40]} ({pid})"


def supervised_labels(out: Path) -> dict[int, str]:
    """pid -> ``trainer`` for the supervised trainer of ``run/pids.json`` (stages name themselves by title)."""
    try:
        pids = json.loads((out / "run" / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(pid): "trainer" for label, pid in pids.items() if label.startswith("trainer")}


def checkpoint_sizes(out: Path) -> dict[str, float]:
    """The trainer's current checkpoint: its meta.json (positions, settled ids, counters) in KB, all of it in MB."""
    link = out / "train" / "checkpoint"
    try:
        target = link.resolve(strict=True)
        meta = (target / "meta.json").stat().st_size
    except OSError:
        return {}
    return {"checkpoint_meta_kb": round(meta / 1024, 1), "checkpoint_mb": round(dir_bytes(target) / 2**20, 3)}


def dir_bytes(path: Path) -> int:
    size = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                size += os.path.getsize(os.path.join(dirpath, f))
            except OSError:
                pass
    return size


def trained(jsonl: Path) -> tuple[int, int]:
    """(steps, samples) of train.jsonl so far."""
    if not jsonl.exists():
        return 0, 0
    steps = samples = 0
    for line in jsonl.read_text().splitlines():
        try:
            samples += int(json.loads(line).get("samples", 0))
        except ValueError:
            continue  # a line being written
        steps += 1
    return steps, samples


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
    ap.add_argument("--prompt-counts", default=None,
                    help="instead of the continuous loop: one finite run per prompt count (e.g. 48,96,...,768), "
                         "samples/s of each against the count")
    args = ap.parse_args()
    if args.prompt_counts:
        return finite_scaling([int(x) for x in args.prompt_counts.split(",")], args.sets, args.name)
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
                step, done = trained(jsonl)
                try:
                    red = redis_sample(json.loads(services.read_text())["redis_url"], run_id)
                except Exception as exc:  # noqa: BLE001 - the run is ending: redis is gone
                    print(f"redis sample failed at step {step}: {exc}", file=sys.stderr)
                    continue
                versions, size = store_size(out / "weights")
                now = round(time.monotonic() - started, 1)
                back = [x for x in samples if now - x["t"] >= 10]
                rate = (done - back[-1]["samples"]) / (now - back[-1]["t"]) if back else None
                rss, cpu = tree_stats(proc.pid, supervised_labels(out))
                cpu_ms = None
                if back and done > back[-1]["samples"] and set(back[-1]["cpu_s"]) <= set(cpu):
                    # the run's CPU per trained sample over the window (not once processes start to exit)
                    cpu_ms = 1000 * (sum(cpu.values()) - sum(back[-1]["cpu_s"].values())) / (done - back[-1]["samples"])
                samples.append({"step": step, "t": now, "samples": done, **red,
                                "store_versions": versions, "store_mb": round(size / 2**20, 2),
                                **checkpoint_sizes(out), "rss_mb": rss, "cpu_s": cpu, "recording_mb": round(dir_bytes(out / "topics") / 2**20, 3),
                                "samples_per_s": None if rate is None else round(rate, 2),
                                "cpu_ms_per_sample": None if cpu_ms is None else round(cpu_ms, 2),
                                "loadavg": os.getloadavg()[0]})
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
        print(f"{'':>6} trainer RSS {row['rss_mb'].get('trainer')} MiB, checkpoint meta.json "
              f"{row.get('checkpoint_meta_kb')} KB of {row.get('checkpoint_mb')} MB, load {row['loadavg']:.1f}")
    growth = growth_per_100(samples, at[0])
    print(f"per 100 steps from step {at[0]} to the end: {json.dumps(growth)}")
    summary = {"bench": "growth", "steps": args.steps, "sets": args.sets, "exit": proc.returncode, "rows": rows,
               "per_100_steps": growth, "load": os.getloadavg()}
    plot(samples, ROOT / "bench" / "results" / f"{args.name}.png")
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / f"{args.name}-samples.json").write_text(json.dumps(samples) + "\n")
    print(json.dumps(summary))
    results = ROOT / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(summary) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0 if proc.returncode == 0 else 1


def finite_scaling(counts: list[int], sets: list[str], name: str) -> int:
    """One ``expstream run`` (finite, generated prompts, report off) per prompt count: samples, wall,
    summary samples/s and steady samples/s, and the ratio of each rate to the smallest count's."""
    from common import write_prompts

    rows = []
    with tempfile.TemporaryDirectory(prefix="scaling-") as tmp:
        for n in counts:
            prompts = write_prompts(Path(tmp) / f"p{n}.jsonl", n)
            out = Path(tmp) / f"run{n}"
            cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
                   "--no-progress", "--no-report", "--set", "run.timeout_s=1200"]
            for s in sets:
                cmd += ["--set", s]
            t0 = time.monotonic()
            rc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
            wall = time.monotonic() - t0
            summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
            rows.append({"prompts": n, "exit": rc, "samples": summary.get("samples"), "cmd_wall_s": round(wall, 2),
                         "samples_per_s": summary.get("samples_per_s"),
                         "steady_samples_per_s": summary.get("steady_samples_per_s"),
                         "recording_mb": round(dir_bytes(out / "topics") / 2**20, 2), "load": os.getloadavg()[0]})
            print(f"{n} prompts: {rows[-1]}", file=sys.stderr)
    base = rows[0]
    print(f"{'prompts':>8} {'samples':>8} {'wall s':>8} {'samples/s':>10} {'steady/s':>9} {'x first':>8} {'rec MB':>7}")
    for r in rows:
        ratio = (r["samples_per_s"] or 0) / (base["samples_per_s"] or 1)
        print(f"{r['prompts']:>8} {r['samples'] or 0:>8} {r['cmd_wall_s']:>8} {r['samples_per_s'] or 0:>10.2f} "
              f"{r['steady_samples_per_s'] or 0:>9.2f} {ratio:>8.2f} {r['recording_mb']:>7}")
    summary = {"bench": "growth-finite", "sets": sets, "rows": rows, "load": os.getloadavg()}
    print(json.dumps(summary))
    (ROOT / "bench" / "results").mkdir(exist_ok=True)
    (ROOT / "bench" / "results" / f"{name}-finite.json").write_text(json.dumps(summary) + "\n")
    return 0 if all(r["exit"] == 0 for r in rows) else 1


def growth_per_100(samples: list[dict], start: int) -> dict[str, float]:
    """Every curve's change per 100 steps between the first sample at ``start`` steps and the last."""
    late = [x for x in samples if x["step"] >= start]
    if len(late) < 2 or late[-1]["step"] == late[0]["step"]:
        return {}
    a, b = late[0], late[-1]
    k = 100 / (b["step"] - a["step"])
    out = {"redis_keys": (b["keys"] - a["keys"]) * k, "redis_used_mb": (b["used_memory"] - a["used_memory"]) / 2**20 * k,
           "store_mb": (b["store_mb"] - a["store_mb"]) * k, "recording_mb": (b["recording_mb"] - a["recording_mb"]) * k}
    with_ckpt = [x for x in late if "checkpoint_meta_kb" in x]
    if len(with_ckpt) >= 2 and with_ckpt[-1]["step"] > with_ckpt[0]["step"]:
        c0, c1 = with_ckpt[0], with_ckpt[-1]
        out["checkpoint_meta_kb"] = (c1["checkpoint_meta_kb"] - c0["checkpoint_meta_kb"]) * 100 / (c1["step"] - c0["step"])
    for name in sorted(a["rss_mb"]):  # each process to its last sample (stages stop before the run ends)
        last = [x for x in late if name in x["rss_mb"]][-1]
        if last["step"] > a["step"]:
            out[f"rss_mb {name}"] = (last["rss_mb"][name] - a["rss_mb"][name]) * 100 / (last["step"] - a["step"])
    rates = [x["cpu_ms_per_sample"] for x in late if x.get("cpu_ms_per_sample")]
    if len(rates) >= 4:  # first and last quarter of the windows: does a sample cost more CPU later?
        q = len(rates) // 4
        out["cpu_ms_per_sample first quarter"] = sum(rates[:q]) / q
        out["cpu_ms_per_sample last quarter"] = sum(rates[-q:]) / q
    return {key: round(v, 3) for key, v in out.items()}


def plot(samples: list[dict], path: Path) -> None:
    """Four panels against the trainer's step: Redis, RSS per process, recording + store, samples/s."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return
    if not samples:
        return
    steps = [x["step"] for x in samples]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0][0].plot(steps, [x["keys"] for x in samples], label="Redis keys")
    twin = ax[0][0].twinx()
    twin.plot(steps, [x["used_memory"] / 2**20 for x in samples], color="tab:red", label="used_memory MiB")
    ax[0][0].set_title("Redis: keys (blue), used_memory MiB (red)")
    names = sorted({n for x in samples for n in x["rss_mb"]})
    for name in names:
        ax[0][1].plot(steps, [x["rss_mb"].get(name) for x in samples], label=name)
    ax[0][1].set_title("RSS MiB per process")
    ax[0][1].legend(fontsize=6, ncol=2)
    ax[1][0].plot(steps, [x["recording_mb"] for x in samples], label="recording MiB")
    ax[1][0].plot(steps, [x["store_mb"] for x in samples], label="weight store MiB")
    ax[1][0].legend(loc="upper left")
    ckpt = ax[1][0].twinx()
    ckpt.plot(steps, [x.get("checkpoint_meta_kb") for x in samples], color="tab:green")
    ax[1][0].set_title("bytes on disk; the checkpoint's meta.json KB (green)")
    ax[1][1].plot(steps, [x["samples_per_s"] for x in samples])
    cpu = ax[1][1].twinx()
    cpu.plot(steps, [x.get("cpu_ms_per_sample") for x in samples], color="tab:red")
    cpu.plot(steps, [10 * x.get("loadavg", 0) for x in samples], color="tab:gray", linewidth=0.8)
    ax[1][1].set_title("samples/s (blue); CPU ms/sample (red); 10 x load avg (grey)")
    for a in ax.flat:
        a.set_xlabel("trainer step")
    fig.tight_layout()
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=80)
    print(f"plot: {path}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
