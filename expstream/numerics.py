"""Pure numerics of the experience maker (torch only; no Kafka, no Redis).

Every function here is a formula from ``shared/notes/fastexperiencemaker-numerics.md`` (cited as
"§n" below), implemented **as intended**: the seed's bugs listed in §14 are not reproduced
(γ is never popped, CPGD is not identically zero, the GAE clip fraction is measured before the
clamp, dynamic sampling is decided per prompt group), and nothing is written into padding
positions: masked positions of advantages/returns/KL/token rewards are exactly 0 (the seed's
whitening and cross-batch normalisation write ``-μ/σ`` there, §14.8).

Conventions:

* per-sample data are torch tensors; action-level tensors are padded ``(B, A)`` views whose
  positions past a row's valid actions are 0 (or False for masks);
* float outputs are float32 (the seed's bf16 leak, §14.11, is not reproduced); statistics
  (means, variances, running moments) are accumulated in float64;
* ``action_mask`` is a bool ``(B, A)`` tensor (any dtype is accepted and converted with ``!= 0``).

This module imports only torch, math and dataclasses (no Kafka, Redis or project imports).
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "PaddedLayout",
    "action_lengths",
    "adaptive_kl_update",
    "apply_normalization",
    "clip_fraction",
    "clip_fraction_masked",
    "compute_advantages",
    "compute_approx_kl",
    "cpgd_scores",
    "cumulative_returns",
    "gae",
    "group_is_constant",
    "high_entropy_mask",
    "kl_penalized_rewards",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "moments_merge",
    "moments_std",
    "moments_to_mean_var",
    "normalize_rewards",
    "overlong_penalty",
    "packed_layout",
    "pad_rows",
    "padded_layout",
    "position_ids_from_attention",
    "rebuild_padded",
    "shape_group_rewards",
    "unpack_actions",
    "unpad_rows",
    "whiten",
]

#: KL estimators accepted by :func:`compute_approx_kl` (§3).
KL_ESTIMATORS = ("k1", "k2", "k3")

#: Advantage estimators accepted by :func:`shape_group_rewards` and :func:`compute_advantages`.
#: ``grpo`` is an alias of ``group_norm``; ``dr_grpo`` is group-mean centring without the std
#: division (Dr. GRPO), handled like ``group_norm`` downstream.
ADVANTAGE_ESTIMATORS = (
    "gae",
    "reinforce",
    "rloo",
    "reinforce_baseline",
    "group_norm",
    "grpo",
    "dr_grpo",
    "cpgd",
)

_GROUP_NEEDS_N_GT_1 = ("rloo", "group_norm", "grpo")

#: eps of the GRPO z-score (§4.3, fast path).
GROUP_NORM_EPS = 1e-9
#: eps of the per-experience whitening: GAE (§6.1 step 4) and the REINFORCE family (§6.2).
GAE_WHITEN_EPS = 1e-9
REINFORCE_WHITEN_EPS = 1e-8
#: eps of the CPGD STD_weight normalisation (§6.4).
CPGD_EPS = 1e-6
#: variance floor of the cross-batch / replay normalisation (§7.2, §7.3).
VAR_FLOOR = 1e-8


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _row(x) -> Tensor:
    t = torch.as_tensor(x)
    if t.dim() != 1:
        raise ValueError(f"expected a 1-D row, got shape {tuple(t.shape)}")
    return t


def _bool_mask(mask: Tensor | None, like: Tensor) -> Tensor:
    if mask is None:
        return torch.ones(like.shape, dtype=torch.bool, device=like.device)
    m = torch.as_tensor(mask)
    m = m if m.dtype == torch.bool else m != 0
    if m.shape != like.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} does not match tensor shape {tuple(like.shape)}")
    return m


def _check_2d(name: str, x: Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (B, A), got shape {tuple(x.shape)}")


# ----------------------------------------------------------------------------------------------
# §1 layouts
# ----------------------------------------------------------------------------------------------


@dataclass
class PaddedLayout:
    """A padded micro-batch (§1.1, §1.5).

    * ``sequences`` (B, P+A) long: left-padded prompt + EOS-repaired output + right padding;
    * ``attention_mask`` (B, P+A) long 0/1;
    * ``action_mask`` (B, A) bool: action t is the token at ``P + t``;
    * ``prompt_width`` = P (longest prompt); ``num_actions`` = A (longest output, ≥ 1).
    """

    sequences: Tensor
    attention_mask: Tensor
    action_mask: Tensor
    prompt_width: int
    num_actions: int

    @property
    def response_length(self) -> Tensor:
        """``action_mask.sum(-1)`` as float32 (§1.1): valid actions including the EOS."""
        return self.action_mask.sum(-1).to(torch.float32)

    @property
    def total_length(self) -> Tensor:
        """``attention_mask.sum(-1)`` as float32 (§1.1)."""
        return self.attention_mask.sum(-1).to(torch.float32)


def pad_rows(
    rows: list[Tensor],
    side: str = "right",
    value=0,
    width: int | None = None,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Stack ragged 1-D rows into a ``(B, W)`` tensor padded with ``value``.

    ``side="right"`` puts each row at the start (responses, §1.1); ``side="left"`` right-aligns it
    (prompts). ``W = width`` or the longest row (0 for no rows); a row longer than ``width`` is a
    ValueError. The dtype is ``dtype``, else the first row's dtype (float32 for no rows).
    """
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}")
    rs = [_row(r) for r in rows]
    longest = max((r.numel() for r in rs), default=0)
    w = longest if width is None else int(width)
    if longest > w:
        raise ValueError(f"a row of length {longest} does not fit in width {w}")
    if dtype is None:
        dtype = rs[0].dtype if rs else torch.float32
    out = torch.full((len(rs), w), value, dtype=dtype)
    for b, r in enumerate(rs):
        n = r.numel()
        if n == 0:
            continue
        if side == "right":
            out[b, :n] = r.to(dtype)
        else:
            out[b, w - n :] = r.to(dtype)
    return out


