"""Several reward sources, the recipe (label -> sources) and the combine rules (expstream/rewards/sources.py,
stages/reward.py, the ``rewards:`` block). Expected values are worked out by hand, or by calling the
reward model directly on one routed sample at a time (no padding, no stage code)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
import yaml

from expstream.config.topology import load_topology
from expstream.errors import ConfigError, PoisonRecordError
from expstream.models.resolve import build_builtin_models, check_models
from expstream.rewards.sources import ROUTED_INFO_PREFIX, build_sources
from schemas import Ragged, SampleBatch, decode, encode
from stages import reward
from stages.context import make_context
from tests import rewardfns
from tests.harness import run_expstream

EOS, PAD = 2, 0


def _rows(rows, dtype):
    return Ragged.from_rows([np.asarray(r, dtype) for r in rows], "bool" if dtype is bool else dtype)


def make_batch(labels, prompts=None, references=None, tokens=None):
    b = len(labels)
    prompts = prompts or [f"prompt {i}" for i in range(b)]
    references = references or [""] * b
    tokens = tokens or [([5 + i, 17, 30 + i], [40 + 3 * i, 41, EOS]) for i in range(b)]
    return SampleBatch(
        batch_id="p000000/m0", policy_version=0, n_samples_per_prompt=b, eos_token_id=EOS, pad_token_id=PAD,
        prompt_id=["g"] * b, group_id=["g"] * b, sample_index=list(range(b)), prompt=list(prompts),
        label=list(labels), reference=list(references), response=["r"] * b,
        prompt_ids=_rows([p for p, _ in tokens], "int32"), response_ids=_rows([a for _, a in tokens], "int32"),
        layout="padded", action_ids=_rows([a for _, a in tokens], "int32"),
        action_mask=_rows([[True] * len(a) for _, a in tokens], bool))


@pytest.fixture(scope="module")
def cache(model_cache):
    return f"models.cache_dir={model_cache}"


def rewards_topology(cache, rewards: dict, *extra):
    return load_topology(overrides=[cache, f"rewards={yaml.safe_dump(rewards, default_flow_style=True).strip()}",
                                    *extra])


def run_stage(topo, batch):
    ctx = make_context(topo, "reward")
    reward.setup(ctx)
    try:
        [out] = reward.process(batch, ctx)
    finally:
        reward.teardown(ctx)
    return decode(encode(out))  # what travels on the wire


class Recorder:
    """Wraps a source to record the sample ids of every batch it is asked to score."""

    def __init__(self, inner):
        self.inner, self.name, self.seen = inner, inner.name, []

    def score(self, batch):
        self.seen.append(batch.sample_ids())
        return self.inner.score(batch)

    def close(self):
        self.inner.close()


def direct_rm_score(topo, batch, i):
    """The tiny reward model on sample ``i`` alone: its tokens unpadded, the score head at the last token."""
    from expstream.models.hf import load_reward_model
    from expstream.models.tiny import build_tiny_models

    rm = load_reward_model(build_tiny_models(topo.models.cache_dir)["reward"])
    ids = np.concatenate([batch.prompt_ids.row(i), batch.action_ids.row(i)]).astype(np.int64)
    with torch.no_grad():
        return float(rm(input_ids=torch.from_numpy(ids)[None]).logits[0, 0])  # pooled at the last token


def test_recipe_routes_each_sample_to_its_sources_and_sums_what_scored_it(cache):
    """The seed's recipe: a math prompt to the rule checker, a chat prompt to the reward model, the rest to both."""
    recipe = {"sources": {"rm": {"kind": "model", "path": "builtin:tiny"},
                          "rule": {"kind": "fn", "fn": "tests.rewardfns:recorded_reference_length"}},
              "recipe": {"math": ["rule"], "chat": ["rm"], "*": ["rm", "rule"]}}
    topo = rewards_topology(cache, recipe)
    batch = make_batch(["math", "chat", "other", "math"], references=["12", "", "abc", "7"])
    ctx = make_context(topo, "reward")
    reward.setup(ctx)
    sources = ctx.models["reward_sources"]
    sources["rm"] = rm = Recorder(sources["rm"])
    rewardfns.CALLS.clear()
    [out] = reward.process(batch, ctx)
    reward.teardown(ctx)
    out = decode(encode(out))

    ids = batch.sample_ids()
    assert rm.seen == [[ids[1], ids[2]]]  # once per micro-batch, only its rows
    assert rewardfns.CALLS == [(["math", "other", "math"], ["12", "abc", "7"])]
    rm1, rm2 = direct_rm_score(topo, batch, 1), direct_rm_score(topo, batch, 2)
    np.testing.assert_allclose(out.rewards, [2.0, rm1, rm2 + 3.0, 1.0], atol=1e-4)
    np.testing.assert_allclose(out.reward_metrics["rule"], [2.0, 0.0, 3.0, 1.0])
    np.testing.assert_allclose(out.reward_metrics["rm"], [0.0, rm1, rm2, 0.0], atol=1e-4)
    assert out.info[ROUTED_INFO_PREFIX + "rm"].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert out.info[ROUTED_INFO_PREFIX + "rule"].tolist() == [1.0, 0.0, 1.0, 1.0]


