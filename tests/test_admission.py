"""Bounded staleness by backpressure (expstream/rl/admission.py): the bound, the trainer's gate in a
randomized simulation against a real MemoryState, wait_for_admission, lost accounting, and the
generate stage blocked and resumed on the real broker and redis-server."""

from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from dataclasses import dataclass, field

import pytest

from expstream.config.topology import load_topology
from expstream.errors import ShutdownRequested
from expstream.kafka.clients import read_topic, topic_lag
from expstream.rl.admission import (
    StalenessGate,
    admission_bound,
    admission_id,
    blocked_counter,
    wait_for_admission,
)
from expstream.state import MemoryState, RedisState
from schemas import PromptBatch, decode, encode
from stages import advantage, generate
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running
from tests.test_runner import produce, stage_topology
from tests.test_streaming_options import scored

LOOP = ["train.enabled=true", "train.batch_size=8", "async.max_staleness=1"]


# --- the bound and the gate, by hand ---------------------------------------------------------------
def test_admission_bound_and_ids():
    assert admission_bound(0, 0, 8) == 8
    assert admission_bound(3, 2, 16) == 96  # (3 + 2 + 1) * 16
    assert admission_id("p000003") == "p000003"
    assert admission_id("p000003~2-3") == "p000003"


def test_gate_waits_for_stragglers_of_old_versions_only():
    gate = StalenessGate(k=1, batch_size=4)
    for i in range(3):
        gate.add(f"a#{i}", 0)
    assert gate.add("a#0", 0) is False  # a redelivered sample counts once
    gate.add("b#0", 1)
    admitted, lost = {0: 8, 1: 4}, {0: 4}
    assert gate.wait_for(0, admitted, lost) == []  # versions <= -1: nothing to wait for
    assert gate.wait_for(1, admitted, lost) == [0]  # 8 admitted > 3 received + 4 lost
    gate.add("a#3", 0)
    assert gate.wait_for(1, admitted, lost) == []
    assert gate.wait_for(2, admitted, lost) == [1]  # version 1: 4 admitted, 1 received


def test_gate_selects_mandatory_then_oldest_first():
    gate = StalenessGate(k=1, batch_size=3)
    versions = [2, 0, 1, 2, 1, 0]
    # step 1: v <= 0 is mandatory (indices 1, 5), then the oldest other (a version 1, first in the buffer)
    assert gate.select(versions, 1) == [1, 5, 2]
    # step 3: every sample with v <= 2 is mandatory: all six, however many
    assert sorted(gate.select(versions, 3)) == list(range(6))
    assert gate.select([], 5) == []
    assert gate.staleness_ok(3, 2) and not gate.staleness_ok(3, 1)
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessGate(k=-1, batch_size=3)


def test_gate_starved_when_losses_leave_less_room_than_a_record():
    gate = StalenessGate(k=0, batch_size=8)
    for i in range(4):
        gate.add(f"g1#{i}", 0)
    # k=0, B=8: one 8-sample record admitted at version 0, one 4-sample group of it dropped
    assert gate.starved(0, {0: 8}, {0: 4}, record_samples=8)  # room 8 - 4 = 4 < 8, nothing in flight
    assert not gate.starved(0, {0: 8}, {0: 4}, record_samples=4)  # a 4-sample record still fits
    assert not gate.starved(0, {0: 8}, {}, record_samples=8)  # 4 samples still in flight