def unpad_rows(x: Tensor, lengths) -> list[Tensor]:
    """Inverse of right-padding: ``[x[b, :lengths[b]] for b]`` (copies, so callers may mutate)."""
    _check_2d("x", x)
    lens = [int(v) for v in torch.as_tensor(lengths).reshape(-1).tolist()]
    if len(lens) != x.shape[0]:
        raise ValueError(f"{len(lens)} lengths for {x.shape[0]} rows")
    for n in lens:
        if n < 0 or n > x.shape[1]:
            raise ValueError(f"length {n} outside [0, {x.shape[1]}]")
    return [x[b, :n].clone() for b, n in enumerate(lens)]


def action_lengths(action_mask: Tensor) -> Tensor:
    """Per row, the index of the last True in ``action_mask`` plus 1 (0 when none): the a_b of
    the wire format (ARCHITECTURE.md, ``action_ids``). Returns a LongTensor (B,)."""
    m = _bool_mask(action_mask, torch.as_tensor(action_mask))
    _check_2d("action_mask", m)
    b, a = m.shape
    if a == 0:
        return torch.zeros(b, dtype=torch.long)
    idx = torch.arange(1, a + 1, dtype=torch.long).expand(b, a)
    return torch.where(m, idx, torch.zeros_like(idx)).max(dim=1).values


def _process_sequences(seq: Tensor, prompt_width: int, eos_id: int, pad_id: int):
    """§1.2: EOS repair, attention_mask and action_mask of a (B, P+A) padded batch."""
    bsz, length = seq.shape
    num_actions = length - prompt_width
    valid = (seq != eos_id) & (seq != pad_id)
    pos = torch.arange(length, dtype=torch.long).expand(bsz, length)
    has_valid = valid.any(dim=1)
    last = torch.where(valid, pos, torch.full_like(pos, -1)).max(dim=1).values
    # eos_b = last_b + 1 if last_b < L-1, else L-1 (also when the row has no valid token).
    eos_pos = torch.where(has_valid & (last < length - 1), last + 1, torch.full_like(last, length - 1))
    seq = seq.clone()
    seq[torch.arange(bsz), eos_pos] = eos_id
    first = torch.where(valid, pos, torch.full_like(pos, length)).min(dim=1).values
    first = torch.where(has_valid, first, torch.zeros_like(first))
    attention_mask = ((pos >= first[:, None]) & (pos <= eos_pos[:, None])).to(torch.long)
    # action t has its state token at P-1+t (read after the repair); [:, 0] forced True.
    action_mask = torch.zeros((bsz, num_actions), dtype=torch.bool)
    if num_actions > 0:
        state = seq[:, prompt_width : length - 1]
        action_mask[:, 1:] = (state != eos_id) & (state != pad_id)
        action_mask[:, 0] = True
    return seq, attention_mask, action_mask


def padded_layout(
    prompt_rows: list[Tensor], response_rows: list[Tensor], eos_id: int, pad_id: int
) -> PaddedLayout:
    """Build a padded micro-batch exactly as §1.1 step 3 + §1.2 (``process_sequences``).

    ``sequences[b] = [pad]*(P-p_b) + prompt_b + output_b + [pad]*(A-o_b)`` with P = longest prompt
    and A = max(1, longest output); then, with ``valid = token ∉ {eos_id, pad_id}``:

    * EOS repair: ``eos_b = last_b + 1`` if the last valid position ``last_b < L-1``, else ``L-1``
      (also for a row without a valid token); ``seq[b, eos_b] = eos_id``. A truncated row's last
      generated token is overwritten by EOS (§14.12);
    * ``attention_mask[b, j] = first_b <= j <= eos_b`` (first_b = first valid position, 0 if none);
    * ``action_mask[b, t] = seq[b, P-1+t] ∉ {eos, pad}`` after the repair, ``[:, 0] = True``.
    """
    if len(prompt_rows) != len(response_rows):
        raise ValueError(f"{len(prompt_rows)} prompts but {len(response_rows)} responses")
    prompts = [_row(r).to(torch.long) for r in prompt_rows]
    responses = [_row(r).to(torch.long) for r in response_rows]
    p_width = max((r.numel() for r in prompts), default=0)
    a_width = max(1, max((r.numel() for r in responses), default=0))
    left = pad_rows(prompts, "left", pad_id, p_width, dtype=torch.long)
    right = pad_rows(responses, "right", pad_id, a_width, dtype=torch.long)
    seq = torch.cat([left, right], dim=1)
    seq, attention_mask, action_mask = _process_sequences(seq, p_width, int(eos_id), int(pad_id))
    return PaddedLayout(seq, attention_mask, action_mask, p_width, a_width)


