"""The padded and packed layouts (expstream.rl.layout): hand-worked cases and hypothesis properties.

Every expected value is derived here (arithmetic written out, or by hand-built sequences), never
by calling the function under test.
"""

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from expstream.rl import layout as lo
from schemas import Ragged, SampleBatch
from tests.tensors import B, L, t

EOS, PAD = 9, 0
SETTINGS = settings(max_examples=60, deadline=None)
# docs/numerics.md §1.2 worked example (eos=9, pad=0, prompt [1, 2, 3]): the sequences after the EOS
# repair and their attention masks, written out by hand from the formulas.
WORKED_SEQUENCES = [
    [1, 2, 3, 7, 8, 9, 0, 0],
    [1, 2, 3, 7, 7, 7, 7, 9],
    [1, 2, 3, 3, 9, 0, 0, 0],
]
WORKED_ATTENTION = [
    [1, 1, 1, 1, 1, 1, 0, 0],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [1, 1, 1, 1, 1, 0, 0, 0],
]


# ---------------------------------------------------------------------------------------------
# docs/numerics.md §1.2 layout
# ---------------------------------------------------------------------------------------------


def test_padded_layout_worked_table():
    # docs/numerics.md §1.2 worked example: eos=9, pad=0, P=3 (prompt [1,2,3]); A = 5 (longest output).
    prompts = [L([1, 2, 3])] * 3
    outputs = [L([7, 8, 9]), L([7, 7, 7, 7, 7]), L([3])]
    lay = lo.padded_layout(prompts, outputs, EOS, PAD)
    assert lay.prompt_width == 3 and lay.num_actions == 5
    assert lay.sequences.dtype == torch.long and lay.attention_mask.dtype == torch.long
    assert lay.action_mask.dtype == torch.bool
    # normal: [7,8,9,0,0] unchanged; last valid = 8 at col 4 -> eos at col 5 (already 9)
    # truncated: last valid at L-1=7 -> eos_b = L-1, the last 7 is overwritten by 9
    # no EOS returned: [3,0,0,0,0] -> last valid at col 3 -> eos at col 4 -> [3,9,0,0,0]
    assert lay.sequences.tolist() == WORKED_SEQUENCES
    # attention: first valid = 0, through eos_b (5, 7, 4)
    assert lay.attention_mask.tolist() == WORKED_ATTENTION
    # action t valid iff the state token seq[P-1+t] is not eos/pad; [:,0] forced
    assert lay.action_mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert lay.response_length.tolist() == [3.0, 5.0, 2.0]
    assert lay.total_length.tolist() == [6.0, 8.0, 5.0]


def test_padded_layout_early_eos_and_left_padding():
    # P = 2, A = 3. Row 0: prompt [5] left-padded -> [0,5]; output [9] (immediate EOS).
    #   valid only at col 1 -> eos_b = 2 (already 9); attention cols 1..2; state tokens
    #   seq[1..3] = 5, 9, 0 -> mask [1,0,0].
    # Row 1: prompt [1,2], output [4,4,9]: last valid col 3 -> eos col 4; state 2,4,4 -> all 1.
    lay = lo.padded_layout([L([5]), L([1, 2])], [L([9]), L([4, 4, 9])], EOS, PAD)
    assert lay.sequences.tolist() == [[0, 5, 9, 0, 0], [1, 2, 4, 4, 9]]
    assert lay.attention_mask.tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert lay.action_mask.int().tolist() == [[1, 0, 0], [1, 1, 1]]
    assert lo.action_lengths(lay.action_mask).tolist() == [1, 3]


def test_padded_layout_length_one_and_empty_and_degenerate():
    # length-1 response without EOS that fills the width (A=1): its token is overwritten.
    lay = lo.padded_layout([L([1, 2])], [L([5])], EOS, PAD)
    assert lay.sequences.tolist() == [[1, 2, 9]]
    assert lay.attention_mask.tolist() == [[1, 1, 1]]
    assert lay.action_mask.tolist() == [[True]]
    # empty output: A = max(1, 0) = 1; last valid = col 0 -> eos at col 1.
    lay = lo.padded_layout([L([1])], [L([])], EOS, PAD)
    assert lay.num_actions == 1 and lay.sequences.tolist() == [[1, 9]]
    assert lay.attention_mask.tolist() == [[1, 1]] and lay.action_mask.tolist() == [[True]]
    # no valid token at all: eos_b = L-1, first_b = 0.
    lay = lo.padded_layout([L([0])], [L([0])], EOS, PAD)
    assert lay.sequences.tolist() == [[0, 9]] and lay.attention_mask.tolist() == [[1, 1]]


