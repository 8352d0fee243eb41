"""Issue 21 item 1: the continuous loop stays stable at its defaults.

* an EOS the pipeline forced at the length limit (not sampled by the policy) carries no KL penalty and
  no policy-loss term (docs/numerics.md §14.12);
* the trainer's policy is the distribution generation samples from (tokens it never samples are
  outside the softmax), so probability cannot pile up on a token no KL estimate ever sees;
* a step whose loss or gradient is not finite changes nothing and is counted; such weights are never
  published;
* a long synchronous loop on the example prompts keeps KL and loss finite and bounded, and the policy
  does not collapse onto one token (or onto padding).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from harness import example_prompt_batches

from expstream.config.topology import find_topology, load_topology
from expstream.models.hf import SamplingSupport, load_causal_lm, load_tokenizer
from expstream.models.resolve import model_dir
from expstream.rl.layout import forced_action_rows, position_ids_from_attention
from expstream.train import PolicyTrainer, experience_from_records
from expstream.train.step import action_log_probs_with_grad
from schemas import Ragged, SampleBatch, encode
from stages import postprocess, shard_preprocess
from stages.context import make_context
from stages.local import LocalChain

ROOT = Path(__file__).resolve().parents[1]
EOS, PAD, STOP2 = 9, 0, 11


def i32(rows):
    return Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")


def f32(rows):
    return Ragged.from_rows([np.asarray(r, np.float32) for r in rows], "float32")


# ---------------------------------------------------------------------------------------------------
# which actions were forced
# ---------------------------------------------------------------------------------------------------


def test_forced_action_rows_by_hand():
    responses = [[7, 8, EOS], [3], [7, 7, 7], [5, STOP2]]
    # what shard-preprocess makes of them with A = 3 (docs/numerics.md §1.2)
    actions = [[7, 8, EOS],  # stopped at its own EOS: everything sampled
               [3, EOS],  # ended without a stop token: an EOS appended
               [7, 7, EOS],  # hit the length limit: its last sampled token overwritten by EOS
               [5, STOP2, EOS]]  # another stop id is a valid token: EOS appended after it
    rows = forced_action_rows([np.array(r) for r in responses], [np.array(r) for r in actions])
    assert [r.tolist() for r in rows] == [[False, False, False], [False, True], [False, False, True],
                                          [False, False, True]]


def _rollouts(topo_overrides=()) -> tuple:
    """Two samples through shard-preprocess: row 0 stopped at its EOS, row 1 truncated at max_new_tokens=3."""
    topo = load_topology(overrides=["generate.max_new_tokens=3", *topo_overrides])
    raw = SampleBatch(batch_id="p000000", policy_version=0, n_samples_per_prompt=2, eos_token_id=EOS,
                      pad_token_id=PAD, prompt_id=["a", "a"], group_id=["a", "a"], sample_index=[0, 1],
                      prompt=["p", "p"], label=["", ""], reference=["", ""], response=["x", "y"],
                      prompt_ids=i32([[5, 6], [5, 6]]), response_ids=i32([[7, 8, EOS], [7, 7, 7]]))
    [mb] = shard_preprocess.process(raw, make_context(topo, "shard-preprocess"))
    assert [r.tolist() for r in mb.action_ids.rows()] == [[7, 8, EOS], [7, 7, EOS]]  # row 1's EOS is forced
    return topo, mb


def test_a_forced_eos_has_no_kl_penalty():
    # the numbers at the forced EOS: log π = -67.9 (actor) against -6.0 (reference), under the
    # old defaults (k3, β = 0.01): its k3 was e^61.9 ≈ 7.4e26 and its token reward -7.4e24
    topo, mb = _rollouts(["algo.kl_estimator=k3", "algo.init_kl_coef=0.01"])
    scored = mb.replace(action_log_probs=f32([[-1.0, -2.0, -0.5], [-1.5, -2.5, -67.9]]),
                        base_action_log_probs=f32([[-1.25, -1.5, -0.75], [-1.0, -2.0, -6.0]]),
                        rewards=np.array([1.0, 0.5], np.float32))
    [out] = postprocess.process(scored, make_context(topo, "postprocess"))
    kl = [r.astype(np.float64) for r in out.kl.rows()]
    k3 = lambda d: np.expm1(-d) + d  # noqa: E731 - the formula, independently of expstream.rl.numerics
    np.testing.assert_allclose(kl[0], k3(np.array([0.25, -0.5, 0.25])), rtol=1e-6)  # every token sampled
    np.testing.assert_allclose(kl[1][:2], k3(np.array([-0.5, -0.5])), rtol=1e-6)  # the sampled ones: as before
    assert kl[1][2] == 0.0, "the EOS the pipeline forced was not sampled by the policy: no KL estimate there"
    # info.kl averages the KL over the sampled actions only; the reward stays at the last action
    np.testing.assert_allclose(out.info["kl"], [kl[0].mean(), kl[1][:2].mean()], rtol=1e-6)
    rewards = [r.astype(np.float64) for r in out.token_rewards.rows()]
    np.testing.assert_allclose(rewards[1], [-0.01 * kl[1][0], -0.01 * kl[1][1], 0.5], rtol=1e-6)


def _experience(mb: SampleBatch, advantages: list[list[float]]):
    """mb as an experience (rewarded and with the given advantages), trained as the trainer does."""
    lengths = [len(r) for r in mb.action_ids.rows()]
    zeros = f32([[0.0] * n for n in lengths])
    done = mb.replace(action_log_probs=zeros, base_action_log_probs=None, rewards=np.zeros(2, np.float32),
                      advantages=f32(advantages), returns=f32(advantages),
                      info={"kl": np.zeros(2, np.float32), "reward": np.zeros(2, np.float32)})
    return experience_from_records([(done, [0, 1])])


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_the_policy_loss_leaves_a_forced_eos_out():
    topo, mb = _rollouts()
    exp = _experience(mb, [[0.0, 0.0, 0.0], [0.0, 0.0, 1e6]])  # all the advantage sits on the forced EOS
    assert exp.forced_mask.tolist() == [[False, False, False], [False, False, True]]
    actor = load_causal_lm(model_dir(topo, "actor"))
    before = _weights(actor)
    result = PolicyTrainer(topo, actor).train_step(exp)
    assert result.loss == 0.0 and result.trained_tokens == 5, result
    assert not result.skipped
    after = _weights(actor)
    assert all(torch.equal(before[k], after[k]) for k in before), "the forced EOS moved the weights"


def test_the_trainer_softmax_covers_only_what_generation_samples():
    topo = load_topology(overrides=["generate.min_new_tokens=2"])
    tok = load_tokenizer(model_dir(topo, "tokenizer"))
    actor = load_causal_lm(model_dir(topo, "actor")).requires_grad_(True)
    support = SamplingSupport.of(tok, actor, "transformers", topo.generate.min_new_tokens)
    assert support.never == (tok.pad_token_id,) and tok.eos_token_id in support.stops
    # two rows, left-padded as the trainer batches them: a 3-token response, a 2-token one
    seq = torch.tensor([[11, 12, 13, 20, 21, tok.eos_token_id], [tok.pad_token_id, 11, 12, 13, 22, 23]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    mask = torch.tensor([[True, True, True], [False, True, True]])
    logp = action_log_probs_with_grad(actor, seq, attn, 3, support, mask)
    # independently: log-softmax over the allowed tokens of each position
    logits = actor(input_ids=seq, attention_mask=attn, position_ids=position_ids_from_attention(attn)).logits
    logits = logits[:, -4:-1].detach().double()
    want = torch.zeros(2, 3, dtype=torch.float64)
    for b in range(2):
        for t in range(3):
            position = t - int((~mask[b]).sum())  # response position of action column t
            allowed = [v for v in range(logits.shape[-1]) if v != tok.pad_token_id
                       and not (position < 2 and v in support.stops)]
            want[b, t] = torch.log_softmax(logits[b, t, allowed], -1)[allowed.index(int(seq[b, 3 + t]))]
    np.testing.assert_allclose(logp[mask].detach().double().numpy(), want[mask].numpy(), rtol=1e-4, atol=1e-5)
    # the pad token's output row gets no gradient: the policy gradient cannot move probability onto it
    logp[mask].sum().backward()
    head = actor.get_output_embeddings().weight
    assert float(head.grad[tok.pad_token_id].abs().max()) == 0.0
    assert float(head.grad[21].abs().max()) > 0.0


# ---------------------------------------------------------------------------------------------------
# non-finite steps
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("advantage, reason", [
    (float("inf"), "actor: non-finite loss"),
    (3e38, "actor: non-finite gradient"),  # a finite loss whose backward overflows
])
def test_a_non_finite_step_changes_nothing(advantage, reason):
    topo, mb = _rollouts(["train.max_grad_norm=1.0"])
    exp = _experience(mb, [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    exp.advantages[0, 0] = advantage  # a hand-built batch: the wire refuses non-finite values
    exp.advantages[1, 0] = -advantage
    actor = load_causal_lm(model_dir(topo, "actor"))
    trainer = PolicyTrainer(topo, actor)
    before = _weights(actor)
    result = trainer.train_step(exp)
    assert result.skipped == [reason], result
    after = _weights(actor)
    assert all(torch.equal(before[k], after[k]) for k in before), "a non-finite step changed the weights"
    assert not trainer.optimizer.state, "the optimiser stepped"
    assert all(p.grad is None for p in actor.parameters())
    # and the next good step trains as usual
    good = trainer.train_step(_experience(mb, [[1.0, -1.0, 0.5], [0.5, -0.5, 0.0]]))
    assert not good.skipped and np.isfinite(good.grad_norm) and good.grad_norm > 0


def _produce(broker: str, topic: str, records: int) -> None:
    from expstream.kafka.clients import make_producer, send_and_confirm

    topo = load_topology(find_topology(None), ["run.seed=3"])
    exps = LocalChain(topo).setup().run(example_prompt_batches(topo, "nf", records))
    producer = make_producer(broker)
    try:
        for b in exps:
            send_and_confirm(producer, topic, encode(b), key=b.batch_id.encode())
    finally:
        producer.close()


@pytest.mark.integration
def test_expstream_train_skips_counts_and_never_publishes_non_finite_weights(broker, redis_url, run_id, fresh_topic,
                                                                            tmp_path):
    """An absurd learning rate: step 0 blows the weights up to ~1e30 (finite: published), every later
    forward is NaN. Those steps are skipped and counted, and only finite weights reach the store."""
    from expstream.kafka.topics import create_topics
    from expstream.state import RedisState
    from expstream.train.weights import DirectoryWeightStore

    create_topics(broker, {"policy": 1}, with_dlq=False)
    topic = fresh_topic(2)
    _produce(broker, topic, records=4)  # 4 records x 8 samples = 4 steps of 8
    out = tmp_path / "train-out"
    cmd = [sys.executable, "-m", "expstream", "train", "--bootstrap-servers", broker, "--redis-url", redis_url,
           "--run-id", run_id, "--output", str(out), "--set", f"stages.advantage.output={topic}",
           "--set", "train.batch_size=8", "--set", "train.max_steps=4", "--set", "async.max_staleness=100",
           "--set", "train.lr=1.0e+30"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    skipped = [line for line in lines if line["skipped"]]
    assert skipped, f"no step was skipped: {lines}"
    assert lines[-1]["nonfinite_steps"] == len(skipped)
    assert json.loads((out / "train" / "done.json").read_text())["nonfinite_steps"] == len(skipped)
    assert "skipped (actor: non-finite" in done.stderr and f"{topic}[" in done.stderr
    state = RedisState(redis_url, run_id)
    try:
        assert state.counters().get("trainer_nonfinite_steps") == len(skipped)
    finally:
        state.close()
    store = DirectoryWeightStore(out / "weights")
    versions = store.versions("actor")  # whichever the store's retention keeps, up to the last one
    assert versions and versions[-1] == 4, versions
    published = [(f"version {v}", store.load("actor", v)) for v in versions]
    published.append(("final/", load_causal_lm(out / "final").state_dict()))
    for name, weights in published:
        bad = [k for k, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
        assert not bad, f"{name} holds non-finite weights: {bad[:3]}"


# ---------------------------------------------------------------------------------------------------
# the long loop
# ---------------------------------------------------------------------------------------------------




@pytest.mark.parametrize("overrides, steps", [
    ([], 250),  # the default topology: the tiny reward model (where the run diverged by step 50)
    (["models.reward=null", "models.reward_fn=expstream.rewards:target_char_rate"], 150),  # the example's rule
])
def test_a_long_loop_stays_finite_bounded_and_diverse(overrides, steps):
    """The continuous loop's defaults (train.enabled) in one process, with its staleness: step u trains
    on samples generated by version u - k (k = async.max_staleness, as a continuous run's staleness
    histogram shows: every sample at k) and scored by actor-logprob with version u - 1; the trainer is
    wired as `expstream train` wires it. Before the fix this diverged by step 50 (KL 2.9e5, then inf)."""
    torch.manual_seed(0)
    topo = load_topology(find_topology(None), ["run.seed=1", "train.enabled=true", *overrides])
    chain = LocalChain(topo).setup()
    tok = chain.contexts["generate"].models["tokenizer"]
    actor = load_causal_lm(model_dir(topo, "actor"))
    trainer = PolicyTrainer(topo, actor, support=SamplingSupport.of(tok, actor, topo.generate.backend,
                                                                    topo.generate.min_new_tokens))
    generator = chain.contexts["generate"].models["generator"].model
    scorer = chain.contexts["actor-logprob"].models["lm"]
    per_step = topo.train.batch_size // (topo.run.prompt_batch_size * topo.generate.n_samples_per_prompt)
    versions = [trainer.actor_state()]  # versions[v] = the weights of policy version v
    log = []
    for step in range(steps):
        exps = chain.run(example_prompt_batches(topo, f"s{step}", per_step))
        exp = experience_from_records([(b, range(len(b.prompt_id))) for b in exps])
        result = trainer.train_step(exp)
        versions.append(trainer.actor_state())
        generator.load_state_dict(versions[max(0, len(versions) - 1 - topo.async_.max_staleness)], strict=True)
        scorer.load_state_dict(versions[max(0, len(versions) - 2)], strict=True)
        chain.state.set_policy_version(step + 1)
        actions = exp.sequences[:, -exp.action_mask.shape[1]:][exp.action_mask].tolist()
        log.append({"kl": result.kl, "loss": result.loss, "grad_norm": result.grad_norm, "skipped": result.skipped,
                    "top_share": Counter(actions).most_common(1)[0][1] / len(actions),
                    "pad_share": actions.count(tok.pad_token_id) / len(actions),
                    "responses": len({r for b in exps for r in b.response}),
                    "reward": float(np.mean([r for b in exps for r in b.rewards]))})
    where = [(i, {k: v for k, v in s.items() if k != "skipped"}) for i, s in enumerate(log) if i % 25 == 0]
    assert topo.algo.use_kl_loss and exp.base_action_log_probs is not None  # the loop's KL is the trainer's
    assert not any(s["skipped"] for s in log), f"steps skipped as non-finite: {where}"
    for s in log:
        assert all(np.isfinite([s["kl"], s["loss"], s["grad_norm"]])), where
        # the run reached a KL of 4.6e25; k3 has an e^(-d) tail, so a rare token can lift one step's mean
        assert s["kl"] < 100 and abs(s["loss"]) < 20, where
    last = log[-20:]
    # per token, KL(π‖π_ref) against the near-uniform tiny reference is at most log|vocab| ≈ 6.2: a policy
    # that sits at that bound is deterministic
    assert np.median([s["kl"] for s in log[-50:]]) < 5, where
    # not onto one token ("rrrr…"), not onto padding, not onto one response; and it still learns
    assert max(s["top_share"] for s in last) < 0.9, where
    assert max(s["pad_share"] for s in last) == 0.0, where
    assert min(s["responses"] for s in last) >= 4, where
    assert np.mean([s["reward"] for s in last]) > np.mean([s["reward"] for s in log[:5]]), where
    # the raw softmax (what `final/` generates with) has not moved its mass onto the pad token either
    with torch.no_grad():
        a = exp.action_mask.shape[1]
        logits = actor(input_ids=exp.sequences, attention_mask=exp.attention_mask,
                       position_ids=position_ids_from_attention(exp.attention_mask)).logits[:, -(a + 1):-1]
        pad_prob = torch.softmax(logits.float(), -1)[..., tok.pad_token_id][exp.action_mask]
    assert float(pad_prob.mean()) < 0.1, float(pad_prob.mean())
