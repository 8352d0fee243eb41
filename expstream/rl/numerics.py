"""The RL math of the experience maker: KL, reward transforms, estimators, normalisation (torch only).

Every function here is a formula from ``docs/numerics.md`` (cited as
"docs/numerics.md §n" below), implemented **as intended**: the seed's bugs listed in docs/numerics.md §14 are
not reproduced (γ is never popped, CPGD is not identically zero, the GAE clip fraction is measured before the
clamp, dynamic sampling is decided per prompt group), and nothing is written into padding
positions: masked positions of advantages/returns/KL/token rewards are exactly 0 (the seed's
whitening and cross-batch normalisation write ``-μ/σ`` there, docs/numerics.md §14.8).

Conventions:

* per-sample data are torch tensors; action-level tensors are the padded ``(B, A)`` views of
  :mod:`expstream.rl.layout` (positions past a row's valid actions are 0, or False for masks);
* float outputs are float32 (the seed's bf16 leak, docs/numerics.md §14.11, is not reproduced); statistics
  (means, variances, running moments) are accumulated in float64;
* ``action_mask`` is a bool ``(B, A)`` tensor (any dtype is accepted and converted with ``!= 0``).

The running moments merge and the KL controller step, applied to run-wide state once per id,
are scalar formulas in :mod:`expstream.rl.moments` (no torch), next to the state that applies them.

No Kafka or Redis here: this module imports torch, :mod:`expstream.rl.layout` (the padded views and
their mask helpers) and :mod:`expstream.config.estimators` (the estimator table).
"""

import math

import torch
from torch import Tensor

from expstream.config import estimators
from expstream.config.estimators import KL_ESTIMATORS
from expstream.rl.layout import action_lengths, as_bool_mask, check_2d

__all__ = [
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
    "masked_sum",
    "normalize_rewards",
    "overlong_penalty",
    "shape_group_rewards",
    "whiten",
]

#: eps of the GRPO z-score (docs/numerics.md §4.3, fast path).
GROUP_NORM_EPS = 1e-9
#: eps of the per-experience whitening: GAE (docs/numerics.md §6.1 step 4) and the REINFORCE
#: family (docs/numerics.md §6.2).
GAE_WHITEN_EPS = 1e-9
REINFORCE_WHITEN_EPS = 1e-8
#: eps of the CPGD STD_weight normalisation (docs/numerics.md §6.4).
CPGD_EPS = 1e-6
#: variance floor of the cross-batch / replay normalisation (docs/numerics.md §7.2, §7.3).
VAR_FLOOR = 1e-8


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §3 KL, masked reductions
# ----------------------------------------------------------------------------------------------


def compute_approx_kl(
    log_probs: Tensor, base_log_probs: Tensor, action_mask: Tensor | None, estimator: str
) -> Tensor:
    """Token-level approximate KL(π‖π_ref) (docs/numerics.md §3), float32 (B, A).

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
    m = as_bool_mask(action_mask, lp)
    d = torch.where(m, lp.double() - blp.double(), torch.zeros((), dtype=torch.float64))
    return torch.where(m, kl_of_log_ratio(d, estimator), torch.zeros((), dtype=torch.float64)).to(torch.float32)


def kl_of_log_ratio(d: Tensor, estimator: str) -> Tensor:
    """k1 = d, k2 = d²/2, k3 = exp(−d) − 1 + d of ``d = log π − log π_ref`` (docs/numerics.md §3),
    elementwise in ``d``'s dtype (differentiable: the trainer's KL-in-loss uses it too)."""
    if estimator == "k1":
        return d
    if estimator == "k2":
        return d * d / 2
    return torch.expm1(-d) + d


def masked_sum(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Σ x over valid positions (masked entries are ignored, even if NaN)."""
    m = as_bool_mask(mask, x)
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype))
    return z.sum() if dim is None else z.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor | None, dim: int | None = None) -> Tensor:
    """Σ x·mask / Σ mask (docs/numerics.md §3 ``info.kl``).

    Decision: where Σ mask == 0 the result is 0 (the seed's 0/0 gives NaN, docs/numerics.md §4.2, which our
    wire format rejects).
    """
    m = as_bool_mask(mask, x)
    x = x if x.is_floating_point() else x.to(torch.float32)
    total = masked_sum(x, m, dim)
    count = m.sum() if dim is None else m.sum(dim=dim)
    count = count.to(total.dtype)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros((), dtype=total.dtype))


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §4 reward shaping
# ----------------------------------------------------------------------------------------------


