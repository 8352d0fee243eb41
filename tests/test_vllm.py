"""vLLM as the generation engine (issue 12): equivalence with transformers, weight reload, the stage.

Every test here needs vLLM (`make setup-vllm`); without it they are skipped with that reason. One
engine serves the whole session (it takes seconds to build); the end-to-end test starts its own, in
the generate stage processes of a real ``expstream run``.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from expstream.models.vllm_generator import vllm_available
from tests.engines import (
    GenerateProcesses,
    assert_a_published_version_is_served,
    assert_every_sample_out_once,
    children,
    cli,
    max_diff,
    perturbed_actor,
    prompts,
    start_example_run,
    stop_problems,
)

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed: run `make setup-vllm`")]
#: Why 1e-4: the issue's bound; float32 on both engines agrees to ~1e-6 here, a reused KV cache of
#: stale weights is off by whole nats.
TOL = 1e-4


@pytest.fixture(scope="session")
def engine(tiny):
    from expstream.models.hf import load_tokenizer
    from expstream.models.vllm_generator import VllmGenerator

    gen = VllmGenerator(tiny["actor"], load_tokenizer(tiny["tokenizer"]), seed=0, max_model_len=256)
    yield gen
    gen.close()


def recompute(model, rows: list[list[int]], outs: list[list[int]], temperature: float = 1.0) -> list[list[float]]:
    """The actor-logprob stage's computation (forward_action_log_probs) on left-padded prompt + response."""
    from expstream.models.passes import forward_action_log_probs

    a = len(outs[0])
    assert all(len(o) == a for o in outs), "equal lengths (ignore_eos) keep the layout simple"
    width = max(map(len, rows))
    seq = torch.zeros((len(rows), width + a), dtype=torch.long)
    mask = torch.zeros_like(seq)
    for i, (r, o) in enumerate(zip(rows, outs, strict=True)):
        seq[i, width - len(r):] = torch.tensor(r + o)
        mask[i, width - len(r):] = 1
    if temperature == 1.0:
        lp, _ = forward_action_log_probs(model, seq, mask, a)
        return lp.tolist()
    with torch.no_grad():
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=seq, attention_mask=mask, position_ids=pos).logits[:, width - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, seq[:, width:, None])[..., 0].tolist()


def test_greedy_tokens_equal_the_transformers_backend(engine, hf):
    ps = prompts(hf.tokenizer)
    for min_new in (0, 3):  # with EOS allowed at once and suppressed for three tokens
        ours, lp = engine.generate(ps, 2, temperature=0, max_new_tokens=12, min_new_tokens=min_new,
                                   return_log_probs=True)
        theirs, lp_hf = hf.generate(ps, 2, temperature=0, max_new_tokens=12, min_new_tokens=min_new,
                                    return_log_probs=True)
        assert ours == theirs
        assert len(ours) == 6 and ours[0] == ours[1]  # rows [g*n, (g+1)*n) belong to prompt g
        if min_new == 0:  # greedy log-probs: softmax of the raw logits on both
            assert max_diff(lp, lp_hf) <= TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_the_actor_recomputation(engine, hf, temperature):
    ps = prompts(hf.tokenizer)
    outs, lp = engine.generate(ps, 3, temperature=temperature, max_new_tokens=10, seed=11, ignore_eos=True,
                               return_log_probs=True)
    assert len(outs) == 9 and all(len(o) == 10 for o in outs)
    assert len({tuple(o) for o in outs}) > 3, "samples of a prompt differ: this is sampling, not greedy"
    rows = [p for p in ps for _ in range(3)]
    assert max_diff(lp, recompute(hf.model, rows, outs, temperature)) <= TOL
    again, _ = engine.generate(ps, 3, temperature=temperature, max_new_tokens=10, seed=11, ignore_eos=True,
                               return_log_probs=True)
    assert again == outs, "the same seed samples the same tokens (a redelivered micro-batch)"