# --- the randomized simulation ---------------------------------------------------------------------
@dataclass
class Sim:
    """Generators admit prompt records through a MemoryState; a trainer uses the gate. Every event
    (refresh, admit, produce, crash, deliver, loss report, train step) is a random choice."""

    k: int
    batch_size: int
    record: int  # samples per prompt record (prompts x n)
    n: int  # group size
    seed: int
    dup_crash: float = 0.0  # share of records produced, then crashed before the commit (redelivered)
    fold: bool = False  # after each step fold the versions below step - k (the trainer's checkpoint, every step)
    generators: int = 3
    records: int = 60
    state: MemoryState = field(default_factory=MemoryState)
    trained: dict[str, int] = field(default_factory=dict)  # sample id -> staleness
    dropped_late: list[tuple[str, int]] = field(default_factory=list)
    lost_ids: set[str] = field(default_factory=set)
    steps: list[int] = field(default_factory=list)  # samples per step
    duplicates: int = 0  # copies of a sample id that arrived again (redelivered records)
    timeouts: int = 0  # steps taken after async.straggler_timeout_s (stragglers given up on)
    ledger_sizes: list[int] = field(default_factory=list)  # versions in admission_counts after each fold

    def run(self) -> None:
        st, rng = self.state, random.Random(self.seed)
        gate = StalenessGate(self.k, self.batch_size)
        queue = [f"p{i:03d}" for i in range(self.records)]
        loaded = [0] * self.generators
        busy: list[tuple[str, int] | None] = [None] * self.generators
        transport: list[tuple[str, int]] = []  # (sample id, version) on the way to the trainer
        loss_reports: list[tuple[str, int, int]] = []  # dead letters / drops not yet counted
        buffer: dict[str, int] = {}  # sample id -> version
        self.admitted_ids: set[str] = set()
        step = 0

        def refresh(g: int) -> bool:
            if loaded[g] == st.policy_version():
                return False
            loaded[g] = rng.randint(loaded[g] + 1, st.policy_version())  # lags behind, never backwards
            return True

        def start(g: int) -> bool:
            if busy[g] is not None or not queue:
                return False
            rid = queue[0]
            if not st.admit(rid, self.record, loaded[g], admission_bound(loaded[g], self.k, self.batch_size)):
                return False
            queue.pop(0)
            busy[g] = (rid, loaded[g])
            return True

        def finish(g: int) -> bool:
            if busy[g] is None:
                return False
            rid, v = busy[g]
            busy[g] = None
            r = rng.random()
            if r < 0.05:  # crashed before producing: redelivered to whoever comes next
                queue.insert(0, rid)
                return True
            if r < 0.05 + self.dup_crash:  # produced, crashed before the commit: redelivered, v copies travel
                queue.insert(0, rid)
            for grp in range(self.record // self.n):
                ids = [f"{rid}/{grp}#{i}" for i in range(self.n)]
                fate = random.Random(f"{self.seed}:{rid}/{grp}").random()  # a redelivery meets the same fate
                if fate < 0.1:  # dead-lettered downstream or dropped by dynamic sampling
                    loss_reports.append((f"g/{rid}/{grp}", v, self.n))
                    self.lost_ids.update(ids)
                else:
                    transport.extend((sid, v) for sid in ids)
                    self.admitted_ids.update(ids)
            return True

        def deliver() -> bool:
            if not transport:
                return False
            sid, v = transport.pop(rng.randrange(len(transport)))  # any order: stragglers happen
            gate.add(sid, v)
            if sid in self.trained or sid in buffer:
                self.duplicates += 1
                return True  # a copy of a redelivered record: the trainer dedupes by sample id
            if not gate.staleness_ok(step, v):
                self.dropped_late.append((sid, v))  # the safety net: dropped, counted, never trained stale
                return True
            buffer[sid] = v
            return True

        def report_loss() -> bool:
            if not loss_reports:
                return False
            st.record_lost(*loss_reports.pop(rng.randrange(len(loss_reports))))
            return True

        def train(timed_out: bool = False) -> bool:
            nonlocal step
            admitted, lost = st.admission_counts()
            if not buffer or (gate.wait_for(step, admitted, lost) and not timed_out):
                return False
            finished = not queue and all(b is None for b in busy) and not transport
            if len(buffer) < self.batch_size and not finished and not gate.starved(step, admitted, lost, self.record):
                return False
            ids = list(buffer)
            for i in gate.select([buffer[s] for s in ids], step):
                sid = ids[i]
                assert sid not in self.trained, f"{sid} trained twice"
                self.trained[sid] = step - buffer.pop(sid)
            self.steps.append(len(self.trained) - sum(self.steps))
            step += 1
            st.set_policy_version(step)
            if self.fold and step - self.k > 0:
                st.fold_admission(step - self.k)
                gate.forget_below(step - self.k)
                self.ledger_sizes.append(sum(map(len, st.admission_counts())))
            return True

        actions = [lambda g=g: refresh(g) for g in range(self.generators)]
        actions += [lambda g=g: start(g) for g in range(self.generators)]
        actions += [lambda g=g: finish(g) for g in range(self.generators)]
        actions += [deliver, deliver, report_loss, train]
        for _ in range(200_000):
            if not queue and all(b is None for b in busy) and not transport and not loss_reports and not buffer:
                return
            order = actions[:]
            rng.shuffle(order)
            if any(a() for a in order):
                continue
            if self.dup_crash and train(timed_out=True):  # the straggler timeout expired
                self.timeouts += 1
                continue
            raise AssertionError(
                f"deadlock at step {step}: queue {len(queue)}, busy {busy}, buffer {len(buffer)}, "
                f"counts {st.admission_counts()}, received {gate.received}")
        raise AssertionError("the simulation did not finish")


def _check_trained(sim: Sim, k: int) -> None:
    assert sim.trained, "nothing trained"
    worst = max(sim.trained.values())
    assert worst <= k, f"a sample trained with staleness {worst} > k={k}"


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize(("batch_size", "record", "n"), [(8, 8, 4), (16, 4, 2), (12, 6, 3)])
def test_simulated_loop_never_trains_stale_loses_nothing_and_never_deadlocks(k, batch_size, record, n, fold):
    """``fold``: the trainer folds the versions below its step - k after every step (issue 28 item 6): the
    same guarantees with a ledger of about k + 2 versions, however many steps."""
    for seed in range(6):
        sim = Sim(k, batch_size, record, n, 1000 * k + 10 * batch_size + seed, fold=fold)
        sim.run()  # raises on a deadlock (no event can happen and the run is not over)
        _check_trained(sim, k)
        # every produced sample that was not lost is trained exactly once (dict keys: once)
        assert set(sim.trained) == sim.admitted_ids - sim.lost_ids, f"seed {seed}"
        # late drops are only extra copies of redelivered records, never a sample's only copy
        assert all(sid in sim.trained for sid, _ in sim.dropped_late)
        # admission keeps steps near B: the mandatory set exceeds B only after out-of-order stragglers
        assert max(sim.steps) <= (k + 1) * batch_size + record, sim.steps
        if fold:  # the versions >= step - k (at most k + 1 published, one loaded ahead) plus the folded total
            assert sim.ledger_sizes and max(sim.ledger_sizes) <= 2 * (k + 3), sim.ledger_sizes


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("k", [0, 2])
def test_simulated_duplicates_from_crashes_after_produce_are_never_trained_stale(k, fold):
    """A record produced, then crashed before its commit and regenerated under newer weights breaks the
    counts (its old copies arrive as extra pairs, its admission moved): the trainer may wait for
    stragglers that never come, until async.straggler_timeout_s. Still nothing is trained stale or twice,
    and every sample id is either trained or (a late copy) dropped, never silently missing."""
    duplicates = 0
    for seed in range(8):
        sim = Sim(k, 8, 4, 2, 7000 + 100 * k + seed, dup_crash=0.15, fold=fold)
        sim.run()
        _check_trained(sim, k)
        missing = sim.admitted_ids - sim.lost_ids - set(sim.trained)
        assert missing <= {sid for sid, _ in sim.dropped_late}, f"seed {seed}: lost silently: {missing}"
        duplicates += sim.duplicates + len(sim.dropped_late)
    assert duplicates > 0, "the scenario should deliver copies of redelivered records"


# --- wait_for_admission ----------------------------------------------------------------------------
def _ctx(*overrides: str, state=None):
    topo = load_topology(overrides=list(overrides))
    return make_context(topo, "generate", state=state or MemoryState())


def test_wait_for_admission_returns_at_once_when_the_loop_is_off():
    calls = []
    off = _ctx("train.batch_size=8")  # train.enabled false: no admission, the refreshed version
    assert wait_for_admission(off, "p0", 1000, refresh=lambda: calls.append(1) or 5) == 5
    drop = _ctx(*LOOP, "async.on_stale=drop")
    assert wait_for_admission(drop, "p0", 1000, refresh=lambda: 7) == 7
    assert off.state.admission_counts() == drop.state.admission_counts() == ({}, {})


def test_wait_for_admission_blocks_counts_and_resumes_on_a_new_version():
    ctx = _ctx(*LOOP, "async.max_staleness=0")
    st = ctx.state
    refresh = st.policy_version
    assert wait_for_admission(ctx, "p0", 8, refresh) == 0
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_admission(ctx, "p1", 8, refresh)), daemon=True)
    waiter.start()
    time.sleep(0.6)
    assert waiter.is_alive() and not got, "p1 must wait: 8 + 8 > (0 + 0 + 1) * 8"
    assert st.counters()[blocked_counter("generate")] > 0.2
    st.set_policy_version(1)
    waiter.join(5)
    assert got == [1]
    assert st.admission_counts() == ({0: 8, 1: 8}, {})
    # a split sub-batch of an admitted record reuses its admission and version, without reloading
    assert wait_for_admission(ctx, "p1~0-1", 4, refresh=lambda: pytest.fail("reloaded")) == 1
    # a stop request ends the wait (the record stays uncommitted)
    ctx.should_stop = lambda: True
    with pytest.raises(ShutdownRequested, match="p2"):
        wait_for_admission(ctx, "p2", 8, refresh)