# source a = len(label), b = -len(prompt); the "solo" label goes to a only.
# row 0: label "aa", prompt "p"   -> a 2, b -1;  row 1: "solo", "qqq" -> a 4 (b none);  row 2: "aa", "rr" -> a 2, b -2
@pytest.mark.parametrize(("combine", "extra", "expected"), [
    ("sum", {}, [1.0, 4.0, 0.0]),
    ("mean", {}, [0.5, 4.0, 0.0]),
    ("max", {}, [2.0, 4.0, 2.0]),
    ("weighted", {"weights": {"a": 0.5, "b": 2.0}}, [-1.0, 2.0, -3.0]),
    ("tests.rewardfns:nan_aware_min", {}, [-1.0, 4.0, -2.0]),
])
def test_every_combine_rule_over_the_sources_that_scored_each_sample(cache, combine, extra, expected):
    cfg = {"sources": {"a": {"kind": "fn", "fn": "tests.rewardfns:label_length"},
                       "b": {"kind": "fn", "fn": "tests.rewardfns:minus_prompt_length"}},
           "recipe": {"solo": ["a"], "*": ["a", "b"]}, "combine": combine, **extra}
    out = run_stage(rewards_topology(cache, cfg), make_batch(["aa", "solo", "aa"], prompts=["p", "qqq", "rr"]))
    np.testing.assert_allclose(out.rewards, expected)
    assert out.reward_metrics["a"].tolist() == [2.0, 4.0, 2.0]
    assert out.reward_metrics["b"].tolist() == [-1.0, 0.0, -2.0]  # 0.0 placeholder where not routed
    assert out.info[ROUTED_INFO_PREFIX + "b"].tolist() == [1.0, 0.0, 1.0]


def test_without_a_recipe_every_source_scores_every_sample_and_no_mask_is_written(cache):
    cfg = {"sources": {"a": {"kind": "fn", "fn": "tests.rewardfns:label_length"}}}
    out = run_stage(rewards_topology(cache, cfg), make_batch(["abc", "de"]))
    assert out.rewards.tolist() == [3.0, 2.0]
    assert out.reward_metrics == {"a": pytest.approx([3.0, 2.0])}  # kept even for a single named source
    assert not any(k.startswith(ROUTED_INFO_PREFIX) for k in (out.info or {}))


