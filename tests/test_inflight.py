"""In-flight weight updates (issue 26 item 1): the decode loop of expstream/models/decode_loop.py.

A new version loaded between two decoding steps changes the log-probs of the later tokens and not of the
earlier ones, checked against independent forward passes under each version; without an update the loop
samples exactly what ``model.generate`` samples (the same logits chain).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from expstream.config.topology import load_topology
from expstream.errors import ShutdownRequested
from expstream.models.decode_loop import InFlight, PartialGeneration
from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer, never_sampled_token_ids
from expstream.models.resolve import model_dir

SWAP_AT = 5  # the step before which version 1 is loaded
STEPS = 12


@pytest.fixture(scope="module")
def tiny(model_cache):
    topo = load_topology(overrides=[f"models.cache_dir={model_cache}"])
    tok = load_tokenizer(model_dir(topo, "tokenizer"))
    model = load_causal_lm(model_dir(topo, "actor"))
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(1)
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v.clone()
          for k, v in v0.items()}
    prompts = [tok("Hello there")["input_ids"], tok("Add two numbers please")["input_ids"]]
    return tok, model, v0, v1, prompts


def swapping_poll(model, v1, at: int):
    """A poll that loads v1 into ``model`` in place before decoding step ``at`` (as PolicyFollower does)."""
    calls = {"n": 0, "version": 0}

    def poll() -> int:
        if calls["n"] == at:
            model.load_state_dict(v1)
            calls["version"] = 1
        calls["n"] += 1
        return calls["version"]

    return poll


def independent_log_probs(model, state, prompt, tokens, banned):
    """log p(token_t | prompt, tokens_<t) under ``state`` by one plain forward pass (no cache, no padding)."""
    ref = copy.deepcopy(model)
    ref.load_state_dict(state)
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = ref(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logits[:, banned] = float("-inf")
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_update_mid_generation_changes_later_log_probs_only(tiny, mode):
    tok, model, v0, v1, prompts = tiny
    model.load_state_dict(v0)
    g = TransformersGenerator(model, tok)
    inf = InFlight(poll=swapping_poll(model, v1, SWAP_AT), version=0, mode=mode)
    tokens, logps = g.generate(prompts, 2, temperature=1.0, max_new_tokens=STEPS, seed=3, ignore_eos=True,
                               return_log_probs=True, in_flight=inf)
    model.load_state_dict(v0)
    assert inf.swaps == 1
    assert inf.token_versions == [[0] * SWAP_AT + [1] * (STEPS - SWAP_AT)] * 4
    # ignore_eos: the stop tokens are banned at every step, the pad token is never sampled
    banned = sorted(set(g.stop_token_ids) | set(never_sampled_token_ids(tok, model)))
    for row, (toks, lp) in enumerate(zip(tokens, logps, strict=True)):
        prompt = prompts[row // 2]
        lp = torch.tensor(lp)
        under_v0 = independent_log_probs(model, v0, prompt, toks, banned)
        under_v1 = independent_log_probs(model, v1, prompt, toks, banned)
        torch.testing.assert_close(lp[:SWAP_AT], under_v0[:SWAP_AT], atol=1e-5, rtol=0)  # earlier: unchanged
        assert (lp[SWAP_AT:] - under_v0[SWAP_AT:]).abs().min() > 1e-4  # later: every one changed
        if mode == "recompute":  # later tokens: exactly the new policy given the prefix
            torch.testing.assert_close(lp[SWAP_AT:], under_v1[SWAP_AT:], atol=1e-5, rtol=0)
        else:  # keep: the new weights over the old weights' KV cache, so neither version's full forward
            assert (lp[SWAP_AT + 1:] - under_v1[SWAP_AT + 1:]).abs().max() > 1e-4


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9),
                                      dict(temperature=0.0)])
def test_loop_without_update_samples_what_model_generate_samples(tiny, sampling):
    tok, model, v0, _, prompts = tiny
    model.load_state_dict(v0)
    g = TransformersGenerator(model, tok)
    ref, ref_lp = g.generate(prompts, 3, max_new_tokens=20, seed=11, return_log_probs=True, **sampling)
    inf = InFlight(poll=lambda: 0, version=0)
    out, lp = g.generate(prompts, 3, max_new_tokens=20, seed=11, return_log_probs=True, in_flight=inf, **sampling)
    assert out == ref
    torch.testing.assert_close(torch.tensor([x for r in lp for x in r]), torch.tensor([x for r in ref_lp for x in r]),
                               atol=1e-5, rtol=0)
    assert inf.token_versions == [[0] * len(r) for r in out] and inf.swaps == 0


def test_stop_keeps_the_prefix_and_a_resume_continues_it(tiny):
    tok, model, v0, v1, prompts = tiny
    model.load_state_dict(v0)
    g = TransformersGenerator(model, tok)
    steps = {"n": 0}

    def should_stop() -> bool:
        steps["n"] += 1
        return steps["n"] > 4

    with pytest.raises(ShutdownRequested):  # without keep_partial: abandoned as model.generate does
        g.generate(prompts, 2, max_new_tokens=STEPS, seed=3, ignore_eos=True, should_stop=should_stop,
                   in_flight=InFlight(poll=lambda: 0, version=0))
    steps["n"] = 0
    with pytest.raises(PartialGeneration) as stop:
        g.generate(prompts, 2, max_new_tokens=STEPS, seed=3, ignore_eos=True, should_stop=should_stop,
                   return_log_probs=True, in_flight=InFlight(poll=lambda: 0, version=0, keep_partial=True))
    part = stop.value
    assert [len(r) for r in part.tokens] == [4] * 4 and part.versions == [[0] * 4] * 4
    assert [len(r) for r in part.log_probs] == [4] * 4
    model.load_state_dict(v1)  # another replica, already at version 1, continues
    inf = InFlight(poll=lambda: 1, version=1)
    rest, rest_lp = g.generate(prompts, 2, max_new_tokens=STEPS, seed=5, ignore_eos=True, return_log_probs=True,
                               in_flight=inf, prefix=part.tokens)
    model.load_state_dict(v0)
    assert [len(r) for r in rest] == [STEPS - 4] * 4 and inf.token_versions == [[1] * (STEPS - 4)] * 4
    banned = sorted(set(g.stop_token_ids) | set(never_sampled_token_ids(tok, model)))
    for row in range(4):
        full = part.tokens[row] + rest[row]
        under_v1 = independent_log_probs(model, v1, prompts[row // 2], full, banned)
        torch.testing.assert_close(torch.tensor(rest_lp[row]), under_v1[4:], atol=1e-5, rtol=0)


def test_vllm_resumable_is_refused_before_any_stage_starts(tmp_path):
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    proc = subprocess.run([sys.executable, "-m", "expstream", "run", "--output", str(tmp_path / "run"),
                           "--prompts", str(prompts),
                           "--set", "generate.backend=vllm", "--set", "generate.resumable=true"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "generate.resumable" in proc.stderr and "backend=vllm" in proc.stderr
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.integration
def test_the_stage_loads_an_announced_version_mid_generation_through_redis_and_the_store(model_cache, redis_url,
                                                                                         tmp_path):
    """The generate stage with in-flight updates (recompute), its follower on a real Redis and weight store: a
    version published and announced while a generation runs is loaded between two decoding steps; the tokens
    before the swap have the old version's log-probs, those after the new one's (independent forward passes)."""
    import uuid

    from expstream.state import RedisState
    from expstream.train.weights import open_store
    from schemas import PromptBatch
    from stages import generate
    from stages.context import make_context

    steps = 48
    topo = load_topology(overrides=[
        f"models.cache_dir={model_cache}", "generate.n_samples_per_prompt=2", f"generate.max_new_tokens={steps}",
        f"generate.min_new_tokens={steps}", "generate.in_flight_updates=true", "generate.in_flight_mode=recompute",
        "train.enabled=true", f"train.weight_store={tmp_path / 'weights'}", "train.batch_size=64"])
    run_id = f"f{uuid.uuid4().hex[:8]}"
    state = RedisState(redis_url, run_id)
    ctx = make_context(topo, "generate", state=state, run_id=run_id)
    generate.setup(ctx)
    model, tok = ctx.models["generator"].model, ctx.models["tokenizer"]
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    v1 = {k: v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(2)) if v.is_floating_point()
          else v.clone() for k, v in v0.items()}
    calls = {"n": 0}

    def trainer_publishes_at_step_5() -> bool:  # and decoding slowed to 20 ms a step: the follower polls every 0.2 s
        calls["n"] += 1
        if calls["n"] == 5:
            open_store(str(tmp_path / "weights")).publish("actor", 1, v1, step=0, offsets={}, run_id=run_id)
            state.set_policy_version(1)
        time.sleep(0.02)
        return False

    ctx.should_stop = trainer_publishes_at_step_5
    try:
        [out] = generate.process(PromptBatch(batch_id="p0", prompt_id=["a"], prompt=["Hello there"], label=[""],
                                             reference=[""]), ctx)
    finally:
        state.close()
    versions = [r.tolist() for r in out.token_versions.rows()]
    swap = versions[0].index(1)
    assert 4 <= swap < steps and versions == [[0] * swap + [1] * (steps - swap)] * 2
    assert out.rollout_version == [0, 0] and ctx.models["actor_follower"].version == 1
    banned = sorted(set(ctx.models["generator"].stop_token_ids) | set(never_sampled_token_ids(tok, model)))
    for toks, lp in zip(out.response_ids.rows(), out.rollout_log_probs.rows(), strict=True):
        prompt, toks, lp = out.prompt_ids.row(0).tolist(), toks.tolist(), torch.from_numpy(lp.copy())
        torch.testing.assert_close(lp[:swap], independent_log_probs(model, v0, prompt, toks, banned)[:swap],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(lp[swap:], independent_log_probs(model, v1, prompt, toks, banned)[swap:],
                                   atol=1e-5, rtol=0)
