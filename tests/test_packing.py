"""Sample packing (algo.packing_samples): the packed layout gives the padded layout's numbers.

The same rollouts go through the chain twice, once padded and once packed, with real tiny models;
log-probs, entropies, values, rewards, advantages and returns must agree to 1e-5, and the packed
model forwards must see no padding at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expstream.config.topology import load_topology
from expstream.rl.layout import packed, padded
from schemas import PromptBatch, Ragged, SampleBatch
from stages import shard_preprocess
from stages.context import make_context
from stages.local import LocalChain

TOL = 1e-5
MAX_NEW = 8
FIELDS = ("action_log_probs", "base_action_log_probs", "values", "action_entropy")
AFTER = ("advantages", "returns")
MODEL_STAGES = {"actor-logprob": "lm", "reference": "lm", "critic": "critic", "reward": "rm"}
MEASURED: dict[str, float] = {}


def _i32(rows):
    return Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")


def _overrides(cache, packing: bool) -> list[str]:
    return [
        f"models.cache_dir={cache}",
        "algo.advantage_estimator=gae",  # so the critic runs
        "algo.high_entropy_token_ratio=0.2",  # so the actor emits action_entropy
        "algo.init_kl_coef=0.05",
        "algo.lambd=0.9",
        "algo.advantages_norm=true",  # per-micro-batch whitening: same micro-batches in both layouts
        "algo.micro_rollout_batch_size=4",  # micro-batches cut across prompt groups
        "generate.n_samples_per_prompt=3",
        f"generate.max_new_tokens={MAX_NEW}",
        f"algo.packing_samples={'true' if packing else 'false'}",
    ]


def _handmade(rollouts: SampleBatch) -> SampleBatch:
    """Rollouts with chosen responses: EOS at once, truncated, varied lengths, a stop on pad, no EOS
    returned, and prompts with leading pad/EOS tokens (outside the padded attention mask)."""
    eos, pad = rollouts.eos_token_id, rollouts.pad_token_id
    p0, p1 = (list(map(int, r)) for r in rollouts.prompt_ids.rows()[::3][:2])
    words = [t for t in range(20, 200) if t not in (eos, pad)]
    prompts = [p0, p1, [pad, pad, eos, *p0], p1, [eos, *p1[1:]], p0, [pad, *p1]]
    responses = [
        [eos],  # length 1: EOS at once
        words[:MAX_NEW],  # truncated: fills max_new_tokens, no EOS (its last token becomes EOS)
        [*words[3:6], eos],  # normal, behind leading pad/EOS prompt tokens
        [*words[10:12], pad],  # stopped on pad: rewritten to EOS
        words[20:22],  # no EOS returned: one is inserted
        [*words[30:35], eos],
        [words[40], eos],
    ]
    b = len(prompts)
    return SampleBatch(
        batch_id="h000000", policy_version=0, n_samples_per_prompt=b, eos_token_id=eos, pad_token_id=pad,
        prompt_id=["h"] * b, group_id=["h"] * b, sample_index=list(range(b)), prompt=["p"] * b, label=[""] * b,
        reference=[""] * b, response=["r"] * b, prompt_ids=_i32(prompts), response_ids=_i32(responses))


def _record_base_model_inputs(chain: LocalChain) -> dict[str, list[torch.Tensor]]:
    """Spy on every model stage's transformer backbone: the input_ids of each forward."""
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in MODEL_STAGES}
    for name, key in MODEL_STAGES.items():
        backbone = chain.contexts[name].models[key].base_model

        def hook(module, args, kwargs, _name=name):
            ids = kwargs.get("input_ids", args[0] if args else None)
            seen[_name].append(ids.detach().cpu().clone())

        backbone.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _after_generate(chain: LocalChain, rollouts: list[SampleBatch]) -> tuple[list[SampleBatch], list[SampleBatch]]:
    """Every stage after generate; returns (the reward stage's output, the experiences)."""
    data, scored = list(rollouts), []
    for st in chain.topology.enabled_stages():
        if st.name != "generate":
            data = chain.run_stage(st.name, data)
        if st.name == "reward":
            scored = data
    return scored, data


def _kept_prompt_len(p, eos: int, pad: int) -> int:
    valid = [j for j, t in enumerate(p.tolist()) if t not in (eos, pad)]
    return len(p) - valid[0]


@pytest.fixture(scope="module")
def runs(model_cache):
    cache = model_cache
    chain_padded = LocalChain(load_topology(overrides=_overrides(cache, False)), through_codec=True).setup()
    chain_packed = LocalChain(load_topology(overrides=_overrides(cache, True)), through_codec=True).setup()
    prompts = PromptBatch(batch_id="p000000", prompt_id=["a", "b", "c"],
                          prompt=["Hello there", "Add two numbers", "What is 3 + 4?"],
                          label=["", "", ""], reference=["", "", ""])
    [generated] = chain_padded.run_stage("generate", [prompts])  # generated once, used by both runs
    rollouts = [generated, _handmade(generated)]
    seen_padded = _record_base_model_inputs(chain_padded)
    seen_packed = _record_base_model_inputs(chain_packed)
    padded_models, padded_out = _after_generate(chain_padded, rollouts)
    packed_models, packed_out = _after_generate(chain_packed, rollouts)
    return {
        "padded": padded_out,
        "packed": packed_out,
        "padded_models": padded_models,
        "packed_models": packed_models,
        "seen_padded": seen_padded,
        "seen_packed": seen_packed,
    }


def _max_diff(a: Ragged, b: Ragged) -> float:
    np.testing.assert_array_equal(a.lengths, b.lengths)
    x, y = np.asarray(a.values, np.float64), np.asarray(b.values, np.float64)
    return float(np.abs(x - y).max()) if x.size else 0.0


