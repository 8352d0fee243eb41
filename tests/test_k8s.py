"""deploy/k8s checked offline (issue 25): each overlay rendered by ``kubectl kustomize``, every object
validated (core kinds against the Kubernetes schemas of ``kubernetes-validate``, Strimzi and KEDA
objects against the ``openAPIV3Schema`` of the upstream CRDs in ``../shared/k8s-crds``), and what a
schema cannot see: a Deployment per enabled stage, a KafkaTopic per topic with enough partitions,
consumer groups as the stages name them, no Secret value anywhere else, GPUs on model stages only.

The Secret is not in the repository (it is created from secrets.env): the test renders each overlay
inside a throw-away kustomization that adds one with random values for every key of
deploy/k8s/secrets.env.example.
"""

from __future__ import annotations

import base64
import copy
import json
import math
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from expstream.config.topology import load_topology
from expstream.kafka.topics import dlq_topic, loop_topics, stage_group
from expstream.launch.k8s import SECRET_NAME, SETTINGS_NAME, RenderOptions, render, uses_gpu
from expstream.launch.supervisor import STOP_GRACE_S

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
CRD_DIR = ROOT.parent / "shared" / "k8s-crds"
OVERLAYS = {"base": K8S, "dev": K8S / "overlays" / "dev", "prod": K8S / "overlays" / "prod"}
NAMESPACE = {"base": "expstream", "dev": "expstream-dev", "prod": "expstream"}
#: The generated directories and the arguments that write them (the Makefile's `k8s` target).
RENDERS = {
    K8S / "base" / "pipeline": ["--topology", "topology.yaml", "--set", "models.device=cuda", "--run-id", "dev"],
    K8S / "overlays" / "prod" / "pipeline": ["--topology", "deploy/k8s/overlays/prod/topology.yaml",
                                             "--run-id", "prod"],
}
CRD_GROUPS = ("kafka.strimzi.io", "keda.sh")
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not on PATH: the overlays cannot be rendered "
                                   "here (install kubectl or kustomize to run these checks)")


def secret_keys() -> list[str]:
    keys = []
    for line in (K8S / "secrets.env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.append(line.partition("=")[0])
    return keys


def kustomize(directory: Path) -> list[dict[str, Any]]:
    proc = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, tuple[list[dict[str, Any]], dict[str, str]]]:
    """overlay -> (its objects with a test Secret added, the Secret's values)."""
    if KUBECTL is None:
        pytest.skip("kubectl is not on PATH")
    out = {}
    for name, path in OVERLAYS.items():
        values = {key: f"{key}-{secrets.token_hex(12)}" for key in secret_keys()}
        tmp = tmp_path_factory.mktemp(f"k8s-{name}")
        (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
            "resources": [os.path.relpath(path, tmp)],
            "secretGenerator": [{"name": SECRET_NAME, "namespace": NAMESPACE[name],
                                 "options": {"disableNameSuffixHash": True},
                                 "literals": [f"{k}={v}" for k, v in values.items()]}],
        }))
        out[name] = (kustomize(tmp), values)
    return out


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def pod_topology(objs: list[dict[str, Any]]):
    """The topology the pods load: the ConfigMap every stage mounts, read by load_topology."""
    import tempfile

    names = {v["configMap"]["name"] for d in of_kind(objs, "Deployment") for v in d["spec"]["template"]["spec"]
             .get("volumes", []) if "configMap" in v}
    assert len(names) == 1, names
    cm = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] in names)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        fh.write(cm["data"]["topology.yaml"])
    try:
        return load_topology(fh.name)
    finally:
        os.unlink(fh.name)


