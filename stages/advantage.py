"""advantage: reward shaping in the seed's order, advantages and returns; group estimators
complete their prompt groups in the run state.

Per unit (a complete group for group estimators, else the micro-batch), in the seed's order
(docs/numerics.md §2): group shaping → running normalisation (moments shared in ctx.state) →
reward clip → token rewards −β·kl + R at t* → the estimator.

* Per-sample estimators (``gae``, ``reinforce``, ``cpgd``) compute on the micro-batch and emit it
  under its own batch id.
* Group estimators (``rloo``, ``reinforce_baseline``, ``group_norm``/``grpo``, ``dr_grpo``) and
  dynamic sampling park each sample in its group's buffer in ctx.state (atomic add-and-take); the call
  that completes a group — on whichever replica and partition — gets all n members back and
  emits the whole group once, as batch ``g/<group_id>``. A redelivery of that completing record
  emits the same group again with the same ids; readers dedupe by sample id. In-process
  (LocalChain, replay) the same happens on a MemoryState, so split groups complete there too; a
  group wholly inside one micro-batch is emitted there without the buffer round trip (same bytes).
* Dynamic sampling drops groups whose processed rewards are all equal and counts them in ctx.state
  (and, in the continuous loop, records their samples lost for generate's admission control).
* Optionally, the seed's cross-batch normalisation over a window or running moments (ctx.state).
* Once the records that carried a group's members are committed (the runner's ``committed`` hook),
  the group's buffer is freed; a "done" marker stays for ``redis.dedupe_window_s`` so that a record
  of it read again (a rewind) is a duplicate (docs/async.md "What a long run keeps").
"""

from __future__ import annotations

import numpy as np
import torch

from expstream.config.estimators import CROSS_BATCH_ESTIMATORS, uses_window
from expstream.models.forward import scalar
from expstream.rl import numerics
from expstream.rl.episodes import PER_TOKEN_ESTIMATORS, turn_reward_tokens
from expstream.rl.layout import action_field, padded, to_ragged
from schemas import Ragged, SampleBatch, decode, encode
from stages.context import StageContext

WINDOW_NAME = "advantages"


def setup(ctx: StageContext) -> None:
    return None


def compute(batch: SampleBatch, ctx: StageContext, shaped: torch.Tensor | None = None) -> SampleBatch:
    """Advantages/returns for ``batch``: one unit of the seed's per-experience loop (docs/numerics.md §2 step 5).

    ``shaped`` are the group-shaped rewards of a complete group (None: no shaping, the reward
    postprocess delivered). Then, in the seed's order: running normalisation and reward clip
    (:func:`finish_rewards`), the KL-penalised token rewards, the estimator. The output's
    ``processed_rewards`` is the final R_b placed at t*.
    """
    algo = ctx.topology.algo
    lay = padded(batch)
    mask, width = lay.action_mask, lay.num_actions
    delivered = torch.from_numpy(np.array(batch.processed_rewards, dtype=np.float32))
    r, reward_info = finish_rewards(delivered if shaped is None else shaped.to(torch.float32), batch.batch_id, ctx)
    if batch.kl is not None and batch.kl_coef is not None:
        token_rewards = numerics.kl_penalized_rewards(r, action_field(batch, "kl", width), mask, batch.kl_coef)
        if batch.turn_rewards is not None and algo.advantage_estimator in PER_TOKEN_ESTIMATORS:
            token_rewards = token_rewards + turn_reward_tokens(batch, width) * mask  # as postprocess (docs/numerics.md §15)
    else:  # no KL on the record: move R within postprocess's token rewards
        token_rewards = action_field(batch, "token_rewards", width) + numerics.kl_penalized_rewards(
            r - delivered, None, mask, 0.0)
    values = action_field(batch, "values", width) if algo.advantage_estimator == "gae" else None
    raw = torch.from_numpy(np.array(batch.info["reward"], dtype=np.float32))
    adv, ret, extra = numerics.compute_advantages(
        algo.advantage_estimator, token_rewards, mask, values=values, raw_rewards=raw, gamma=algo.gamma,
        lambd=algo.lambd, advantages_norm=algo.advantages_norm, advantage_clip=algo.advantage_clip,
        skip_masked=batch.turn_lengths is not None)  # multi-turn: observations are no steps (docs/numerics.md §15)
    info = dict(batch.info or {})
    info.update(reward_info)
    info["return"] = scalar((token_rewards * mask).sum(-1))
    info.update({k: scalar(v) for k, v in extra.items()})
    return batch.replace(advantages=to_ragged(adv, batch), returns=to_ragged(ret, batch), info=info,
                         processed_rewards=scalar(r), kl=None, token_rewards=None)