def test_a_label_without_a_route_is_a_poison_sample_naming_it(cache):
    cfg = {"sources": {"a": {"kind": "fn", "fn": "tests.rewardfns:label_length"}}, "recipe": {"math": ["a"]}}
    ctx = make_context(rewards_topology(cache, cfg), "reward")
    reward.setup(ctx)
    with pytest.raises(PoisonRecordError, match=r"g#1 \(label 'chat'\).*rewards.recipe"):
        reward.process(make_batch(["math", "chat"]), ctx)
    [alone] = reward.process(make_batch(["math"]), ctx)  # the bisected good half goes through
    assert alone.rewards.tolist() == [4.0]


@pytest.mark.parametrize("combine", ["sum", "mean"])
def test_sources_null_keeps_the_models_reward_and_reward_fn_behaviour(cache, combine):
    topo = load_topology(overrides=[cache, "models.reward_fn=tests.rewardfns:label_length",
                                    f"models.reward_combine={combine}"])
    batch = make_batch(["abc", "de", "f"])
    out = run_stage(topo, batch)
    model = np.array([direct_rm_score(topo, batch, i) for i in range(3)], np.float32)
    fn = np.array([3.0, 2.0, 1.0], np.float32)
    assert set(out.reward_metrics) == {"model", "fn"}
    np.testing.assert_allclose(out.reward_metrics["model"], model, atol=1e-4)
    assert out.reward_metrics["fn"].tolist() == fn.tolist()
    expected = np.stack([out.reward_metrics["model"], fn])
    expected = expected.mean(0) if combine == "mean" else expected.sum(0)
    assert out.rewards.tobytes() == expected.astype(np.float32).tobytes()  # the pre-rewards-block formula, bit for bit
    assert not out.info


def test_sources_null_with_one_source_writes_no_metrics(cache):
    topo = load_topology(overrides=[cache, "models.reward=null", "models.reward_fn=tests.rewardfns:label_length"])
    out = run_stage(topo, make_batch(["abc", "de"]))
    assert out.rewards.tolist() == [3.0, 2.0] and not out.reward_metrics


FN = {"kind": "fn", "fn": "tests.rewardfns:label_length"}


@pytest.mark.parametrize(("rewards", "extra", "field"), [
    ({"sources": {"a": {"kind": "judge"}}}, [], "rewards.sources.a.kind"),
    ({"sources": {"a": {"kind": "model"}}}, [], "rewards.sources.a.path"),
    ({"sources": {"a": {"kind": "model", "path": "builtin:tiny", "url": "http://x"}}}, [], "rewards.sources.a.url"),
    ({"sources": {"a": {"kind": "model", "pth": "builtin:tiny"}}}, [], "rewards.sources.a.pth"),
    ({"sources": {"a": {"kind": "fn", "fn": "no_colon"}}}, [], "rewards.sources.a.fn"),
    ({"sources": {"a": {"kind": "http", "url": "127.0.0.1:80"}}}, [], "rewards.sources.a.url"),
    ({"sources": {"a": {"kind": "http", "url": "http://h:1", "max_in_flight": 0}}}, [], "rewards.sources.a.max_in_flight"),
    ({"sources": {"a b": FN}}, [], "rewards.sources.a b"),
    ({"sources": {}}, [], "rewards.sources"),
    ({"sources": {"a": FN}, "recipe": {"math": ["nope"]}}, [], "rewards.recipe.math.nope"),
    ({"sources": {"a": FN}, "recipe": {"math": []}}, [], "rewards.recipe.math"),
    ({"sources": {"a": FN}, "weights": {"nope": 1.0}, "combine": "weighted"}, [], "rewards.weights.nope"),
    ({"sources": {"a": FN, "b": FN}, "weights": {"a": 1.0}, "combine": "weighted"}, [], "rewards.weights.b"),
    ({"sources": {"a": FN}, "weights": {"a": 1.0}}, [], "rewards.weights"),
    ({"sources": {"a": FN}, "combine": "median"}, [], "rewards.combine"),
    ({"recipe": {"math": ["a"]}}, [], "rewards.recipe"),
    ({"combine": "max"}, [], "rewards.combine"),
    ({"sources": {"a": FN}}, ["models.reward_fn=tests.rewardfns:label_length"], "models.reward_fn"),
])
def test_bad_rewards_blocks_name_the_field_and_the_fix(cache, rewards, extra, field):
    with pytest.raises(ConfigError) as err:
        rewards_topology(cache, rewards, *extra)
    assert err.value.field == field, str(err.value)
    assert field in str(err.value)
    assert err.value.fix or "valid" in str(err.value), str(err.value)  # a fix, or the list of valid keys


