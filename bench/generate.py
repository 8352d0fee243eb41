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

Usage: ``.venv/bin/python bench/generate.py [--model-size tiny|small] [--prompts 64] [--repeats 3]``.
Nothing is asserted: the script reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import SMALL_CACHE, TINY_CACHE, fmt, machine, progress, ratio, save, table, write_prompts

from expstream.prompts import prompt_batches, read_prompts
from expstream.topology import load_topology
from schemas import SampleBatch

#: The goal of the issue: the stage must not waste the engine.
GOAL_STAGE_VS_BARE = 0.95


def topology(size: str, backend: str, prompt_batch_size: int, max_new_tokens: int, n: int) -> Any:
    from expstream.models import build_tiny_models

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


def run_stage(ctx: Any, batches: list) -> tuple[int, float]:
    """(generated tokens, seconds) of the stage function over every record."""
    from stages import generate

    t0 = time.perf_counter()
    tokens = 0
    for b in batches:
        for out in generate.process(b, ctx):
            assert isinstance(out, SampleBatch)
            tokens += int(out.response_ids.lengths.sum())
    return tokens, time.perf_counter() - t0


def run_bare(ctx: Any, token_batches: list[list[list[int]]], seed: int) -> tuple[int, float]:
    """(generated tokens, seconds) of bare ``LLM.generate`` on the engine the stage built."""
    from vllm import SamplingParams

    gen = ctx.models["generator"]
    g = ctx.topology.generate
    params = SamplingParams(n=g.n_samples_per_prompt, temperature=g.temperature, top_p=g.top_p,
                            max_tokens=g.max_new_tokens, min_tokens=g.min_new_tokens, seed=seed, logprobs=0,
                            detokenize=False, stop_token_ids=sorted(gen.stop_token_ids))

    def call() -> tuple[int, float]:
        t0 = time.perf_counter()
        tokens = 0
        for prompts in token_batches:
            outs = gen.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            tokens += sum(len(c.token_ids) for o in outs for c in o.outputs)
        return tokens, time.perf_counter() - t0

    return gen._on_engine_thread(call)  # the engine's own thread (expstream/vllm_backend.py)


def best_rate(fn: Any, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        tokens, seconds = fn()
        rates.append(tokens / seconds)
    return max(rates), rates


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--n", type=int, default=4, help="samples per prompt")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

    with tempfile.TemporaryDirectory() as tmp:
        rows = read_prompts(str(write_prompts(Path(tmp) / "p.jsonl", args.prompts)))
    results: dict[str, Any] = {"machine": machine(), "args": vars(args)}
    rate: dict[str, float] = {}

    # transformers first (see the module docstring)
    topo_tf = topology(args.model_size, "transformers", 2, args.max_new_tokens, args.n)
    batches = list(prompt_batches(rows, topo_tf.run.prompt_batch_size))
    ctx_tf = stage_context(topo_tf)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        progress(f"transformers stage, {threads} thread(s)")
        rate[f"transformers_{threads}t"], _ = best_rate(lambda: run_stage(ctx_tf, batches), args.repeats)

    from stages.generate import batch_seed, tokenize_prompts

    topo = topology(args.model_size, "vllm", 2, args.max_new_tokens, args.n)
    progress("vLLM engine start")
    t0 = time.perf_counter()
    ctx = stage_context(topo)
    results["engine_start_s"] = round(time.perf_counter() - t0, 2)
    whole = list(prompt_batches(rows, len(rows)))
    toks = [tokenize_prompts(b, ctx) for b in batches]
    toks_whole = [tokenize_prompts(whole[0], ctx)]
    seed = batch_seed(topo.run.seed, "bench")
    for _ in range(args.repeats):  # interleaved: the machine's noise hits every variant alike
        for name, fn in (("stage_per_record", lambda: run_stage(ctx, batches)),
                         ("bare_per_record", lambda: run_bare(ctx, toks, seed)),
                         ("stage_one_record", lambda: run_stage(ctx, whole)),
                         ("bare_one_call", lambda: run_bare(ctx, toks_whole, seed))):
            progress(name)
            best, _ = best_rate(fn, 1)
            rate[name] = max(rate.get(name, 0.0), best)

    progress("weight reload")
    from expstream.models import load_causal_lm
    from expstream.resolve import model_dir

    sd = load_causal_lm(model_dir(topo, "actor")).state_dict()
    gen = ctx.models["generator"]
    reloads = [gen.reload(state_dict=sd) for _ in range(5)]
    gen.close()

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
        ["best vLLM stage / best transformers", fmt(ratio(best_stage, best_tf)) + "x",
         "transformers best at " + ("1 thread" if rate["transformers_1t"] >= rate["transformers_2t"] else "2 threads"),
         ""],
        ["weight reload in the stage (median of 5)", fmt(sorted(reloads)[2] * 1000, ".1f") + " ms", "", ""],
        ["vLLM engine start (stage setup)", fmt(results["engine_start_s"]) + " s", "", ""],
    ]
    print(table(["measure", "tokens/s or figure", "ratio", "goal"], rows_out,
                title=f"generate, {args.model_size} model, {len(rows)} prompts x {args.n} samples x "
                      f"<= {args.max_new_tokens} tokens (best of {args.repeats})"))
    results.update(rates=rate, reload_s=reloads, stage_vs_bare=ratio(best_stage, best_bare),
                   stage_vs_transformers=ratio(best_stage, best_tf))
    print("saved", save(f"generate-{args.model_size}", results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
