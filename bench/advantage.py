"""The postprocess and advantage stages' throughput against the bare math on the same tensors.

Builds K scored micro-batches in memory (seeded random token log-probs, reference log-probs,
values and rewards; action lengths up to ``--max-actions``), then, in the same run and
interleaved repeat by repeat, times

* the stages: ``stages.postprocess.process`` and ``stages.advantage.process`` on the
  ``SampleBatch`` records (ragged -> padded views, ``SampleBatch.replace`` + validation, ragged
  outputs, and for the group estimator the Redis group buffers: a ``RedisState`` on a
  ``LocalRedis``; gae and reinforce, and the "no Redis" rows, on a ``MemoryState``);
* the bare numerics on pre-built padded tensors: ``compute_approx_kl`` + ``kl_penalized_rewards``
  (postprocess), ``shape_group_rewards`` + ``kl_penalized_rewards`` (group estimators only) +
  ``compute_advantages`` (advantage),

and prints samples/s of each and the overhead ratio stage/bare (time). The advantages the stages
emit are checked against the bare ones (max |difference|), so both sides compute the same thing.

Usage: ``.venv/bin/python bench/advantage.py [--microbatches 32] [--mrb 8] [--max-actions 256]``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import fmt, machine, median, progress, ratio, rounded, save, table

from expstream.config.topology import Topology, load_topology
from expstream.rl import numerics
from schemas import Ragged, SampleBatch
from stages import advantage, postprocess, shard_preprocess
from stages.context import make_context

EOS, PAD = 2, 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--microbatches", type=int, default=32, help="K micro-batches per pass")
    p.add_argument("--mrb", type=int, default=8, help="samples per micro-batch (micro_rollout_batch_size)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt group (must divide --mrb)")
    p.add_argument("--min-actions", type=int, default=16)
    p.add_argument("--max-actions", type=int, default=256, help="longest response (max_new_tokens)")
    p.add_argument("--estimators", default="gae,reinforce,group_norm")
    p.add_argument("--repeats", type=int, default=7, help="timed passes per variant (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (stage processes use run.torch_threads=1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="extra topology override (repeatable)")
    return p.parse_args()


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------


def topology(args: argparse.Namespace, estimator: str) -> Topology:
    return load_topology(None, [f"algo.advantage_estimator={estimator}", f"algo.micro_rollout_batch_size={args.mrb}",
                                f"generate.n_samples_per_prompt={args.n}",
                                f"generate.max_new_tokens={args.max_actions}", *args.overrides])


def scored_inputs(args: argparse.Namespace, topo: Topology, with_values: bool) -> list[SampleBatch]:
    """K micro-batches as the reward stage emits them (postprocess's input), seeded."""
    rng = np.random.default_rng(args.seed)
    prep = make_context(topo, "shard-preprocess")
    groups_per_mb = args.mrb // args.n
    out = []
    for k in range(args.microbatches):
        gids = [f"q{k:04d}-{g}" for g in range(groups_per_mb)]
        prompts = [rng.integers(3, 500, size=int(rng.integers(8, 65)), dtype=np.int32) for _ in gids]
        responses = []
        for _ in range(args.mrb):
            length = int(rng.integers(args.min_actions, args.max_actions + 1))
            r = rng.integers(3, 500, size=length, dtype=np.int32)
            if length < args.max_actions:
                r[-1] = EOS  # finished; a response of max length is truncated (no EOS)
            responses.append(r)
        rep = lambda xs: [x for x in xs for _ in range(args.n)]  # noqa: E731
        raw = SampleBatch(
            batch_id=f"p{k:06d}", policy_version=0, n_samples_per_prompt=args.n, eos_token_id=EOS,
            pad_token_id=PAD, prompt_id=rep(gids), group_id=rep(gids),
            sample_index=[i for _ in gids for i in range(args.n)], prompt=rep(["p"] * len(gids)),
            label=rep([""] * len(gids)), reference=rep([""] * len(gids)), response=["r"] * args.mrb,
            prompt_ids=Ragged.from_rows(rep(prompts), "int32"), response_ids=Ragged.from_rows(responses, "int32"),
        )
        (mb,) = shard_preprocess.process(raw, prep)
        lengths = mb.action_ids.lengths
        lp = [(-np.abs(rng.normal(0.0, 2.0, int(a)))).astype(np.float32) for a in lengths]
        base = [(x + rng.normal(0.0, 0.1, x.size)).astype(np.float32) for x in lp]
        fields: dict[str, Any] = {
            "action_log_probs": Ragged.from_rows(lp, "float32"),
            "base_action_log_probs": Ragged.from_rows(base, "float32"),
            "rewards": rng.normal(0.0, 1.0, args.mrb).astype(np.float32),
        }
        if with_values:
            fields["values"] = Ragged.from_rows([rng.normal(0.0, 1.0, int(a)).astype(np.float32) for a in lengths],
                                                "float32")
        out.append(mb.replace(**fields))
    return out


def padded_tensors(batches: list[SampleBatch]) -> list[dict[str, torch.Tensor]]:
    """The bare side's inputs: padded (B, A) tensors built once, outside the timing."""
    from expstream.rl.layout import action_field, padded

    out = []
    for b in batches:
        lay = padded(b)
        width = lay.num_actions
        t = {"mask": lay.action_mask, "lp": action_field(b, "action_log_probs", width),
             "base": action_field(b, "base_action_log_probs", width),
             "r": torch.from_numpy(np.array(b.rewards, dtype=np.float32)), "ids": b.sample_ids()}
        if b.values is not None:
            t["values"] = action_field(b, "values", width)
        out.append(t)
    return out


# ------------------------------------------------------------------------------------------------
# the two sides
# ------------------------------------------------------------------------------------------------


def bare_postprocess(topo: Topology, t: dict[str, Any]) -> torch.Tensor:
    algo = topo.algo
    kl = numerics.compute_approx_kl(t["lp"], t["base"], t["mask"], algo.kl_estimator)
    return numerics.kl_penalized_rewards(t["r"], kl, t["mask"], float(algo.init_kl_coef))


def bare_advantage(topo: Topology, t: dict[str, Any], token_rewards: torch.Tensor, n: int) -> torch.Tensor:
    algo = topo.algo
    est = algo.advantage_estimator
    if topo.is_group_estimator:
        shaped = numerics.shape_group_rewards(t["r"].reshape(-1, n), est).reshape(-1)
        token_rewards = token_rewards + numerics.kl_penalized_rewards(
            shaped - t["r"], torch.zeros_like(token_rewards), t["mask"], 0.0)
    adv, _ret, _info = numerics.compute_advantages(
        est, token_rewards, t["mask"], values=t.get("values"), raw_rewards=t["r"], gamma=algo.gamma,
        lambd=algo.lambd, advantages_norm=algo.advantages_norm, advantage_clip=algo.advantage_clip)
    return adv


def timed(fn) -> tuple[float, Any]:  # noqa: ANN001
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def bench_variant(args: argparse.Namespace, estimator: str, redis_url: str | None) -> dict[str, Any]:
    from expstream.state import MemoryState, RedisState

    topo = topology(args, estimator)
    rewarded = scored_inputs(args, topo, with_values=estimator == "gae")
    tensors = padded_tensors(rewarded)
    samples = sum(len(b) for b in rewarded)

    def contexts(tag: str):  # noqa: ANN202
        state = RedisState(redis_url, f"bench-{estimator}-{tag}") if redis_url else MemoryState(tag)
        return make_context(topo, "postprocess", state=state), make_context(topo, "advantage", state=state), state

    # warm-up (and the advantage stage's input: what postprocess emits)
    pp_ctx, adv_ctx, state = contexts("warm")
    scored = [postprocess.process(b, pp_ctx)[0] for b in rewarded]
    for b in scored:
        advantage.process(b, adv_ctx)
    for t in tensors:
        bare_advantage(topo, t, bare_postprocess(topo, t), args.n)
    state.close()

    times: dict[str, list[float]] = {"stage_post": [], "bare_post": [], "stage_adv": [], "bare_adv": []}
    stage_out: list[SampleBatch] = []
    bare_out: list[torch.Tensor] = []
    bare_tr = [bare_postprocess(topo, t) for t in tensors]
    for rep in range(args.repeats):
        pp_ctx, adv_ctx, state = contexts(f"r{rep}")  # fresh Redis keys: every group completes anew
        dt, _ = timed(lambda: [postprocess.process(b, pp_ctx) for b in rewarded])  # noqa: B023
        times["stage_post"].append(dt)
        dt, _ = timed(lambda: [bare_postprocess(topo, t) for t in tensors])
        times["bare_post"].append(dt)
        dt, outs = timed(lambda: [o for b in scored for o in advantage.process(b, adv_ctx)])  # noqa: B023
        times["stage_adv"].append(dt)
        dt, bouts = timed(lambda: [bare_advantage(topo, t, tr, args.n) for t, tr in zip(tensors, bare_tr, strict=True)])
        times["bare_adv"].append(dt)
        stage_out, bare_out = outs, bouts
        state.close()

    # the same numbers on both sides?
    got = {sid: row for b in stage_out for sid, row in zip(b.sample_ids(), b.advantages.rows(), strict=True)}
    diff = 0.0
    for t, adv in zip(tensors, bare_out, strict=True):
        for i, sid in enumerate(t["ids"]):
            row = got[sid]
            diff = max(diff, float(np.max(np.abs(adv[i, : row.size].numpy() - row), initial=0.0)))
    med = {k: median(v) for k, v in times.items()}
    return {"estimator": estimator, "redis": redis_url is not None, "samples": samples,
            "actions_mean": float(np.mean([int(x) for b in rewarded for x in b.action_ids.lengths])),
            "seconds": med, "samples_per_s": {k: samples / v for k, v in med.items()},
            "stage_records_out": len(stage_out), "max_abs_adv_diff": diff}


def main() -> int:
    args = parse_args()
    if args.mrb % args.n:
        raise SystemExit(f"--n {args.n} must divide --mrb {args.mrb} (whole groups per micro-batch)")
    torch.set_num_threads(args.threads)
    info_start = machine()
    from expstream.launch.localservers import LocalRedis

    tmp = Path(tempfile.mkdtemp(prefix="bench-advantage-"))
    redis = LocalRedis(tmp / "redis", appendonly=False)
    url = redis.start()
    variants = []
    for est in [e.strip() for e in args.estimators.split(",") if e.strip()]:
        group = topology(args, est).is_group_estimator
        plan = [url, None] if group else [None]  # the group path through Redis, and wholly in-process
        for u in plan:
            progress(f"{est} ({'Redis group buffers' if u else 'MemoryState'})")
            variants.append(bench_variant(args, est, u))
    redis.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    info_end = machine()

    print()
    print(f"advantage bench  {info_end['date']}  {info_end['cpu_count']} cores  load avg start "
          f"{info_start['loadavg']} end {info_end['loadavg']}")
    v0 = variants[0]
    print(f"{args.microbatches} micro-batches x {args.mrb} samples = {v0['samples']} samples per pass, groups of "
          f"n={args.n}, actions {args.min_actions}..{args.max_actions} (mean {v0['actions_mean']:.0f}), torch "
          f"threads {args.threads}; median of {args.repeats} passes, stage and bare interleaved")
    print()
    rows = []
    for v in variants:
        sps, sec = v["samples_per_s"], v["seconds"]
        label = f"{v['estimator']}{' + Redis' if v['redis'] else ''}"
        both_stage = sec["stage_post"] + sec["stage_adv"]
        both_bare = sec["bare_post"] + sec["bare_adv"]
        rows.append([label, sps["stage_post"], sps["bare_post"], ratio(sec["stage_post"], sec["bare_post"]),
                     sps["stage_adv"], sps["bare_adv"], ratio(sec["stage_adv"], sec["bare_adv"]),
                     v["samples"] / both_stage, v["samples"] / both_bare, ratio(both_stage, both_bare),
                     f"{v['max_abs_adv_diff']:.1e}"])
    print(table(["estimator", "post stage/s", "post bare/s", "post x", "adv stage/s", "adv bare/s", "adv x",
                 "both stage/s", "both bare/s", "both x", "max|dA|"], rows,
                title="samples/s (stage = process() on SampleBatch records; bare = numerics on padded tensors); "
                      "x = overhead ratio, stage time / bare time"))
    print()
    for v in variants:
        sec = v["seconds"]
        per_mb = 1000 / args.microbatches
        print(f"  {v['estimator']}{' + Redis' if v['redis'] else ''}: ms per micro-batch: postprocess "
              f"{fmt(sec['stage_post'] * per_mb)} (bare {fmt(sec['bare_post'] * per_mb)}), advantage "
              f"{fmt(sec['stage_adv'] * per_mb)} (bare {fmt(sec['bare_adv'] * per_mb)}); "
              f"stage overhead {fmt((sec['stage_post'] + sec['stage_adv'] - sec['bare_post'] - sec['bare_adv']) * per_mb)}"
              " ms/micro-batch")
    print()
    summary = {
        "bench": "advantage",
        "machine": info_end,
        "loadavg_start": info_start["loadavg"],
        "config": {"microbatches": args.microbatches, "mrb": args.mrb, "n": args.n, "min_actions": args.min_actions,
                   "max_actions": args.max_actions, "repeats": args.repeats, "threads": args.threads,
                   "overrides": args.overrides},
        "variants": {
            f"{v['estimator']}{'+redis' if v['redis'] else ''}": {
                "samples_per_s": {k: rounded(x, 1) for k, x in v["samples_per_s"].items()},
                "overhead_ratio": {
                    "postprocess": rounded(ratio(v["seconds"]["stage_post"], v["seconds"]["bare_post"]), 2),
                    "advantage": rounded(ratio(v["seconds"]["stage_adv"], v["seconds"]["bare_adv"]), 2),
                    "both": rounded(ratio(v["seconds"]["stage_post"] + v["seconds"]["stage_adv"],
                                          v["seconds"]["bare_post"] + v["seconds"]["bare_adv"]), 2)},
                "max_abs_adv_diff": v["max_abs_adv_diff"]}
            for v in variants},
    }
    save("advantage", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