def finish_rewards(r: torch.Tensor, unit_id: str, ctx: StageContext) -> tuple[torch.Tensor, dict[str, np.ndarray]]:
    """Running normalisation then reward clip of one unit's (shaped) rewards (docs/numerics.md §5.1–5.2).

    The unit is what this stage emits at once: a complete group (``g/<group_id>``) for group
    estimators, the micro-batch otherwise. Its rewards are merged into the run-wide moments
    (``reward`` in ctx.state, shared by every replica) once per unit id, and the snapshot right
    after that merge normalises them (the seed: update, then normalise), so a redelivery gives the
    same bytes. Then ``reward_clip_frac`` is measured over the unit and the rewards are clamped.
    """
    algo = ctx.topology.algo
    info: dict[str, np.ndarray] = {}
    if algo.reward_running_norm:
        m = ctx.state.merge_reward_moments(unit_id, r.numpy().astype(np.float64))
        r = numerics.normalize_rewards(r, m.mean, m.std, algo.reward_running_norm_minus_mean)
        if not bool(torch.isfinite(r).all()):
            # std is inf after one reward in total and 0 while every reward so far was equal: the
            # seed gives 0 (or ±huge) there; we give 0 and say so rather than emit inf downstream.
            ctx.log.warning("advantage batch=%s: running std %.3g cannot normalise; rewards set to 0", unit_id, m.std)
            r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    if algo.reward_clip > 0:
        c = algo.reward_clip
        info["reward_clip_frac"] = scalar(numerics.clip_fraction(r, -c, c))
        r = r.clamp(-c, c)
    return r.to(torch.float32), info


def _normalized(batch: SampleBatch, mean: float, var: float) -> SampleBatch:
    """docs/numerics.md §7.2 on the valid actions only: (A − μ)·rsqrt(max(var, 1e-8)); padding stays 0."""
    adv = torch.from_numpy(np.array(batch.advantages.values))
    mask = torch.from_numpy(np.array(batch.action_mask.values, dtype=bool))
    out = numerics.apply_normalization(adv, mask, mean, var).numpy().astype(np.float32)
    return batch.replace(advantages=Ragged(out, np.array(batch.advantages.lengths), "float32"))


def _valid_advantages(batch: SampleBatch) -> np.ndarray:
    return np.asarray(batch.advantages.values, np.float64)[np.asarray(batch.action_mask.values, bool)]


def normalize_window(payloads: list[bytes]) -> list[SampleBatch]:
    """One closed window: pooled masked mean and biased variance over all its micro-batches."""
    batches = sorted((decode(p) for p in payloads), key=lambda b: b.batch_id)
    vals = np.concatenate([_valid_advantages(b) for b in batches]) if batches else np.zeros(0)
    mean = float(vals.mean()) if vals.size else 0.0
    var = float(((vals - mean) ** 2).mean()) if vals.size else 0.0
    return [_normalized(b, mean, var) for b in batches]


def cross_batch(outputs: list[SampleBatch], ctx: StageContext) -> list[SampleBatch]:
    """The seed's cross-batch advantage normalisation (docs/numerics.md §7.2), streamed.

    ``running``: moments of every valid advantage so far, merged in ctx.state once per batch id, the
    snapshot after this batch normalises it. ``window``: micro-batches gather in a window in ctx.state
    of ``algo.rollout_batch_size`` samples, normalised together when it closes (the seed's shape).
    Applies to gae, reinforce and reinforce_baseline, as in the seed.
    """
    algo = ctx.topology.algo
    if algo.advantage_cross_batch_norm == "none" or algo.advantage_estimator not in CROSS_BATCH_ESTIMATORS:
        return outputs
    result: list[SampleBatch] = []
    for b in outputs:
        if algo.advantage_cross_batch_norm == "running":
            m = ctx.state.merge_reward_moments(b.batch_id, _valid_advantages(b), name="advantages")
            result.append(_normalized(b, m.mean, m.m2 / m.count if m.count else 0.0))
        else:
            taken = ctx.state.park_window(WINDOW_NAME, b.batch_id, encode(b), len(b), algo.rollout_batch_size)
            if taken is not None:
                result.extend(normalize_window(taken[1]))
    return result


def _uses_window(ctx: StageContext) -> bool:
    return uses_window(ctx.topology.algo)


def held_samples(ctx: StageContext) -> int:
    """Stage hook: samples parked in the open normalisation window (0 without a window)."""
    return ctx.state.pending_window_samples(WINDOW_NAME) if _uses_window(ctx) else 0