def test_dynamic_sampling_drop_is_counted_lost_in_the_loop(state):
    topo = load_topology(overrides=["algo.advantage_estimator=group_norm", "algo.dynamic_sampling=true", *LOOP])
    ctx = make_context(topo, "advantage", state=state)
    const = scored("c", [0.5, 0.5], [1, 2], group="const", n=2).replace(policy_version=3)
    assert advantage.process(const, ctx) == []
    advantage.process(const, ctx)  # redelivery: counted once
    assert state.admission_counts() == ({}, {3: 2})
    off = make_context(load_topology(overrides=["algo.advantage_estimator=group_norm", "algo.dynamic_sampling=true"]),
                       "advantage", state=MemoryState())
    advantage.process(const, off)
    assert off.state.admission_counts() == ({}, {})  # not in the loop: nothing to account for


# --- generate on the real broker and redis-server --------------------------------------------------
def _prompts(batch_id: str, texts: list[str]) -> bytes:
    return encode(PromptBatch(batch_id=batch_id, prompt_id=[f"{batch_id}-{i}" for i in range(len(texts))],
                              prompt=texts, label=[""] * len(texts), reference=[""] * len(texts)))


def _generate_runner(broker, redis_url, cache, *sets):
    topo = stage_topology(broker, "generate", f"models.cache_dir={cache}", "generate.n_samples_per_prompt=4",
                          "generate.max_new_tokens=4", "train.enabled=true", "train.batch_size=8", *sets)
    run_id = f"a{uuid.uuid4().hex[:8]}"
    ctx = make_context(topo, "generate", state=RedisState(redis_url, run_id), run_id=run_id)
    generate.setup(ctx)
    runner = StageRunner(ctx, generate.process, broker)
    ctx.should_stop = lambda: runner.stop_requested  # as expstream stage does: a blocked wait ends on stop
    return topo, ctx, runner