@pytest.mark.parametrize(("source", "combine", "field"), [
    ({"kind": "model", "path": "/nonexistent/rm"}, "sum", "rewards.sources.a.path"),
    ({"kind": "fn", "fn": "tests.rewardfns:no_such_function"}, "sum", "rewards.sources.a.fn"),
    ({"kind": "fn", "fn": "no_such_module_xyz:f"}, "sum", "rewards.sources.a.fn"),
    (FN, "tests.rewardfns:no_such_combine", "rewards.combine"),
])
def test_what_the_sources_name_outside_the_file_is_checked_before_the_run(cache, source, combine, field):
    topo = rewards_topology(cache, {"sources": {"a": source}, "combine": combine})
    with pytest.raises(ConfigError) as err:
        check_models(topo)
    assert err.value.field == field and err.value.fix


def test_set_reaches_inside_the_rewards_block(cache):
    topo = load_topology(overrides=[cache, "rewards.sources.rm.kind=model", "rewards.sources.rm.path=builtin:tiny",
                                    "rewards.sources.rule.kind=fn", "rewards.sources.rule.fn=tests.rewardfns:label_length",
                                    "rewards.combine=weighted", "rewards.weights.rm=0.25", "rewards.weights.rule=1",
                                    "rewards.recipe.math=[rule]", "rewards.recipe.*=[rm, rule]"])
    assert list(topo.rewards.sources) == ["rm", "rule"]
    assert topo.rewards.weights == {"rm": 0.25, "rule": 1.0}
    assert topo.rewards.route_of("math") == ["rule"] and topo.rewards.route_of("chat") == ["rm", "rule"]
    check_models(topo)
    build_builtin_models(topo)  # builds the tiny reward model the rm source loads
    with pytest.raises(ConfigError, match=r"rewards\.nope"):
        load_topology(overrides=["rewards.nope=1"])


def test_an_http_source_without_the_client_module_is_a_config_error(cache, monkeypatch):
    topo = rewards_topology(cache, {"sources": {"judge": {"kind": "http", "url": "http://127.0.0.1:9"}}})
    monkeypatch.setitem(sys.modules, "expstream.rewards.http_client", None)  # as if the module were not installed
    with pytest.raises(ConfigError) as err:
        build_sources(topo, make_context(topo, "reward"))
    assert err.value.field == "rewards.sources.judge.kind" and "rewards.http_client" in str(err.value)


def test_the_documented_recipe_example_loads(cache):
    """examples/recipe.yaml, the seed's recipe as docs/reward.md shows it, is a valid topology."""
    from pathlib import Path

    topo = load_topology(Path(__file__).resolve().parents[1] / "examples" / "recipe.yaml", overrides=[cache])
    check_models(topo)
    assert topo.rewards.route_of("math") == ["rule"] and topo.rewards.route_of("chat") == ["rm"]


