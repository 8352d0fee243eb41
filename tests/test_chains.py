"""Chained stages (topology.yaml ``chains:``; expstream/config/chains.py, stages/chain.py).

* the block's checks name the field and the fix; the units, topics and scale names a chain makes;
* inside a chain a failing stage is named by its dead letter, and every stage keeps its own statistics
  (the chain's process bisects exactly as the runner does: stages/splitting.py);
* a SIGKILL of a chain process mid-run, and a chain that kills itself between produce and commit (fault
  injection), lose and double nothing (the crash harness of tests/test_crash.py).

The byte-identity of a chained run with the unchained one is in tests/test_replay.py (it reuses that
module's recorded run).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from expstream.config.chains import unit_of
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.kafka.letters import H_STAGE, header_value
from expstream.launch.replica import stage_unit
from expstream.launch.scale import check_counts
from expstream.observe.metrics import StageMetrics
from stages import STAGES
from stages.chain import Chain
from stages.context import StageContext
from stages.deadletters import DeadLetters, ProcessFailure
from stages.splitting import process_or_split
from tests.runners import exp_batch
from tests.test_crash import GROUP_NORM_STAGES, PipelineRun, assert_exactly_once, finish

EXAMPLE = "chains=[[actor-logprob, reference, critic], [postprocess, advantage]]"


@pytest.mark.parametrize(("chains", "field"), [
    ("chains=[[actor-logprob, reward]]", "chains[0]"),  # reference runs between them
    ("chains=[[reward, actor-logprob]]", "chains[0]"),  # not in pipeline order
    ("chains=[[reward, postproces]]", "chains[0][1]"),  # not a stage
    ("chains=[[reward, postprocess], [postprocess, advantage]]", "chains[1][0]"),  # in two chains
    ("chains=[[reward]]", "chains[0]"),  # a chain of one
    ("chains=reward", "chains"),
])
def test_bad_chains_name_the_field(chains: str, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_topology(None, [chains])
    assert err.value.field == field or str(err.value).startswith(f"{field}:"), str(err.value)


def test_a_chain_across_the_environment_stage_is_refused_with_a_fix_that_loads() -> None:
    """Multi-turn: generate also consumes the turns topic (a runner a chain does not have), so no chain may
    span the environment stage; the fix given must itself be a topology that loads."""
    env = "environment={fn: expstream.rewards.games:guess_digit}"
    with pytest.raises(ConfigError, match=r"chains\[0\]: .*environment stage.*fix: start the chain after") as err:
        load_topology(None, [env, "chains=[[generate, shard-preprocess]]"])
    assert err.value.field == "chains[0]"
    topo = load_topology(None, [env, "chains=[[shard-preprocess, actor-logprob]]"])
    assert "shard-preprocess+actor-logprob" in [u.name for u in topo.units()]


def test_a_chain_scales_as_one_unit() -> None:
    with pytest.raises(ConfigError, match=r"stages\.advantage\.replicas: 2.*fix: give it 1"):
        load_topology(None, [EXAMPLE, "stages.advantage.replicas=2"])
    with pytest.raises(ConfigError, match=r"stages\.advantage\.autoscale.*stages\.postprocess"):
        load_topology(None, [EXAMPLE, "stages.advantage.autoscale={min: 1, max: 2}"])
    topo = load_topology(None, [EXAMPLE])
    with pytest.raises(ConfigError, match=r"runs in the chain postprocess\+advantage"):
        check_counts(topo, {"advantage": 1})
    check_counts(topo, {"postprocess+advantage": 1})


def test_units_topics_and_round_trip() -> None:
    default = load_topology(None)
    assert default.chains == [] and all(not u.chained for u in default.units())
    assert [u.name for u in default.units()] == [st.name for st in default.enabled_stages()]
    topo = load_topology(None, [EXAMPLE])  # critic is off (group_norm): dropped from its chain
    assert [u.name for u in topo.units()] == ["generate", "shard-preprocess", "actor-logprob+reference", "reward",
                                              "postprocess+advantage"]
    assert set(topo.all_topics()) == {"prompts", "rollouts", "batches", "reference", "rewarded", "experiences"}
    assert unit_of(topo, "reference").name == "actor-logprob+reference" and unit_of(topo, "reward").name == "reward"
    gae = load_topology(None, [EXAMPLE, "algo.advantage_estimator=gae"])
    assert unit_of(gae, "critic").stages == ("actor-logprob", "reference", "critic")
    assert load_topology(None, [f"chains={topo.to_raw()['chains']}"]).chains == topo.chains
    assert stage_unit(topo, "postprocess+advantage").stages == ("postprocess", "advantage")  # `expstream stage`
    assert stage_unit(topo, "reward").name == "reward"
    with pytest.raises(ConfigError, match=r"runs in the chain postprocess\+advantage.*expstream stage postprocess\+adv"):
        stage_unit(topo, "advantage")
    with pytest.raises(ConfigError, match="switched off"):
        stage_unit(topo, "critic")


def test_rewind_of_a_stage_inside_a_chain_names_the_chain() -> None:
    """A stage inside a chain reads no topic: `expstream rewind --stage reference` is refused before anything
    is contacted, with the chain's first stage as the fix."""
    from argparse import Namespace

    from expstream.tools.rewind import rewind_command

    topo = load_topology(None, [EXAMPLE])
    args = Namespace(run_dir=None, run_id="r1", bootstrap_servers="127.0.0.1:1", redis_url="redis://127.0.0.1:1/0",
                     stage="reference", to="0:0", topology=None, overrides=[])
    with pytest.raises(ConfigError, match=r"inside the chain actor-logprob\+reference.*--stage actor-logprob") as err:
        rewind_command(topo, args)
    assert err.value.field == "--stage"


