"""The generate stage with vLLM vs. bare vLLM and vs. the transformers backend (issue 12).

Measures generated tokens per second of

* the **stage**: ``stages.generate.process`` on PromptBatch records (tokenize with the chat template,
  admission, one engine call per record, SampleBatch building and validation), backend=vllm, at the
  default micro-batch (``run.prompt_batch_size`` prompts per record) and with every prompt in one record;
* **bare vLLM**: ``LLM.generate`` of the very same engine on the same prompt token ids and sampling
  settings, per record and with every prompt in one call (the best configuration of the bare API; the
  ratio's baseline);
* the **transformers backend** (the same stage function, backend=transformers) at 1 and 2 torch threads,
  the best of which is the baseline of the "vLLM vs transformers" ratio.

and the stage's weight reload time (``VllmGenerator.reload`` of a full state dict, then the prefix-cache
reset). The transformers rows run first: vLLM's CPU backend binds the process's OpenMP threads when its
engine starts and refuses ``torch.set_num_threads`` afterwards. Each figure is the best of ``--repeats``
(default 3) timed passes after one warm-up pass (vLLM's first call in a process costs ~2 s).

Bare vLLM gets the very ``SamplingParams`` the stage submits (per-prompt seeds, flat log-probs), so
both sample the same tokens and the ratio is the stage's own cost (the script checks the token counts).

Time to first sample:

* **in a stage process**, per backend: a fresh process that has imported what the fork server preloads
  (``expstream.launch.forkserver.PRELOAD``, plus ``vllm`` for the vLLM backend as ``expstream run`` does; a
  stage process is forked from it), then the clock runs from the start of ``stages.generate.setup``
  (for vLLM: the in-process engine, the mode the stage uses) to the first ``SampleBatch`` out of
  ``stages.generate.process`` on a default record (2 prompts); the preload's import time is reported
  apart (the fork server pays it once, while the broker starts);
* **end to end** (``--e2e``, on by default for the tiny model): ``expstream run --prompts
  examples/prompts.jsonl --set generate.backend=B --set run.prompt_batch_size=8`` for both backends, one
  run each: summary.json's ``first_experience_after_s`` and the command's wall.

SGLang rows (bench/generate_sglang.py; with ``make setup-sglang`` done, or ``--sglang``): the stage with
backend=sglang vs. bare ``/generate`` on its server, beside the rows above. ``--no-vllm`` skips vLLM.

Usage: ``.venv/bin/python bench/generate.py [--model-size tiny|small] [--prompts 64] [--repeats 3] [--no-e2e]
[--no-sglang] [--no-vllm]``.
Nothing is asserted: the script reports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import ROOT, SMALL_CACHE, TINY_CACHE, fmt, machine, progress, ratio, save, table, write_prompts

from expstream.config.topology import load_topology
from expstream.launch.prompts import prompt_batches, read_prompts
from schemas import SampleBatch

#: The goal of the issue: the stage must not waste the engine.
GOAL_STAGE_VS_BARE = 0.95


def topology(size: str, backend: str, prompt_batch_size: int, max_new_tokens: int, n: int) -> Any:
    from expstream.models.tiny import build_tiny_models

    sets = [f"generate.backend={backend}", f"run.prompt_batch_size={prompt_batch_size}",
            f"generate.max_new_tokens={max_new_tokens}", f"generate.n_samples_per_prompt={n}",
            "generate.min_new_tokens=1"]
    if size == "tiny":
        build_tiny_models(TINY_CACHE)
        sets.append(f"models.cache_dir={TINY_CACHE}")
    else:
        paths = build_tiny_models(SMALL_CACHE, hidden=256, layers=4)
        sets += [f"models.cache_dir={SMALL_CACHE}", f"models.tokenizer={paths['tokenizer']}",
                 f"models.actor={paths['actor']}"]
    return load_topology(None, sets)


def stage_context(topo: Any) -> Any:
    from stages import generate
    from stages.context import make_context

    ctx = make_context(topo, "generate")
    generate.setup(ctx)
    return ctx


def run_stage(ctx: Any, batches: list) -> tuple[int, float, float]:
    """(generated tokens, seconds, CPU seconds of the process) of the stage function over every record."""
    from stages import generate

    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for b in batches:
        for out in generate.process(b, ctx):
            assert isinstance(out, SampleBatch)
            tokens += int(out.response_ids.lengths.sum())
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def run_bare(ctx: Any, token_batches: list[list[list[int]]], seeds: list[int]) -> tuple[int, float, float]:
    """(generated tokens, seconds, CPU seconds) of bare ``LLM.generate`` on the engine the stage built, with the
    SamplingParams the stage submits for each record (``seeds``: the records' batch seeds)."""
    gen = ctx.models["generator"]
    g = ctx.topology.generate
    params = [[gen._params(g.n_samples_per_prompt, temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                           max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens,
                           seed=(seed + i) % 2**31, ignore_eos=False, logprobs=True) for i in range(len(prompts))]
              for prompts, seed in zip(token_batches, seeds, strict=True)]

    def call() -> tuple[int, float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        tokens = 0
        for prompts, ps in zip(token_batches, params, strict=True):
            outs = gen.llm.generate([{"prompt_token_ids": p} for p in prompts], ps, use_tqdm=False)
            tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
        return tokens, time.perf_counter() - t0, time.process_time() - c0

    return gen._on_engine_thread(call)  # the engine's own thread (expstream/models/vllm_generator.py)


def stage_overhead_ms(ctx: Any, batch: Any, repeats: int = 20) -> float:
    """CPU ms of ``stages.generate.process`` on ``batch`` with the engine call replaced by its recorded
    result: the stage's own work per record (tokenize, admission, decode, SampleBatch), which the
    machine's load does not blur as it blurs the rates."""
    from stages import generate

    real = ctx.models["generator"]
    calls: list[Any] = []

    class Recorded:
        def generate(self, *args: Any, **kwargs: Any) -> Any:
            if not calls:
                calls.append(real.generate(*args, **kwargs))
            return calls[0]

    ctx.models["generator"] = Recorded()
    try:
        generate.process(batch, ctx)
        t0 = time.process_time()
        for _ in range(repeats):
            generate.process(batch, ctx)
        return round((time.process_time() - t0) / repeats * 1000, 2)
    finally:
        ctx.models["generator"] = real


def first_sample(size: str, backend: str, max_new_tokens: int, n: int) -> dict[str, float]:
    """Seconds from the start of the generate stage's setup to its first SampleBatch, in a fresh
    process that starts like a stage process (the fork server's imports done, nothing else)."""
    out = subprocess.run([sys.executable, __file__, "--first-sample-child", backend, "--model-size", size,
                          "--max-new-tokens", str(max_new_tokens), "--n", str(n)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode != 0:
        raise RuntimeError(f"first-sample child ({backend}) failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def first_sample_child(args: argparse.Namespace) -> int:
    import importlib

    from expstream.launch.forkserver import PRELOAD

    t0 = time.perf_counter()
    # what a stage process has imported when it is forked from the fork server (expstream run adds
    # vllm to the preload with generate.backend=vllm: expstream/launch/run.py)
    for module in PRELOAD + (["vllm"] if args.first_sample_child == "vllm" else []):
        importlib.import_module(module)
    import_s = time.perf_counter() - t0
    from stages import generate
    from stages.context import make_context

    topo = topology(args.model_size, args.first_sample_child, 2, args.max_new_tokens, args.n)
    torch.set_num_threads(topo.run.torch_threads)  # as expstream/launch/replica.py does before setup
    with tempfile.TemporaryDirectory() as tmp:
        record = next(iter(prompt_batches(read_prompts(str(write_prompts(Path(tmp) / "p.jsonl", 8))),
                                          topo.run.prompt_batch_size)))
    t0 = time.perf_counter()
    ctx = make_context(topo, "generate")
    generate.setup(ctx)
    setup_s = time.perf_counter() - t0
    outs = generate.process(record, ctx)
    first_s = time.perf_counter() - t0
    assert outs and isinstance(outs[0], SampleBatch)
    generate.teardown(ctx)
    print(json.dumps({"preload_import_s": round(import_s, 2), "setup_s": round(setup_s, 2),
                      "first_sample_s": round(first_s, 2)}))
    return 0


def end_to_end(backend: str, out_dir: Path) -> dict[str, Any]:
    """One ``expstream run`` of the example prompts (8 prompts per record): the command's wall and
    summary.json's first_experience_after_s."""
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", "examples/prompts.jsonl", "--output", str(out_dir),
           "--no-progress", "--set", f"generate.backend={backend}", "--set", "run.prompt_batch_size=8"]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"expstream run ({backend}) exited {res.returncode}:\n{res.stderr[-3000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"wall_s": round(wall, 2), "first_experience_after_s": summary["first_experience_after_s"],
            "run_wall_s": summary["wall_s"], "samples": summary["samples"]}


def best_rate(fn: Any, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        tokens, seconds, _cpu = fn()
        rates.append(tokens / seconds)
    return max(rates), rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    ap.add_argument("--e2e", action=argparse.BooleanOptionalAction, default=None,
                    help="time expstream run end to end with both backends (default: with --model-size tiny)")
    ap.add_argument("--sglang", action=argparse.BooleanOptionalAction, default=None,
                    help="the SGLang rows (default: when the SGLang venv exists, make setup-sglang)")
    ap.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=True, help="the vLLM rows")
    ap.add_argument("--first-sample-child", choices=["vllm", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if args.first_sample_child:
        return first_sample_child(args)

    with tempfile.TemporaryDirectory() as tmp:
        rows = read_prompts(str(write_prompts(Path(tmp) / "p.jsonl", args.prompts)))
    results: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    print("load average at start:", Path("/proc/loadavg").read_text().strip())
    rate: dict[str, float] = {}

    # transformers first (see the module docstring)
    topo_tf = topology(args.model_size, "transformers", 2, args.max_new_tokens, args.n)
    batches = list(prompt_batches(rows, topo_tf.run.prompt_batch_size))
    ctx_tf = stage_context(topo_tf)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        progress(f"transformers stage, {threads} thread(s)")
        rate[f"transformers_{threads}t"], _ = best_rate(lambda: run_stage(ctx_tf, batches), args.repeats)

    from expstream.models.sglang_server import sglang_installed

    sglang_rows: list[list[str]] = []
    if args.sglang if args.sglang is not None else sglang_installed():
        from generate_sglang import sglang_section

        sglang_rows, results["sglang"] = sglang_section(args, topology, stage_context, run_stage, rows, batches,
                                                        max(rate["transformers_1t"], rate["transformers_2t"]),
                                                        stage_overhead_ms)
    if not args.vllm:
        print(table(["measure", "tokens/s or figure", "ratio", "goal"],
                    [["transformers stage, 1 thread", fmt(rate["transformers_1t"], ".0f"), "", ""],
                     ["transformers stage, 2 threads", fmt(rate["transformers_2t"], ".0f"), "", ""], *sglang_rows],
                    title=f"generate, {args.model_size} model, {len(rows)} prompts x {args.n} samples x "
                          f"<= {args.max_new_tokens} tokens (best of {args.repeats})"))
        results.update(rates=rate)
        print("load average at end:", Path("/proc/loadavg").read_text().strip())
        print("saved", save(f"generate-{args.model_size}-no-vllm", results))
        return 0

    from stages.generate import batch_seed, tokenize_prompts

    topo = topology(args.model_size, "vllm", 2, args.max_new_tokens, args.n)
    # time to first sample, each backend in a process of its own started like a stage process
    ttfs = {}
    for backend in ("vllm", "transformers"):
        progress(f"time to first sample, {backend} (a fresh process)")
        ttfs[backend] = first_sample(args.model_size, backend, args.max_new_tokens, args.n)
    results["first_sample"] = ttfs
    if args.e2e if args.e2e is not None else args.model_size == "tiny":
        e2e: dict[str, Any] = {"loadavg_before": [round(x, 2) for x in os.getloadavg()]}
        with tempfile.TemporaryDirectory() as tmp:
            for backend in ("vllm", "transformers"):
                progress(f"expstream run end to end, {backend}")
                e2e[backend] = end_to_end(backend, Path(tmp) / backend)
        e2e["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        results["end_to_end"] = e2e

    progress("vLLM engine start")
    t0 = time.perf_counter()
    ctx = stage_context(topo)
    results["engine_start_s"] = round(time.perf_counter() - t0, 2)
    whole = list(prompt_batches(rows, len(rows)))
    toks = [tokenize_prompts(b, ctx) for b in batches]
    toks_whole = [tokenize_prompts(whole[0], ctx)]
    seeds = [batch_seed(topo.run.seed, b.batch_id) for b in batches]
    seeds_whole = [batch_seed(topo.run.seed, whole[0].batch_id)]
    tokens: dict[str, set[int]] = {}
    passes: dict[str, list[int]] = {}  # every timed pass's tokens/s: the spread of the noise
    cpu_passes: dict[str, list[int]] = {}  # tokens per CPU second (all threads): blind to other processes
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every variant alike
        for name, fn in (("stage_per_record", lambda: run_stage(ctx, batches)),
                         ("bare_per_record", lambda: run_bare(ctx, toks, seeds)),
                         ("stage_one_record", lambda: run_stage(ctx, whole)),
                         ("bare_one_call", lambda: run_bare(ctx, toks_whole, seeds_whole))):
            progress(name)
            fn()  # warm-up
            count, seconds, cpu = fn()
            tokens.setdefault(name, set()).add(count)
            passes.setdefault(name, []).append(round(count / seconds))
            cpu_passes.setdefault(name, []).append(round(count / cpu))
            rate[name] = max(rate.get(name, 0.0), count / seconds)
    # the same seeds on both sides: the stage and bare vLLM sample the same tokens, so the same counts
    same_tokens = tokens["stage_per_record"] == tokens["bare_per_record"] and \
        tokens["stage_one_record"] == tokens["bare_one_call"] and all(len(v) == 1 for v in tokens.values())

    progress("the stage's own work per record")
    overhead = {"per_record": stage_overhead_ms(ctx, batches[0]), "one_record": stage_overhead_ms(ctx, whole[0])}
    results["stage_overhead_ms"] = overhead

    progress("weight reload")
    from expstream.models.hf import load_causal_lm
    from expstream.models.resolve import model_dir

    sd = load_causal_lm(model_dir(topo, "actor")).state_dict()
    gen = ctx.models["generator"]
    reloads = [gen.reload(state_dict=sd) for _ in range(5)]
    gen.close()

    # each round times stage and bare back to back: the median of their ratios is steadier on a busy
    # machine than the ratio of two best passes (one lucky pass moves that)
    def paired_median(by: dict[str, list[int]], kind: str, bare: str) -> float:
        return statistics.median(s / b for s, b in zip(by[f"stage_{kind}"], by[f"bare_{bare}"], strict=True))

    kinds = (("per_record", "per_record"), ("one_record", "one_call"))
    paired = {kind: paired_median(passes, kind, bare) for kind, bare in kinds}
    # CPU time: a pass preempted by another process costs it wall time, not CPU time
    paired_cpu = {kind: paired_median(cpu_passes, kind, bare) for kind, bare in kinds}
    results.update(paired_median_stage_vs_bare=paired, paired_median_stage_vs_bare_cpu=paired_cpu,
                   cpu_passes=cpu_passes)
    best_tf = max(rate["transformers_1t"], rate["transformers_2t"])
    best_bare = max(rate["bare_per_record"], rate["bare_one_call"])
    best_stage = max(rate["stage_per_record"], rate["stage_one_record"])
    rows_out = [
        ["transformers stage, 1 thread", fmt(rate["transformers_1t"], ".0f"), "", ""],
        ["transformers stage, 2 threads", fmt(rate["transformers_2t"], ".0f"), "", ""],
        [f"vLLM stage, {topo.run.prompt_batch_size} prompts per record", fmt(rate["stage_per_record"], ".0f"),
         fmt(ratio(rate["stage_per_record"], rate["bare_per_record"])) + "x bare per record", ""],
        ["bare LLM.generate, per record", fmt(rate["bare_per_record"], ".0f"), "", ""],
        [f"vLLM stage, {len(rows)} prompts in one record", fmt(rate["stage_one_record"], ".0f"),
         fmt(ratio(rate["stage_one_record"], rate["bare_one_call"])) + "x bare one call", ""],
        ["bare LLM.generate, one call", fmt(rate["bare_one_call"], ".0f"), "", ""],
        ["best vLLM stage / best bare vLLM", fmt(ratio(best_stage, best_bare)) + "x", "",
         f">= {GOAL_STAGE_VS_BARE}x"],
        ["median of paired passes, stage / bare: per record, one record",
         f"{fmt(paired['per_record'])}x, {fmt(paired['one_record'])}x", "", f">= {GOAL_STAGE_VS_BARE}x"],
        ["the same by tokens per CPU second", f"{fmt(paired_cpu['per_record'])}x, {fmt(paired_cpu['one_record'])}x",
         "", f">= {GOAL_STAGE_VS_BARE}x"],
        ["best vLLM stage / best transformers", fmt(ratio(best_stage, best_tf)) + "x",
         "transformers best at " + ("1 thread" if rate["transformers_1t"] >= rate["transformers_2t"] else "2 threads"),
         ""],
        ["the stage's own CPU per record, 2 / 64 prompts", f"{fmt(overhead['per_record'])} / "
         f"{fmt(overhead['one_record'])} ms", "outside the engine call", ""],
        ["weight reload in the stage (median of 5)", fmt(sorted(reloads)[2] * 1000, ".1f") + " ms", "", ""],
        ["vLLM engine start (stage setup)", fmt(results["engine_start_s"]) + " s", "", ""],
        *sglang_rows,
    ]
    for backend in ("vllm", "transformers"):
        t = ttfs[backend]
        rows_out.append([f"time to first sample, {backend} stage process", fmt(t["first_sample_s"]) + " s",
                         f"setup {fmt(t['setup_s'])} s; preload {fmt(t['preload_import_s'])} s", ""])
    if "end_to_end" in results:
        e2e = results["end_to_end"]
        for backend in ("vllm", "transformers"):
            rows_out.append([f"expstream run, {backend}, 8 prompts per record: first experience / wall",
                             f"{fmt(e2e[backend]['first_experience_after_s'])} s / {fmt(e2e[backend]['wall_s'])} s",
                             f"load {e2e['loadavg_before'][0]:.2f} -> {e2e['loadavg_after'][0]:.2f}", ""])
    print(table(["measure", "tokens/s or figure", "ratio", "goal"], rows_out,
                title=f"generate, {args.model_size} model, {len(rows)} prompts x {args.n} samples x "
                      f"<= {args.max_new_tokens} tokens (best of {args.repeats})"))
    print(f"stage and bare vLLM sampled the same token counts: {same_tokens} {tokens}")
    print("tokens/s of every timed pass:", passes)
    print("load average at end:", Path("/proc/loadavg").read_text().strip())
    results["machine_end"] = {"loadavg": [round(x, 2) for x in os.getloadavg()]}
    results.update(rates=rate, reload_s=reloads, stage_vs_bare=ratio(best_stage, best_bare),
                   stage_vs_transformers=ratio(best_stage, best_tf), same_tokens=same_tokens, passes=passes,
                   token_counts={k: sorted(v) for k, v in tokens.items()})
    print("saved", save(f"generate-{args.model_size}", results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