def stage_deployments(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """stage name -> its Deployment (the ones whose container runs `expstream stage NAME`)."""
    out = {}
    for d in of_kind(objs, "Deployment"):
        c = d["spec"]["template"]["spec"]["containers"][0]
        if c.get("command") == ["expstream"] and c["args"][0] == "stage":
            assert c["args"][1] not in out, f"two Deployments run stage {c['args'][1]}"
            out[c["args"][1]] = d
    return out


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


# ---- schemas ------------------------------------------------------------------------------------
def strict(schema: Any) -> Any:
    """The API server's field validation: an object schema with ``properties`` takes no other key
    (unless ``x-kubernetes-preserve-unknown-fields`` or ``additionalProperties`` says otherwise)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the served version's openAPIV3Schema, made strict."""
    if not CRD_DIR.is_dir():
        pytest.skip(f"{CRD_DIR} is absent: the Strimzi and KEDA CRDs are read from ../shared/k8s-crds beside the "
                    "repository")
    out = {}
    for path in sorted(CRD_DIR.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            for version in doc["spec"]["versions"]:
                if version.get("served"):
                    key = (f"{doc['spec']['group']}/{version['name']}", doc["spec"]["names"]["kind"])
                    out[key] = strict(version["schema"]["openAPIV3Schema"])
    return out


def crd_errors(obj: dict[str, Any], schemas: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    import jsonschema

    schema = schemas.get((obj["apiVersion"], obj["kind"]))
    if schema is None:
        return [f"{obj['kind']} {obj['apiVersion']}: no served CRD version"]
    validator = jsonschema.Draft7Validator(schema)
    return [f"{obj['kind']}/{obj['metadata']['name']}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(obj)]


@needs_kubectl
def test_each_overlay_renders_with_no_network():
    for name, path in OVERLAYS.items():
        objs = kustomize(path)
        kinds = {o["kind"] for o in objs}
        assert {"Kafka", "KafkaNodePool", "KafkaTopic", "Deployment", "ScaledObject",
                "TriggerAuthentication"} <= kinds, name
        assert "Secret" not in kinds, f"{name}: a Secret is committed; it is created from secrets.env"


@needs_kubectl
def test_core_objects_are_valid_kubernetes(rendered):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for name, (objs, _) in rendered.items():
        core = [o for o in objs if o["apiVersion"].split("/")[0] not in CRD_GROUPS]
        assert len(core) > 10, name
        for obj in core:
            kubernetes_validate.validate(obj, version, strict=True)  # raises, naming the field


@needs_kubectl
def test_strimzi_and_keda_objects_match_their_crds(rendered, crd_schemas):
    for name, (objs, _) in rendered.items():
        custom = [o for o in objs if o["apiVersion"].split("/")[0] in CRD_GROUPS]
        assert {o["kind"] for o in custom} == {"Kafka", "KafkaNodePool", "KafkaUser", "KafkaTopic", "ScaledObject",
                                              "TriggerAuthentication"}, name
        errors = [e for o in custom for e in crd_errors(o, crd_schemas)]
        assert not errors, f"{name}:\n" + "\n".join(errors)


@needs_kubectl
def test_the_crd_check_refuses_what_an_operator_would(rendered, crd_schemas):
    """The check can fail: a typo'd field, a wrong type, a retired API version."""
    objs, _ = rendered["base"]
    scaled = of_kind(objs, "ScaledObject")[0]
    typo = copy.deepcopy(scaled)
    typo["spec"]["maxReplicas"] = typo["spec"].pop("maxReplicaCount")
    assert any("maxReplicas" in e for e in crd_errors(typo, crd_schemas))
    topic = copy.deepcopy(of_kind(objs, "KafkaTopic")[0])
    topic["spec"]["partitions"] = "8"
    assert crd_errors(topic, crd_schemas)
    old = copy.deepcopy(of_kind(objs, "Kafka")[0])
    old["apiVersion"] = "kafka.strimzi.io/v1beta2"
    assert crd_errors(old, crd_schemas)


# ---- what a schema cannot see -------------------------------------------------------------------
@needs_kubectl
def test_every_enabled_stage_has_a_deployment_running_it(rendered):
    for name, (objs, _) in rendered.items():
        topo = pod_topology(objs)
        deployments = stage_deployments(objs)
        assert sorted(deployments) == sorted(st.name for st in topo.enabled_stages()), name
        for stage, d in deployments.items():
            args = d["spec"]["template"]["spec"]["containers"][0]["args"]
            assert flag(args, "--topology").startswith(
                next(m["mountPath"] for m in d["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
                     if m["name"] == "topology")), stage
            assert flag(args, "--bootstrap-servers") == "expstream-kafka-bootstrap:9092"
        trainers = [j for j in of_kind(objs, "Job") if j["spec"]["template"]["spec"]["containers"][0]["args"][0] == "train"]
        assert len(trainers) == (1 if topo.train.enabled else 0), name


@needs_kubectl
def test_every_topic_has_a_kafka_topic_with_a_partition_per_replica(rendered):
    for name, (objs, _) in rendered.items():
        topo = pod_topology(objs)
        topics = {t["spec"]["topicName"]: t["spec"]["partitions"] for t in of_kind(objs, "KafkaTopic")}
        wanted = {**{n: p for n, p in topo.all_topics().items()}, **loop_topics(topo)}
        for topic, parts in wanted.items():
            assert topics.get(topic) == parts, f"{name}: {topic}"
            if topic in topo.all_topics():
                assert dlq_topic(topic) in topics, f"{name}: {dlq_topic(topic)}"
        assert set(topics) == set(wanted) | {dlq_topic(t) for t in topo.all_topics()}, name
        deployments = stage_deployments(objs)
        scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in of_kind(objs, "ScaledObject")}
        for stage, d in deployments.items():
            st = topo.stages[stage]
            most = scaled[d["metadata"]["name"]]["spec"]["maxReplicaCount"] if d["metadata"]["name"] in scaled \
                else d["spec"]["replicas"]
            assert topics[st.input] >= most, f"{name}: {stage} may run {most} replicas on {topics[st.input]} partitions"
        if name == "prod":
            assert all(topics[t] >= 8 for t in topo.all_topics()), "prod: several partitions per topic"
            assert {t["spec"]["replicas"] for t in of_kind(objs, "KafkaTopic")} == {3}


@needs_kubectl
def test_keda_watches_the_group_and_topic_the_stage_really_consumes(rendered):
    import logging

    from expstream.state import MemoryState
    from stages.context import StageContext
    from stages.runner import StageRunner

    for name, (objs, _) in rendered.items():
        topo = pod_topology(objs)
        deployments = {d["metadata"]["name"]: (s, d) for s, d in stage_deployments(objs).items()}
        scaled = of_kind(objs, "ScaledObject")
        assert "reward" in {deployments[s["spec"]["scaleTargetRef"]["name"]][0] for s in scaled}, name
        for so in scaled:
            stage, d = deployments[so["spec"]["scaleTargetRef"]["name"]]
            run_id = flag(d["spec"]["template"]["spec"]["containers"][0]["args"], "--run-id")
            ctx = StageContext(topology=topo, stage=topo.stages[stage], state=MemoryState(run_id),
                               log=logging.getLogger("test"), run_id=run_id, replica_id="0")
            runner = StageRunner(ctx, lambda batch, ctx: [], "127.0.0.1:1")  # names its group; connects to nothing
            (trigger,) = so["spec"]["triggers"]
            meta = trigger["metadata"]
            assert meta["consumerGroup"] == runner.group_id == stage_group(run_id, stage)
            assert meta["topic"] == topo.stages[stage].input
            auto = topo.stages[stage].autoscale
            assert meta["lagThreshold"] == str(math.ceil(auto.target_lag_per_replica))
            assert so["spec"]["minReplicaCount"] == auto.min
            assert so["spec"]["maxReplicaCount"] <= auto.max
            assert so["spec"]["cooldownPeriod"] >= auto.cooldown_s
            assert trigger["authenticationRef"]["name"] in {t["metadata"]["name"]
                                                            for t in of_kind(objs, "TriggerAuthentication")}
            assert "replicas" not in d["spec"], "the HPA owns a KEDA-scaled Deployment's count"


@needs_kubectl
def test_no_secret_value_appears_outside_the_secret(rendered):
    for name, (objs, values) in rendered.items():
        (secret,) = of_kind(objs, "Secret")
        assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == values
        others = json.dumps([o for o in objs if o["kind"] != "Secret"])
        for key, value in values.items():
            for form in (value, base64.b64encode(value.encode()).decode()):
                assert form not in others, f"{name}: the value of {key} appears outside the Secret"


@needs_kubectl
def test_credentials_come_from_the_secret_by_reference_and_never_on_a_command_line(rendered):
    keys = set(secret_keys())
    for name, (objs, _) in rendered.items():
        settings = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == SETTINGS_NAME)
        assert not [k for k in settings["data"] if any(w in k.lower() for w in ("password", "secret", "token"))]
        for obj in objs:
            spec = obj.get("spec", {})
            pod = spec.get("template", {}).get("spec", {}) if isinstance(spec, dict) else {}
            for c in pod.get("containers", []):
                from_secret = set()
                for env in c.get("env", []):
                    ref = env.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        assert ref["name"] == SECRET_NAME and ref["key"] in keys, (name, env)
                        from_secret.add(env["name"])
                    else:
                        assert "value" not in env or "PASSWORD" not in env["name"], (name, env)
                argv = " ".join(c.get("command", []) + c.get("args", []))
                for var in from_secret:
                    assert f"$({var})" not in argv, f"{name}: {obj['metadata']['name']} puts ${var} on its command line"
                assert "redis://" not in argv and "--redis-url" not in argv, (name, argv)
        stage = next(iter(stage_deployments(objs).values()))
        env = {e["name"] for e in stage["spec"]["template"]["spec"]["containers"][0]["env"]}
        assert {"EXPSTREAM_REDIS_URL", "EXPSTREAM_KAFKA_PASSWORD", "EXPSTREAM_REWARD_TOKEN",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= env
        auth = of_kind(objs, "TriggerAuthentication")[0]["spec"]
        assert [(r["parameter"], r["name"]) for r in auth["secretTargetRef"]] == [("password", SECRET_NAME)]
        user = of_kind(objs, "KafkaUser")[0]["spec"]["authentication"]["password"]["valueFrom"]["secretKeyRef"]
        assert user["name"] == SECRET_NAME and user["key"] in keys


@needs_kubectl
def test_gpus_on_model_stages_only_and_prod_nodes_by_selector(rendered):
    for name, (objs, _) in rendered.items():
        topo = pod_topology(objs)
        for stage, d in stage_deployments(objs).items():
            pod = d["spec"]["template"]["spec"]
            gpus = pod["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu")
            assert bool(gpus) == uses_gpu(topo, stage), f"{name}: {stage}"
            if name == "prod":
                if gpus:
                    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
                    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
                else:
                    assert pod["nodeSelector"] == {"expstream.io/pool": "cpu"} and "tolerations" not in pod
        if name == "prod":
            (trainer,) = [j["spec"]["template"]["spec"] for j in of_kind(objs, "Job")
                          if j["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"]
            assert trainer["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] >= 1
            assert trainer["nodeSelector"] == {"nvidia.com/gpu.present": "true"} and trainer["tolerations"]
            assert not uses_gpu(topo, "reward"), "prod scales reward on CPU nodes"
            assert of_kind(objs, "KafkaNodePool")[0]["spec"]["replicas"] == 3


@needs_kubectl
def test_readiness_on_the_metrics_port_and_a_grace_longer_than_a_micro_batch(rendered):
    for objs, _ in rendered.values():
        settings = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == SETTINGS_NAME)["data"]
        assert settings["EXPSTREAM_METRICS_ADDR"] == "0.0.0.0"
        for stage, d in stage_deployments(objs).items():
            pod = d["spec"]["template"]["spec"]
            c = pod["containers"][0]
            port = next(p for p in c["ports"] if p["name"] == c["readinessProbe"]["httpGet"]["port"])
            assert str(port["containerPort"]) == settings["EXPSTREAM_METRICS_PORT"]
            assert c["readinessProbe"]["httpGet"]["path"] == "/metrics"
            notes = d["spec"]["template"]["metadata"]["annotations"]
            assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(port["containerPort"])
            assert pod["terminationGracePeriodSeconds"] > STOP_GRACE_S, stage


def test_stage_metrics_answer_on_the_probed_path():
    """What the readiness probe asks: the stage's metrics server (prometheus_client) answers GET /metrics."""
    import urllib.request

    from expstream.observe.metrics import StageMetrics

    m = StageMetrics("reward", "0")
    port = m.serve(port=0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200 and b"expstream_" in resp.read()


# ---- the generator ------------------------------------------------------------------------------
def test_the_committed_pipelines_are_what_the_generator_writes(tmp_path, monkeypatch):
    from expstream.cli import main

    monkeypatch.chdir(ROOT)
    for committed, args in RENDERS.items():
        out = tmp_path / committed.name / committed.parent.name
        assert main(["k8s", "render", *args, "--out", str(out)]) == 0
        fresh = {p.name: p.read_text() for p in out.iterdir()}
        kept = {p.name: p.read_text() for p in committed.iterdir()}
        assert fresh == kept, f"{committed.relative_to(ROOT)} is stale: run `make k8s`"


def _objs(files: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [o for objs in files.values() for o in objs]


def test_a_marked_stage_gets_a_scaled_object_and_the_partitions_for_it():
    topo = load_topology(None, ["topics.partitions=2", "stages.postprocess.autoscale.max=6"])  # below the max
    files, text, _ = render(topo, RenderOptions(run_id="r9", keda=("advantage",)))
    scaled = {s["spec"]["scaleTargetRef"]["name"]: s for s in _objs(files) if s["kind"] == "ScaledObject"}
    assert set(scaled) == {"expstream-reward", "expstream-postprocess", "expstream-advantage"}
    parts = {t["spec"]["topicName"]: t["spec"]["partitions"] for t in files["topics.yaml"]}
    assert scaled["expstream-postprocess"]["spec"]["maxReplicaCount"] == 6
    assert parts[topo.stages["postprocess"].input] == 6
    assert scaled["expstream-advantage"]["spec"]["maxReplicaCount"] <= parts[topo.stages["advantage"].input]
    assert scaled["expstream-advantage"]["spec"]["triggers"][0]["metadata"]["consumerGroup"] == \
        stage_group("r9", "advantage")
    assert yaml.safe_load(text)["stages"]["advantage"]["autoscale"] is not None  # the pods' topology agrees


def test_refuses_a_stage_it_cannot_scale():
    from expstream.errors import ConfigError

    topo = load_topology(None)
    with pytest.raises(ConfigError, match="critic"):  # group_norm switches critic off
        render(topo, RenderOptions(keda=("critic",)))
    with pytest.raises(ConfigError, match="--keda"):
        render(topo, RenderOptions(keda=("rewards",)))


def test_a_url_credential_stays_out_of_the_configmap_and_the_reward_runs_where_its_sources_do():
    secret = secrets.token_hex(8)
    topo = load_topology(None, ["models.reward=null", f"rewards.sources={{judge: {{kind: http, url: "
                                f"'http://u:{secret}@judge:8000'}}}}"])
    files, text, redacted = render(topo, RenderOptions())
    assert redacted == ["rewards.sources.judge.url"]
    assert secret not in text and secret not in json.dumps(_objs(files))
    assert not uses_gpu(topo, "reward") and uses_gpu(load_topology(None), "reward")
    reward = next(o for o in files["stages.yaml"] if o["kind"] == "Deployment" and o["metadata"]["name"] == "expstream-reward")
    assert "nvidia.com/gpu" not in reward["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    files, _, _ = render(load_topology(None), RenderOptions(gpus=0))
    assert "nvidia.com/gpu" not in json.dumps(files["stages.yaml"])


@needs_kubectl
def test_every_command_line_is_one_the_cli_takes_and_loads_the_pods_topology(rendered, tmp_path):
    """The kubelet's $(VAR) expansion done by hand from the settings ConfigMap, then the real parser and
    loader: the stores given by --set arrive in the topology, the topology file is the mounted one."""
    import re

    from expstream.cli import build_parser

    for name, (objs, _) in rendered.items():
        settings = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"] == SETTINGS_NAME)["data"]
        topo_file = tmp_path / f"{name}.yaml"
        topo_file.write_text(next(o for o in of_kind(objs, "ConfigMap") if "topology.yaml" in o.get("data", {}))
                             ["data"]["topology.yaml"])
        runs = [o for o in objs if o["kind"] in ("Deployment", "Job")
                and o["spec"]["template"]["spec"]["containers"][0].get("command") == ["expstream"]]
        assert len(runs) == len(stage_deployments(objs)) + (1 if pod_topology(objs).train.enabled else 0)
        for obj in runs:
            c = obj["spec"]["template"]["spec"]["containers"][0]
            assert {"configMapRef": {"name": SETTINGS_NAME}} in c["envFrom"]
            argv = [re.sub(r"\$\((\w+)\)", lambda m, env=settings: env[m.group(1)], a) for a in c["args"]]
            args = build_parser().parse_args(argv)
            assert args.topology.startswith("/etc/") and args.bootstrap_servers
            topo = load_topology(topo_file, args.overrides)
            assert topo.train.weight_store == settings["EXPSTREAM_WEIGHT_STORE"]
            assert topo.run.blob_store == settings["EXPSTREAM_BLOB_STORE"]
            assert topo.kafka.security_protocol == "SASL_PLAINTEXT"  # the Strimzi listener wants SCRAM


def test_out_refuses_a_directory_it_did_not_write(tmp_path):
    from expstream.cli import main

    hand = tmp_path / "base"
    hand.mkdir()
    (hand / "kustomization.yaml").write_text("resources: [infra]\n")
    assert main(["k8s", "render", "--out", str(hand)]) == 2
    assert (hand / "kustomization.yaml").read_text() == "resources: [infra]\n"
    out = tmp_path / "pipeline"
    assert main(["k8s", "render", "--set", "train.enabled=true", "--out", str(out)]) == 0
    assert (out / "trainer.yaml").exists()
    assert main(["k8s", "render", "--out", str(out)]) == 0  # rendered again: the trainer is gone
    assert sorted(p.name for p in out.iterdir()) == ["kustomization.yaml", "stages.yaml", "topics.yaml", "topology.yaml"]


def test_without_out_it_prints_the_objects_and_the_topology_configmap(capsys, tmp_path):
    from expstream.cli import main

    assert main(["k8s", "render", "--run-id", "r2"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    cm = docs[0]
    assert cm["kind"] == "ConfigMap"
    (tmp_path / "t.yaml").write_text(cm["data"]["topology.yaml"])
    topo = load_topology(tmp_path / "t.yaml")
    assert [d["kind"] for d in docs].count("Deployment") == len(topo.enabled_stages())
    assert [d["spec"]["topicName"] for d in docs if d["kind"] == "KafkaTopic"] == \
        [t for name in topo.all_topics() for t in (name, dlq_topic(name))]


# ---- chained stages (chains:, expstream/config/chains.py) ---------------------------------------
#: critic is switched off by the default estimator (group_norm): the first chain runs actor-logprob+reference.
CHAINS = "chains=[[actor-logprob, reference, critic], [postprocess, advantage]]"
CHAIN_SETS = [CHAINS, "topics.partitions=2", "stages.actor-logprob.autoscale.max=6"]
CHAIN_OPTS = RenderOptions(run_id="c1", keda=("advantage",))  # a stage inside a chain: the chain scales


@pytest.fixture(scope="module")
def chained(tmp_path_factory) -> list[dict[str, Any]]:
    """A chained topology rendered as `--out` writes it, through `kubectl kustomize` where it is installed
    (the topology ConfigMap then named by its hash in every pod), else the objects as printed."""
    from expstream.launch.k8s import write_rendered

    files, text, _ = render(load_topology(None, CHAIN_SETS), CHAIN_OPTS)
    if KUBECTL is None:
        return [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "expstream-topology"},
                 "data": {"topology.yaml": text}}, *_objs(files)]
    out = tmp_path_factory.mktemp("k8s-chained") / "pipeline"
    write_rendered(out, files, text)
    return kustomize(out)


@needs_kubectl
def test_a_chained_topology_renders_valid_objects(chained, crd_schemas):
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    for obj in chained:
        if obj["apiVersion"].split("/")[0] in CRD_GROUPS:
            assert not crd_errors(obj, crd_schemas)
        else:
            kubernetes_validate.validate(obj, version, strict=True)
    assert {"KafkaTopic", "Deployment", "ScaledObject", "ConfigMap"} == {o["kind"] for o in chained}


def test_one_deployment_per_chain_and_per_unchained_stage(chained):
    topo = pod_topology(chained)
    assert topo.chains, "the pods' topology keeps chains:"
    deployments = stage_deployments(chained)
    assert len(of_kind(chained, "Deployment")) == len(deployments)
    assert {"actor-logprob+reference", "postprocess+advantage"} <= set(deployments)
    inner = {"actor-logprob", "reference", "critic", "postprocess", "advantage"}
    assert not inner & set(deployments), "a stage inside a chain runs in the chain's process, not its own"
    unchained = [st.name for st in topo.enabled_stages() if st.name not in inner]
    assert sorted(deployments) == sorted([*unchained, "actor-logprob+reference", "postprocess+advantage"])
    assert deployments["actor-logprob+reference"]["metadata"]["name"] == "expstream-actor-logprob-reference"
    for name, d in deployments.items():
        pod = d["spec"]["template"]["spec"]
        c = pod["containers"][0]
        gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert bool(gpus) == any(uses_gpu(topo, s) for s in name.split("+")), name
        assert c["readinessProbe"]["httpGet"]["path"] == "/metrics", name
        assert d["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true", name
        assert pod["terminationGracePeriodSeconds"] > STOP_GRACE_S, name
    assert deployments["actor-logprob+reference"]["spec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"]["nvidia.com/gpu"] == 1  # the chain's models share the process's GPU
    assert "nvidia.com/gpu" not in deployments["postprocess+advantage"]["spec"]["template"]["spec"]["containers"][0][
        "resources"]["limits"]


def test_no_kafka_topic_for_a_topic_inside_a_chain(chained):
    topo = pod_topology(chained)
    topics = {t["spec"]["topicName"]: t["spec"]["partitions"] for t in of_kind(chained, "KafkaTopic")}
    # what `expstream run` creates (expstream/launch/services.py): all_topics with their .dlq twins, the loop's
    wanted = {**topo.all_topics(), **{dlq_topic(t): 1 for t in topo.all_topics()}, **loop_topics(topo)}
    assert topics == wanted
    plain = load_topology(None, CHAIN_SETS[1:])  # the same pipeline unchained: its hops inside the chains
    hops = {plain.stages["actor-logprob"].output, plain.stages["postprocess"].output}
    assert hops and not hops & set(topics) and not {dlq_topic(t) for t in hops} & set(topics)
    assert plain.stages["reference"].output in topics and plain.stages["advantage"].output in topics
    assert topics[plain.stages["actor-logprob"].input] == 6, "a partition per replica the chain may run"


def test_keda_on_a_chain_watches_the_group_and_topic_its_runner_consumes(chained):
    import logging

    from expstream.launch.replica import stage_unit
    from expstream.state import MemoryState
    from stages.chain import Chain
    from stages.context import StageContext
    from stages.runner import StageRunner

    topo = pod_topology(chained)
    topics = {t["spec"]["topicName"]: t["spec"]["partitions"] for t in of_kind(chained, "KafkaTopic")}
    deployments = {d["metadata"]["name"]: (s, d) for s, d in stage_deployments(chained).items()}
    scaled = {}
    for so in of_kind(chained, "ScaledObject"):
        name, d = deployments[so["spec"]["scaleTargetRef"]["name"]]
        scaled[name] = so
        unit = stage_unit(topo, name)  # what `expstream stage NAME` runs, then its runner as replica.py makes it
        stage = Chain.runner_stage(unit, topo) if unit.chained else topo.stages[name]
        ctx = StageContext(topology=topo, stage=stage, state=MemoryState("c1"), log=logging.getLogger("test"),
                           run_id=flag(d["spec"]["template"]["spec"]["containers"][0]["args"], "--run-id"),
                           replica_id="0")
        runner = StageRunner(ctx, lambda batch, ctx: [], "127.0.0.1:1")  # names its group; connects to nothing
        meta = so["spec"]["triggers"][0]["metadata"]
        assert meta["consumerGroup"] == runner.group_id, name
        assert meta["topic"] == runner.stage.input == topo.stages[unit.head].input, name
        assert so["spec"]["maxReplicaCount"] <= topics[meta["topic"]], name
        assert "replicas" not in d["spec"], "the HPA owns a KEDA-scaled Deployment's count"
    assert set(scaled) == {"actor-logprob+reference", "reward", "postprocess+advantage"}
    assert scaled["actor-logprob+reference"]["spec"]["maxReplicaCount"] == 6
    assert scaled["actor-logprob+reference"]["spec"]["triggers"][0]["metadata"]["consumerGroup"] != \
        stage_group("c1", "actor-logprob+reference"), "the chain joins its first stage's group, not one of its name"


def test_a_chains_command_parses_through_the_cli_and_the_topology_loader(chained, tmp_path):
    from expstream.cli import build_parser
    from expstream.launch.replica import stage_unit

    topo_file = tmp_path / "topology.yaml"
    topo_file.write_text(next(o for o in of_kind(chained, "ConfigMap"))["data"]["topology.yaml"])
    for name, d in stage_deployments(chained).items():
        args = build_parser().parse_args(d["spec"]["template"]["spec"]["containers"][0]["args"])
        assert args.name == name
        topo = load_topology(topo_file, [o for o in args.overrides if "$(" not in o])
        unit = stage_unit(topo, args.name)  # refuses an inner stage, and a chain this topology does not have
        assert unit.name == name and (unit.chained == ("+" in name))
        if "replicas" in d["spec"]:
            assert d["spec"]["replicas"] == topo.stages[unit.head].replicas


def test_keda_and_gpus_name_chains_in_their_errors(capsys):
    from expstream.cli import main
    from expstream.errors import ConfigError

    topo = load_topology(None, [CHAINS])
    files, _, _ = render(topo, RenderOptions(keda=("postprocess+advantage",)))  # a chain by its name
    assert "expstream-postprocess-advantage" in {o["spec"]["scaleTargetRef"]["name"] for o in _objs(files)
                                                 if o["kind"] == "ScaledObject"}
    with pytest.raises(ConfigError, match=r"actor-logprob\+reference") as err:  # critic is off: not in the chain
        render(topo, RenderOptions(keda=("actor-logprob+critic",)))
    assert err.value.field == "--keda" and "chain" in str(err.value)
    with pytest.raises(ConfigError, match="switches this stage off"):
        render(topo, RenderOptions(keda=("critic",)))
    assert main(["k8s", "render", "--set", CHAINS, "--keda", "nope"]) == 2
    assert "postprocess+advantage" in capsys.readouterr().err
    assert main(["k8s", "render", "--set", CHAINS, "--gpus", "-1"]) == 2
    assert "--gpus" in capsys.readouterr().err
    assert main(["k8s", "render", "--set", CHAINS, "--set", "stages.reference.autoscale.max=4"]) == 2
    assert "stages.actor-logprob" in capsys.readouterr().err  # autoscale the chain by its first stage
    files, _, _ = render(topo, RenderOptions(gpus=0))
    assert "nvidia.com/gpu" not in json.dumps(files["stages.yaml"])