def rebuild_padded(
    prompt_rows: list[Tensor],
    action_rows: list[Tensor],
    action_mask_rows: list[Tensor],
    pad_id: int,
    eos_id: int | None = None,
) -> PaddedLayout:
    """Rebuild a padded micro-batch from the wire's ragged fields (no EOS repair is redone).

    Inputs are the prompt tokens, the ALREADY-REPAIRED action tokens (response up to and
    including the EOS, a_b tokens) and the a_b-long action masks. With P = longest prompt and
    A = max(1, max a_b):

    * ``sequences`` = left-padded prompt + actions + right padding (``pad_id``);
    * ``attention_mask`` = 1 from ``first_b`` through the last action token ``P + a_b - 1``, where
      ``first_b`` is the first token of the row (prompt, then actions) that is neither pad nor
      ``eos_id``: inside the prompt in the usual case; if the prompt has no valid token it is the
      first valid action (exactly what §1.2 computes); a row with no valid token at all is
      attended from position P;
    * ``action_mask`` = the given masks right-padded with False.

    ``eos_id=None`` treats only ``pad_id`` as invalid when searching ``first_b`` (enough unless a
    prompt starts with the EOS token).

    For engine-shaped outputs this reproduces :func:`padded_layout` on columns ``[0, P + max a_b)``
    and the original's remaining columns are pad / 0 / False. It cannot when the original row
    loses information in the cut: a row without any valid token, a row whose repaired EOS is not
    its last valid action (e.g. an output that fills the width and ends ``…, eos, x``, or a prompt
    ending in pad/eos followed by an output with no valid token), or trailing EOS tokens after the
    stop token.
    """
    n = len(prompt_rows)
    if len(action_rows) != n or len(action_mask_rows) != n:
        raise ValueError(
            f"row counts differ: {n} prompts, {len(action_rows)} action rows, "
            f"{len(action_mask_rows)} action masks"
        )
    prompts = [_row(r).to(torch.long) for r in prompt_rows]
    actions = [_row(r).to(torch.long) for r in action_rows]
    masks = [_row(r) for r in action_mask_rows]
    masks = [m if m.dtype == torch.bool else m != 0 for m in masks]
    for b, (a, m) in enumerate(zip(actions, masks, strict=True)):
        if a.numel() != m.numel():
            raise ValueError(f"row {b}: {a.numel()} action tokens but an action mask of {m.numel()}")
    p_width = max((r.numel() for r in prompts), default=0)
    lens = torch.tensor([a.numel() for a in actions], dtype=torch.long)
    a_width = max(1, int(lens.max()) if n else 0)
    left = pad_rows(prompts, "left", pad_id, p_width, dtype=torch.long)
    right = pad_rows(actions, "right", pad_id, a_width, dtype=torch.long)
    seq = torch.cat([left, right], dim=1)
    action_mask = pad_rows(masks, "right", False, a_width, dtype=torch.bool)
    length = p_width + a_width
    pos = torch.arange(length, dtype=torch.long).expand(n, length)
    end = p_width + lens - 1  # last action token (P-1 when a row has no action)
    valid = seq != pad_id
    if eos_id is not None:
        valid &= seq != eos_id
    valid &= pos <= end[:, None]
    first = torch.where(valid, pos, torch.full_like(pos, length)).min(dim=1).values
    first = torch.where(valid.any(dim=1), first, torch.full_like(first, p_width))
    attention_mask = ((pos >= first[:, None]) & (pos <= end[:, None])).to(torch.long)
    return PaddedLayout(seq, attention_mask, action_mask, p_width, a_width)


def position_ids_from_attention(attention_mask: Tensor) -> Tensor:
    """§1.3: ``cumsum(attention_mask) - 1`` along the last axis, with masked positions set to 1."""
    am = torch.as_tensor(attention_mask).to(torch.long)
    pos = am.cumsum(dim=-1) - 1
    return pos.masked_fill(am == 0, 1)


