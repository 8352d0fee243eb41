"""The object store (issue 23): s3:// weight and blob stores against a real S3-protocol server on
loopback (moto's server mode, tests/conftest.py ``s3_server``), the URL parser, and the preflight.

Each test opens its own bucket; the weights are tiny state dicts (no model is loaded here besides
the follower's small Linear), so the whole module costs a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import boto3
import pytest
import torch

from expstream.config.storeurl import parse_store
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.launch.preflight import check_stores
from expstream.models.blobs import MissingBlobError, ObjectBlobStore, blob_ref, open_blob_store
from expstream.models.objstore import ObjectStore, ObjectStoreError
from expstream.retry import Policy
from expstream.train.objweights import ObjectWeightStore
from expstream.train.weights import (
    CorruptWeightsError,
    PolicyFollower,
    VersionGoneError,
    WeightStoreError,
    open_store,
)
from tests.tensors import Small, small_state_dict


def s3_client(s3_server):
    env = s3_server.env()
    return boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])


def keys_of(s3_server, bucket_url: str) -> list[str]:
    resp = s3_client(s3_server).list_objects_v2(Bucket=bucket_url[len("s3://"):])
    return sorted(o["Key"] for o in resp.get("Contents", []))


# --- the URL parser (pure) -------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["s3:", "s3:/bucket", "s3://", "s3://B", "s3://user:pw@bucket/p", "gs://bucket",
                                 "http://host/x", "s3://bucket/../x"])
def test_store_values_that_are_not_urls_are_errors_not_directories(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="train.weight_store"):
        load_topology(overrides=[f"train.weight_store={bad}"])
    with pytest.raises(ConfigError, match="run.blob_store"):
        load_topology(overrides=[f"run.blob_store={bad}"])
    assert list(tmp_path.iterdir()) == []  # no directory named `s3:` (what the old code created)


def test_credentials_in_a_store_url_are_refused_without_echoing_them():
    with pytest.raises(ConfigError) as info:
        parse_store("s3://user:pw-secret@bucket/p", "train.weight_store")
    assert "pw-secret" not in str(info.value) and "no credentials" in str(info.value)


def test_store_values_parse():
    assert parse_store("s3://my-bucket/runs/a/", "f").url == "s3://my-bucket/runs/a"
    assert (parse_store("s3://my-bucket", "f").bucket, parse_store("s3://my-bucket", "f").prefix) == ("my-bucket", "")
    assert parse_store("relative/dir", "f").kind == "dir"
    assert parse_store("file:///abs/dir", "f").path == "/abs/dir"
    assert parse_store("./s3:", "f").kind == "dir"  # an explicit local path stays one


# --- weights -------------------------------------------------------------------------------------
def test_weights_publish_manifest_last_and_load_back(s3_server, s3_bucket):
    store = open_store(f"{s3_bucket}/w")
    assert isinstance(store, ObjectWeightStore)
    sd = small_state_dict(1)
    m = store.publish("actor", 1, sd, step=0, offsets={"experiences[0]": [0, 7]}, run_id="r1")
    store.publish("critic", 1, small_state_dict(2), step=0, offsets={}, run_id="r1")
    assert keys_of(s3_server, s3_bucket) == ["w/critic/v000001/manifest.json", "w/critic/v000001/model.safetensors",
                                             "w/v000001/manifest.json", "w/v000001/model.safetensors"]
    body = s3_client(s3_server).get_object(Bucket=s3_bucket[5:], Key="w/v000001/model.safetensors")["Body"].read()
    assert m.sha256 == hashlib.sha256(body).hexdigest()
    manifest = json.loads(s3_client(s3_server).get_object(Bucket=s3_bucket[5:], Key="w/v000001/manifest.json")
                          ["Body"].read())
    assert manifest["sha256"] == m.sha256 and manifest["offsets"] == {"experiences[0]": [0, 7]}
    loaded = store.load("actor", 1)
    assert all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert store.versions("actor") == [1] and store.versions("critic") == [1]
    with pytest.raises(WeightStoreError, match="written once"):
        store.publish("actor", 1, sd, step=0, offsets={}, run_id="r1")


def test_weights_without_a_manifest_are_not_a_version(s3_server, s3_bucket):
    """A publisher killed between its two PUTs leaves weights without a manifest: not listed, not
    loadable, removed by discard_after, and the version can be published again."""
    store = open_store(s3_bucket)
    store.publish("actor", 1, small_state_dict(1), step=0, offsets={}, run_id="r")
    s3_client(s3_server).put_object(Bucket=s3_bucket[5:], Key="v000002/model.safetensors", Body=b"half")
    assert store.versions("actor") == [1] and store.latest("actor") == 1
    with pytest.raises(VersionGoneError, match="v000002/manifest.json is missing"):
        store.load("actor", 2)
    assert store.discard_after("actor", 1) == []
    assert keys_of(s3_server, s3_bucket) == ["v000001/manifest.json", "v000001/model.safetensors"]
    store.publish("actor", 2, small_state_dict(2), step=1, offsets={}, run_id="r")
    assert store.versions("actor") == [1, 2]
    assert store.delete("actor", 1) and not store.delete("actor", 1)
    assert store.versions("actor") == [2]


def test_corrupt_weights_are_refused_and_the_follower_keeps_its_own(s3_server, s3_bucket, redis_state):
    store = open_store(s3_bucket)
    store.publish("actor", 1, small_state_dict(1), step=0, offsets={}, run_id="r")
    store.publish("actor", 2, small_state_dict(2), step=1, offsets={}, run_id="r")
    model = Small()
    follower = PolicyFollower(store, redis_state, "actor", model, logging.getLogger("test.s3"))
    redis_state.set_policy_version(1)
    assert follower.refresh() == 1
    assert torch.equal(model.lin.bias.detach(), small_state_dict(1)["lin.bias"])
    # v2's bytes replaced behind the manifest's back: the hash check refuses it, nothing is half loaded
    good = s3_client(s3_server).get_object(Bucket=s3_bucket[5:], Key="v000002/model.safetensors")["Body"].read()
    s3_client(s3_server).put_object(Bucket=s3_bucket[5:], Key="v000002/model.safetensors", Body=good[:-8] + b"\0" * 8)
    with pytest.raises(CorruptWeightsError, match="sha256"):
        store.load("actor", 2)
    redis_state.set_policy_version(2)
    assert follower.refresh() == 1
    assert torch.equal(model.lin.bias.detach(), small_state_dict(1)["lin.bias"])


def test_a_store_that_does_not_answer_is_retried_then_a_retriable_error(caplog):
    store_env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s3cr3t",
                 "AWS_DEFAULT_REGION": "us-east-1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in store_env.items():
            mp.setenv(k, v)
        store = ObjectStore(parse_store("s3://nobody-home/x", "f"),
                            read_retry=Policy(base_s=0.05, cap_s=0.1, give_up_s=0.3), client_retry={"max_retries": 0})
        with caplog.at_level(logging.WARNING, logger="expstream.objstore"), pytest.raises(ObjectStoreError) as info:
            store.get("v000001/model.safetensors")
    assert info.value.retriable  # the stage runner retries the record; nothing is dead-lettered for an outage
    assert "s3://nobody-home/x/v000001/model.safetensors" in str(info.value)
    assert len([r for r in caplog.records if "retry" in r.getMessage()]) >= 2
    assert "s3cr3t" not in str(info.value) + caplog.text


# --- blobs ---------------------------------------------------------------------------------------
def test_blobs_in_the_object_store(s3_server, s3_bucket):
    blobs = open_blob_store(f"{s3_bucket}/blobs")
    assert isinstance(blobs, ObjectBlobStore)
    ref = blobs.put(b"pixels")
    assert ref == blob_ref(b"pixels") and blobs.put(b"pixels") == ref  # stored once, same reference
    assert blobs.get(ref) == b"pixels" and blobs.exists(ref)
    digest = ref[len("sha256:"):]
    assert keys_of(s3_server, s3_bucket) == [f"blobs/{digest[:2]}/{digest}"]
    missing = blob_ref(b"never stored")
    assert not blobs.exists(missing)
    with pytest.raises(MissingBlobError, match="is not in s3://"):
        blobs.get(missing)
    s3_client(s3_server).put_object(Bucket=s3_bucket[5:], Key=f"blobs/{digest[:2]}/{digest}", Body=b"other")
    with pytest.raises(MissingBlobError, match="corrupt"):
        blobs.get(ref)


# --- preflight -----------------------------------------------------------------------------------
def test_preflight_names_the_store_and_the_fix_without_secrets(s3_server, s3_bucket, monkeypatch):
    check_stores({"train.weight_store": f"{s3_bucket}/w", "run.blob_store": "/some/dir"})  # answers: no error
    with pytest.raises(ConfigError) as info:
        check_stores({"train.weight_store": "s3://no-such-bucket-here/w"})
    text = str(info.value)
    assert "train.weight_store" in text and "s3://no-such-bucket-here/w" in text and "AWS_ENDPOINT_URL" in text
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    with pytest.raises(ConfigError) as info:
        check_stores({"run.blob_store": f"{s3_bucket}/b"}, timeout_s=2)
    text = str(info.value)
    assert f"{s3_bucket}/b" in text and "\n" not in text
    assert s3_server.env()["AWS_SECRET_ACCESS_KEY"] not in text and s3_server.env()["AWS_ACCESS_KEY_ID"] not in text


def test_run_with_an_unreachable_store_stops_before_any_stage(tmp_path, model_cache):
    from tests.harness import run_expstream

    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "kid", "AWS_SECRET_ACCESS_KEY": "s3cr3t-x",
           "AWS_DEFAULT_REGION": "us-east-1"}
    proc, out = run_expstream(tmp_path, "--continuous", cache=model_cache, env=env, timeout=120,
                              sets=["train.weight_store=s3://bucket-x/w"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "s3://bucket-x/w" in ln]
    assert len(lines) == 1 and "train.weight_store" in lines[0] and "AWS_ENDPOINT_URL" in lines[0]
    assert "s3cr3t-x" not in proc.stderr + proc.stdout
    assert not (Path(out) / "run" / "logs").exists()  # no stage started


# --- end to end ----------------------------------------------------------------------------------
def secret_in_files(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


@pytest.mark.e2e
@pytest.mark.integration
def test_a_continuous_run_trains_through_the_object_store(tmp_path, model_cache, s3_server, s3_bucket):
    """The trainer publishes to s3://, generate and actor-logprob reload from it: the staleness bound
    holds over more steps than it allows, which needs rollouts of newer versions."""
    from tests.harness import run_expstream

    steps, k = 4, 1
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}?"}) + "\n" for i in range(5)))
    store = f"{s3_bucket}/run/w"
    proc, out = run_expstream(tmp_path, "--continuous", prompts=prompts, cache=model_cache, env=s3_server.env(),
                              timeout=400, sets=["generate.max_new_tokens=6", "generate.n_samples_per_prompt=2",
                                                 "run.prompt_batch_size=2", "train.batch_size=8", "run.timeout_s=150",
                                                 f"train.max_steps={steps}", f"async.max_staleness={k}",
                                                 f"train.weight_store={store}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [x["policy_version"] for x in lines] == list(range(1, steps + 1))
    for x in lines:  # step s trains versions >= s - k: generate followed the store
        assert max(int(s) for s in x["staleness_hist"]) <= k, x
    assert not (out / "weights").exists()  # nothing published locally
    kept = {key.split("/")[2] for key in keys_of(s3_server, s3_bucket) if key.endswith("manifest.json")}
    assert f"v{steps:06d}" in kept
    for stage in ("generate", "actor-logprob"):
        log = (out / "run" / "logs" / f"{stage}-0.log").read_text()
        assert f"loaded in place from {store}/v0000" in log, log[-2000:]
    assert secret_in_files(out, s3_server.env()["AWS_SECRET_ACCESS_KEY"]) == []


@pytest.mark.e2e
def test_a_run_with_images_keeps_its_blobs_in_the_object_store(tmp_path, model_cache, s3_server, s3_bucket):
    from tests.harness import run_expstream
    from tests.test_vision import png

    (tmp_path / "ok.png").write_bytes(png((80, 60)))
    lines = [{"id": "one", "prompt": "shape?", "images": ["ok.png"]}, {"id": "text", "prompt": "2+2?"},
             {"id": "two", "prompt": "which?", "images": [f"data:image/png;base64,{__import__('base64').b64encode(png()).decode()}"]}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    proc, out = run_expstream(tmp_path, prompts=prompts, env=s3_server.env(), timeout=300,
                              sets=["models.actor=builtin:tiny-vl", "run.prompt_batch_size=3",
                                    f"models.cache_dir={model_cache}", "generate.max_new_tokens=6",
                                    f"run.blob_store={s3_bucket}/blobs"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["groups_complete"] == 3, summary
    assert not (out / "blobs").exists()
    want = {blob_ref(png((80, 60)))[7:], blob_ref(png())[7:]}
    assert {key.rsplit("/", 1)[1] for key in keys_of(s3_server, s3_bucket)} == want
    assert secret_in_files(out, s3_server.env()["AWS_SECRET_ACCESS_KEY"]) == []


def test_a_follower_whose_store_does_not_answer_keeps_its_weights_and_tries_again(s3_server, s3_bucket, redis_state,
                                                                                  monkeypatch, caplog):
    store = open_store(s3_bucket)
    store.publish("actor", 1, small_state_dict(1), step=0, offsets={}, run_id="r")
    model = Small()
    before = model.lin.bias.detach().clone()
    follower = PolicyFollower(store, redis_state, "actor", model, logging.getLogger("test.s3down"))
    redis_state.set_policy_version(1)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the store goes away
    down = ObjectStore(parse_store(s3_bucket, "f"), read_retry=Policy(base_s=0.05, cap_s=0.1, give_up_s=0.2),
                       client_retry={"max_retries": 0})
    follower.store = ObjectWeightStore(down)
    with caplog.at_level(logging.ERROR, logger="test.s3down"):
        assert follower.refresh() == 0  # no exception into the stage: the micro-batch goes on with v0
    assert torch.equal(model.lin.bias.detach(), before) and follower.refused is None
    assert "trying again" in caplog.text
    follower.store = store  # back: the next refresh loads v1
    assert follower.refresh() == 1
    assert torch.equal(model.lin.bias.detach(), small_state_dict(1)["lin.bias"])
