"""The weight store, the policy announcement and hot reload in the stages (issue 9, "weights flow back").

Store tests use a temporary directory; followers use the real redis-server (``redis_state``);
announce uses the real broker. Expected values are computed here independently: hashes with
hashlib, log-probs and greedy tokens with plain per-row forward loops over a freshly loaded model.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pytest
import torch

from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.models.hf import load_causal_lm, load_critic
from expstream.models.resolve import model_dir
from expstream.train.weights import (
    POLICY_TOPIC,
    CorruptWeightsError,
    DirectoryWeightStore,
    Manifest,
    PolicyFollower,
    VersionGoneError,
    WeightStoreError,
    announce,
    open_store,
    prune_versions,
    read_policy_log,
    refresh_weights,
    retained_versions,
)
from schemas import PromptBatch, Ragged, SampleBatch
from stages import actor_logprob, critic, generate
from stages.context import make_context
from tests.tensors import Small, small_state_dict


# --- the store -------------------------------------------------------------------------------------
def test_publish_writes_a_hashed_manifest_and_loads_back(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    sd = small_state_dict()
    m = store.publish("actor", 1, sd, step=0, offsets={"experiences[0]": [0, 7]}, run_id="r1")
    path = tmp_path / "v000001" / "model.safetensors"
    assert m.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert (m.version, m.step, m.role, m.dtype, m.run_id) == (1, 0, "actor", "float32", "r1")
    assert m.offsets == {"experiences[0]": [0, 7]}
    assert store.manifest("actor", 1) == m
    assert Manifest.from_dict(m.to_dict()) == m
    loaded = store.load("actor", 1)
    assert set(loaded) == set(sd)
    for k in sd:
        assert torch.equal(loaded[k], sd[k])
    assert store.versions("actor") == [1] and store.latest("actor") == 1
    assert store.versions("critic") == [] and store.latest("critic") is None


def test_half_written_publication_is_not_a_version(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    store.publish("actor", 1, small_state_dict(), step=0, offsets={}, run_id="r")
    # a trainer killed mid-publication leaves its temporary directory (and maybe a bare version dir)
    leftover = tmp_path / ".tmp-deadbeef"
    leftover.mkdir()
    (leftover / "model.safetensors").write_bytes(b"partial")
    (tmp_path / "v000002").mkdir()  # no manifest: never completed
    assert store.versions("actor") == [1]
    assert store.latest("actor") == 1
    with pytest.raises(CorruptWeightsError, match="v000002"):
        store.load("actor", 2)


def test_a_version_is_written_once(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    first = store.publish("actor", 1, small_state_dict(0), step=0, offsets={}, run_id="r")
    with pytest.raises(WeightStoreError, match="already exists"):
        store.publish("actor", 1, small_state_dict(1), step=0, offsets={}, run_id="r")
    assert store.manifest("actor", 1).sha256 == first.sha256
    assert torch.equal(store.load("actor", 1)["lin.bias"], small_state_dict(0)["lin.bias"])
    with pytest.raises(WeightStoreError, match="start at 1"):
        store.publish("actor", 0, small_state_dict(), step=0, offsets={}, run_id="r")
    with pytest.raises(WeightStoreError, match="unknown weight role"):
        store.publish("reward", 1, small_state_dict(), step=0, offsets={}, run_id="r")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_corrupt_and_truncated_files_are_refused_naming_file_and_fix(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    store.publish("actor", 1, small_state_dict(), step=0, offsets={}, run_id="r")
    store.publish("actor", 2, small_state_dict(1), step=1, offsets={}, run_id="r")
    f1 = tmp_path / "v000001" / "model.safetensors"
    data = bytearray(f1.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit of a weight
    f1.write_bytes(bytes(data))
    with pytest.raises(CorruptWeightsError) as err:
        store.load("actor", 1)
    assert str(f1) in str(err.value) and "sha256" in str(err.value) and "fix:" in str(err.value)
    f2 = tmp_path / "v000002" / "model.safetensors"
    f2.write_bytes(f2.read_bytes()[:40])  # half written
    with pytest.raises(CorruptWeightsError) as err:
        store.load("actor", 2)
    assert str(f2) in str(err.value) and "fix:" in str(err.value)
    with pytest.raises(CorruptWeightsError, match="missing"):
        store.load("actor", 3)


def test_discard_after_removes_unannounced_leftovers(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    for v in (1, 2, 3):
        store.publish("actor", v, small_state_dict(v), step=v - 1, offsets={}, run_id="r")
    (tmp_path / ".tmp-x").mkdir()
    assert store.discard_after("actor", 1) == [2, 3]
    assert store.versions("actor") == [1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000001"]
    store.publish("actor", 2, small_state_dict(9), step=1, offsets={}, run_id="r")  # republished after a resume
    assert torch.equal(store.load("actor", 2)["lin.bias"], small_state_dict(9)["lin.bias"])


# --- retention (issue 21 item 6) -------------------------------------------------------------------
def test_retention_keeps_the_newest_versions_and_the_checkpoints():
    assert retained_versions([1, 2, 3, 4, 5, 6], keep=3, checkpoint=2) == {2, 4, 5, 6}
    assert retained_versions([1, 2, 3, 4, 5, 6], keep=3, checkpoint=6) == {4, 5, 6}
    assert retained_versions([5, 1, 3], keep=1, checkpoint=None) == {5}
    assert retained_versions([1, 2], keep=5, checkpoint=None) == {1, 2}
    assert retained_versions([1, 2, 3], keep=0, checkpoint=1) == {1, 2, 3}  # 0: every version
    assert retained_versions([3, 4], keep=1, checkpoint=2) == {4}  # a checkpoint version not in the store


def test_prune_deletes_whole_versions_and_a_deleted_version_is_gone(tmp_path):
    store = DirectoryWeightStore(tmp_path)
    for v in range(1, 7):
        store.publish("actor", v, small_state_dict(v), step=v - 1, offsets={}, run_id="r")
        store.publish("critic", v, small_state_dict(10 + v), step=v - 1, offsets={}, run_id="r")
    assert prune_versions(store, "actor", keep=2, checkpoint=3) == [1, 2, 4]
    assert store.versions("actor") == [3, 5, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["critic", "v000003", "v000005", "v000006"]
    assert store.versions("critic") == [1, 2, 3, 4, 5, 6]  # per role
    with pytest.raises(VersionGoneError, match="v1: .* is missing: deleted by retention"):
        store.load("actor", 1)
    assert store.delete("actor", 1) is False  # idempotent
    assert torch.equal(store.load("actor", 5)["lin.bias"], small_state_dict(5)["lin.bias"])


class RacingStore(DirectoryWeightStore):
    """A real directory store in which the trainer runs ahead while a follower loads: the first load of
    ``version`` first publishes and announces ``newer`` and deletes ``version`` (what retention does)."""

    def __init__(self, root, state, version: int, newer: int) -> None:
        super().__init__(root)
        self.state, self.version, self.newer, self.raced = state, version, newer, False

    def load(self, role, version):
        if version == self.version and not self.raced:
            self.raced = True
            self.publish(role, self.newer, small_state_dict(self.newer), step=self.newer - 1, offsets={}, run_id="r")
            self.state.set_policy_version(self.newer)
            prune_versions(self, role, keep=1, checkpoint=None)
        return super().load(role, version)


def test_a_follower_whose_version_is_deleted_while_loading_loads_the_newest_instead(tmp_path, redis_state, caplog):
    store = RacingStore(tmp_path, redis_state, version=2, newer=3)
    for v in (1, 2):
        store.publish("actor", v, small_state_dict(v), step=v - 1, offsets={}, run_id="r")
    redis_state.set_policy_version(2)
    model = Small()
    follower = PolicyFollower(store, redis_state, "actor", model, logging.getLogger("test.gone"))
    with caplog.at_level(logging.INFO, logger="test.gone"):
        assert follower.refresh() == 3
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("v2 was deleted before it could be loaded" in r.getMessage() for r in caplog.records)
    assert torch.equal(model.lin.bias.detach(), small_state_dict(3)["lin.bias"])
    assert store.versions("actor") == [3]


def test_open_store(tmp_path):
    assert isinstance(open_store(str(tmp_path)), DirectoryWeightStore)
    assert open_store(f"file://{tmp_path}").root == tmp_path
    for bad in ("gs://bucket/weights", "s3:", "s3:/bucket", "s3://", "s3://B"):
        with pytest.raises(ConfigError, match="train.weight_store"):
            open_store(bad)


def test_tied_weights_are_stored(tmp_path):
    shared = torch.randn(5, 2)
    store = DirectoryWeightStore(tmp_path)
    store.publish("actor", 1, {"emb.weight": shared, "head.weight": shared}, step=0, offsets={}, run_id="r")
    loaded = store.load("actor", 1)
    assert torch.equal(loaded["emb.weight"], shared) and torch.equal(loaded["head.weight"], shared)


# --- followers -------------------------------------------------------------------------------------
def test_follower_keeps_previous_weights_on_a_corrupt_version_then_loads_the_next(tmp_path, redis_state, caplog):
    store = DirectoryWeightStore(tmp_path)
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    follower = PolicyFollower(store, redis_state, "actor", model, logging.getLogger("test.follower"))
    assert follower.refresh() == 0 and follower.reloads == 0

    store.publish("actor", 1, small_state_dict(1), step=0, offsets={}, run_id="r")
    f = tmp_path / "v000001" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-4])
    redis_state.set_policy_version(1)
    with caplog.at_level(logging.INFO, logger="test.follower"):
        assert follower.refresh() == 0
        assert follower.refresh() == 0  # not retried: no second log line
    refusals = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(refusals) == 1 and "refused actor v1" in refusals[0].getMessage()
    assert str(f) in refusals[0].getMessage()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])

    caplog.clear()
    store.publish("actor", 2, small_state_dict(2), step=1, offsets={}, run_id="r")
    redis_state.set_policy_version(2)
    with caplog.at_level(logging.INFO, logger="test.follower"):
        assert follower.refresh() == 2
    assert follower.version == 2 and follower.reloads == 1 and follower.last_reload_s is not None
    want = small_state_dict(2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k])
    assert any("v0 -> v2" in r.getMessage() for r in caplog.records)
    assert redis_state.counters()["reloads:actor"] == 1


def test_weights_of_another_shape_are_refused_leaving_every_weight(tmp_path, redis_state, caplog):
    store = DirectoryWeightStore(tmp_path)
    model = Small()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    # the bias fits, the weight does not: nothing may be copied
    store.publish("actor", 1, {"lin.weight": torch.ones(2, 4), "lin.bias": torch.ones(3)}, step=0, offsets={},
                  run_id="r")
    redis_state.set_policy_version(1)
    follower = PolicyFollower(store, redis_state, "actor", model, logging.getLogger("test.shape"))
    with caplog.at_level(logging.ERROR, logger="test.shape"):
        assert follower.refresh() == 0
    assert "lin.weight" in caplog.records[0].getMessage()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_announced_but_missing_actor_version_is_refused(tmp_path, redis_state, caplog):
    follower = PolicyFollower(DirectoryWeightStore(tmp_path), redis_state, "actor", Small(),
                              logging.getLogger("test.missing"))
    redis_state.set_policy_version(1)
    with caplog.at_level(logging.ERROR, logger="test.missing"):
        assert follower.refresh() == 0
    assert "missing" in caplog.records[0].getMessage()


def test_critic_follower_loads_only_what_the_store_has(tmp_path, redis_state, caplog):
    store = DirectoryWeightStore(tmp_path)
    model = Small()
    follower = PolicyFollower(store, redis_state, "critic", model, logging.getLogger("test.critic"))
    redis_state.set_policy_version(1)  # a trainer that does not train the critic: quietly stays
    with caplog.at_level(logging.WARNING, logger="test.critic"):
        assert follower.refresh() == 0
    assert not caplog.records
    store.publish("critic", 1, small_state_dict(5), step=0, offsets={}, run_id="r")
    redis_state.set_policy_version(2)  # actor v2 announced; the critic has v1 at most
    assert follower.refresh() == 1
    assert torch.equal(model.lin.bias.detach(), small_state_dict(5)["lin.bias"])


def test_announce_logs_on_the_policy_topic_and_sets_the_version(tmp_path, broker, fresh_topic, kafka_cfg,
                                                                  redis_state):
    assert POLICY_TOPIC == "policy"
    topic = fresh_topic(1)
    store = DirectoryWeightStore(tmp_path)
    m1 = store.publish("actor", 1, small_state_dict(1), step=0, offsets={"experiences[0]": [0, 3]}, run_id="run-a")
    c1 = store.publish("critic", 1, small_state_dict(2), step=0, offsets={"experiences[0]": [0, 3]}, run_id="run-a")
    announce(c1, bootstrap=broker, kafka_config=kafka_cfg, state=redis_state, topic=topic)
    assert redis_state.policy_version() == 0  # a critic alone does not move the policy version
    announce(m1, bootstrap=broker, kafka_config=kafka_cfg, state=redis_state, topic=topic)
    assert redis_state.policy_version() == 1
    assert read_policy_log(broker, kafka_cfg, topic) == [c1, m1]


def test_announce_with_the_callers_producer_leaves_it_open(tmp_path, broker, fresh_topic, kafka_cfg, redis_state):
    """The trainer keeps one producer for its life (it made and closed one per step): ``announce`` sends through
    a given producer and does not close it, so the next announcement goes through the same one."""
    from expstream.kafka.clients import make_producer, send_and_confirm

    topic = fresh_topic(1)
    store = DirectoryWeightStore(tmp_path)
    manifests = [store.publish("actor", v, small_state_dict(v), step=v - 1, offsets={}, run_id="run-p")
                 for v in (1, 2, 3)]
    producer = make_producer(broker, kafka_cfg)
    try:
        for m in manifests:
            announce(m, bootstrap=broker, kafka_config=kafka_cfg, state=redis_state, topic=topic, producer=producer)
            assert redis_state.policy_version() == m.version
        other = fresh_topic(1)
        assert send_and_confirm(producer, other, b"still open").offset == 0  # a closed producer refuses to send
    finally:
        producer.close()
    assert read_policy_log(broker, kafka_cfg, topic) == manifests


# --- hot reload in the stages (the test) -------------------------------------------------
def loop_topology(cache, store_dir, *extra):
    return load_topology(overrides=[f"models.cache_dir={cache}", "train.enabled=true",
                                    f"train.weight_store={store_dir}", "generate.n_samples_per_prompt=2",
                                    "run.prompt_batch_size=2", "train.batch_size=4", *extra])


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def fresh_actor(topo, state_dict):
    model = load_causal_lm(model_dir(topo, "actor"))
    model.load_state_dict(state_dict, strict=True)
    return model


def publish_and_announce(store, state_dict, version, broker, kafka_cfg, state, topic, role="actor"):
    m = store.publish(role, version, state_dict, step=version - 1, offsets={}, run_id="t")
    announce(m, bootstrap=broker, kafka_config=kafka_cfg, state=state, topic=topic)


def reference_log_probs(model, prompts, actions) -> list[np.ndarray]:
    """log p(a_t | prompt, a_<t) row by row, without padding (independent of the stage's layouts)."""
    out = []
    with torch.no_grad():
        for p, a in zip(prompts, actions, strict=True):
            ids = torch.tensor([list(p) + list(a)])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            pos = torch.arange(len(p) - 1, len(p) + len(a) - 1)
            out.append(logp[pos, torch.tensor(list(a))].numpy())
    return out


def logprob_batch(eos: int, pad: int) -> SampleBatch:
    prompts = [[5, 17, 30, 8], [12, 40]]
    actions = [[21, 22, 23, eos], [33, 34, 35, 36, 37, eos]]
    i32 = lambda rows: Ragged.from_rows([np.asarray(r, np.int32) for r in rows], "int32")  # noqa: E731
    return SampleBatch(
        batch_id="p000000/m0", policy_version=0, n_samples_per_prompt=1, eos_token_id=eos, pad_token_id=pad,
        prompt_id=["a", "b"], group_id=["a", "b"], sample_index=[0, 0], prompt=["x", "y"], label=["", ""],
        reference=["", ""], response=["r", "s"], prompt_ids=i32(prompts), response_ids=i32(actions),
        layout="padded", action_ids=i32(actions),
        action_mask=Ragged.from_rows([np.ones(len(a), bool) for a in actions], "bool"))


def test_hot_reload_actor_logprob(model_cache, tmp_path, redis_state, broker, fresh_topic, kafka_cfg):
    topo = loop_topology(model_cache, tmp_path / "weights")
    topic = fresh_topic(1)
    ctx = make_context(topo, "actor-logprob", state=redis_state)
    actor_logprob.setup(ctx)
    follower = ctx.models["actor_follower"]
    assert follower is not None and follower.version == 0
    model = ctx.models["lm"]
    batch = logprob_batch(int(model.config.eos_token_id), int(model.config.pad_token_id))
    prompts, actions = [r.tolist() for r in batch.prompt_ids.rows()], [r.tolist() for r in batch.action_ids.rows()]

    [out0] = actor_logprob.process(batch, ctx)
    assert follower.version == 0
    v0 = out0.action_log_probs.rows()

    new_weights = perturbed(model, seed=1)
    publish_and_announce(DirectoryWeightStore(tmp_path / "weights"), new_weights, 1, broker, kafka_cfg,
                         redis_state, topic)
    [out1] = actor_logprob.process(batch, ctx)
    assert follower.version == 1 and refresh_weights(ctx, "actor") == 1
    if hasattr(out1, "logprob_version"):  # the wire part's stamp
        assert list(out1.logprob_version) == [1, 1]
    want = reference_log_probs(fresh_actor(topo, new_weights), prompts, actions)
    for got, ref, old in zip(out1.action_log_probs.rows(), want, v0, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)
        assert np.abs(got - old).max() > 1e-2  # really the new weights, not version 0's
    print(f"\nactor-logprob reload of the tiny actor: {follower.last_reload_s * 1000:.1f} ms")


def greedy_reference(model, prompts, max_new, stops, suppress) -> list[list[int]]:
    """Greedy decoding one prompt at a time, by argmax (min_new_tokens = 1: no stop as first token)."""
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            gen: list[int] = []
            for step in range(max_new):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float().clone()
                logits[suppress] = -float("inf")
                if step == 0:
                    logits[stops] = -float("inf")
                tok = int(torch.argmax(logits))
                gen.append(tok)
                ids.append(tok)
                if tok in stops:
                    break
            out.append(gen)
    return out


def test_hot_reload_generate(model_cache, tmp_path, redis_state, broker, fresh_topic, kafka_cfg):
    topo = loop_topology(model_cache, tmp_path / "weights", "generate.temperature=0", "generate.max_new_tokens=8")
    topic = fresh_topic(1)
    ctx = make_context(topo, "generate", state=redis_state)
    generate.setup(ctx)
    gen = ctx.models["generator"]
    batch = PromptBatch(batch_id="p000000", prompt_id=["0", "1"], prompt=["the cat", "a dog sat on"],
                        label=["", ""], reference=["", ""])
    [out0] = generate.process(batch, ctx)
    assert out0.policy_version == 0
    new_weights = perturbed(gen.model, seed=2)
    publish_and_announce(DirectoryWeightStore(tmp_path / "weights"), new_weights, 1, broker, kafka_cfg,
                         redis_state, topic)
    [out1] = generate.process(batch, ctx)
    assert out1.policy_version == 1
    if hasattr(out1, "rollout_version"):  # the wire part's stamp
        assert list(out1.rollout_version) == [1] * 4
    prompts = [r.tolist() for r in out1.prompt_ids.rows()]
    want = greedy_reference(fresh_actor(topo, new_weights), prompts, 8, gen.stop_token_ids, gen.suppress_token_ids)
    got = [r.tolist() for r in out1.response_ids.rows()]
    assert got == want
    assert got != [r.tolist() for r in out0.response_ids.rows()]
    print(f"\ngenerate reload of the tiny actor: {ctx.models['actor_follower'].last_reload_s * 1000:.1f} ms")


def test_critic_stage_reloads_a_published_critic(model_cache, tmp_path, redis_state, broker, fresh_topic,
                                                 kafka_cfg):
    topo = loop_topology(model_cache, tmp_path / "weights")
    topic = fresh_topic(1)
    ctx = make_context(topo, "critic", state=redis_state)
    critic.setup(ctx)
    model = ctx.models["critic"]
    batch = logprob_batch(int(model.config.eos_token_id), int(model.config.pad_token_id))
    store = DirectoryWeightStore(tmp_path / "weights")
    new_weights = perturbed(model, seed=3)
    publish_and_announce(store, new_weights, 1, broker, kafka_cfg, redis_state, topic, role="critic")
    publish_and_announce(store, perturbed(load_causal_lm(model_dir(topo, "actor")), 4), 1, broker, kafka_cfg,
                         redis_state, topic)
    [out] = critic.process(batch, ctx)
    assert ctx.models["critic_follower"].version == 1
    ref = load_critic(model_dir(topo, "critic"))
    ref.load_state_dict(new_weights, strict=True)
    with torch.no_grad():
        for row, p, a in zip(out.values.rows(), batch.prompt_ids.rows(), batch.action_ids.rows(), strict=True):
            ids = torch.tensor([p.tolist() + a.tolist()])
            values = ref(input_ids=ids).logits[0, :, 0]
            # V_t is read at the position before action t
            np.testing.assert_allclose(row, values[len(p) - 1: len(p) + len(a) - 1].numpy(), atol=1e-5)


def test_no_follower_without_the_loop(model_cache, redis_state):
    topo = load_topology(overrides=[f"models.cache_dir={model_cache}"])
    ctx = make_context(topo, "actor-logprob", state=redis_state)
    actor_logprob.setup(ctx)
    assert ctx.models["actor_follower"] is None
    redis_state.set_policy_version(3)  # an external trainer's PipelineControl announcement
    assert refresh_weights(ctx, "actor") == 3


def test_reload_time_of_the_tiny_actor(model_cache, tmp_path, redis_state):
    """Measured, never asserted as a time: the seconds of one verified in-place reload."""
    topo = loop_topology(model_cache, tmp_path / "weights")
    model = load_causal_lm(model_dir(topo, "actor"))
    store = DirectoryWeightStore(tmp_path / "weights")
    follower = PolicyFollower(store, redis_state, "actor", model)
    times = []
    for v in range(1, 6):
        store.publish("actor", v, perturbed(model, v), step=v - 1, offsets={}, run_id="t")
        redis_state.set_policy_version(v)
        t0 = time.perf_counter()
        assert follower.refresh() == v
        times.append(time.perf_counter() - t0)
    size = (tmp_path / "weights" / "v000001" / "model.safetensors").stat().st_size
    print(f"\nreload of the tiny actor ({size / 1e6:.2f} MB): median {sorted(times)[2] * 1000:.1f} ms")