def packed_layout(
    prompt_rows: list[Tensor], action_rows: list[Tensor]
) -> tuple[Tensor, Tensor, Tensor, list[int], list[int]]:
    """§1.4 packed layout (intended; no EOS repair).

    Returns ``(sequences (1,T) long, segment_ids (1,T) long 1-based, position_ids (1,T) long
    restarting at 0 in each segment, seq_lens list[int] = [p_i + o_i], num_actions list[int] =
    [max(1, o_i)])``. A sample with no token at all is a ValueError.
    """
    if len(prompt_rows) != len(action_rows):
        raise ValueError(f"{len(prompt_rows)} prompts but {len(action_rows)} action rows")
    seqs, segs, poss, seq_lens, num_actions = [], [], [], [], []
    for i, (p, a) in enumerate(zip(prompt_rows, action_rows, strict=True)):
        s = torch.cat([_row(p).to(torch.long), _row(a).to(torch.long)])
        if s.numel() == 0:
            raise ValueError(f"packed sample {i} has no token")
        seqs.append(s)
        segs.append(torch.full((s.numel(),), i + 1, dtype=torch.long))
        poss.append(torch.arange(s.numel(), dtype=torch.long))
        seq_lens.append(int(s.numel()))
        num_actions.append(max(1, int(_row(a).numel())))
    if not seqs:
        empty = torch.zeros((1, 0), dtype=torch.long)
        return empty, empty.clone(), empty.clone(), [], []
    return (
        torch.cat(seqs)[None],
        torch.cat(segs)[None],
        torch.cat(poss)[None],
        seq_lens,
        num_actions,
    )


def unpack_actions(flat: Tensor, num_actions: list[int]) -> list[Tensor]:
    """Split a packed action-level row ``(1, N)`` or ``(N,)`` into per-sample rows (§1.4)."""
    x = torch.as_tensor(flat)
    if x.dim() == 2 and x.shape[0] == 1:
        x = x[0]
    if x.dim() != 1:
        raise ValueError(f"flat must be (1, N) or (N,), got shape {tuple(x.shape)}")
    sizes = [int(k) for k in num_actions]
    if any(k < 0 for k in sizes) or sum(sizes) != x.numel():
        raise ValueError(f"num_actions sum to {sum(sizes)} but the row has {x.numel()} entries")
    return [part.clone() for part in torch.split(x, sizes)]


# ----------------------------------------------------------------------------------------------
# §3 KL, masked reductions
# ----------------------------------------------------------------------------------------------


def compute_approx_kl(
    log_probs: Tensor, base_log_probs: Tensor, action_mask: Tensor | None, estimator: str
) -> Tensor:
    """Token-level approximate KL(π‖π_ref) (§3), float32 (B, A).

    With ``d = log π − log π_ref`` at valid positions: k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d
    (evaluated as ``expm1(−d) + d`` in float64, so it is never negative). No clamping.
    Masked positions are exactly 0 whatever the inputs hold there. Unknown estimator: ValueError.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl estimator {estimator!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    lp = torch.as_tensor(log_probs).to(torch.float32)
    blp = torch.as_tensor(base_log_probs).to(torch.float32)
    if lp.shape != blp.shape:
        raise ValueError(f"log_probs {tuple(lp.shape)} and base_log_probs {tuple(blp.shape)} differ")
    m = _bool_mask(action_mask, lp)
    d = torch.where(m, lp.double() - blp.double(), torch.zeros((), dtype=torch.float64))
    if estimator == "k1":
        k = d
    elif estimator == "k2":
        k = d * d / 2
    else:
        k = torch.expm1(-d) + d
    return torch.where(m, k, torch.zeros((), dtype=torch.float64)).to(torch.float32)


def masked_sum(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Σ x over valid positions (masked entries are ignored, even if NaN)."""
    m = _bool_mask(mask, x)
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype))
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask (§3 ``info.kl``).

    Decision: where Σ mask == 0 the result is 0 (the seed's 0/0 gives NaN, §4.2, which our wire
    format rejects).
    """
    m = _bool_mask(mask, x)
    x = x if x.is_floating_point() else x.to(torch.float32)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    count = count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros((), dtype=total.dtype))


# ----------------------------------------------------------------------------------------------
# §4 reward shaping
# ----------------------------------------------------------------------------------------------


def overlong_penalty(response_length, max_new_tokens: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong penalty (§4.1), float32 (B,).

    ``penalty_b = min(0, −(L_b − L_exp) / buffer_len · factor)`` with ``L_exp = max_new_tokens −
    buffer_len`` and L_b = valid actions including the EOS (original mask).
    """
    if buffer_len <= 0:
        raise ValueError(f"overlong_buffer_len must be > 0, got {buffer_len}")
    length = torch.as_tensor(response_length).to(torch.float64)
    expected = float(max_new_tokens - buffer_len)
    pen = -(length - expected) / float(buffer_len) * float(factor)
    return pen.clamp(max=0.0).to(torch.float32)


def group_is_constant(r: Tensor) -> Tensor:
    """Per prompt group (row of ``r`` (G, n)): True iff every reward equals the first exactly.

    Used for the intended dynamic sampling (§4.2): test each prompt group, any constant value
    (not only all-0/all-1). A NaN makes a group non-constant.
    """
    x = torch.as_tensor(r)
    _check_2d("r", x)
    if x.shape[1] == 0:
        return torch.ones(x.shape[0], dtype=torch.bool)
    return (x == x[:, :1]).all(dim=1)


