"""expstream.rl.experience: padded Experiences rebuilt from recorded ``experiences`` records (no Kafka).

The SampleBatches are typed in by hand (eos=2, pad=0) and the expected padded tensors are
written out, so a change of layout shows up as a diff of small literal tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from expstream.rl.experience import (
    BufferItem,
    Experience,
    iter_experience_batches,
    iter_records,
    make_experience_batch,
    padded_from_ragged,
    read_experiences,
    remove_padding_in_sequences,
    split_experience_batch,
    zero_pad_sequences,
)
from schemas import Ragged, SampleBatch, encode

EOS, PAD = 2, 0
F = torch.float32


def rag(rows, dtype):
    return Ragged.from_rows([np.asarray(r) for r in rows], dtype)


def sample_batch(batch_id, rows, policy_version=3):
    """rows: dicts with group, index, prompt, actions, lp, adv, ret, (mask), reward."""
    return SampleBatch(
        batch_id=batch_id,
        policy_version=policy_version,
        n_samples_per_prompt=2,
        eos_token_id=EOS,
        pad_token_id=PAD,
        prompt_id=[r["group"] for r in rows],
        group_id=[r["group"] for r in rows],
        sample_index=[r["index"] for r in rows],
        prompt=["q"] * len(rows),
        label=[""] * len(rows),
        reference=[""] * len(rows),
        response=["a"] * len(rows),
        prompt_ids=rag([r["prompt"] for r in rows], "int32"),
        response_ids=rag([r["actions"] for r in rows], "int32"),
        layout="padded",
        action_ids=rag([r["actions"] for r in rows], "int32"),
        action_mask=rag([r.get("mask", [True] * len(r["actions"])) for r in rows], "bool"),
        action_log_probs=rag([r["lp"] for r in rows], "float32"),
        advantages=rag([r["adv"] for r in rows], "float32"),
        returns=rag([r["ret"] for r in rows], "float32"),
        rewards=np.asarray([r["reward"] for r in rows], np.float32),
        info={"reward": np.asarray([r["reward"] for r in rows], np.float32)},
    )


ROW0 = dict(group="g0", index=0, prompt=[5, 6, 7], actions=[11, 12, EOS],
            lp=[-0.5, -0.25, -1.0], adv=[1.0, 1.0, 1.0], ret=[0.5, 0.5, 0.5], reward=1.0)
# a prompt that starts with the EOS token: attention starts at the 8
ROW1 = dict(group="g0", index=1, prompt=[EOS, 8], actions=[13, EOS],
            lp=[-2.0, -0.125], adv=[-1.0, -1.0], ret=[0.0, 0.0], reward=0.0)
# a prompt with no real token: attention starts at the first action column
ROW2 = dict(group="g1", index=0, prompt=[EOS], actions=[14],
            lp=[-3.0], adv=[0.25], ret=[0.75], reward=0.5)
ROW3 = dict(group="g1", index=1, prompt=[9, 10], actions=[17, 18, 19, EOS],
            lp=[-1.0, -1.0, -1.0, -1.0], adv=[2.0, 2.0, 2.0, 2.0], ret=[1.5, 1.5, 1.5, 1.5], reward=1.5)

B1 = sample_batch("p000000/m0", [ROW0, ROW1, ROW2])
B2 = sample_batch("p000001/m0", [ROW3, ROW1])  # ROW1 (g0#1) doubled: delivered again in another record

EXP1 = dict(
    sequences=torch.tensor([[5, 6, 7, 11, 12, 2],
                            [0, 2, 8, 13, 2, 0],
                            [0, 0, 2, 14, 0, 0]]),
    attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1],
                                 [0, 0, 1, 1, 1, 0],
                                 [0, 0, 0, 1, 0, 0]]),
    action_mask=torch.tensor([[True, True, True],
                              [True, True, False],
                              [True, False, False]]),
    action_log_probs=torch.tensor([[-0.5, -0.25, -1.0],
                                   [-2.0, -0.125, 0.0],
                                   [-3.0, 0.0, 0.0]]),
    advantages=torch.tensor([[1.0, 1.0, 1.0],
                             [-1.0, -1.0, 0.0],
                             [0.25, 0.0, 0.0]]),
    returns=torch.tensor([[0.5, 0.5, 0.5],
                          [0.0, 0.0, 0.0],
                          [0.75, 0.0, 0.0]]),
)
# B2 after dedupe: only g1#1 is left
EXP2 = dict(
    sequences=torch.tensor([[9, 10, 17, 18, 19, 2]]),
    attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1]]),
    action_mask=torch.tensor([[True, True, True, True]]),
    action_log_probs=torch.tensor([[-1.0, -1.0, -1.0, -1.0]]),
    advantages=torch.tensor([[2.0, 2.0, 2.0, 2.0]]),
    returns=torch.tensor([[1.5, 1.5, 1.5, 1.5]]),
)


def assert_tensors(exp, expected):
    for name, want in expected.items():
        got = getattr(exp, name)
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        assert torch.equal(got, want), f"{name}:\n{got}\n!=\n{want}"


def assert_same_experience(a: Experience, b: Experience):
    for name in ("sequences", "action_log_probs", "base_action_log_probs", "values", "returns",
                 "advantages", "attention_mask", "action_mask", "kl", "action_entropy", "rollout_log_probs"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), f"{name}:\n{x}\n!=\n{y}"
    assert a.info.keys() == b.info.keys()
    for k in a.info:
        assert a.info[k].dtype == b.info[k].dtype and torch.equal(a.info[k], b.info[k]), k
    for name in ("batch_id", "sample_ids", "prompt_ids", "group_ids", "sample_index", "policy_version",
                 "rollout_versions", "logprob_versions"):
        assert getattr(a, name) == getattr(b, name), name


@pytest.fixture
def record_file(tmp_path):
    """B1, B2 (one doubled sample), then B1 again (a doubled record), concatenated."""
    path = tmp_path / "experiences.msgpack"
    path.write_bytes(encode(B1) + encode(B2) + encode(B1))
    return path


# ---- reading ------------------------------------------------------------------------------------


def test_read_experiences_padded_layout(record_file):
    exps = read_experiences(record_file)
    assert len(exps) == 2
    e1, e2 = exps
    assert_tensors(e1, EXP1)
    assert e1.base_action_log_probs is None and e1.values is None
    assert e1.kl is None and e1.action_entropy is None
    assert torch.equal(e1.info["reward"], torch.tensor([1.0, 0.0, 0.5]))
    assert e1.info["reward"].dtype == F
    assert e1.batch_id == "p000000/m0"
    assert e1.sample_ids == ["g0#0", "g0#1", "g1#0"]
    assert e1.prompt_ids == ["g0", "g0", "g1"] and e1.group_ids == ["g0", "g0", "g1"]
    assert e1.sample_index == [0, 1, 0]
    assert e1.policy_version == 3
    assert len(e1) == e1.batch_size == 3

    # the doubled sample g0#1 is gone from the second record; P and A follow the rows left
    assert_tensors(e2, EXP2)
    assert e2.sample_ids == ["g1#1"] and e2.batch_id == "p000001/m0"
    assert torch.equal(e2.info["reward"], torch.tensor([1.5]))


def test_read_experiences_without_dedupe_keeps_everything(record_file):
    exps = read_experiences(record_file, dedupe=False)
    assert [e.batch_id for e in exps] == ["p000000/m0", "p000001/m0", "p000000/m0"]
    assert [len(e) for e in exps] == [3, 2, 3]
    assert_same_experience(exps[0], exps[2])
    assert exps[1].sample_ids == ["g1#1", "g0#1"]
    # P = 2, A = 4 for the two-row record
    assert torch.equal(exps[1].sequences, torch.tensor([[9, 10, 17, 18, 19, 2], [2, 8, 13, 2, 0, 0]]))
    assert torch.equal(exps[1].attention_mask, torch.tensor([[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]))


def test_iter_records_and_batches_round_trip(record_file):
    raw = record_file.read_bytes()
    for chunk_size in (1, 7, 1 << 20):  # record boundaries inside and across chunks
        records = list(iter_records(record_file, chunk_size=chunk_size))
        assert b"".join(records) == raw
        assert records == [encode(B1), encode(B2), encode(B1)]
    assert list(iter_experience_batches(record_file)) == [B1, B2, B1]


def test_truncated_file_is_an_error(tmp_path):
    path = tmp_path / "cut.msgpack"
    data = encode(B1) + encode(B2)
    path.write_bytes(data[:-5])
    with pytest.raises(ValueError, match="trailing bytes"):
        read_experiences(path)


def test_empty_file_gives_no_experiences(tmp_path):
    path = tmp_path / "empty.msgpack"
    path.write_bytes(b"")
    assert read_experiences(path) == []


def test_optional_action_fields_are_padded():
    lp = B1.action_log_probs
    batch = B1.replace(base_action_log_probs=lp, values=B1.returns, action_entropy=B1.advantages)
    exp = Experience.from_sample_batch(batch)
    assert torch.equal(exp.base_action_log_probs, EXP1["action_log_probs"])
    assert torch.equal(exp.values, EXP1["returns"])
    assert torch.equal(exp.action_entropy, EXP1["advantages"])


def test_wire_action_mask_with_false_is_kept():
    row = dict(ROW0, mask=[True, True, False])
    exp = Experience.from_sample_batch(sample_batch("p9", [row]))
    assert torch.equal(exp.action_mask, torch.tensor([[True, True, False]]))
    assert torch.equal(exp.attention_mask, torch.tensor([[1, 1, 1, 1, 1, 1]]))


def test_missing_required_field_names_it():
    batch = B1.replace(advantages=None)
    with pytest.raises(ValueError, match="advantages"):
        Experience.from_sample_batch(batch)
    with pytest.raises(ValueError, match="action_ids"):
        Experience.from_sample_batch(B1.replace(action_ids=None, action_mask=None, action_log_probs=None,
                                                advantages=None, returns=None))


def test_padded_from_ragged_on_hand_written_rows():
    """The padded layout read_experiences builds, on the hand-written rows."""
    rows = [ROW0, ROW1, ROW2, ROW3, dict(ROW0, prompt=[PAD, EOS], actions=[EOS, 5])]

    def flat(key, dtype):
        vals = [torch.tensor(r[key], dtype=dtype) for r in rows]
        return torch.cat(vals), torch.tensor([len(v) for v in vals])

    prompts, actions = flat("prompt", torch.long), flat("actions", torch.long)
    masks = torch.ones(int(actions[1].sum()), dtype=torch.bool)
    seq, att, am = padded_from_ragged(prompts, actions, masks, PAD, EOS)
    assert torch.equal(seq[:3, :6], EXP1["sequences"])
    assert torch.equal(att[:3, :6], EXP1["attention_mask"])
    assert am.dtype == torch.bool and am.shape == (5, int(actions[1].max()))
    # prompt of pad/eos and a first action EOS: attention starts at the first real action
    assert seq[4].tolist() == [0, 0, 2, 2, 5, 0, 0]
    assert att[4].tolist() == [0, 0, 0, 0, 1, 0, 0]


def test_read_experiences_needs_a_source():
    # reading from a real topic is tested against a real broker in test_experience_kafka.py
    with pytest.raises(ValueError, match="source"):
        read_experiences(None)


# ---- Experience validation ------------------------------------------------------------------------


def test_experience_validation_names_the_field():
    exp = Experience.from_sample_batch(B1)
    fields = {k: getattr(exp, k) for k in ("sequences", "action_log_probs", "base_action_log_probs", "values",
                                            "returns", "advantages", "attention_mask", "action_mask", "info")}
    with pytest.raises(ValueError, match=r"Experience\.advantages"):
        Experience(**{**fields, "advantages": torch.zeros(3, 4)})
    with pytest.raises(ValueError, match=r"Experience\.attention_mask"):
        Experience(**{**fields, "attention_mask": torch.zeros(3, 5, dtype=torch.long)})
    with pytest.raises(ValueError, match=r"Experience\.info\['reward'\]"):
        Experience(**{**fields, "info": {"reward": torch.zeros(2)}})
    with pytest.raises(ValueError, match=r"Experience\.sample_ids"):
        Experience(**fields, sample_ids=["a#0"])
    with pytest.raises(ValueError, match=r"Experience\.action_mask"):
        Experience(**{**fields, "action_mask": fields["action_mask"].long()})


def test_to_device_copies_every_tensor():
    exp = Experience.from_sample_batch(B1).to_device("cpu")
    assert_tensors(exp, EXP1)


# ---- replay-buffer helpers --------------------------------------------------------------------------


def test_zero_pad_sequences_seed_example():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7, 8, 9])]
    assert torch.equal(zero_pad_sequences(seqs, side="right"),
                       torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]))
    assert torch.equal(zero_pad_sequences(seqs, side="left"),
                       torch.tensor([[0, 1, 2, 3], [0, 0, 4, 5], [6, 7, 8, 9]]))
    assert torch.equal(zero_pad_sequences(seqs), zero_pad_sequences(seqs, "left"))
    with pytest.raises(ValueError, match="side"):
        zero_pad_sequences(seqs, side="middle")


def test_split_then_make_round_trip():
    exp = Experience.from_sample_batch(B1)
    items = split_experience_batch(exp)
    assert len(items) == 3
    it = items[1]
    assert torch.equal(it.sequences, torch.tensor([0, 2, 8, 13, 2, 0]))
    assert torch.equal(it.action_mask, torch.tensor([True, True, False]))
    assert it.info == {"reward": 0.0}
    assert (it.sample_id, it.group_id, it.sample_index, it.batch_id, it.policy_version) == \
        ("g0#1", "g0", 1, "p000000/m0", 3)
    assert_same_experience(make_experience_batch(items), exp)


def test_make_from_several_records():
    e1, e2 = (Experience.from_sample_batch(b) for b in (B1, B2.replace(policy_version=2)))
    items = split_experience_batch(e1)[:1] + split_experience_batch(e2)[:1]
    batch = make_experience_batch(items)
    assert batch.batch_id == "p000000/m0+p000001/m0"
    assert batch.policy_version == 2
    assert batch.sample_ids == ["g0#0", "g1#1"]
    # left padding on the action axis: the 3-action row gets a leading 0 / False
    assert torch.equal(batch.action_mask, torch.tensor([[False, True, True, True], [True, True, True, True]]))
    # both rows are 6 tokens wide already (P+A = 3+3 and 2+4): no token padding
    assert torch.equal(batch.sequences, torch.tensor([[5, 6, 7, 11, 12, 2], [9, 10, 17, 18, 19, 2]]))


def test_remove_padding_seed_example():
    item = BufferItem(
        sequences=torch.tensor([0, 0, 1, 2, 3, 0, 0]),
        action_log_probs=torch.tensor([-1.0, -2.0, 0.0, 0.0]),
        base_action_log_probs=None,
        values=None,
        returns=torch.tensor([1.0, 1.0, 0.0, 0.0]),
        advantages=torch.tensor([0.5, 0.5, 0.0, 0.0]),
        attention_mask=torch.tensor([0, 0, 1, 1, 1, 0, 0]),
        action_mask=torch.tensor([True, True, False, False]),
        info={"reward": 1.0},
    )
    (out,) = remove_padding_in_sequences([item])
    assert torch.equal(out.sequences, torch.tensor([1, 2, 3]))
    assert torch.equal(out.attention_mask, torch.tensor([1, 1, 1]))
    assert torch.equal(out.action_log_probs, torch.tensor([-1.0, -2.0]))
    assert torch.equal(out.returns, torch.tensor([1.0, 1.0]))
    assert torch.equal(out.advantages, torch.tensor([0.5, 0.5]))
    assert torch.equal(out.action_mask, torch.tensor([True, True]))
    assert out.values is None and out.info == {"reward": 1.0}
    assert item.sequences.shape == (7,)  # the input is not changed


def test_remove_padding_then_make_re_pads_left():
    items = remove_padding_in_sequences(split_experience_batch(Experience.from_sample_batch(B1)))
    assert [it.sequences.tolist() for it in items] == [[5, 6, 7, 11, 12, 2], [8, 13, 2], [14]]
    assert [it.action_log_probs.tolist() for it in items] == [[-0.5, -0.25, -1.0], [-2.0, -0.125], [-3.0]]
    batch = make_experience_batch(items)
    assert_tensors(batch, dict(
        sequences=torch.tensor([[5, 6, 7, 11, 12, 2], [0, 0, 0, 8, 13, 2], [0, 0, 0, 0, 0, 14]]),
        attention_mask=torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1]]),
        action_mask=torch.tensor([[True, True, True], [False, True, True], [False, False, True]]),
        action_log_probs=torch.tensor([[-0.5, -0.25, -1.0], [0.0, -2.0, -0.125], [0.0, 0.0, -3.0]]),
    ))
    assert torch.equal(batch.info["reward"], torch.tensor([1.0, 0.0, 0.5]))


def test_remove_padding_fully_masked_row_keeps_prompt():
    exp = Experience.from_sample_batch(B1)
    (item,) = split_experience_batch(exp)[:1]
    zeroed = BufferItem(**{**item.__dict__, "action_mask": torch.zeros(3, dtype=torch.bool)})
    (out,) = remove_padding_in_sequences([zeroed])
    assert out.action_log_probs.numel() == 0 and out.action_mask.numel() == 0
    assert out.sequences.tolist() == [5, 6, 7]


def test_make_packed():
    items = remove_padding_in_sequences(split_experience_batch(Experience.from_sample_batch(B1)))
    packed = make_experience_batch(items, packing_samples=True)
    assert packed.packed_seq_lens == [6, 3, 1] and packed.num_actions == [3, 2, 1]
    assert packed.sequences.tolist() == [[5, 6, 7, 11, 12, 2, 8, 13, 2, 14]]
    assert packed.attention_mask.tolist() == [[1] * 6 + [2] * 3 + [3]]
    assert packed.action_log_probs.tolist() == [[-0.5, -0.25, -1.0, -2.0, -0.125, -3.0]]
    assert len(packed) == 3
    with pytest.raises(ValueError, match="packed"):
        split_experience_batch(packed)


def test_make_empty_is_an_error():
    with pytest.raises(ValueError, match="no items"):
        make_experience_batch([])