def _outputs(broker, topo):
    return [decode(r.value) for r in read_topic(broker, topo.kafka, topo.stages["generate"].output)]


@pytest.mark.integration
def test_generate_blocks_at_the_bound_keeps_its_membership_and_resumes_after_a_publish(
        broker, redis_url, model_cache):
    """max_staleness 0, batch_size 8 = one record of 2 prompts x 4: exactly one record comes out, then
    generate waits (alive in its group, the blocked counter growing) until version 1 is published."""
    topo, ctx, runner = _generate_runner(broker, redis_url, model_cache,
                                         "async.max_staleness=0", "kafka.max_poll_interval_ms=3000")
    src = topo.topics.input
    produce(broker, src, [_prompts(f"p{i}", ["Hello there", "Add two numbers"]) for i in range(4)])
    running = Running(runner)
    try:
        running.wait(lambda: len(_outputs(broker, topo)) == 1, 120, "the first record's samples")
        counter = blocked_counter("generate")
        running.wait(lambda: ctx.state.counters().get(counter, 0) > 0, 30, "generate to block")
        blocked = ctx.state.counters()[counter]
        changes = runner.tracker.changes
        time.sleep(4.0)  # longer than max_poll_interval_ms: membership kept only by the paused polls
        assert len(_outputs(broker, topo)) == 1, "a second record was generated beyond the bound"
        assert ctx.state.counters()[counter] > blocked + 2.0, "the blocked time must keep growing"
        assert runner.tracker.changes == changes, "no rebalance while blocked"
        assert runner.handled == 1, "the blocked record is still in hand, uncommitted"
        assert ctx.state.admission_counts() == ({0: 8}, {})

        ctx.state.set_policy_version(1)
        running.wait(lambda: len(_outputs(broker, topo)) == 2, 60, "the second record after the publish")
        time.sleep(1.0)
        assert len(_outputs(broker, topo)) == 2, "version 1 admits exactly one more record"
    finally:
        running.stop()
    outs = _outputs(broker, topo)
    assert [(o.batch_id, o.policy_version, len(o)) for o in outs] == [("p0", 0, 8), ("p1", 1, 8)]
    assert [o.rollout_version for o in outs] == [[0] * 8, [1] * 8]  # every sample: the version it was made by
    assert ctx.state.admission_counts() == ({0: 8, 1: 8}, {})
    assert runner.dead_lettered == 0 and list(read_topic(broker, topo.kafka, f"{src}.dlq")) == []
    assert topic_lag(broker, topo.kafka, runner.group_id, src) == {0: 2}, "p2, p3 wait uncommitted, not dropped"


