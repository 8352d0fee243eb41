"""The SGLang rows of bench/generate.py (issue 27): the generate stage with backend=sglang vs. bare SGLang.

* the **stage**: ``stages.generate.process`` on the same PromptBatch records as the other rows,
  backend=sglang (the stage starts its SGLang server from ``.venv-sglang``), per record and with every
  prompt in one record;
* **bare SGLang**: ``POST /generate`` to that very server with the request body the stage sends (the
  same token ids and sampling parameters, ``return_logprob``), per record and in one call.

On CPU SGLang does not honour per-request seeds (deterministic inference needs a GPU attention
backend), so stage and bare sample different tokens; with the tiny random models EOS is rare and the
counts differ by a few tokens, which the tokens/s rates absorb. Plus the server start and the weight
update (``/update_weights_from_disk`` + ``/flush_cache`` of a full state dict).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from common import fmt, progress, ratio


def _bare(ctx: Any, token_batches: list[list[list[int]]], seeds: list[int]) -> tuple[int, float, float]:
    """(generated tokens, seconds, CPU seconds) of bare /generate calls with the stage's own request bodies."""
    from expstream.models.sglang_server import http_json

    gen = ctx.models["generator"]
    g = ctx.topology.generate
    n = g.n_samples_per_prompt
    bodies = []
    for prompts, seed in zip(token_batches, seeds, strict=True):
        rows = [p for p in prompts for _ in range(n)]
        params = [gen._params(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
                              min_new_tokens=g.min_new_tokens, seed=seed + i, ignore_eos=False)
                  for i in range(len(rows))]
        bodies.append({"input_ids": rows, "sampling_params": params, "return_logprob": True, "logprob_start_len": -1})
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = 0
    for body in bodies:
        tokens += sum(len(o["output_ids"]) for o in http_json(gen.url, "/generate", body))
    return tokens, time.perf_counter() - t0, time.process_time() - c0


def sglang_section(args: Any, topology: Any, stage_context: Any, run_stage: Any, rows: list, batches: list,
                   best_tf: float, stage_overhead_ms: Any) -> tuple[list[list[str]], dict[str, Any]]:
    """Table rows and results of the SGLang measurements (the helpers are bench/generate.py's)."""
    from expstream.launch.prompts import prompt_batches
    from expstream.models.hf import load_causal_lm
    from expstream.models.resolve import model_dir
    from stages.generate import batch_seed, tokenize_prompts

    topo = topology(args.model_size, "sglang", 2, args.max_new_tokens, args.n)
    progress("SGLang server start (stage setup)")
    t0 = time.perf_counter()
    ctx = stage_context(topo)
    start_s = time.perf_counter() - t0
    whole = list(prompt_batches(rows, len(rows)))
    toks = [tokenize_prompts(b, ctx) for b in batches]
    toks_whole = [tokenize_prompts(whole[0], ctx)]
    seeds = [batch_seed(topo.run.seed, b.batch_id) for b in batches]
    seeds_whole = [batch_seed(topo.run.seed, whole[0].batch_id)]
    rate: dict[str, float] = {}
    passes: dict[str, list[int]] = {}
    try:
        for _ in range(args.repeats):  # interleaved, like the vLLM rows
            for name, fn in (("stage_per_record", lambda: run_stage(ctx, batches)),
                             ("bare_per_record", lambda: _bare(ctx, toks, seeds)),
                             ("stage_one_record", lambda: run_stage(ctx, whole)),
                             ("bare_one_call", lambda: _bare(ctx, toks_whole, seeds_whole))):
                progress(f"sglang {name}")
                fn()  # warm-up
                count, seconds, _cpu = fn()
                passes.setdefault(name, []).append(round(count / seconds))
                rate[name] = max(rate.get(name, 0.0), count / seconds)
        progress("sglang: the stage's own work per record")
        overhead = {"per_record": stage_overhead_ms(ctx, batches[0]), "one_record": stage_overhead_ms(ctx, whole[0])}
        progress("sglang weight update")
        sd = load_causal_lm(model_dir(topo, "actor")).state_dict()
        gen = ctx.models["generator"]
        reloads = [gen.reload(state_dict=sd) for _ in range(5)]
    finally:
        ctx.models["generator"].close()

    paired = {kind: statistics.median(s / b for s, b in zip(passes[f"stage_{kind}"], passes[f"bare_{bare}"],
                                                             strict=True))
              for kind, bare in (("per_record", "per_record"), ("one_record", "one_call"))}
    best_stage = max(rate["stage_per_record"], rate["stage_one_record"])
    best_bare = max(rate["bare_per_record"], rate["bare_one_call"])
    out = [
        [f"SGLang stage, {topo.run.prompt_batch_size} prompts per record", fmt(rate["stage_per_record"], ".0f"),
         fmt(ratio(rate["stage_per_record"], rate["bare_per_record"])) + "x bare per record", ""],
        ["bare SGLang /generate, per record", fmt(rate["bare_per_record"], ".0f"), "", ""],
        [f"SGLang stage, {len(rows)} prompts in one record", fmt(rate["stage_one_record"], ".0f"),
         fmt(ratio(rate["stage_one_record"], rate["bare_one_call"])) + "x bare one call", ""],
        ["bare SGLang /generate, one call", fmt(rate["bare_one_call"], ".0f"), "", ""],
        ["best SGLang stage / best bare SGLang", fmt(ratio(best_stage, best_bare)) + "x", "", ">= 0.95x"],
        ["median of paired passes, SGLang stage / bare: per record, one record",
         f"{fmt(paired['per_record'])}x, {fmt(paired['one_record'])}x", "", ">= 0.95x"],
        ["best SGLang stage / best transformers", fmt(ratio(best_stage, best_tf)) + "x", "", ""],
        [f"the SGLang stage's own CPU per record, 2 / {len(rows)} prompts",
         f"{fmt(overhead['per_record'])} / {fmt(overhead['one_record'])} ms", "outside the /generate call", ""],
        ["SGLang weight update in the stage (median of 5)", fmt(sorted(reloads)[2] * 1000, ".1f") + " ms",
         "/update_weights_from_disk + /flush_cache", ""],
        ["SGLang server start (stage setup)", fmt(start_s) + " s", "", ""],
    ]
    results = {"rates": rate, "stage_overhead_ms": overhead, "passes": passes, "paired_median_stage_vs_bare": paired, "reload_s": reloads,
               "server_start_s": round(start_s, 2), "stage_vs_bare": ratio(best_stage, best_bare),
               "stage_vs_transformers": ratio(best_stage, best_tf)}
    return out, results