def _fake(process):
    return SimpleNamespace(setup=lambda ctx: None, process=process)


def test_a_failing_stage_inside_a_chain_is_named_and_accounted(monkeypatch) -> None:
    """advantage fails on one sample: the chain's batch is bisected like the runner's, the letter names
    advantage (not postprocess, whose input topic the chain reads), and each stage counts its own flow."""
    def advantage(batch, ctx):
        if 2 in batch.sample_index:
            raise ValueError("sample 2 is bad")
        return [batch]

    monkeypatch.setitem(STAGES, "postprocess", _fake(lambda batch, ctx: [batch]))
    monkeypatch.setitem(STAGES, "advantage", _fake(advantage))
    topo = load_topology(None, [EXAMPLE])
    unit = unit_of(topo, "advantage")
    ctx = StageContext(topology=topo, stage=Chain.runner_stage(unit, topo))
    assert (ctx.stage.name, ctx.stage.input, ctx.stage.output) == ("postprocess", "rewarded", "experiences")
    ctx.metrics = StageMetrics(unit.name, "0")  # what the runner gives a chain process
    chain = Chain(unit, ctx)
    chain.bind(ctx)
    chain.setup()

    def run(batch):
        try:
            return chain.process(batch)
        except ValueError as exc:
            raise ProcessFailure(str(exc)) from exc

    split = process_or_split(exp_batch("b7", "g", [0, 1, 2, 3]), run, reraise=lambda exc: False)
    assert [o.batch_id for o in split.outputs] == ["b7~0-2", "b7~3-4"]
    (bad, exc), = split.bad
    assert bad.batch_id == "b7~2-3"
    record = SimpleNamespace(value=b"\x80", key=b"g", headers=[], topic="rewarded", partition=0, offset=5)
    letter = DeadLetters(ctx, logging.getLogger("test"), None).letter(record, exc, value=b"x", batch=bad)
    assert header_value(letter.headers, H_STAGE) == "advantage" and letter.topic == "rewarded.dlq"
    rows = chain.rows("b7", {"advantage": 1})
    assert {s: r[1] for s, r in rows.items()} == {"postprocess": {"in": 4, "out": 4, "dead": 0},
                                                  "advantage": {"in": 4, "out": 3, "dead": 1}}
    reg = ctx.metrics.registry  # each inner stage's series under its own name, beside the chain's
    assert reg.get_sample_value("expstream_batch_seconds_count", {"stage": "postprocess"}) == 5  # whole + 4 parts
    assert reg.get_sample_value("expstream_samples_processed_total", {"stage": "advantage"}) == 3  # 2 + 1 went through
    seen: list = []
    monkeypatch.setattr(STAGES["advantage"], "committed", lambda batches, c: seen.extend(b.batch_id for b in batches),
                        raising=False)
    chain.committed([exp_batch("b7", "g", [0])])
    assert seen == ["b7~0-2", "b7~3-4"] and chain.rows("b7", {}) == {}  # its own inputs, then forgotten


# ------------------------------------------------------------------------------------------------
# A SIGKILL of a chain process mid-run, and a chain that kills itself between produce and commit.
# ------------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.integration
def test_killed_chains_lose_and_double_nothing(tmp_path_factory: pytest.TempPathFactory, model_cache: Path) -> None:
    run = PipelineRun(tmp_path_factory.mktemp("kill-chains"), model_cache, n_prompts=24,
                      sets=["algo.advantage_estimator=group_norm", "algo.reward_running_norm=true", EXAMPLE],
                      env={"EXPSTREAM_FAULT": "postprocess+advantage:after_produce:2"})
    label = "actor-logprob+reference[0]"
    killed = None
    try:
        run.start()
        deadline = time.monotonic() + 300
        while killed is None and run.alive and time.monotonic() < deadline:
            pid = run.pids().get(label)
            if pid is not None and run.handled(label, pid) >= 1:  # mid-flow: more records on their way
                killed = run.kill(label, pid)
            time.sleep(0.05)
        outcome = finish(run, tmp_path_factory, "kill-chains", stages=GROUP_NORM_STAGES, running_norm=True,
                         group_buffers=True)
    finally:
        run.close()
    assert killed is not None, f"{label} was never killed (the run ended first?)\n{run.diagnostics()}"
    assert_exactly_once(outcome)
    kills = {(r.kill.label, r.kill.how): r for r in outcome.recs}
    for key in ((label, "sigkill"), ("postprocess+advantage[0]", "fault:after_produce")):
        assert key in kills and kills[key].respawned_s is not None, f"{key} not killed and replaced: {list(kills)}"
    restarts = outcome.acct.summary["stage_restarts"]  # a chain restarts as one process, under its unit's name
    assert restarts.get(label) == 1 and restarts.get("postprocess+advantage[0]") == 1, restarts
    assert outcome.redis_problems == [] and outcome.overcount_problems == []
    assert outcome.stat_problems == []  # each stage inside a chain counted once per batch id