def test_padded_layout_stop_on_pad_is_rewritten_and_special_in_prompt():
    # Qwen-like: the engine stopped on the pad token -> rewritten to eos.
    lay = lo.padded_layout([L([1])], [L([7, 0])], EOS, PAD)
    assert lay.sequences.tolist() == [[1, 7, 9]]
    assert lay.action_mask.int().tolist() == [[1, 1]]
    # an EOS at the start of the prompt is not attended (first_b = first valid = col 1).
    lay = lo.padded_layout([L([9, 4])], [L([5, 9])], EOS, PAD)
    assert lay.sequences.tolist() == [[9, 4, 5, 9]]
    assert lay.attention_mask.tolist() == [[0, 1, 1, 1]]


def test_padded_layout_accepts_int32_numpy_rows():
    lay = lo.padded_layout(
        [np.array([1, 2, 3], dtype=np.int32)], [np.array([7, 9], dtype=np.int32)], EOS, PAD
    )
    assert lay.sequences.dtype == torch.long
    assert lay.sequences.tolist() == [[1, 2, 3, 7, 9]]


def test_action_lengths():
    m = B([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    # last True at 3 -> 4; none -> 0; last True at 0 -> 1
    assert lo.action_lengths(m).tolist() == [4, 0, 1]
    assert lo.action_lengths(torch.zeros((2, 0), dtype=torch.bool)).tolist() == [0, 0]


def test_pad_rows():
    rows = [L([1, 2]), L([3]), L([])]
    assert lo.pad_rows(rows).tolist() == [[1, 2], [3, 0], [0, 0]]
    assert lo.pad_rows(rows, side="left", value=-1, width=3).tolist() == [
        [-1, 1, 2],
        [-1, -1, 3],
        [-1, -1, -1],
    ]
    assert lo.pad_rows([t([True]), t([])], value=False, dtype=torch.bool).tolist() == [[True], [False]]
    with pytest.raises(ValueError):
        lo.pad_rows(rows, width=1)
    with pytest.raises(ValueError):
        lo.pad_rows(rows, side="middle")


def test_rebuild_padded_from_worked_table():
    # cut of the docs/numerics.md §1.2 table: a_b = last True + 1 = 3, 5, 2; action tokens seq[P : P+a_b]
    prompts = [L([1, 2, 3])] * 3
    actions = [L([7, 8, 9]), L([7, 7, 7, 7, 9]), L([3, 9])]
    masks = [B([1, 1, 1]), B([1, 1, 1, 1, 1]), B([1, 1])]
    lay = lo.rebuild_padded(prompts, actions, masks, PAD, eos_id=EOS)
    assert lay.prompt_width == 3 and lay.num_actions == 5
    assert lay.sequences.tolist() == WORKED_SEQUENCES
    assert lay.attention_mask.tolist() == WORKED_ATTENTION
    assert lay.action_mask.int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]


def test_rebuild_padded_narrower_and_prompt_edge_cases():
    # original: prompt [0,5] (left-pad), output [7,9,0] -> A=3 but a_b = 2; rebuilt A = 2.
    lay = lo.rebuild_padded([L([5]), L([4, 4])], [L([7, 9]), L([9])], [B([1, 1]), B([1])], PAD, eos_id=EOS)
    assert lay.sequences.tolist() == [[0, 5, 7, 9], [4, 4, 9, 0]]
    assert lay.attention_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 0]]
    assert lay.action_mask.int().tolist() == [[1, 1], [1, 0]]
    # prompt with a leading EOS: with eos_id the first attended token is the 4.
    lay = lo.rebuild_padded([L([9, 4])], [L([5, 9])], [B([1, 1])], PAD, eos_id=EOS)
    assert lay.attention_mask.tolist() == [[0, 1, 1, 1]]
    # prompt with no valid token at all: attended from the first valid action (col P=2).
    lay = lo.rebuild_padded([L([0, 0])], [L([5, 9])], [B([1, 1])], PAD, eos_id=EOS)
    assert lay.attention_mask.tolist() == [[0, 0, 1, 1]]
    # no valid token anywhere: from position P through the last action.
    lay = lo.rebuild_padded([L([0])], [L([9])], [B([1])], PAD, eos_id=EOS)
    assert lay.attention_mask.tolist() == [[0, 1]]
    with pytest.raises(ValueError):
        lo.rebuild_padded([L([1])], [L([5, 9])], [B([1])], PAD)