def test_fire_samples_the_first_token_hot_and_the_rest_at_temperature(engine, hf):
    """FIRE on vLLM (two engine calls, expstream/models/fire.py): the first token's log-prob is
    log_softmax(logits / 10) of an independent transformers forward, the later ones at 0.7; with equal
    temperatures the tokens and log-probs are those of plain sampling, byte for byte."""
    ps = prompts(hf.tokenizer)
    outs, lp = engine.generate(ps, 3, temperature=0.7, max_new_tokens=6, seed=13, ignore_eos=True,
                               return_log_probs=True, first_token_temperature=10.0)
    assert len(outs) == 9 and all(len(o) == 6 for o in outs)
    rows = [p for p in ps for _ in range(3)]
    hot = recompute(hf.model, rows, outs, 10.0)
    rest = recompute(hf.model, rows, outs, 0.7)
    assert max_diff([r[:1] for r in lp], [r[:1] for r in hot]) <= 1e-5
    assert max_diff([r[1:] for r in lp], [r[1:] for r in rest]) <= 1e-5
    assert max(abs(a[0] - b[0]) for a, b in zip(lp, rest, strict=True)) > 1e-2, "the first token is not at 0.7"
    kw = dict(temperature=0.7, max_new_tokens=6, seed=13, return_log_probs=True)
    assert engine.generate(ps, 3, first_token_temperature=0.7, **kw) == engine.generate(ps, 3, **kw)