def end_of_input(ctx: StageContext) -> list[SampleBatch]:
    """Stage hook: close the open normalisation window (end of a finite run), return its batches."""
    if not _uses_window(ctx):
        return []
    taken = ctx.state.flush_window(WINDOW_NAME)
    return normalize_window(taken[1]) if taken is not None else []


def committed(batches: list, ctx: StageContext) -> None:
    """Stage hook (stages/commitgroup.py step 5): these records are committed; settle their groups' members
    in ctx.state, which frees every group whose completing record and members' records are all committed."""
    if not ctx.topology.is_group_estimator:
        return
    records = []
    for batch in batches:
        if isinstance(batch, SampleBatch):
            members: dict[str, list[int]] = {}
            for g, i in zip(batch.group_id, batch.sample_index, strict=True):
                members.setdefault(g, []).append(int(i))
            records.append((batch.batch_id, members))
    if records:
        ctx.state.settle_records(records)  # the commit group's records in one round trip


def _groups(batch: SampleBatch) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(batch.group_id):
        groups.setdefault(g, []).append(i)
    return groups


def process(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    return cross_batch(_advantages(batch, ctx), ctx)


def _advantages(batch: SampleBatch, ctx: StageContext) -> list[SampleBatch]:
    if not ctx.topology.is_group_estimator:
        return [compute(batch, ctx)]
    n = batch.n_samples_per_prompt
    whole: dict[str, SampleBatch] = {}
    parked: dict[str, tuple[int, dict[int, bytes]]] = {}
    for group_id, rows in _groups(batch).items():
        rows = sorted(rows, key=lambda i: int(batch.sample_index[i]))
        if [int(batch.sample_index[i]) for i in rows] == list(range(n)):
            # A group wholly inside this micro-batch: the same group as the buffer hands out (members in
            # sample_index order, same id, same bytes), made here without decoding the members back. In
            # one process (MemoryState) it has nothing to wait for and no other replica to meet: no
            # buffer at all. On Redis it is still parked: the buffer names its completer (a redelivery, a
            # sub-batch of a split) and keeps its "done" marker once settled.
            whole[group_id] = batch.select(rows, batch_id=f"g/{group_id}")
            if ctx.state.shared:
                # Parked for its completer and "done" marker only, with empty payloads: the n members
                # arrive in this one call, so it names this record the completer, and the buffer's payloads
                # only ever go back to a completer, which uses `whole` (a park of all n that finds the group
                # complete already writes nothing). Encoding each member cost more than the stage's math
                # (bench/README.md "The advantage stage parks whole groups without their bytes").
                parked[group_id] = (n, dict.fromkeys(range(n), b""))
        else:
            parked[group_id] = (n, {int(batch.sample_index[i]): encode(batch.select([i], batch_id=f"{batch.batch_id}#{i}"))
                                    for i in rows})
    # every group of the record parked in one round trip (RedisState: one pipeline of the park script)
    taken = ctx.state.park_groups(batch.batch_id, parked) if parked else {}
    out = []
    for group_id in _groups(batch):  # the record's order of groups, as one park call per group gave
        if group_id in parked and taken.get(group_id) is None:
            continue  # waits for members in other records, or completed or settled by another record
        if group_id in whole:
            group = whole[group_id]
        elif taken.get(group_id) is not None:
            group = SampleBatch.concat([decode(p) for p in taken[group_id]], batch_id=f"g/{group_id}")
        else:
            continue
        emitted = complete_group(group, ctx)
        if emitted is not None:
            out.append(emitted)
    return out


def complete_group(group: SampleBatch, ctx: StageContext) -> SampleBatch | None:
    """Shape one complete prompt group's rewards and compute its advantages (None: dropped)."""
    algo = ctx.topology.algo
    r = torch.from_numpy(np.array(group.processed_rewards, dtype=np.float32)).reshape(1, -1)
    if algo.dynamic_sampling and bool(numerics.group_is_constant(r)[0]):
        ctx.state.incr_counter("dynamic_sampling_dropped_groups", 1, once_id=group.batch_id)
        if ctx.topology.train.enabled:  # never reaches the trainer: lost for admission (expstream/rl/admission.py)
            ctx.state.record_lost(group.batch_id, int(group.policy_version), len(group))
        ctx.log.info("advantage batch=%s: dropped by dynamic sampling (all rewards equal %.4g)",
                     group.batch_id, float(r[0, 0]))
        return None
    shaped = numerics.shape_group_rewards(r, algo.advantage_estimator).reshape(-1)
    return compute(group, ctx, shaped=shaped)