def test_position_ids_from_attention():
    # cumsum [0,1,2,3,3] - 1 = [-1,0,1,2,2]; masked positions (0 and 4) -> 1
    am = L([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]])
    assert lo.position_ids_from_attention(am).tolist() == [[1, 0, 1, 2, 1], [0, 1, 1, 1, 1]]


def test_packed_layout():
    seqs, seg, pos, lens, nact = lo.packed_layout([L([1, 2]), L([3])], [L([4, 5, 6]), L([])])
    assert seqs.tolist() == [[1, 2, 4, 5, 6, 3]]  # no EOS repair, no padding
    assert seg.tolist() == [[1, 1, 1, 1, 1, 2]]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 0]]
    assert lens == [5, 1] and nact == [3, 1]  # max(1, o_i)


# ---------------------------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------------------------

token = st.sampled_from([PAD, EOS, 1, 2, 3])


@st.composite
def engine_rows(draw):
    """Prompts of any tokens; outputs = tokens ending in a valid one (or nothing), then an
    optional stop token (eos or pad), then right padding — what an engine returns."""
    b = draw(st.integers(1, 4))
    prompts, outputs = [], []
    for _ in range(b):
        prompts.append(draw(st.lists(token, min_size=0, max_size=4)))
        body = draw(st.lists(token, min_size=0, max_size=5))
        while body and body[-1] in (PAD, EOS):
            body.pop()
        stop = draw(st.sampled_from([[], [EOS], [PAD]]))
        outputs.append(body + stop + [PAD] * draw(st.integers(0, 2)))
    return prompts, outputs


def _is_valid(tok):
    return tok not in (PAD, EOS)


@SETTINGS
@given(engine_rows())
def test_rebuild_padded_reproduces_padded_layout(rows):
    prompts, outputs = rows
    P = max(len(p) for p in prompts)
    A = max(1, max(len(o) for o in outputs))
    Lw = P + A
    # the domain where the cut keeps everything (see rebuild_padded's docstring), computed by hand
    for p, o in zip(prompts, outputs, strict=True):
        seq = [PAD] * (P - len(p)) + p + o + [PAD] * (A - len(o))
        valid = [_is_valid(x) for x in seq]
        assume(any(valid))
        last = max(j for j, v in enumerate(valid) if v)
        assume(last >= P - 1)
        assume(not (last == Lw - 1 and A >= 2 and not valid[Lw - 2]))

    lay = lo.padded_layout([torch.tensor(p) for p in prompts], [torch.tensor(o) for o in outputs], EOS, PAD)
    seq = lay.sequences.tolist()
    am = lay.action_mask.tolist()
    # cut to the wire's ragged fields: a_b = last True + 1
    a_len = [max(t + 1 for t, v in enumerate(row) if v) for row in am]
    action_rows = [torch.tensor(seq[b][P : P + a_len[b]]) for b in range(len(seq))]
    mask_rows = [torch.tensor(am[b][: a_len[b]]) for b in range(len(seq))]
    re = lo.rebuild_padded([torch.tensor(p) for p in prompts], action_rows, mask_rows, PAD, eos_id=EOS)

    w = P + max(a_len)
    assert re.prompt_width == P and re.num_actions == max(a_len)
    assert re.sequences.shape[1] == w
    assert re.sequences.tolist() == lay.sequences[:, :w].tolist()
    assert re.attention_mask.tolist() == lay.attention_mask[:, :w].tolist()
    assert re.action_mask.tolist() == lay.action_mask[:, : max(a_len)].tolist()
    # the original's remaining columns are padding / 0 / False
    assert torch.all(lay.sequences[:, w:] == PAD)
    assert torch.all(lay.attention_mask[:, w:] == 0)
    assert not lay.action_mask[:, max(a_len) :].any()