def test_rollouts_cover_the_edge_cases(runs):
    batches = runs["padded"]
    actions = [list(map(int, r)) for b in batches for r in b.action_ids.rows()]
    lengths = {len(a) for a in actions}
    assert 1 in lengths and MAX_NEW in lengths and len(lengths) >= 4
    eos = batches[0].eos_token_id
    assert all(a[-1] == eos for a in actions)  # every row ends in the (repaired) EOS


def test_packed_layout_equals_padded_layout(runs):
    pad_out, pack_out = runs["padded"], runs["packed"]
    assert [b.batch_id for b in pad_out] == [b.batch_id for b in pack_out]
    assert len(pad_out) >= 4
    assert {b.layout for b in pad_out} == {"padded"} and {b.layout for b in pack_out} == {"packed"}
    diffs: dict[str, float] = {}
    for a, b in zip(pad_out, pack_out, strict=True):
        assert a.sample_ids() == b.sample_ids()
        np.testing.assert_array_equal(a.action_ids.values, b.action_ids.values)
        np.testing.assert_array_equal(a.action_ids.lengths, b.action_ids.lengths)
        np.testing.assert_array_equal(a.action_mask.values, b.action_mask.values)
        for name in ("action_log_probs", "values", "action_entropy", *AFTER):
            diffs[name] = max(diffs.get(name, 0.0), _max_diff(getattr(a, name), getattr(b, name)))
        for key in ("reward", "kl", "return", "response_length", "total_length"):
            d = float(np.abs(a.info[key].astype(np.float64) - b.info[key]).max())
            diffs[f"info.{key}"] = max(diffs.get(f"info.{key}", 0.0), d)
    MEASURED.update(diffs)
    print("max |padded - packed| in the experiences:", diffs)
    assert all(v <= TOL for v in diffs.values()), diffs


def test_model_fields_equal_between_layouts(runs):
    """The model stages' outputs (before postprocess drops the reference log-probs), entropy included."""
    diffs = {}
    for a, b in zip(runs["padded_models"], runs["packed_models"], strict=True):
        assert (a.layout, b.layout) == ("padded", "packed")
        for name in FIELDS:
            ra, rb = getattr(a, name), getattr(b, name)
            assert ra is not None and rb is not None, name
            diffs[name] = max(diffs.get(name, 0.0), _max_diff(ra, rb))
        diffs["rewards"] = max(diffs.get("rewards", 0.0), float(np.abs(a.rewards - b.rewards).max()))
    MEASURED.update({f"stage:{k}": v for k, v in diffs.items()})
    print("max |padded - packed| at the model stages:", diffs)
    assert all(v <= TOL for v in diffs.values()), diffs


def test_packed_forwards_see_no_padding(runs):
    batches = runs["packed"]
    eos, pad = batches[0].eos_token_id, batches[0].pad_token_id
    expected = []
    for b in batches:
        segs = [_kept_prompt_len(p, eos, pad) + len(a) for p, a in zip(b.prompt_ids.rows(), b.action_ids.rows(),
                                                                      strict=True)]
        expected.append(sum(segs))
    for name, seen in runs["seen_packed"].items():
        assert [tuple(ids.shape) for ids in seen] == [(1, t) for t in expected], name
        for ids in seen:
            assert int((ids == pad).sum()) == 0, name  # no pad token anywhere (the prompts' leading pads dropped)
    # the padded run did pay for padding
    padded_tokens = sum(ids.numel() for ids in runs["seen_padded"]["actor-logprob"])
    assert padded_tokens > sum(expected)


def test_packed_view_drops_leading_pad_and_eos():
    topo = load_topology(overrides=["algo.packing_samples=true", "algo.micro_rollout_batch_size=8"])
    eos, pad = 9, 0
    batch = SampleBatch(
        batch_id="b", policy_version=0, n_samples_per_prompt=3, eos_token_id=eos, pad_token_id=pad,
        prompt_id=["g"] * 3, group_id=["g"] * 3, sample_index=[0, 1, 2], prompt=["p"] * 3, label=[""] * 3,
        reference=[""] * 3, response=["r"] * 3, prompt_ids=_i32([[pad, eos, 5, 6], [7], [pad, pad]]),
        response_ids=_i32([[3, 4, eos], [eos], [8, eos]]))
    [mb] = shard_preprocess.process(batch, make_context(topo, "shard-preprocess"))
    assert mb.layout == "packed"
    view = packed(mb)
    # segments: [5 6 | 3 4 9], [7 | 9], [pad (last prompt token kept) | 8 9]
    assert view.sequences.tolist() == [[5, 6, 3, 4, 9, 7, 9, 0, 8, 9]]
    assert view.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1, 2]]
    assert view.seq_lens == [5, 2, 3] and view.num_actions == [3, 1, 2]
    # the padded view of the same micro-batch: total_length (attended tokens) matches the segments
    lay = padded(mb)
    assert lay.attention_mask.sum(-1).tolist()[:2] == [5, 2]


def test_packed_view_refuses_an_empty_prompt():
    eos, pad = 9, 0
    batch = SampleBatch(
        batch_id="b", policy_version=0, n_samples_per_prompt=1, eos_token_id=eos, pad_token_id=pad,
        prompt_id=["g"], group_id=["g"], sample_index=[0], prompt=["p"], label=[""], reference=[""],
        response=["r"], prompt_ids=_i32([[]]), response_ids=_i32([[3, eos]]), layout="packed",
        action_ids=_i32([[3, eos]]), action_mask=Ragged.from_rows([np.array([True, True])], "bool"))
    with pytest.raises(Exception, match="empty prompt"):
        packed(batch)
