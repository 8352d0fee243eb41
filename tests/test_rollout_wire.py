"""Behaviour log-probs and policy versions from generate to the trainer's Experience (issue 9, "wire").

generate records the engine's log-prob of every sampled token and the version that produced it;
shard-preprocess moves them onto the repaired actions; actor-logprob stamps the version of its
weights; Experience / BufferItem / make_experience_batch carry all of it, in both layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expstream.config.topology import load_topology
from expstream.rl.experience import (
    Experience,
    make_experience_batch,
    remove_padding_in_sequences,
    split_experience_batch,
)
from expstream.rl.layout import align_rollout_log_probs
from schemas import PromptBatch, Ragged, SampleBatch, decode, encode
from stages import shard_preprocess
from stages.context import make_context
from stages.local import LocalChain

EOS, PAD, STOP2 = 9, 0, 4


def f32(rows):
    return Ragged.from_rows([np.asarray(r, np.float32) for r in rows], "float32")


def i32(rows):
    return Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")


def test_align_rollout_log_probs_by_hand():
    responses = [[7, 8, EOS], [3], [7, 7, 7], [5, STOP2]]
    logps = [[-0.5, -1.5, -2.5], [-0.25], [-1.0, -2.0, -3.0], [-4.0, -0.75]]
    # the actions shard-preprocess gives (docs/numerics.md §1.2) with A = 3:
    actions = [[7, 8, EOS],  # stopped at EOS: every token sampled
               [3, EOS],  # EOS appended after a response that ended without one
               [7, 7, EOS],  # fills the width: its last sampled token is overwritten by EOS
               [5, STOP2, EOS]]  # another stop id is a valid token: EOS appended after it
    out = align_rollout_log_probs([np.array(r) for r in responses], [np.array(r) for r in logps],
                                  [np.array(r) for r in actions])
    assert [r.tolist() for r in out] == [[-0.5, -1.5, -2.5], [-0.25, 0.0], [-1.0, -2.0, 0.0], [-4.0, -0.75, 0.0]]
    assert all(r.dtype == np.float32 for r in out)
    with pytest.raises(ValueError, match="row 0: 3 response tokens but 2 behaviour log-probs"):
        align_rollout_log_probs([np.array([1, 2, 3])], [np.array([-1.0, -1.0])], [np.array([1, 2, 3])])


@pytest.mark.parametrize("packing", [False, True])
def test_shard_preprocess_aligns_rollout_log_probs_in_both_layouts(packing):
    topo = load_topology(overrides=["algo.micro_rollout_batch_size=2", f"algo.packing_samples={str(packing).lower()}"])
    ctx = make_context(topo, "shard-preprocess")
    responses = [[7, 8, EOS], [3], [7, 7, 7]]
    batch = SampleBatch(
        batch_id="b", policy_version=2, n_samples_per_prompt=3, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=["g"] * 3, group_id=["g"] * 3, sample_index=[0, 1, 2], prompt=["p"] * 3, label=[""] * 3,
        reference=[""] * 3, response=["r"] * 3, prompt_ids=i32([[5, 6, 7], [6, 7], [5]]), response_ids=i32(responses),
        rollout_log_probs=f32([[-0.5, -1.5, -2.5], [-0.25], [-1.0, -2.0, -3.0]]), rollout_version=[2, 2, 2],
    )  # fmt: skip
    batch = decode(encode(batch))  # response-level rollout log-probs travel before shard-preprocess
    out = [decode(encode(o)) for o in shard_preprocess.process(batch, ctx)]
    assert [o.layout for o in out] == ["packed" if packing else "padded"] * 2
    # m0 = rows 0, 1 (A = 3): row 1 gets an EOS appended; m1 = row 2 alone fills A = 3: last token overwritten
    assert [r.tolist() for r in out[0].action_ids.rows()] == [[7, 8, EOS], [3, EOS]]
    assert [r.tolist() for r in out[0].rollout_log_probs.rows()] == [[-0.5, -1.5, -2.5], [-0.25, 0.0]]
    assert [r.tolist() for r in out[1].rollout_log_probs.rows()] == [[-1.0, -2.0, 0.0]]
    assert out[0].rollout_version == [2, 2] and out[1].rollout_version == [2]


@pytest.fixture(scope="module")
def topo_models(model_cache):
    return [f"models.cache_dir={model_cache}"]


@pytest.mark.parametrize("packing", [False, True])
def test_chain_stamps_versions_and_carries_behaviour_log_probs_to_experiences(topo_models, packing):
    topo = load_topology(overrides=[*topo_models, "generate.n_samples_per_prompt=3", "generate.max_new_tokens=6",
                                    "generate.temperature=0.8", "algo.micro_rollout_batch_size=4",
                                    f"algo.packing_samples={str(packing).lower()}"])
    chain = LocalChain(topo, through_codec=True).setup()
    chain.state.set_policy_version(5)  # announced by a trainer; no weight store, so nothing is reloaded
    prompts = PromptBatch(batch_id="p000000", prompt_id=["a", "b"], prompt=["Hello there", "Add two numbers"],
                          label=["x", "y"], reference=["", ""])
    [rollouts] = chain.run_stage("generate", [prompts])
    assert rollouts.rollout_version == [5] * 6 and rollouts.policy_version == 5
    gen_lp = rollouts.rollout_log_probs.rows()
    assert [len(r) for r in gen_lp] == [len(r) for r in rollouts.response_ids.rows()]
    # the generator's own answer for the same record (same seed): the stage ships exactly it
    g = chain.contexts["generate"]
    tokens, logps = g.models["generator"].generate(
        [list(p) for p in rollouts.prompt_ids.rows()[::3]], 3, temperature=0.8, max_new_tokens=6,
        seed=__import__("stages.generate", fromlist=["batch_seed"]).batch_seed(topo.run.seed, "p000000"),
        return_log_probs=True)
    assert tokens == [r.tolist() for r in rollouts.response_ids.rows()]
    np.testing.assert_array_equal(np.concatenate(gen_lp), np.asarray([x for r in logps for x in r], np.float32))
    batches = chain.run_stage("shard-preprocess", [rollouts])
    [actor] = chain.run_stage("actor-logprob", batches[:1])
    assert actor.logprob_version == [5] * len(actor) and actor.rollout_version == [5] * len(actor)
    for resp, lp, act, rl in zip(batches[0].response_ids.rows(), gen_lp, actor.action_ids.rows(),
                                 actor.rollout_log_probs.rows(), strict=False):
        same = min(len(resp), len(act))
        kept = resp[:same] == act[:same]
        np.testing.assert_array_equal(rl[:same][kept], lp[:same][kept])  # sampled tokens keep the engine's value
        assert (rl[:same][~kept] == 0).all() and (rl[same:] == 0).all() and np.isfinite(rl).all()
    exps = chain.run([prompts])
    assert sorted(s for e in exps for s in e.sample_ids()) == sorted(f"{g}#{i}" for g in "ab" for i in range(3))
    for e in exps:
        assert e.rollout_log_probs is not None and e.rollout_version == [5] * len(e)
        assert e.logprob_version == [5] * len(e)
        x = Experience.from_sample_batch(e)
        assert x.rollout_versions == [5] * len(e) and x.logprob_versions == [5] * len(e)
        assert x.rollout_log_probs.shape == x.action_log_probs.shape
        for b, row in enumerate(e.rollout_log_probs.rows()):
            assert torch.equal(x.rollout_log_probs[b, : len(row)], torch.from_numpy(np.array(row)))
            assert (x.rollout_log_probs[b, len(row):] == 0).all()


def _exp_batch(batch_id, versions, logprob_versions, rollout=True):
    rows = [[7, 8, EOS], [3, EOS], [6]]
    return SampleBatch(
        batch_id=batch_id, policy_version=min(versions, default=0), n_samples_per_prompt=3, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=["g"] * 3, group_id=["g"] * 3, sample_index=[0, 1, 2], prompt=["p"] * 3, label=[""] * 3,
        reference=[""] * 3, response=["r"] * 3, prompt_ids=i32([[5, 6], [5], [4, 5, 6]]), response_ids=i32(rows),
        rollout_log_probs=f32([[-0.5, -1.5, -2.5], [-0.25, 0.0], [-3.0]]) if rollout else None,
        rollout_version=versions, layout="padded", action_ids=i32(rows),
        action_mask=Ragged.from_rows([np.ones(len(r), bool) for r in rows], "bool"),
        action_log_probs=f32([[-0.75, -1.25, -2.0], [-0.5, -0.125], [-2.5]]), logprob_version=logprob_versions,
        advantages=f32([[1, 1, 1], [2, 2], [3]]), returns=f32([[1, 1, 1], [2, 2], [3]]),
    )  # fmt: skip


def test_experience_padded_split_make_and_remove_padding_carry_the_new_fields():
    e = Experience.from_sample_batch(decode(encode(_exp_batch("m", [3, 4, 5], [6, 6, 7]))))
    want = torch.tensor([[-0.5, -1.5, -2.5], [-0.25, 0.0, 0.0], [-3.0, 0.0, 0.0]])
    assert torch.equal(e.rollout_log_probs, want)
    assert e.rollout_versions == [3, 4, 5] and e.logprob_versions == [6, 6, 7]
    sub = Experience.from_sample_batch(_exp_batch("m", [3, 4, 5], [6, 6, 7]), rows=[2, 0])
    assert sub.rollout_versions == [5, 3] and torch.equal(sub.rollout_log_probs, want[[2, 0]])
    items = split_experience_batch(e)
    assert [(it.rollout_version, it.logprob_version) for it in items] == [(3, 6), (4, 6), (5, 7)]
    assert torch.equal(items[1].rollout_log_probs, want[1])
    back = make_experience_batch(items)
    assert torch.equal(back.rollout_log_probs, want) and back.rollout_versions == [3, 4, 5]
    assert back.logprob_versions == [6, 6, 7]
    trimmed = remove_padding_in_sequences(items)
    assert [it.rollout_log_probs.tolist() for it in trimmed] == [[-0.5, -1.5, -2.5], [-0.25, 0.0], [-3.0]]
    # left padding, as the seed's trainer batches (responses right-aligned)
    left = make_experience_batch(trimmed[1:])
    assert torch.equal(left.rollout_log_probs, torch.tensor([[-0.25, 0.0], [0.0, -3.0]]))
    assert left.rollout_versions == [4, 5] and left.logprob_versions == [6, 7]


def test_experience_packed_carries_the_new_fields():
    items = remove_padding_in_sequences(split_experience_batch(
        Experience.from_sample_batch(_exp_batch("m", [3, 4, 5], [6, 6, 7]))))
    packed = make_experience_batch(items, packing_samples=True)
    assert packed.num_actions == [3, 2, 1]
    assert packed.rollout_log_probs.tolist() == [[-0.5, -1.5, -2.5, -0.25, 0.0, -3.0]]
    assert packed.rollout_versions == [3, 4, 5] and packed.logprob_versions == [6, 6, 7]


def test_experience_from_a_version_1_record_has_no_rollout_fields():
    e = Experience.from_sample_batch(_exp_batch("m", [], [], rollout=False))
    assert e.rollout_log_probs is None and e.rollout_versions == [] and e.logprob_versions == []
    items = split_experience_batch(e)
    assert all(it.rollout_log_probs is None and it.rollout_version == -1 for it in items)
    back = make_experience_batch(items)
    assert back.rollout_log_probs is None and back.rollout_versions == [] and back.logprob_versions == []
    with pytest.raises(ValueError, match=r"Experience\.rollout_versions: 2 entries for 3 rows"):
        Experience(**{k: getattr(e, k) for k in ("sequences", "action_log_probs", "base_action_log_probs", "values",
                                                 "returns", "advantages", "attention_mask", "action_mask")},
                   rollout_versions=[1, 2])
    with pytest.raises(ValueError, match=r"Experience\.rollout_log_probs: shape \(3, 2\) does not match"):
        Experience(**{k: getattr(e, k) for k in ("sequences", "action_log_probs", "base_action_log_probs", "values",
                                                 "returns", "advantages", "attention_mask", "action_mask")},
                   rollout_log_probs=torch.zeros(3, 2))