@pytest.mark.integration
def test_dead_lettered_prompt_is_counted_lost_under_its_admitted_version(broker, redis_url, model_cache):
    topo, ctx, runner = _generate_runner(broker, redis_url, model_cache,
                                         "async.max_staleness=1", "generate.truncate_prompts=false",
                                         "generate.prompt_max_len=40")
    ctx.state.set_policy_version(2)
    produce(broker, topo.topics.input, [_prompts("s0", ["   ", "Hello there"])])
    running = Running(runner)
    try:
        running.wait(lambda: runner.handled == 1, 120, "the record with an empty prompt")
    finally:
        running.stop()
    [out] = _outputs(broker, topo)
    assert (out.batch_id, out.policy_version, len(out)) == ("s0~1-2", 2, 4)
    assert runner.dead_lettered == 1
    # admitted as a whole (8 samples under version 2); the empty prompt's 4 samples never come: lost
    assert ctx.state.admission_counts() == ({2: 8}, {2: 4})


logging.getLogger("kafka").setLevel(logging.WARNING)


@pytest.mark.integration
def test_dead_lettered_samples_downstream_are_counted_lost_once(broker, redis_url):
    """A poisoned sample split out of an experience batch at a later stage: its one sample is lost under
    the batch's policy version; a redelivery of the same record counts nothing twice."""
    from tests.test_runner import rollouts

    topo = stage_topology(broker, "shard-preprocess", *LOOP, "generate.n_samples_per_prompt=4")
    run_id = f"a{uuid.uuid4().hex[:8]}"

    def process(batch, ctx):
        if "poison" in batch.label:
            raise ValueError(f"poisoned sample in {batch.batch_id}")
        return [batch]

    bad = rollouts("r0", ["ok", "poison", "ok", "ok"]).replace(policy_version=5)
    produce(broker, topo.stages["shard-preprocess"].input, [encode(bad), encode(bad)])
    state = RedisState(redis_url, run_id)
    runner = StageRunner(make_context(topo, "shard-preprocess", state=state, run_id=run_id), process, broker)
    running = Running(runner)
    try:
        running.wait(lambda: runner.handled == 2, 60, "both deliveries")
    finally:
        running.stop()
    assert runner.dead_lettered == 2
    assert state.admission_counts() == ({}, {5: 1})  # r0~1-2: one sample of version 5, counted once