def long_prompt(tok, tokens: int = 200) -> list[int]:
    """A prompt of ``tokens`` tokens: longer than one KV block (128 on CPU), so its first block is cached."""
    ids = tok("def add(a, b):\n    return a + b\n\nx = [i * i for i in range(10)]\n", add_special_tokens=False)
    return (ids["input_ids"] * (tokens // len(ids["input_ids"]) + 1))[:tokens]


def test_a_published_version_reloads_in_place(engine, hf, tiny, tmp_path):
    """The continuous loop's path: the trainer publishes, the stage's follower reloads the engine.

    A 200-token prompt is generated before and after the update: its first KV block is in the prefix
    cache under the old weights, so without the prefix-cache reset the second generation would reuse
    it and its log-probs would be off by whole nats."""
    from expstream.models.vllm_generator import VllmWeights

    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    ps = [*prompts(hf.tokenizer), long_prompt(hf.tokenizer)]
    assert len(ps[-1]) > block, f"the long prompt must fill a KV block ({block} tokens) to be cached"
    assert len(ps[-1]) + 10 <= engine.llm.llm_engine.vllm_config.model_config.max_model_len

    def check_log_probs(new, outs, lp) -> None:
        for row, out, row_lp in zip(ps, outs, lp, strict=True):  # one at a time: no padding in the forward
            assert max_diff([row_lp], recompute(new, [row], [out])) <= TOL, f"prompt of {len(row)} tokens"

    assert_a_published_version_is_served(engine, hf, tiny["actor"], tmp_path / "store",
                                         VllmWeights(engine, tiny["actor"]), ps, check_log_probs)


def test_a_knob_vllm_cannot_honour_is_refused_at_start_up(tmp_path):
    res = cli("run", "--prompts", "examples/prompts.jsonl", "--output", str(tmp_path / "out"),
              "--set", "generate.backend=vllm", "--set", "generate.vllm_max_model_len=32", timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "generate.vllm_max_model_len" in res.stderr
    assert not (tmp_path / "out" / "run" / "pids.json").exists(), "refused before any stage started"
    res = cli("run", "--prompts", "examples/prompts.jsonl", "--output", str(tmp_path / "out2"),
              "--set", "generate.backend=vllm", "--set", "generate.top_k=-3", timeout=60)
    assert res.returncode == 2 and "generate.top_k" in res.stderr, res.stderr[-2000:]


@pytest.mark.e2e
def test_expstream_run_with_vllm_survives_a_killed_generate_and_leaves_no_engine_process(tmp_path, tiny):
    """The example prompts through ``expstream run`` with generate.backend=vllm; generate[0] is SIGKILLed
    once its engine is up: the engine lives in the stage process (no process of its own is left
    behind), the supervisor restarts the stage, and every group comes out once. At the end, SIGTERM
    stops every generate replica cleanly: each returns from its runner and shuts its engine down
    (never SIGKILLed after the grace), and nothing that a generate stage started outlives it."""
    out = tmp_path / "run"
    proc, stderr_path = start_example_run(tmp_path, out, Path(tiny["actor"]).parents[1], "generate.backend=vllm")
    gen_procs = GenerateProcesses(out)
    try:
        log = out / "run" / "logs" / "generate-0.log"
        deadline = time.monotonic() + 150
        while not (log.exists() and "vLLM engine" in log.read_text(errors="replace")):
            assert proc.poll() is None, stderr_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "generate[0] built no engine within 150 s"
            gen_procs.watch()
            time.sleep(0.2)
        killed = json.loads((out / "run" / "pids.json").read_text())["generate[0]"]
        assert children(killed) == [], "the engine runs inside the stage process: no engine process to orphan"
        os.kill(killed, signal.SIGKILL)
        gen_procs.wait_for_end(proc, 240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = stderr_path.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    summary = assert_every_sample_out_once(out)
    assert summary["stage_restarts"].get("generate[0]", 0) >= 1, summary["stage_restarts"]

    # The stop: no generate replica was SIGKILLed after the grace or exited with an error code (the
    # supervisor logs both: "did not stop within ...; killing it", "exited with code N on stop").
    assert not stop_problems(stderr), stop_problems(stderr)
    # Each replica alive at the stop returned from its runner (so exited 0) and shut its engine down;
    # its log lines carry its pid.
    final = {pid: label for pid, label in gen_procs.pids.items() if pid != killed}
    assert sorted(final.values()) == sorted(set(gen_procs.pids.values())), gen_procs.pids  # one process per replica
    for pid, label in final.items():
        lines = (out / "run" / "logs" / f"generate-{label[9:-1]}.log").read_text(errors="replace")
        assert f"[{pid}]: stage generate replica {label[9:-1]}: stopped after" in lines, f"{label} pid {pid}"
        assert f"[{pid}]: generate: vLLM engine shut down" in lines, f"{label} pid {pid}"
    # Nothing a generate stage started survives: no child seen during the run, and no process in a
    # generate stage's session.
    gen_procs.assert_none_left()


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_in_flight_update_between_engine_steps_changes_later_log_probs_only(engine, hf, tiny, mode):
    """generate.in_flight_updates with vLLM (issue 26): a version loaded between two engine steps (on the engine
    thread, through the follower's path: VllmWeights.load_state_dict) changes the log-probs of the later tokens
    only; recompute re-prefills the running requests under the new weights (their later log-probs are the new
    policy's), keep keeps their KV cache."""
    from expstream.models.decode_loop import InFlight
    from expstream.models.hf import load_causal_lm
    from expstream.models.vllm_generator import VllmWeights

    swap_at, steps = 4, 10
    new = perturbed_actor(tiny["actor"], seed=5, scale=0.05)
    weights, calls = VllmWeights(engine, tiny["actor"]), {"n": 0, "v": 0}

    def poll() -> int:
        if calls["n"] == swap_at:
            weights.load_state_dict(new.state_dict())
            calls["v"] = 1
        calls["n"] += 1
        return calls["v"]

    ps = prompts(hf.tokenizer)
    inf = InFlight(poll=poll, version=0, mode=mode)
    try:
        outs, lp = engine.generate(ps, 2, temperature=1.0, max_new_tokens=steps, seed=3, ignore_eos=True,
                                   return_log_probs=True, in_flight=inf)
    finally:
        engine.reload(state_dict=load_causal_lm(tiny["actor"]).state_dict())
    assert inf.swaps == 1 and all(len(o) == steps for o in outs)
    assert inf.token_versions == [[0] * swap_at + [1] * (steps - swap_at)] * 6
    rows = [p for p in ps for _ in range(2)]
    old_lp, new_lp = recompute(hf.model, rows, outs), recompute(new, rows, outs)
    for got, old, newer in zip(lp, old_lp, new_lp, strict=True):
        assert max(abs(a - b) for a, b in zip(got[:swap_at], old[:swap_at], strict=True)) <= TOL
        assert min(abs(a - b) for a, b in zip(got[swap_at:], old[swap_at:], strict=True)) > TOL
        if mode == "recompute":
            assert max(abs(a - b) for a, b in zip(got[swap_at:], newer[swap_at:], strict=True)) <= TOL