def shape_group_rewards(r: Tensor, estimator: str) -> Tensor:
    """Group shaping of scalar rewards (§4.3); ``r`` is (G, n), row g = prompt group g.

    * gae, reinforce, cpgd: identity;
    * rloo: ``r_i − (Σ_g r − r_i)/(n−1)`` (leave-one-out; a group sums to 0);
    * reinforce_baseline, dr_grpo: ``r_i − mean_g(r)``;
    * group_norm / grpo: ``(r_i − mean_g)/(std_g + 1e-9)`` with the unbiased std.

    A constant group gives exactly 0 for every non-identity estimator (forced, so that float
    rounding of the group mean cannot leave ~1e-8 residues). Statistics are computed in float64
    and the result has r's float dtype (float32 for integer input). n == 1 is a ValueError for
    rloo / group_norm / grpo (the seed divides by zero); for reinforce_baseline and dr_grpo it
    gives 0.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    x = torch.as_tensor(r)
    _check_2d("r (G, n)", x)
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    if estimator in ("gae", "reinforce", "cpgd"):
        return x.to(out_dtype).clone()
    n = x.shape[1]
    if estimator in _GROUP_NEEDS_N_GT_1 and n <= 1:
        raise ValueError(f"{estimator}: n_samples_per_prompt must be > 1 (got n={n})")
    xd = x.to(torch.float64)
    mean = xd.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        out = xd - (xd.sum(dim=1, keepdim=True) - xd) / (n - 1)
    elif estimator in ("reinforce_baseline", "dr_grpo"):
        out = xd - mean
    else:  # group_norm, grpo
        std = xd.std(dim=1, unbiased=True, keepdim=True)
        out = (xd - mean) / (std + GROUP_NORM_EPS)
    const = group_is_constant(x)
    out = torch.where(const[:, None], torch.zeros_like(out), out)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# §5 / §9 running moments, reward normalisation, KL-penalised rewards
# ----------------------------------------------------------------------------------------------


def moments_merge(count: float, mean: float, m2: float, batch: Tensor) -> tuple[float, float, float]:
    """Chan's parallel merge of (count, mean, M2) with a batch (§9), in float64.

    M2 is the sum of squared deviations. With k = numel(batch), m = its mean and
    M2_b = k·var_pop(batch)::

        δ = m − mean;  N = count + k
        M2 ← M2 + M2_b + δ²·count·k/N;  mean ← mean + δ·k/N;  count ← N

    Decision: the state starts at an exact zero (count = 0, mean = 0, M2 = 0), so ``mean`` and
    :func:`moments_std` are the exact pooled statistics of everything seen. The seed's prior
    (count = 1e-24, mean = 0, var = 1) has weight 1e-24, so it agrees with this to ~1e-12 (and
    exactly in float64 except for an all-equal history, see :func:`moments_std`). An empty batch
    leaves the state unchanged. Returns python floats.
    """
    x = torch.as_tensor(batch).detach().reshape(-1).to(torch.float64)
    k = x.numel()
    count, mean, m2 = float(count), float(mean), float(m2)
    if k == 0:
        return count, mean, m2
    bm = float(x.mean())
    bm2 = float(((x - bm) ** 2).sum())
    total = count + k
    delta = bm - mean
    new_m2 = m2 + bm2 + delta * delta * count * k / total
    new_mean = mean + delta * k / total
    return total, new_mean, new_m2


def moments_std(count: float, m2: float) -> float:
    """Unbiased (Bessel) std of all samples merged so far: ``sqrt(M2 / (count − 1))`` (§9).

    Edge cases (§9): count == 0 (nothing seen) → NaN; 0 < count <= 1 (a first batch of one
    element) → inf, so the normalised reward becomes 0 as in the seed. An all-equal history gives
    0 (the seed's 1e-24 prior gives ~1e-12 instead); see :func:`normalize_rewards`.
    """
    count, m2 = float(count), float(m2)
    if count <= 0:
        return math.nan
    if count <= 1:
        return math.inf
    return math.sqrt(max(m2, 0.0) / (count - 1.0))


def normalize_rewards(r: Tensor, mean: float, std: float, minus_mean: bool) -> Tensor:
    """Running reward normalisation (§5.1): ``(r − mean)/std`` if ``minus_mean`` else ``r/std``.

    float32 out. std = inf gives 0. A zero numerator gives 0 even when std == 0 (the seed divides
    by its ~1e-12 prior std and gets 0 there too); a nonzero numerator over std == 0 is ±inf —
    callers must check finiteness (the wire rejects it).
    """
    x = torch.as_tensor(r).to(torch.float64)
    num = x - float(mean) if minus_mean else x
    out = num / float(std)
    out = torch.where(num == 0, torch.zeros_like(out), out)
    return out.to(torch.float32)


def kl_penalized_rewards(R: Tensor, kl: Tensor | None, action_mask: Tensor, beta: float) -> Tensor:
    """Per-token reward ``final[b,t] = −β·kl[b,t] + R_b·1[t = t*_b]`` (§5.3), float32 (B, A).

    β <= 0 is treated as 0. t*_b = last True of ``action_mask[b]``; a row with no True uses A−1.
    The −β·kl term is masked, so ``final`` is 0 at masked positions (except the t* fallback);
    ``final.sum(-1) = R − β·Σ kl``. ``kl=None`` means no KL (all zeros).
    """
    m = torch.as_tensor(action_mask)
    m = m if m.dtype == torch.bool else m != 0
    _check_2d("action_mask", m)
    bsz, a = m.shape
    rr = torch.as_tensor(R).to(torch.float32).reshape(-1)
    if rr.numel() != bsz:
        raise ValueError(f"{rr.numel()} rewards for {bsz} rows")
    beta = float(beta)
    if beta > 0 and kl is not None:
        k = torch.as_tensor(kl).to(torch.float32)
        if k.shape != m.shape:
            raise ValueError(f"kl shape {tuple(k.shape)} does not match action_mask {tuple(m.shape)}")
        final = torch.where(m, -beta * k, torch.zeros((), dtype=torch.float32))
    else:
        final = torch.zeros((bsz, a), dtype=torch.float32)
    if a == 0:
        return final
    last = action_lengths(m) - 1
    last = torch.where(last < 0, torch.full_like(last, a - 1), last)
    final[torch.arange(bsz), last] += rr
    return final


# ----------------------------------------------------------------------------------------------
# §8 clip fractions
# ----------------------------------------------------------------------------------------------


def clip_fraction(x: Tensor, lo: float, hi: float) -> Tensor:
    """``(#(x > hi) + #(x < lo)) / numel(x)`` broadcast to float32 (x.shape[0],) (§8).

    Strict inequalities; numel counts every entry given (padding included); numel 0 → zeros.
    """
    t = torch.as_tensor(x)
    if t.dim() == 0:
        t = t.reshape(1)
    rows = t.shape[0]
    if t.numel() == 0:
        return torch.zeros(rows, dtype=torch.float32)
    n = int(((t > hi) | (t < lo)).sum())
    return torch.full((rows,), n / t.numel(), dtype=torch.float32)


def clip_fraction_masked(x: Tensor, mask: Tensor | None, lo: float, hi: float) -> Tensor:
    """Like :func:`clip_fraction` but over valid positions only: #clipped valid / #valid.

    This is what :func:`compute_advantages` reports as ``advantage_clip_frac``: our padding is 0
    (never written), so counting it would only make the fraction depend on the micro-batch
    width A (§14.8). For per-row scalars (rewards) use :func:`clip_fraction`. No valid → zeros.
    """
    t = torch.as_tensor(x)
    if t.dim() == 0:
        t = t.reshape(1)
    m = _bool_mask(mask, t)
    rows = t.shape[0]
    nvalid = int(m.sum())
    if nvalid == 0:
        return torch.zeros(rows, dtype=torch.float32)
    n = int((((t > hi) | (t < lo)) & m).sum())
    return torch.full((rows,), n / nvalid, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# §6 estimators
# ----------------------------------------------------------------------------------------------


def cumulative_returns(rewards: Tensor, action_mask: Tensor | None, gamma: float) -> Tensor:
    """Masked reward-to-go ``G_t = Σ_{k>=t} γ^{k−t} F_k M_k`` (§6), float32 (B, A).

    The recursion runs over all A positions (as the seed); the result is 0 at masked positions.
    """
    f = torch.as_tensor(rewards).to(torch.float32)
    _check_2d("rewards", f)
    m = _bool_mask(action_mask, f)
    f = torch.where(m, f, torch.zeros((), dtype=torch.float32))
    out = torch.zeros_like(f)
    run = torch.zeros(f.shape[0], dtype=torch.float32)
    for t in range(f.shape[1] - 1, -1, -1):
        run = f[:, t] + gamma * run
        out[:, t] = run
    return torch.where(m, out, torch.zeros((), dtype=torch.float32))


def gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor | None, gamma: float, lambd: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (§6.1 steps 1–3), float32 (advantages, returns).

    V ← V·M, F ← F·M, V_A := 0; δ_t = F_t + γV_{t+1} − V_t; Â_t = δ_t + γλÂ_{t+1}, Â_A = 0;
    returns = Â + V (from the raw Â). Both are 0 at masked positions.
    """
    f = torch.as_tensor(rewards).to(torch.float32)
    _check_2d("rewards", f)
    v = torch.as_tensor(values).to(torch.float32)
    if v.shape != f.shape:
        raise ValueError(f"values shape {tuple(v.shape)} does not match rewards {tuple(f.shape)}")
    m = _bool_mask(action_mask, f)
    zero = torch.zeros((), dtype=torch.float32)
    f = torch.where(m, f, zero)
    v = torch.where(m, v, zero)
    bsz, a = f.shape
    adv = torch.zeros_like(f)
    last = torch.zeros(bsz, dtype=torch.float32)
    for t in range(a - 1, -1, -1):
        next_v = v[:, t + 1] if t + 1 < a else torch.zeros(bsz, dtype=torch.float32)
        delta = f[:, t] + gamma * next_v - v[:, t]
        last = delta + gamma * lambd * last
        adv[:, t] = last
    returns = adv + v
    return torch.where(m, adv, zero), torch.where(m, returns, zero)


def whiten(x: Tensor, mask: Tensor | None, eps: float) -> Tensor:
    """Per-experience whitening (§7.1): ``(x − μ)/(σ + eps)`` with μ, σ = mean and unbiased std
    over the valid positions (statistics in float64; result in x's dtype).

    Intended behaviour, unlike the seed: only valid positions change; masked positions keep x's
    values (0 for our tensors, so padding of advantages stays 0). Fewer than two valid elements
    (the seed gives NaN) → x is returned unchanged (a copy) and the calling stage reports it. A
    constant set of valid values gives exactly 0 there.
    """
    t = torch.as_tensor(x)
    m = _bool_mask(mask, t)
    vals = t[m].to(torch.float64)
    if vals.numel() < 2:
        return t.clone()
    mu = vals.mean()
    sd = vals.std(unbiased=True)
    if sd == 0:
        w = torch.zeros(t.shape, dtype=torch.float64)
    else:
        w = (t.to(torch.float64) - mu) / (sd + eps)
    return torch.where(m, w.to(t.dtype), t)


def cpgd_scores(rewards_raw: Tensor, mode: str = "STD_weight") -> Tensor:
    """Intended CPGD scores (§6.4), float32 (B,).

    s_b = raw reward (a (B, A) input is summed over the last axis first); μ and σ = mean and
    **biased** std over the micro-batch. ``STD_weight``: (s − μ)/(σ + 1e-6);
    ``clip_filter_like_weight``: (s − μ)·min(B / max(1, #(σ > 0)), 3) — σ is one scalar, so the
    factor is min(B, 3), as written in the seed; any other mode: s − μ.
    """
    s = torch.as_tensor(rewards_raw).to(torch.float64)
    if s.dim() == 2:
        s = s.sum(dim=-1)
    s = s.reshape(-1)
    if s.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    mu = s.mean()
    sd = s.std(unbiased=False)
    if mode == "STD_weight":
        out = (s - mu) / (sd + CPGD_EPS)
    elif mode == "clip_filter_like_weight":
        nonzero = max(1, int(sd > 0))
        out = (s - mu) * min(s.numel() / nonzero, 3.0)
    else:
        out = s - mu
    return out.to(torch.float32)


def compute_advantages(
    estimator: str,
    token_rewards: Tensor,
    action_mask: Tensor,
    *,
    values: Tensor | None = None,
    raw_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    advantages_norm: bool = False,
    advantage_clip: float = 0.0,
    cpgd_mode: str = "STD_weight",
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Advantages and returns of one experience (§6.1–6.5, as intended).

    ``token_rewards`` (B, A) is the KL-penalised reward of :func:`kl_penalized_rewards` built
    from the group-shaped R. Per estimator:

    * ``gae``: ``values`` required; :func:`gae`; optional whitening (eps 1e-9); optional clamp to
      ±c with ``advantage_clip_frac`` measured BEFORE the clamp (the seed measures after, §14.3);
      the key is always present (zeros when c <= 0);
    * ``reinforce``, ``rloo``: returns = advantages = G^γ; ``reinforce_baseline``: the same with
      γ forced to 1; optional whitening (eps 1e-8) of the advantages only; optional clamp with
      the fraction measured before it;
    * ``group_norm``, ``grpo``, ``dr_grpo``: G^γ, never whitened; optional clamp;
    * ``cpgd``: ``raw_rewards`` (B,) required; advantages = returns = :func:`cpgd_scores`·M;
      γ, whitening and clipping do not apply and no clip fraction is reported.

    γ is the configured one for every experience (no pop, §14.2). Returns are never whitened
    or clipped. Masked positions of both outputs are 0. Clip fractions use
    :func:`clip_fraction_masked` (valid positions only). ``info`` maps names to float32 (B,).
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {estimator!r}; allowed: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    f = torch.as_tensor(token_rewards).to(torch.float32)
    _check_2d("token_rewards", f)
    m = _bool_mask(action_mask, f)
    bsz = f.shape[0]
    zero = torch.zeros((), dtype=torch.float32)
    info: dict[str, Tensor] = {}
    clip = float(advantage_clip)

    if estimator == "cpgd":
        if raw_rewards is None:
            raise ValueError("cpgd needs raw_rewards (the raw reward r_b of every row)")
        s = cpgd_scores(raw_rewards, cpgd_mode)
        if s.numel() != bsz:
            raise ValueError(f"{s.numel()} raw rewards for {bsz} rows")
        adv = torch.where(m, s[:, None].expand_as(f), zero)
        return adv, adv.clone(), info

    if estimator == "gae":
        if values is None:
            raise ValueError("gae needs values (run the critic stage)")
        adv, returns = gae(f, values, m, gamma, lambd)
        eps = GAE_WHITEN_EPS
    else:
        g = 1.0 if estimator == "reinforce_baseline" else gamma
        returns = cumulative_returns(f, m, g)
        adv = returns.clone()
        eps = REINFORCE_WHITEN_EPS

    if advantages_norm and estimator in ("gae", "reinforce", "rloo", "reinforce_baseline"):
        adv = whiten(adv, m, eps)

    if clip > 0:
        info["advantage_clip_frac"] = clip_fraction_masked(adv, m, -clip, clip)
        adv = torch.where(m, adv.clamp(-clip, clip), zero)
    elif estimator == "gae":
        info["advantage_clip_frac"] = torch.zeros(bsz, dtype=torch.float32)
    return adv, returns, info


# ----------------------------------------------------------------------------------------------
# §7.2 streaming (cross-batch) normalisation
# ----------------------------------------------------------------------------------------------


def masked_moments(x: Tensor, mask: Tensor | None) -> tuple[float, float, float]:
    """(count, Σx, Σx²) over valid positions, as float64 python floats.

    Additive across micro-batches (and replicas), so a streaming stage can accumulate them in
    Redis and derive the §7.2 statistics with :func:`moments_to_mean_var`.
    """
    t = torch.as_tensor(x)
    m = _bool_mask(mask, t)
    vals = t[m].to(torch.float64)
    return float(vals.numel()), float(vals.sum()), float((vals * vals).sum())


def moments_to_mean_var(count: float, total: float, sumsq: float) -> tuple[float, float]:
    """μ = Σx/N and the **biased** var = Σx²/N − μ² (clamped at 0) from :func:`masked_moments`
    sums (§7.2). N <= 0 gives (0.0, 0.0)."""
    count = float(count)
    if count <= 0:
        return 0.0, 0.0
    mean = float(total) / count
    return mean, max(float(sumsq) / count - mean * mean, 0.0)


def apply_normalization(
    x: Tensor, mask: Tensor | None, mean: float, var: float, floor: float = VAR_FLOOR
) -> Tensor:
    """§7.2/§7.3: ``(x − μ)·rstd`` with ``rstd = 1/sqrt(max(var, floor))`` at valid positions only;
    masked positions keep x's values (0 for our tensors). Result in x's dtype."""
    t = torch.as_tensor(x)
    m = _bool_mask(mask, t)
    rstd = 1.0 / math.sqrt(max(float(var), float(floor)))
    out = (t.to(torch.float64) - float(mean)) * rstd
    return torch.where(m, out.to(t.dtype), t)


# ----------------------------------------------------------------------------------------------
# §10 KL controller, §11 high-entropy mask
# ----------------------------------------------------------------------------------------------


def adaptive_kl_update(
    value: float, current_kl: float, target: float | None, n_steps: int, horizon: int = 10000
) -> float:
    """One KL-coefficient update (§10).

    Adaptive (``target`` set): ``e = clip(current/target − 1, −0.2, 0.2)``;
    ``value · (1 + e · n_steps / horizon)``, with n_steps = rollout_batch_size · n per update.
    Fixed controller (``target=None``, the default config): the value is returned unchanged
    (β = init_kl_coef for the whole run).
    """
    if target is None:
        return float(value)
    if target <= 0:
        raise ValueError(f"kl_target must be > 0, got {target}")
    if horizon <= 0:
        raise ValueError(f"kl_horizon must be > 0, got {horizon}")
    err = min(max(float(current_kl) / float(target) - 1.0, -0.2), 0.2)
    return float(value) * (1.0 + err * float(n_steps) / float(horizon))


def high_entropy_mask(entropy: Tensor, action_mask: Tensor, ratio: float) -> Tensor:
    """High-entropy token mask (§11), bool (B, A).

    ρ <= 0 or ρ >= 1 → ``action_mask`` (as bool). Otherwise per row, k = max(1, ⌊n_valid·ρ⌋)
    and the k valid tokens of highest entropy are True; rows with no valid token stay False.
    Decision: only valid tokens can be selected (the seed ranks ``entropy·mask``, so a padding
    position could win a tie against zero-entropy tokens); ties go to the earlier position.
    """
    m = torch.as_tensor(action_mask)
    m = m if m.dtype == torch.bool else m != 0
    _check_2d("action_mask", m)
    if ratio <= 0 or ratio >= 1:
        return m.clone()
    e = torch.as_tensor(entropy).to(torch.float32)
    if e.shape != m.shape:
        raise ValueError(f"entropy shape {tuple(e.shape)} does not match action_mask {tuple(m.shape)}")
    n_valid = m.sum(dim=1).tolist()
    k = torch.tensor([max(1, math.floor(n * ratio)) if n > 0 else 0 for n in n_valid], dtype=torch.long)
    scores = torch.where(m, e, torch.full((), -math.inf))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(m.shape[1], dtype=torch.long).expand_as(order).contiguous())
    return (ranks < k[:, None]) & m
