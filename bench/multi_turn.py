"""Multi-turn episodes/s with an environment that answers in 200 ms: streaming vs. a synchronous loop.

Both run the same prompts through the same stage code (generate and environment, tiny models, three
model turns per episode, ``bench/multi_turn_env.py`` sleeping 0.2 s per call):

* **streaming**: ``expstream run`` with ``environment:`` set (embedded broker and Redis, one process per
  stage, the whole pipeline downstream running too); episodes/s = episodes / (the last finished episode's
  record on the ``episodes`` topic − the first prompt record), from the run's recording;
* **synchronous**: in this process, one prompt record at a time: generate, then the environment for every
  episode of the batch (concurrently, ``environment.max_in_flight``) and wait for all of them, then the
  next turn of the unfinished ones, ... (a batch barrier at every turn, the loop of the frameworks that
  generate a batch, step the environment, generate again); no downstream stage at all.

    python bench/multi_turn.py [--prompts 32] [--env-s 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, TINY_CACHE, machine, progress, ratio, rounded, save, table, write_prompts

SETS = ["environment.fn=bench.multi_turn_env:answer", "environment.max_turns=3", "generate.max_new_tokens=8",
        "generate.n_samples_per_prompt=4", "run.prompt_batch_size=2", f"models.cache_dir={TINY_CACHE}"]


def streaming(prompts: Path, out: Path, env_s: float) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
           "--no-progress", *[x for s in SETS for x in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "EXPSTREAM_BENCH_ENV_S": str(env_s), "PYTHONPATH": str(ROOT)})
    if proc.returncode != 0:
        sys.exit(f"expstream run failed:\n{proc.stderr[-3000:]}")
    from expstream.tools.recording import iter_topic
    from schemas import decode

    first = min(f.timestamp for f in iter_topic(out, "prompts"))
    frames = list(iter_topic(out, "episodes"))
    episodes = sum(len(decode(f.value)) for f in frames)
    return (max(f.timestamp for f in frames) - first) / 1000.0, episodes


def synchronous(prompts: Path, env_s: float) -> tuple[float, int]:
    os.environ["EXPSTREAM_BENCH_ENV_S"] = str(env_s)
    sys.path.insert(0, str(ROOT))
    from expstream.config.topology import load_topology
    from expstream.launch.prompts import prompt_batches, read_prompts
    from stages import environment, generate
    from stages.context import Routed, make_context

    topo = load_topology(ROOT / "topology.yaml", SETS)
    gctx, ectx = make_context(topo, "generate"), make_context(topo, "environment")
    generate.setup(gctx)
    environment.setup(ectx)
    episodes, started = 0, time.perf_counter()
    for pb in prompt_batches(read_prompts(prompts), topo.run.prompt_batch_size):
        batch = generate.process(pb, gctx)[0]
        while batch is not None:  # every environment call of the batch answered before the next turn
            outs = environment.process(batch, ectx)
            episodes += sum(len(o) for o in outs if not isinstance(o, Routed))
            going = [o.batch for o in outs if isinstance(o, Routed)]
            batch = generate.process(going[0], gctx)[0] if going else None
    environment.teardown(ectx)
    return time.perf_counter() - started, episodes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--env-s", type=float, default=0.2, help="seconds the environment takes per call")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(Path(tmp) / "prompts.jsonl", args.prompts)
        progress(f"streaming: expstream run, {args.prompts} prompts x 4 samples, 3 turns, env {args.env_s}s")
        s_wall, s_eps = streaming(prompts, Path(tmp) / "out", args.env_s)
        progress("synchronous: generate, wait for every environment call of the batch, repeat")
        y_wall, y_eps = synchronous(prompts, args.env_s)
    s_rate, y_rate = s_eps / s_wall, y_eps / y_wall
    print(table(["loop", "episodes", "seconds", "episodes/s"],
                [["streaming (expstream run)", s_eps, f"{s_wall:.2f}", f"{s_rate:.2f}"],
                 ["synchronous (batch barrier per turn)", y_eps, f"{y_wall:.2f}", f"{y_rate:.2f}"]],
                title=f"multi-turn, environment {args.env_s * 1000:.0f} ms per call"))
    print(f"streaming / synchronous: {ratio(s_rate, y_rate):.2f}x")
    save("multi_turn", {"bench": "multi_turn", "env_s": args.env_s, "prompts": args.prompts,
                        "streaming_episodes_per_s": rounded(s_rate), "synchronous_episodes_per_s": rounded(y_rate),
                        "ratio": rounded(ratio(s_rate, y_rate)), "loadavg": os.getloadavg(), "machine": machine(),
                        "settings": json.dumps(SETS)})


if __name__ == "__main__":
    main()
