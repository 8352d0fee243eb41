"""environment: one environment step of every episode generate just extended (docs/multi_turn.md).

Only in a run with an ``environment:`` block, between generate and shard-preprocess. Per micro-batch
(every row has taken k model turns, its last one just generated):

1. the environment answers each episode (``prompt``, ``label``, the decoded model turns; over HTTP
   also the exact token ids) with ``(observation, reward, done)``, up to ``environment.max_in_flight``
   at once (expstream/rewards/environment.py);
2. a row the environment failed on (an error, a timeout, a malformed answer) fails alone: the batch is
   bisected by the runner and that episode dead-lettered (its answers so far are kept for the re-runs
   of the others, so no environment is asked twice for one step of a split batch);
3. ``done``, or k = ``max_turns`` (``info.truncated`` = 1): the episode is finished; its reward is
   appended to ``turn_rewards`` (0.0 when None), ``info.turns`` = k, and it goes on to shard-preprocess
   under the record's batch id;
4. otherwise its observation is rendered at the turn boundary (:class:`expstream.rl.episodes.TurnBoundary`),
   tokenized once and appended to ``response_ids`` (behaviour log-prob 0.0, not an action), and the
   episode goes back to generate on ``environment.turns_topic`` as ``<batch id>/t<k>``.

A crash anywhere in between resumes the episode from its record: the episode so far is in it, and
an environment is a function of the episode so far (docs/multi_turn.md "Writing an environment").
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from expstream.errors import PoisonRecordError
from expstream.models.resolve import import_function, model_dir
from expstream.rewards.environment import EnvironmentFailed, Episode, Step, build_environment
from expstream.rl.episodes import TurnBoundary, turn_segments, with_observation
from schemas import Ragged, SampleBatch
from stages.context import Routed, StageContext

#: Answers kept for the re-runs of a split batch (sample id, turns taken) -> Step.
ANSWERS_KEPT = 4096


def setup(ctx: StageContext) -> None:
    from expstream.models.hf import load_tokenizer

    topo = ctx.topology
    tok = load_tokenizer(model_dir(topo, "tokenizer"))
    ctx.models["tokenizer"] = tok
    ctx.models["boundary"] = TurnBoundary(tok, topo.generate.apply_chat_template)
    ctx.models["environment"] = build_environment(topo.environment, import_function)
    ctx.models["answers"] = OrderedDict()


def teardown(ctx: StageContext) -> None:
    env = ctx.models.pop("environment", None)
    if env is not None:
        env.close()


def episodes_of(batch: SampleBatch, ctx: StageContext) -> tuple[list[Episode], list[int]]:
    """The episodes of ``batch`` as the environment sees them, and the model turns each has taken."""
    tok, skip = ctx.models["tokenizer"], ctx.topology.generate.skip_special_tokens
    out, turns = [], []
    for b, (ids, lengths) in enumerate(zip(batch.response_ids.rows(), batch.turn_lengths.rows(), strict=True)):
        model, obs = turn_segments(np.asarray(ids), np.asarray(lengths))
        out.append(Episode(batch.sample_ids()[b], batch.prompt[b], batch.label[b],
                           tok.batch_decode(model, skip_special_tokens=skip), model, obs))
        turns.append(len(model))
    return out, turns


def answers(batch: SampleBatch, episodes: list[Episode], turns: list[int], ctx: StageContext) -> list[Step]:
    """One Step per episode (kept ones reused); the first failure raised when any episode failed."""
    kept: OrderedDict = ctx.models["answers"]
    keys = [(e.sample_id, k) for e, k in zip(episodes, turns, strict=True)]
    todo = [i for i, key in enumerate(keys) if key not in kept]
    got = ctx.models["environment"].step_all([episodes[i] for i in todo]) if todo else []
    failed = None
    for i, step in zip(todo, got, strict=True):
        if isinstance(step, Exception):
            failed = failed or step
        else:
            kept[keys[i]] = step
    while len(kept) > ANSWERS_KEPT:
        kept.popitem(last=False)
    if failed is not None:
        ctx.log.warning("environment batch=%s: %s", batch.batch_id, failed)
        raise failed if isinstance(failed, EnvironmentFailed) else EnvironmentFailed(str(failed))
    return [kept[key] for key in keys]


def process(batch: SampleBatch, ctx: StageContext) -> list:
    if not isinstance(batch, SampleBatch) or batch.turn_lengths is None or batch.layout:
        raise PoisonRecordError(f"environment: {getattr(batch, 'batch_id', '?')} is not an episode from generate "
                                "(a SampleBatch with turn_lengths, layout \"\"); check the topology's stage order")
    episodes, turns = episodes_of(batch, ctx)
    steps = answers(batch, episodes, turns, ctx)
    max_turns = ctx.topology.environment.max_turns
    finished = [i for i, (s, k) in enumerate(zip(steps, turns, strict=True)) if s.done or k >= max_turns]
    going = [i for i in range(len(batch)) if i not in set(finished)]
    tok, skip = ctx.models["tokenizer"], ctx.topology.generate.skip_special_tokens
    decode = lambda rows: tok.batch_decode(rows, skip_special_tokens=skip)  # noqa: E731
    out: list = []
    if finished:
        done = batch.select(finished)
        rewards = [np.append(r, steps[i].reward or 0.0).astype(np.float32)
                   for r, i in zip(done.turn_rewards.rows(), finished, strict=True)]
        info = {**(done.info or {}), "turns": np.asarray([turns[i] for i in finished], np.float32),
                "truncated": np.asarray([0.0 if steps[i].done else 1.0 for i in finished], np.float32)}
        out.append(done.replace(turn_rewards=Ragged.from_rows(rewards, "float32"), info=info))
    if going:
        boundary: TurnBoundary = ctx.models["boundary"]
        eos = batch.eos_token_id
        obs_ids = [boundary.ids(steps[i].observation or "", bool(episodes[i].turn_ids[-1][-1:] == [eos]))
                   for i in going]
        k = turns[going[0]]
        nxt = batch.select(going, batch_id=f"{batch.batch_id}/t{k}")
        nxt = with_observation(nxt, obs_ids, [steps[i].reward or 0.0 for i in going], decode)
        out.append(Routed(ctx.topology.environment.turns_topic, nxt))
    return out
