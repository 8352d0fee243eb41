"""Each stage function on an in-memory micro-batch, with expectations worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from expstream.config.topology import load_topology
from schemas import PromptBatch, Ragged, SampleBatch, decode, encode
from stages import advantage, generate, postprocess, reward, shard_preprocess
from stages.context import make_context
from stages.local import LocalChain

EOS, PAD = 9, 0


def i32(rows):
    return Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")


def f32(rows):
    return Ragged.from_rows([np.asarray(r, np.float32) for r in rows], "float32")


def bools(rows):
    return Ragged.from_rows([np.asarray(r, bool) for r in rows], "bool")


def base_batch(prompts, responses, n=None, group_ids=None, **kw):
    b = len(prompts)
    n = n or b
    group_ids = group_ids or ["g"] * b
    return SampleBatch(
        batch_id="b", policy_version=0, n_samples_per_prompt=n, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=list(group_ids), group_id=list(group_ids), sample_index=list(range(b)) if n == b else kw.pop("idx"),
        prompt=["p"] * b, label=["l"] * b, reference=[""] * b, response=["r"] * b,
        prompt_ids=i32(prompts), response_ids=i32(responses), **kw)


@pytest.fixture(scope="module")
def topo_models(model_cache):
    return [f"models.cache_dir={model_cache}"]


def test_shard_preprocess_cuts_micro_batches_and_repairs_eos():
    topo = load_topology(overrides=["algo.micro_rollout_batch_size=2"])
    ctx = make_context(topo, "shard-preprocess")
    batch = base_batch([[5, 6, 7], [6, 7], [5]], [[7, 8, 9], [3], [7, 7, 7]])
    out = shard_preprocess.process(batch, ctx)
    assert [o.batch_id for o in out] == ["b/m0", "b/m1"]
    # m0: P=3, A=3. Row 0 "normal": 7 8 EOS, mask all True.
    # Row 1 "no EOS returned": [0 6 7 | 3 0 0] -> EOS written after 3 -> actions 3 EOS; mask [1,1,0] -> a=2.
    assert [r.tolist() for r in out[0].action_ids.rows()] == [[7, 8, 9], [3, 9]]
    assert [r.tolist() for r in out[0].action_mask.rows()] == [[True] * 3, [True, True]]
    # m1 alone: A=3 and the row fills it without EOS -> its last token is overwritten by EOS.
    assert [r.tolist() for r in out[1].action_ids.rows()] == [[7, 7, 9]]
    assert out[1].layout == "padded" and out[1].sample_index == [2]


def _scored_pair(topo_overrides=()):
    topo = load_topology(overrides=["algo.kl_estimator=k1", "algo.init_kl_coef=0.5", *topo_overrides])
    batch = base_batch([[5], [5, 6]], [[7, 9], [9]], layout="padded", action_ids=i32([[7, 9], [9]]),
                       action_mask=bools([[1, 1], [1]]), action_log_probs=f32([[-1.0, -2.0], [-0.5]]),
                       base_action_log_probs=f32([[-1.5, -1.0], [-0.25]]),
                       rewards=np.array([1.0, 2.0], np.float32))
    return topo, batch


def test_postprocess_kl_and_penalised_token_rewards():
    topo, batch = _scored_pair()
    [out] = postprocess.process(batch, make_context(topo, "postprocess"))
    # k1: d = logp - base = [0.5, -1.0] and [-0.25]; info.kl = per-row masked means
    assert [r.tolist() for r in out.kl.rows()] == [[0.5, -1.0], [-0.25]]
    np.testing.assert_allclose(out.info["kl"], [-0.25, -0.25])
    # token rewards = -0.5 * kl, plus R at the last valid action: [-0.25, 0.5 + 1] and [0.125 + 2]
    np.testing.assert_allclose(out.token_rewards.values, [-0.25, 1.5, 2.125])
    np.testing.assert_allclose(out.info["response_length"], [2, 1])
    np.testing.assert_allclose(out.info["total_length"], [3, 3])  # prompt tokens + actions
    assert out.kl_coef == 0.5 and out.base_action_log_probs is None  # dropped unless use_kl_loss


def test_postprocess_overlong_penalty_then_advantage_clips_with_fraction_before_clamp():
    over = ["algo.overlong_buffer=true", "algo.overlong_buffer_len=1", "generate.max_new_tokens=2",
            "algo.reward_clip=1.5", "algo.init_kl_coef=0"]
    topo, batch = _scored_pair(over)
    [out] = postprocess.process(batch, make_context(topo, "postprocess"))
    # L_exp = 2 - 1 = 1; lengths [2, 1] -> penalties [-(2-1)/1*1, 0] = [-1, 0]; R = [0, 2]
    np.testing.assert_allclose(out.processed_rewards, [0.0, 2.0])
    assert "reward_clip_frac" not in out.info  # the clip comes after group shaping, in advantage
    np.testing.assert_allclose(out.info["reward"], [1.0, 2.0])  # raw reward logged untouched
    rtopo = load_topology(overrides=["algo.advantage_estimator=reinforce", *over])
    [exp] = advantage.process(out, make_context(rtopo, "advantage"))
    # clip at 1.5: one of two values beyond -> frac 0.5 each row; R -> [0, 1.5] at the last action
    np.testing.assert_allclose(exp.processed_rewards, [0.0, 1.5])
    np.testing.assert_allclose(exp.info["reward_clip_frac"], [0.5, 0.5])
    np.testing.assert_allclose(exp.advantages.values, [0.0, 0.0, 1.5])


def test_advantage_reinforce_and_gae_by_hand():
    topo, batch = _scored_pair()
    [scored] = postprocess.process(batch, make_context(topo, "postprocess"))
    rtopo = load_topology(overrides=["algo.advantage_estimator=reinforce"])
    [exp] = advantage.process(scored, make_context(rtopo, "advantage"))
    # reward-to-go of [-0.25, 1.5] and [2.125]
    np.testing.assert_allclose(exp.advantages.values, [1.25, 1.5, 2.125])
    np.testing.assert_allclose(exp.info["return"], [1.25, 2.125])
    gtopo = load_topology(overrides=["algo.advantage_estimator=gae", "algo.lambd=1.0"])
    with_values = scored.replace(values=f32([[0.5, 0.25], [1.0]]))
    [g] = advantage.process(with_values, make_context(gtopo, "advantage"))
    # row 0: d1 = 1.5 - 0.25 = 1.25; d0 = -0.25 + 0.25 - 0.5 = -0.5; A = [0.75, 1.25]; returns = A + V
    # row 1: d0 = 2.125 - 1.0 = 1.125
    np.testing.assert_allclose(g.advantages.values, [0.75, 1.25, 1.125], rtol=1e-6)
    np.testing.assert_allclose(g.returns.values, [1.25, 1.5, 2.125], rtol=1e-6)


def _group_member_batches():
    topo = load_topology(overrides=["algo.advantage_estimator=group_norm", "algo.init_kl_coef=0"])
    rewards = [1.0, 0.0, 0.0, 1.0]
    parts = []
    for rows, bid in (([0, 1], "x/m0"), ([2, 3], "y/m0")):
        b = SampleBatch(
            batch_id=bid, policy_version=0, n_samples_per_prompt=4, eos_token_id=EOS, pad_token_id=PAD,
            prompt_id=["g1"] * 2, group_id=["g1"] * 2, sample_index=rows, prompt=["p"] * 2, label=["l"] * 2,
            reference=["", ""], response=["r"] * 2, prompt_ids=i32([[5], [5]]), response_ids=i32([[9], [7, 9]]),
            layout="padded", action_ids=i32([[9], [7, 9]]), action_mask=bools([[1], [1, 1]]),
            action_log_probs=f32([[-1.0], [-1.0, -1.0]]), rewards=np.array([rewards[i] for i in rows], np.float32))
        [scored] = postprocess.process(b, make_context(topo, "postprocess"))
        parts.append(scored)
    return topo, parts


@pytest.mark.integration
def test_group_split_across_batches_and_two_replicas_completes_once(redis_state):
    topo, (first, second) = _group_member_batches()
    replica_a = make_context(topo, "advantage", state=redis_state, replica_id="a")
    replica_b = make_context(topo, "advantage", state=redis_state, replica_id="b")
    assert advantage.process(first, replica_a) == []
    [group] = advantage.process(second, replica_b)
    assert group.batch_id == "g/g1" and sorted(group.sample_index) == [0, 1, 2, 3]
    # rewards [1,0,0,1]: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = 0.57735 -> +-0.866025 per token
    by_index = dict(zip(group.sample_index, group.advantages.rows(), strict=True))
    expected = 0.5 / math.sqrt(1 / 3)
    for i, sign in ((0, 1), (1, -1), (2, -1), (3, 1)):
        np.testing.assert_allclose(by_index[i], sign * expected, rtol=1e-5)
    # redelivery of the completing record emits the same group again (same bytes); the other emits nothing
    [again] = advantage.process(second, replica_a)
    assert encode(again) == encode(group)
    assert advantage.process(first, replica_b) == []


def _whole_group_batch():
    """One scored record holding the whole group g1 (4 samples) and the first half of g2."""
    topo = load_topology(overrides=["algo.advantage_estimator=group_norm", "algo.init_kl_coef=0"])
    groups, rows = ["g1"] * 4 + ["g2"] * 2, [0, 1, 2, 3, 0, 1]
    b = SampleBatch(
        batch_id="w/m0", policy_version=0, n_samples_per_prompt=4, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=groups, group_id=groups, sample_index=rows, prompt=["p"] * 6, label=["l"] * 6,
        reference=[""] * 6, response=["r"] * 6, prompt_ids=i32([[5]] * 6), response_ids=i32([[9], [7, 9]] * 3),
        layout="padded", action_ids=i32([[9], [7, 9]] * 3), action_mask=bools([[1], [1, 1]] * 3),
        action_log_probs=f32([[-1.0], [-1.0, -1.0]] * 3),
        rewards=np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.25], np.float32))
    [scored] = postprocess.process(b, make_context(topo, "postprocess"))
    return topo, scored


@pytest.mark.integration
def test_a_whole_group_is_parked_on_redis_without_its_bytes_and_emitted_as_in_one_process(redis_state):
    topo, scored = _whole_group_batch()
    [alone] = advantage.process(scored, make_context(topo, "advantage"))  # MemoryState: no buffer at all
    ctx = make_context(topo, "advantage", state=redis_state)
    [group] = advantage.process(scored, ctx)
    assert group.batch_id == "g/g1" and encode(group) == encode(alone)
    client = redis_state.client
    # g1 names this record its completer with empty payloads; g2's two members wait with their bytes
    assert client.hgetall(redis_state.group_key("g1", "group")) == {str(i).encode(): b"" for i in range(4)}
    assert client.hget(redis_state.group_key("g1", "group", "meta"), "completer") == b"w/m0"
    assert all(len(v) > 100 for v in client.hgetall(redis_state.group_key("g2", "group")).values())
    # a redelivery emits the same bytes again; a record carrying some of g1's members again emits nothing
    [again] = advantage.process(scored, ctx)
    assert encode(again) == encode(group)
    dup = scored.select([0, 1], batch_id="d/m0")
    assert advantage.process(dup, ctx) == []


@pytest.mark.integration
def test_a_whole_group_completes_a_group_parked_in_part_before_with_the_same_bytes(redis_state):
    topo, scored = _whole_group_batch()
    [alone] = advantage.process(scored, make_context(topo, "advantage"))
    ctx = make_context(topo, "advantage", state=redis_state)
    assert advantage.process(scored.select([0, 1], batch_id="d/m0"), ctx) == []  # g1's first half, with bytes
    [group] = advantage.process(scored, ctx)
    assert encode(group) == encode(alone)
    assert advantage.process(scored.select([2, 3], batch_id="e/m0"), ctx) == []  # completed by w/m0 already


def test_reward_function_by_import_path_and_bad_count(topo_models):
    topo = load_topology(overrides=[*topo_models, "models.reward=null", "models.reward_fn=tests.rewardfns:label_length"])
    ctx = make_context(topo, "reward")
    reward.setup(ctx)
    batch = base_batch([[5], [6]], [[9], [9]], layout="padded", action_ids=i32([[9], [9]]),
                       action_mask=bools([[1], [1]])).replace(label=["abc", "de"])
    [out] = reward.process(batch, ctx)
    np.testing.assert_allclose(out.rewards, [3.0, 2.0])
    topo_bad = load_topology(overrides=[*topo_models, "models.reward=null", "models.reward_fn=tests.rewardfns:wrong_count"])
    ctx_bad = make_context(topo_bad, "reward")
    reward.setup(ctx_bad)
    with pytest.raises(Exception, match="one float per query"):
        reward.process(batch, ctx_bad)


def test_generate_then_chain_ids_layout_and_logprobs(topo_models):
    topo = load_topology(overrides=[*topo_models, "generate.n_samples_per_prompt=3", "generate.max_new_tokens=6",
                                    "algo.micro_rollout_batch_size=4"])
    chain = LocalChain(topo, through_codec=True).setup()
    prompts = PromptBatch(batch_id="p000000", prompt_id=["a", "b"], prompt=["Hello there", "Add two numbers"],
                          label=["x", "y"], reference=["", ""])
    [rollouts] = chain.run_stage("generate", [prompts])
    assert rollouts.group_id == ["a"] * 3 + ["b"] * 3 and rollouts.sample_index == [0, 1, 2] * 2
    assert all(len(r) <= 6 for r in rollouts.response_ids.rows())
    # the same record samples the same responses (seed derived from run.seed and batch id)
    [again] = generate.process(prompts, chain.contexts["generate"])
    assert encode(again) == encode(rollouts)
    batches = chain.run_stage("shard-preprocess", [rollouts])
    assert [len(b) for b in batches] == [4, 2]
    [actor] = chain.run_stage("actor-logprob", batches[:1])
    # log-probs equal a plain forward of the unpadded prompt + actions, computed here from raw logits
    lm = chain.contexts["actor-logprob"].models["lm"]
    for p, a, lp in zip(actor.prompt_ids.rows(), actor.action_ids.rows(), actor.action_log_probs.rows(), strict=True):
        seq = torch.tensor(np.concatenate([p, a]), dtype=torch.long)[None]
        with torch.no_grad():
            logits = lm(seq).logits[0].float()
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, seq[0, 1:, None])[:, 0]
        np.testing.assert_allclose(lp, logp[-len(a):].numpy(), atol=1e-5)
    exps = chain.run(batches and [prompts])
    assert sorted(s for e in exps for s in e.sample_ids()) == sorted(f"{g}#{i}" for g in "ab" for i in range(3))


def test_poison_prompt_is_refused_with_the_field(topo_models):
    topo = load_topology(overrides=[*topo_models, "generate.truncate_prompts=false", "generate.prompt_max_len=3"])
    ctx = make_context(topo, "generate")
    generate.setup(ctx)
    with pytest.raises(Exception, match="prompt_max_len"):
        generate.process(PromptBatch(batch_id="p", prompt_id=["a"], prompt=["a long prompt " * 5], label=[""],
                                     reference=[""]), ctx)
    with pytest.raises(Exception, match="empty prompt"):
        generate.process(PromptBatch(batch_id="p", prompt_id=["a"], prompt=["  "], label=[""], reference=[""]), ctx)
    assert decode(encode(PromptBatch(batch_id="p", prompt_id=[], prompt=[], label=[], reference=[]))).batch_id == "p"


@pytest.mark.integration
@pytest.mark.parametrize("estimator", ["gae", "group_norm"])
def test_every_stage_twice_on_the_same_record_gives_identical_bytes(topo_models, redis_state, estimator):
    topo = load_topology(overrides=[*topo_models, f"algo.advantage_estimator={estimator}", "generate.max_new_tokens=5",
                                    "algo.reward_running_norm=true", "algo.high_entropy_token_ratio=0.3",
                                    "generate.n_samples_per_prompt=2", "algo.micro_rollout_batch_size=4"])
    chain = LocalChain(topo, state=redis_state, through_codec=True).setup()
    data = [PromptBatch(batch_id="p000000", prompt_id=["a", "b"], prompt=["Hi", "Sum"], label=["", ""],
                        reference=["", ""])]
    for st in topo.enabled_stages():
        first = [encode(b) for b in chain.run_stage(st.name, data)]
        second = [encode(b) for b in chain.run_stage(st.name, data)]
        assert first == second, f"stage {st.name} is not deterministic"
        assert first, f"stage {st.name} emitted nothing"
        data = [decode(b) for b in first]


def test_local_chain_completes_a_group_split_across_three_micro_batches_without_redis(topo_models):
    """One prompt, n=3, micro-batches of 1: the group arrives at advantage in three records and
    completes in the chain's MemoryState, with the advantages of the same group seen whole."""
    common = [*topo_models, "algo.advantage_estimator=group_norm", "generate.n_samples_per_prompt=3",
              "generate.max_new_tokens=5"]
    prompts = [PromptBatch(batch_id="p000000", prompt_id=["a"], prompt=["Add two numbers"], label=[""],
                           reference=[""])]
    split = LocalChain(load_topology(overrides=[*common, "algo.micro_rollout_batch_size=1"]),
                       through_codec=True).setup()
    [rollouts] = split.run_stage("generate", prompts)
    micro = split.run_stage("shard-preprocess", [rollouts])
    assert [len(b) for b in micro] == [1, 1, 1]
    whole = LocalChain(load_topology(overrides=[*common, "algo.micro_rollout_batch_size=3"]),
                       through_codec=True).setup()
    [got] = split.run(prompts)
    [ref] = whole.run(prompts)
    assert got.batch_id == ref.batch_id == "g/a" and got.sample_index == [0, 1, 2]
    assert split.contexts["advantage"].state.group_status("a") == (3, 3, micro[-1].batch_id)
    np.testing.assert_allclose(got.rewards, ref.rewards, atol=1e-5)
    for a, b in zip(got.advantages.rows(), ref.advantages.rows(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)