def overlong_penalty(response_length, max_new_tokens: int, buffer_len: int, factor: float) -> Tensor:
    """DAPO soft overlong penalty (docs/numerics.md §4.1), float32 (B,).

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

    Used for the intended dynamic sampling (docs/numerics.md §4.2): test each prompt group, any constant value
    (not only all-0/all-1). A NaN makes a group non-constant.
    """
    x = torch.as_tensor(r)
    check_2d("r", x)
    if x.shape[1] == 0:
        return torch.ones(x.shape[0], dtype=torch.bool)
    return (x == x[:, :1]).all(dim=1)


def shape_group_rewards(r: Tensor, estimator: str) -> Tensor:
    """Group shaping of scalar rewards (docs/numerics.md §4.3); ``r`` is (G, n), row g = prompt group g.

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
    spec = estimators.estimator(estimator)  # ValueError naming the allowed ones
    x = torch.as_tensor(r)
    check_2d("r (G, n)", x)
    out_dtype = x.dtype if x.is_floating_point() else torch.float32
    if not spec.group:
        return x.to(out_dtype).clone()
    n = x.shape[1]
    if spec.divides_by_n_minus_1 and n <= 1:
        raise ValueError(f"{estimator}: n_samples_per_prompt must be > 1 (got n={n})")
    xd = x.to(torch.float64)
    mean = xd.mean(dim=1, keepdim=True)
    if spec.shaping == "leave_one_out":  # rloo
        out = xd - (xd.sum(dim=1, keepdim=True) - xd) / (n - 1)
    elif spec.shaping == "mean":  # reinforce_baseline, dr_grpo
        out = xd - mean
    else:  # zscore: group_norm, grpo
        std = xd.std(dim=1, unbiased=True, keepdim=True)
        out = (xd - mean) / (std + GROUP_NORM_EPS)
    const = group_is_constant(x)
    out = torch.where(const[:, None], torch.zeros_like(out), out)
    return out.to(out_dtype)


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §5 / §9 running moments, reward normalisation, KL-penalised rewards
# ----------------------------------------------------------------------------------------------


def normalize_rewards(r: Tensor, mean: float, std: float, minus_mean: bool) -> Tensor:
    """Running reward normalisation (docs/numerics.md §5.1): ``(r − mean)/std`` if
    ``minus_mean`` else ``r/std``.

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
    """Per-token reward ``final[b,t] = −β·kl[b,t] + R_b·1[t = t*_b]`` (docs/numerics.md §5.3), float32 (B, A).

    β <= 0 is treated as 0. t*_b = last True of ``action_mask[b]``; a row with no True uses A−1.
    The −β·kl term is masked, so ``final`` is 0 at masked positions (except the t* fallback);
    ``final.sum(-1) = R − β·Σ kl``. ``kl=None`` means no KL (all zeros).
    """
    m = torch.as_tensor(action_mask)
    m = m if m.dtype == torch.bool else m != 0
    check_2d("action_mask", m)
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
# docs/numerics.md §8 clip fractions
# ----------------------------------------------------------------------------------------------