@SETTINGS
@given(engine_rows())
def test_padded_layout_invariants(rows):
    prompts, outputs = rows
    lay = lo.padded_layout([torch.tensor(p) for p in prompts], [torch.tensor(o) for o in outputs], EOS, PAD)
    P, A = lay.prompt_width, lay.num_actions
    assert P == max(len(p) for p in prompts) and A == max(1, max(len(o) for o in outputs))
    assert lay.action_mask[:, 0].all()
    # exactly one repaired EOS closes each row's attended span
    for b in range(len(prompts)):
        att = lay.attention_mask[b].tolist()
        end = max(j for j, v in enumerate(att) if v)
        assert lay.sequences[b, end].item() == EOS
        # position ids count attended tokens from 0
        pos = lo.position_ids_from_attention(lay.attention_mask[b : b + 1])[0].tolist()
        start = att.index(1)
        assert pos[start : end + 1] == list(range(end - start + 1))


# ---------------------------------------------------------------------------------------------
# SampleBatch views
# ---------------------------------------------------------------------------------------------


def _cut_batch(prompts, actions, masks, layout="padded"):
    b = len(prompts)
    rag = lambda rows, dt: Ragged.from_rows([np.asarray(r, dt) for r in rows], np.dtype(dt).name)  # noqa: E731
    return SampleBatch(
        batch_id="x", policy_version=0, n_samples_per_prompt=b, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=["p"] * b, group_id=["p"] * b, sample_index=list(range(b)), prompt=["p"] * b, label=[""] * b,
        reference=[""] * b, response=["r"] * b, prompt_ids=rag(prompts, np.int32), response_ids=rag(actions, np.int32),
        layout=layout, action_ids=rag(actions, np.int32), action_mask=rag(masks, np.bool_))


def test_padded_view_action_field_and_to_ragged():
    batch = _cut_batch([[1, 2], [3]], [[7, 8, 9], [9]], [[1, 1, 1], [1]])
    lay = lo.padded(batch)
    assert lay.sequences.tolist() == [[1, 2, 7, 8, 9], [0, 3, 9, 0, 0]]
    assert lay.action_mask.int().tolist() == [[1, 1, 1], [1, 0, 0]]
    x = t([[0.5, 1.5, 2.5], [3.5, 99.0, 99.0]])  # 99 sits past row 1's single action
    r = lo.to_ragged(x, batch)
    assert r.dtype == "float32" and r.lengths.tolist() == [3, 1]
    assert [row.tolist() for row in r.rows()] == [[0.5, 1.5, 2.5], [3.5]]
    back = lo.action_field(batch.replace(values=r), "values", 4)
    assert back.tolist() == [[0.5, 1.5, 2.5, 0.0], [3.5, 0.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="values missing"):
        lo.action_field(batch, "values", 3)


def test_packed_view_and_ragged_from_flat():
    # prompt [0, 9, 4]: leading pad/EOS dropped; prompt [0]: only invalid tokens, its last one kept
    batch = _cut_batch([[0, 9, 4], [0]], [[5, 6, 9], [9]], [[1, 1, 1], [1]], layout="packed")
    assert lo.is_packed(batch) and not lo.is_packed(batch.replace(layout="padded"))
    pk = lo.packed(batch)
    assert pk.sequences.tolist() == [[4, 5, 6, 9, 0, 9]]
    assert pk.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    assert pk.seq_lens == [4, 2] and pk.num_actions == [3, 1]
    r = lo.ragged_from_flat(t([0.1, 0.2, 0.3, 0.4]), batch)
    assert r.lengths.tolist() == [3, 1]
    np.testing.assert_allclose(np.concatenate(r.rows()), [0.1, 0.2, 0.3, 0.4], rtol=0, atol=1e-7)


def test_views_need_shard_preprocess():
    batch = _cut_batch([[1]], [[9]], [[1]]).replace(action_ids=None, action_mask=None, layout="")
    with pytest.raises(ValueError, match="after shard-preprocess"):
        lo.padded(batch)
    with pytest.raises(ValueError, match="after shard-preprocess"):
        lo.packed(batch)