@pytest.mark.e2e
@pytest.mark.integration
def test_recipe_through_expstream_run_scores_by_route_and_dead_letters_only_the_unrouted_group(tmp_path, model_cache):
    """Real broker and redis-server: math -> rule, chat -> rm, a label with no route -> its samples alone
    to the dead-letter topic (the micro-batch is bisected); every other sample once, with both metrics."""
    import json
    from collections import Counter
    from pathlib import Path

    from expstream import read_experiences

    root = Path(__file__).resolve().parents[1]
    topo = tmp_path / "topology.yaml"
    topo.write_text(yaml.safe_dump({"rewards": {
        "sources": {"rm": {"kind": "model", "path": "builtin:tiny"},
                    "rule": {"kind": "fn", "fn": "expstream.rewards:reference_in_response"}},
        "recipe": {"math": ["rule"], "chat": ["rm"]}}}))
    prompts = tmp_path / "p.jsonl"
    rows = [{"id": "m1", "prompt": "What is 2 + 3?", "label": "math", "reference": "5"},
            {"id": "m2", "prompt": "What is 1 + 1?", "label": "math", "reference": "e"},
            {"id": "c1", "prompt": "Say hello.", "label": "chat"},
            {"id": "poem", "prompt": "A line about the sea.", "label": "poem"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, out = run_expstream(tmp_path, "--topology", str(topo), prompts=prompts, cache=model_cache, cwd=root,
                              sets=["generate.n_samples_per_prompt=2", "generate.max_new_tokens=6",
                                    "run.prompt_batch_size=4", "run.timeout_s=120", "run.max_lost_group_share=0.5"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_dead_lettered"] == ["poem"] and summary["groups_complete"] == 3
    assert summary["lost_groups"]["poem"].startswith("dead letter from reward: ")
    exps = read_experiences(out / "experiences.msgpack")
    ids = Counter(s for e in exps for s in e.sample_ids)
    assert set(ids) == {f"{g}#{k}" for g in ("m1", "m2", "c1") for k in range(2)} and set(ids.values()) == {1}
    seen = set()
    for e in exps:
        for i, sid in enumerate(e.sample_ids):
            info = {k: float(v[i]) for k, v in e.info.items()}
            raw, rm, rule = info["reward"], info["reward_metrics.rm"], info["reward_metrics.rule"]
            if sid.startswith("m"):
                assert (info["reward_routed.rule"], info["reward_routed.rm"]) == (1.0, 0.0)
                assert rm == 0.0 and rule in (0.0, 1.0) and raw == rule
            else:
                assert (info["reward_routed.rule"], info["reward_routed.rm"]) == (0.0, 1.0)
                assert rule == 0.0 and raw == pytest.approx(rm) and rm != 0.0
            seen.add(sid[0])
    assert seen == {"m", "c"}


def test_an_http_source_in_a_recipe_gets_only_its_rows_from_a_real_server(cache):
    """A real aiohttp server on a loopback port (serve-reward's app, len(label) per item) next to a fn source."""
    from expstream.rewards.server import FnScorer, ServerThread

    srv = ServerThread(FnScorer("tests.rewardfns_http:label_length"))
    url = srv.start()
    try:
        cfg = {"sources": {"judge": {"kind": "http", "url": url, "batch_size": 1, "max_in_flight": 2},
                           "rule": {"kind": "fn", "fn": "tests.rewardfns:minus_prompt_length"}},
               "recipe": {"chat": ["judge"], "*": ["judge", "rule"]}, "combine": "sum"}
        topo = rewards_topology(cache, cfg)
        ctx = make_context(topo, "reward")
        reward.setup(ctx)
        sources = ctx.models["reward_sources"]
        sources["judge"] = judge = Recorder(sources["judge"])
        batch = make_batch(["chat", "maths", "chat"], prompts=["p", "qq", "rrr"])
        [out] = reward.process(batch, ctx)
        reward.teardown(ctx)
    finally:
        srv.stop()
    assert judge.seen == [batch.sample_ids()]  # every row is routed to the judge: one call, the whole batch
    assert out.reward_metrics["judge"].tolist() == [4.0, 5.0, 4.0]  # len("chat"), len("maths")
    assert out.reward_metrics["rule"].tolist() == [0.0, -2.0, 0.0]  # only "maths" goes to rule
    assert out.rewards.tolist() == [4.0, 3.0, 4.0]