def clip_fraction(x: Tensor, lo: float, hi: float) -> Tensor:
    """``(#(x > hi) + #(x < lo)) / numel(x)`` broadcast to float32 (x.shape[0],) (docs/numerics.md §8).

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
    width A (docs/numerics.md §14.8). For per-row scalars (rewards) use
    :func:`clip_fraction`. No valid → zeros.
    """
    t = torch.as_tensor(x)
    if t.dim() == 0:
        t = t.reshape(1)
    m = as_bool_mask(mask, t)
    rows = t.shape[0]
    nvalid = int(m.sum())
    if nvalid == 0:
        return torch.zeros(rows, dtype=torch.float32)
    n = int((((t > hi) | (t < lo)) & m).sum())
    return torch.full((rows,), n / nvalid, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §6 estimators
# ----------------------------------------------------------------------------------------------


def cumulative_returns(rewards: Tensor, action_mask: Tensor | None, gamma: float, skip_masked: bool = False) -> Tensor:
    """Masked reward-to-go ``G_t = Σ_{k>=t} γ^{k−t} F_k M_k`` (docs/numerics.md §6), float32 (B, A).

    The recursion runs over all A positions (as the seed); the result is 0 at masked positions.
    ``skip_masked`` (a multi-turn episode, docs/numerics.md §15): a masked position is no step at all
    (the return passes it unchanged, no factor γ), so an observation between two turns costs no discount.
    """
    f = torch.as_tensor(rewards).to(torch.float32)
    check_2d("rewards", f)
    m = as_bool_mask(action_mask, f)
    f = torch.where(m, f, torch.zeros((), dtype=torch.float32))
    out = torch.zeros_like(f)
    run = torch.zeros(f.shape[0], dtype=torch.float32)
    for t in range(f.shape[1] - 1, -1, -1):
        step = f[:, t] + gamma * run
        run = torch.where(m[:, t], step, run) if skip_masked else step
        out[:, t] = run
    return torch.where(m, out, torch.zeros((), dtype=torch.float32))


def gae(
    rewards: Tensor, values: Tensor, action_mask: Tensor | None, gamma: float, lambd: float,
    skip_masked: bool = False,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (docs/numerics.md §6.1 steps 1–3), float32 (advantages, returns).

    V ← V·M, F ← F·M, V_A := 0; δ_t = F_t + γV_{t+1} − V_t; Â_t = δ_t + γλÂ_{t+1}, Â_A = 0;
    returns = Â + V (from the raw Â). Both are 0 at masked positions.
    ``skip_masked`` (a multi-turn episode, docs/numerics.md §15): the recursion runs over the unmasked
    positions only, V_{t+1} being the next *unmasked* position's value: the last model token of a turn
    bootstraps from the first of the next turn, across the observation between them.
    """
    if skip_masked:
        return _gae_over_actions(rewards, values, action_mask, gamma, lambd)
    f = torch.as_tensor(rewards).to(torch.float32)
    check_2d("rewards", f)
    v = torch.as_tensor(values).to(torch.float32)
    if v.shape != f.shape:
        raise ValueError(f"values shape {tuple(v.shape)} does not match rewards {tuple(f.shape)}")
    m = as_bool_mask(action_mask, f)
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


def _gae_over_actions(rewards: Tensor, values: Tensor, action_mask: Tensor | None, gamma: float,
                      lambd: float) -> tuple[Tensor, Tensor]:
    """:func:`gae` with masked positions skipped (no step: Â and the next value pass them unchanged)."""
    f = torch.as_tensor(rewards).to(torch.float32)
    v = torch.as_tensor(values).to(torch.float32)
    m = as_bool_mask(action_mask, f)
    zero = torch.zeros((), dtype=torch.float32)
    f, v = torch.where(m, f, zero), torch.where(m, v, zero)
    adv = torch.zeros_like(f)
    last = torch.zeros(f.shape[0], dtype=torch.float32)
    next_v = torch.zeros(f.shape[0], dtype=torch.float32)
    for t in range(f.shape[1] - 1, -1, -1):
        here = m[:, t]
        delta = f[:, t] + gamma * next_v - v[:, t]
        last = torch.where(here, delta + gamma * lambd * last, last)
        next_v = torch.where(here, v[:, t], next_v)
        adv[:, t] = last
    return torch.where(m, adv, zero), torch.where(m, adv + v, zero)


def whiten(x: Tensor, mask: Tensor | None, eps: float) -> Tensor:
    """Per-experience whitening (docs/numerics.md §7.1): ``(x − μ)/(σ + eps)`` with μ, σ = mean and unbiased
    std over the valid positions (statistics in float64; result in x's dtype).

    Intended behaviour, unlike the seed: only valid positions change; masked positions keep x's
    values (0 for our tensors, so padding of advantages stays 0). Fewer than two valid elements
    (the seed gives NaN) → x is returned unchanged (a copy) and the calling stage reports it. A
    constant set of valid values gives exactly 0 there.
    """
    t = torch.as_tensor(x)
    m = as_bool_mask(mask, t)
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
    """Intended CPGD scores (docs/numerics.md §6.4), float32 (B,).

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
    skip_masked: bool = False,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Advantages and returns of one experience (docs/numerics.md §6.1–6.5, as intended).

    ``token_rewards`` (B, A) is the KL-penalised reward of :func:`kl_penalized_rewards` built
    from the group-shaped R. Per estimator:

    * ``gae``: ``values`` required; :func:`gae`; optional whitening (eps 1e-9); optional clamp to
      ±c with ``advantage_clip_frac`` measured BEFORE the clamp (the seed measures after,
      docs/numerics.md §14.3); the key is always present (zeros when c <= 0);
    * ``reinforce``, ``rloo``: returns = advantages = G^γ; ``reinforce_baseline``: the same with
      γ forced to 1; optional whitening (eps 1e-8) of the advantages only; optional clamp with
      the fraction measured before it;
    * ``group_norm``, ``grpo``, ``dr_grpo``: G^γ, never whitened; optional clamp;
    * ``cpgd``: ``raw_rewards`` (B,) required; advantages = returns = :func:`cpgd_scores`·M;
      γ, whitening and clipping do not apply and no clip fraction is reported.

    ``skip_masked``: a multi-turn episode's recursions skip the observation positions (:func:`gae`,
    :func:`cumulative_returns`; docs/numerics.md §15).

    γ is the configured one for every experience (no pop, docs/numerics.md §14.2). Returns are never whitened
    or clipped. Masked positions of both outputs are 0. Clip fractions use
    :func:`clip_fraction_masked` (valid positions only). ``info`` maps names to float32 (B,).
    """
    spec = estimators.estimator(estimator)  # ValueError naming the allowed ones
    f = torch.as_tensor(token_rewards).to(torch.float32)
    check_2d("token_rewards", f)
    m = as_bool_mask(action_mask, f)
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
        adv, returns = gae(f, values, m, gamma, lambd, skip_masked=skip_masked)
        eps = GAE_WHITEN_EPS
    else:
        g = 1.0 if estimator == "reinforce_baseline" else gamma
        returns = cumulative_returns(f, m, g, skip_masked=skip_masked)
        adv = returns.clone()
        eps = REINFORCE_WHITEN_EPS

    if advantages_norm and spec.whiten:
        adv = whiten(adv, m, eps)

    if clip > 0:
        info["advantage_clip_frac"] = clip_fraction_masked(adv, m, -clip, clip)
        adv = torch.where(m, adv.clamp(-clip, clip), zero)
    elif estimator == "gae":
        info["advantage_clip_frac"] = torch.zeros(bsz, dtype=torch.float32)
    return adv, returns, info


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §7.2 streaming (cross-batch) normalisation
# ----------------------------------------------------------------------------------------------


def apply_normalization(
    x: Tensor, mask: Tensor | None, mean: float, var: float, floor: float = VAR_FLOOR
) -> Tensor:
    """docs/numerics.md §7.2/§7.3: ``(x − μ)·rstd`` with ``rstd = 1/sqrt(max(var, floor))`` at valid positions
    only; masked positions keep x's values (0 for our tensors). Result in x's dtype."""
    t = torch.as_tensor(x)
    m = as_bool_mask(mask, t)
    rstd = 1.0 / math.sqrt(max(float(var), float(floor)))
    out = (t.to(torch.float64) - float(mean)) * rstd
    return torch.where(m, out.to(t.dtype), t)


# ----------------------------------------------------------------------------------------------
# docs/numerics.md §10 KL controller, §11 high-entropy mask
# ----------------------------------------------------------------------------------------------


def high_entropy_mask(entropy: Tensor, action_mask: Tensor, ratio: float) -> Tensor:
    """High-entropy token mask (docs/numerics.md §11), bool (B, A).

    ρ <= 0 or ρ >= 1 → ``action_mask`` (as bool). Otherwise per row, k = max(1, ⌊n_valid·ρ⌋)
    and the k valid tokens of highest entropy are True; rows with no valid token stay False.
    Decision: only valid tokens can be selected (the seed ranks ``entropy·mask``, so a padding
    position could win a tie against zero-entropy tokens); ties go to the earlier position.
    """
    m = torch.as_tensor(action_mask)
    m = m if m.dtype == torch.bool else m != 0
    check_2d("action_mask", m)
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
