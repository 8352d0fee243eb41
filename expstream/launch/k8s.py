"""``expstream k8s render``: the topology-dependent Kubernetes objects of a deployment (docs/deploy.md
"Kubernetes").

What depends on the topology is written here, from the loaded :class:`Topology`, so that it cannot
drift from what the processes do: one Strimzi ``KafkaTopic`` per topic of ``Topology.all_topics()``
and its ``.dlq`` twin (plus ``policy`` with ``train.enabled``), one ``Deployment`` per process of the
topology (``Topology.units()``: an enabled stage alone, running ``expstream stage NAME``, or a chain of
``chains:``, running ``expstream stage a+b`` as the local launcher does; its inner stages get none, and
the topics between them, which are never created, no KafkaTopic), a KEDA ``ScaledObject`` per
autoscaled one (reward's always) on its real consumer group and input topic (the first stage's:
:func:`expstream.kafka.topics.stage_group`), the trainer ``Job`` with
``train.enabled``, and the topology itself, which kustomize turns into a ConfigMap. What does not
depend on it (Kafka, Redis, MinIO, the settings, the TriggerAuthentication) is static YAML in
``deploy/k8s/base/infra``.

The written topology is the one the pods read: the input with the changes a cluster needs (SASL on
the Kafka client, an ``autoscale`` block on every KEDA-scaled stage, or a chain's first stage, so that
its input topic gets a partition per replica it may run), and every URL credential redacted (they travel in the Secret's
``topology-secrets`` key, :data:`expstream.config.redaction.TOPOLOGY_SECRETS_ENV`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from expstream.config.chains import Unit, unit_of
from expstream.config.cli_args import Command
from expstream.config.redaction import REDIS_URL_ENV, REWARD_TOKEN_ENV, TOPOLOGY_SECRETS_ENV, split_secrets
from expstream.config.topology import AutoscaleConfig, Topology, build_topology
from expstream.errors import EXIT_OK, ConfigError
from expstream.kafka.topics import DEFAULT_TOPIC_CONFIG, dlq_topic, loop_topics, stage_group
from expstream.launch.supervisor import STOP_GRACE_S

__all__ = ["RenderOptions", "MODEL_STAGES", "SECRET_NAME", "SETTINGS_NAME", "cluster_topology", "keda_units",
           "render", "unit_uses_gpu", "uses_gpu", "write_rendered", "K8S"]

#: Stages that run a model forward on every record (GPU); reward too when a reward source is a model.
MODEL_STAGES = ("generate", "actor-logprob", "reference", "critic")
#: The Secret every credential comes from (created out of band: deploy/k8s/secrets.env.example).
SECRET_NAME = "expstream-secrets"
#: The ConfigMap of non-secret settings (deploy/k8s/base/infra/kustomization.yaml), given as envFrom.
SETTINGS_NAME = "expstream-settings"
#: The TriggerAuthentication of the KEDA Kafka trigger (deploy/k8s/base/infra/keda.yaml).
KEDA_AUTH_NAME = "expstream-kafka"
TOPOLOGY_CONFIGMAP = "expstream-topology"
TOPOLOGY_DIR = "/etc/expstream-k8s"
SHARED_MOUNT = "/shared"
SHARED_CLAIM = "expstream-shared"
METRICS_PORT = 9400
LABEL = "expstream.io"
# Why 3x the supervisor's grace: a stage asked to stop finishes its micro-batch (a GPU forward of
# seconds, a generation stops between two tokens), flushes, commits and leaves the group; the
# supervisor allows 20 s on one machine, a pod on a loaded node gets three times that.
GRACE_S = int(3 * STOP_GRACE_S)
# Why 180 s for the trainer: the step in hand, then a checkpoint (weights + Adam state) to /shared.
TRAINER_GRACE_S = 180


@dataclass(frozen=True)
class RenderOptions:
    run_id: str = "prod"
    image: str = "expstream:latest"
    kafka_cluster: str = "expstream"  # the Strimzi Kafka's name: bootstrap <name>-kafka-bootstrap:9092
    keda: tuple[str, ...] = ()  # stages (or chains a+b) scaled by KEDA besides reward and autoscaled ones
    gpus: int = 1  # nvidia.com/gpu per replica of a model stage or a chain holding one (and the trainer)
    kafka_sasl: bool = True  # the cluster's listener wants SCRAM-SHA-512 (deploy/k8s/base/infra/kafka.yaml)

    @property
    def bootstrap(self) -> str:
        return f"{self.kafka_cluster}-kafka-bootstrap:9092"


def _name(text: str) -> str:
    """A Kubernetes object name (RFC 1123 subdomain) for a topic or stage name."""
    out = re.sub(r"[^a-z0-9.-]+", "-", text.lower()).strip("-.")
    return out or "x"


def uses_gpu(topo: Topology, stage: str) -> bool:
    """Whether ``stage`` runs a model: the model stages, and reward when a reward source is a model."""
    if stage in MODEL_STAGES:
        return True
    if stage != "reward":
        return False
    if topo.rewards.sources is None:
        return topo.models.reward is not None
    return any(src.kind == "model" for src in topo.rewards.sources.values())


def unit_uses_gpu(topo: Topology, unit: Unit) -> bool:
    """Whether a process runs a model: a model stage alone, or a chain with one among its stages."""
    return any(uses_gpu(topo, stage) for stage in unit.stages)


def keda_units(topo: Topology, opts: RenderOptions) -> list[Unit]:
    """The processes KEDA scales (a stage alone or a chain, ``Topology.units()``): the one running reward,
    every one whose first stage has an ``autoscale`` block (only a chain's first stage may have one), and
    those ``--keda`` names: a stage, a chain by its name ``a+b``, or a stage inside a chain (the chain
    scales as one unit)."""
    enabled = {st.name for st in topo.enabled_stages()}
    for name in opts.keda:
        if name in topo.stages:
            if name not in enabled:
                raise ConfigError(f"--keda {name}: the topology switches this stage off", field="--keda",
                                  fix="leave it out, or enable the stage")
        elif unit_of(topo, name) is None:
            chained = [u.name for u in topo.units() if u.chained]
            raise ConfigError(f"--keda {name}: no such stage{' or chain' if chained else ''}", field="--keda",
                              fix=f"name one of {', '.join(topo.stages)}"
                              + (f", or a chain of this topology: {', '.join(chained)}" if chained else ""))
    marked = {"reward", *opts.keda} | {st.name for st in topo.enabled_stages() if st.autoscale is not None}
    return [u for u in topo.units() if u.name in marked or marked.intersection(u.stages)]


def cluster_topology(topo: Topology, opts: RenderOptions) -> tuple[dict[str, Any], list[str]]:
    """The topology the pods read, as topology.yaml's mapping, and the dotted keys whose credentials
    were redacted out of it (for the Secret's ``topology-secrets``)."""
    raw = topo.to_raw()
    for unit in keda_units(topo, opts):  # a chain scales by its first stage's block (expstream/config/chains.py)
        name = unit.head
        if raw["stages"][name].get("autoscale") is None:
            st = topo.stages[name]
            auto = AutoscaleConfig()
            raw["stages"][name]["autoscale"] = {"min": 1, "max": max(auto.max, st.replicas),
                                                "target_lag_per_replica": auto.target_lag_per_replica,
                                                "cooldown_s": auto.cooldown_s}
    if opts.kafka_sasl and raw["kafka"].get("security_protocol") == "PLAINTEXT":
        raw["kafka"]["security_protocol"] = "SASL_PLAINTEXT"
        raw["kafka"]["sasl_mechanism"] = "SCRAM-SHA-512"
    build_topology(raw)  # what the pods will load: refused here, not in a crash-looping pod
    shown, secrets = split_secrets(raw)
    return shown, sorted(secrets)


def kafka_topics(topo: Topology, opts: RenderOptions) -> list[dict[str, Any]]:
    """One KafkaTopic per topic (partitions from ``all_topics``), its ``.dlq`` twin (1), ``policy``: what
    ``expstream run`` creates (expstream/launch/services.py), so not the topics inside a chain."""
    wanted: dict[str, int] = {}
    for name, parts in topo.all_topics().items():
        wanted[name] = parts
        wanted.setdefault(dlq_topic(name), 1)
    wanted.update(loop_topics(topo))
    return [{
        "apiVersion": "kafka.strimzi.io/v1", "kind": "KafkaTopic",
        "metadata": {"name": _name(name), "labels": {"strimzi.io/cluster": opts.kafka_cluster,
                                                     f"{LABEL}/topic": _name(name)}},
        "spec": {"topicName": name, "partitions": parts, "replicas": 1, "config": dict(DEFAULT_TOPIC_CONFIG)},
    } for name, parts in wanted.items()]


def _secret_env(var: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": SECRET_NAME, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": var, "valueFrom": {"secretKeyRef": ref}}


def _env() -> list[dict[str, Any]]:
    """Every credential from the Secret, by reference (never a value, never on a command line)."""
    return [_secret_env(REDIS_URL_ENV, "redis-url"),
            _secret_env("EXPSTREAM_KAFKA_PASSWORD", "kafka-password"),
            _secret_env(REWARD_TOKEN_ENV, "reward-token", optional=True),
            _secret_env(TOPOLOGY_SECRETS_ENV, "topology-secrets", optional=True),
            _secret_env("AWS_ACCESS_KEY_ID", "aws-access-key-id", optional=True),
            _secret_env("AWS_SECRET_ACCESS_KEY", "aws-secret-access-key", optional=True)]


def _common_args(opts: RenderOptions) -> list[str]:
    """The flags every process gets; the stores come from the settings ConfigMap (``$(VAR)`` is
    expanded by the kubelet): a directory on the shared volume, or an ``s3://`` URL."""
    return ["--topology", f"{TOPOLOGY_DIR}/topology.yaml", "--bootstrap-servers", opts.bootstrap,
            "--run-id", opts.run_id,
            "--set", "train.weight_store=$(EXPSTREAM_WEIGHT_STORE)",
            "--set", "run.blob_store=$(EXPSTREAM_BLOB_STORE)"]


def _pod_spec(container: dict[str, Any], grace_s: int, restart: str = "Always") -> dict[str, Any]:
    return {
        "terminationGracePeriodSeconds": grace_s,
        "restartPolicy": restart,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "containers": [container],
        "volumes": [{"name": "topology", "configMap": {"name": TOPOLOGY_CONFIGMAP}},
                    {"name": "shared", "persistentVolumeClaim": {"claimName": SHARED_CLAIM}}],
    }


def _container(name: str, args: list[str], opts: RenderOptions, gpu: bool) -> dict[str, Any]:
    resources: dict[str, Any] = {"requests": {"cpu": "1", "memory": "4Gi"}, "limits": {"memory": "16Gi"}}
    if gpu and opts.gpus:  # --gpus 0: the model stages on CPU (models.device: cpu), no device asked for
        resources["limits"]["nvidia.com/gpu"] = opts.gpus
        resources["requests"]["nvidia.com/gpu"] = opts.gpus
    return {
        "name": name, "image": opts.image, "imagePullPolicy": "IfNotPresent",
        "command": ["expstream"], "args": args,
        "envFrom": [{"configMapRef": {"name": SETTINGS_NAME}}], "env": _env(),
        "resources": resources,
        "securityContext": {"allowPrivilegeEscalation": False},
        "volumeMounts": [{"name": "topology", "mountPath": TOPOLOGY_DIR, "readOnly": True},
                         {"name": "shared", "mountPath": SHARED_MOUNT}],
    }


def _labels(component: str, gpu: bool) -> dict[str, str]:
    return {"app.kubernetes.io/name": "expstream", "app.kubernetes.io/component": component,
            f"{LABEL}/accelerator": "gpu" if gpu else "cpu"}


def stage_deployment(topo: Topology, unit: Unit, opts: RenderOptions, keda: bool) -> dict[str, Any]:
    """``expstream stage NAME`` (a chain's ``NAME`` is ``a+b``, its objects' ``a-b``): readiness = its
    /metrics answers (served once the models are loaded)."""
    gpu, name = unit_uses_gpu(topo, unit), _name(unit.name)
    container = _container("stage", ["stage", unit.name, *_common_args(opts)], opts, gpu)
    container["ports"] = [{"name": "metrics", "containerPort": METRICS_PORT}]
    container["readinessProbe"] = {"httpGet": {"path": "/metrics", "port": "metrics"},
                                   "periodSeconds": 10, "failureThreshold": 3}
    labels = {**_labels(name, gpu), f"{LABEL}/stage": name}
    notes = {"prometheus.io/scrape": "true", "prometheus.io/port": str(METRICS_PORT), "prometheus.io/path": "/metrics"}
    spec: dict[str, Any] = {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "expstream", f"{LABEL}/stage": name}},
        "template": {
            "metadata": {"labels": labels, "annotations": notes},
            "spec": _pod_spec(container, GRACE_S),
        },
    }
    if not keda:  # a KEDA-scaled Deployment leaves its count to the HPA (an apply would reset it)
        spec = {"replicas": topo.stages[unit.head].replicas, **spec}
    meta: dict[str, Any] = {"name": f"expstream-{name}", "labels": labels}
    if unit.chained:  # label values cannot hold the `+` of the chain's name
        meta["annotations"] = {f"{LABEL}/chain": unit.name}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta, "spec": spec}


def scaled_object(topo: Topology, unit: Unit, opts: RenderOptions) -> dict[str, Any]:
    """KEDA's Kafka trigger on the process's own group and input topic (a chain's: its first stage's, as
    stages/chain.py runs it): replicas = ceil(lag / lagThreshold), the in-process autoscaler's rule
    (expstream/launch/scale.py), capped by the input's partitions."""
    name = _name(unit.name)
    st = topo.stages[unit.head]
    auto = st.autoscale
    assert auto is not None, "cluster_topology gives every KEDA-scaled stage an autoscale block"
    parts = topo.all_topics()[st.input]
    cooldown = int(math.ceil(auto.cooldown_s))
    return {
        "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
        # no accelerator label: the overlays' node patches select the pods' owners by it
        "metadata": {"name": f"expstream-{name}",
                     "labels": {"app.kubernetes.io/name": "expstream", "app.kubernetes.io/component": name}},
        "spec": {
            "scaleTargetRef": {"name": f"expstream-{name}"},
            "minReplicaCount": auto.min, "maxReplicaCount": min(auto.max, parts),
            "pollingInterval": 10, "cooldownPeriod": cooldown,
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleDown": {"stabilizationWindowSeconds": cooldown}}}},
            "triggers": [{
                "type": "kafka",
                "metadata": {"bootstrapServers": opts.bootstrap, "consumerGroup": stage_group(opts.run_id, unit.head),
                             "topic": st.input,
                             "lagThreshold": str(max(1, math.ceil(auto.target_lag_per_replica))),
                             "offsetResetPolicy": topo.kafka.auto_offset_reset},
                **({"authenticationRef": {"name": KEDA_AUTH_NAME}} if opts.kafka_sasl else {}),
            }],
        },
    }


def trainer_job(topo: Topology, opts: RenderOptions) -> dict[str, Any]:
    """``expstream train``: a Job, since exit 0 means finished (the supervisor's one-shot child); a crash
    is retried and resumes from the checkpoint under --output on the shared volume."""
    args = ["train", *_common_args(opts), "--output", f"{SHARED_MOUNT}/train/{opts.run_id}"]
    container = _container("trainer", args, opts, gpu=True)
    labels = _labels("trainer", True)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": f"expstream-trainer-{_name(opts.run_id)}", "labels": labels},
            "spec": {"backoffLimit": 20, "template": {"metadata": {"labels": labels},
                                                      "spec": _pod_spec(container, TRAINER_GRACE_S, "OnFailure")}}}


def render(topo: Topology, opts: RenderOptions) -> tuple[dict[str, list[dict[str, Any]]], str, list[str]]:
    """``({file name: objects}, topology.yaml text, redacted keys)`` of ``topo`` on a cluster."""
    raw, redacted = cluster_topology(topo, opts)
    ctopo = build_topology(raw)
    scaled = keda_units(ctopo, opts)
    stages: list[dict[str, Any]] = []
    for unit in ctopo.units():  # one process per replica: a stage alone or a chain (as expstream run starts them)
        stages.append(stage_deployment(ctopo, unit, opts, unit in scaled))
        if unit in scaled:
            stages.append(scaled_object(ctopo, unit, opts))
    files = {"topics.yaml": kafka_topics(ctopo, opts), "stages.yaml": stages}
    if ctopo.train.enabled:
        files["trainer.yaml"] = [trainer_job(ctopo, opts)]
    header = (f"# The topology the pods read (expstream k8s render, run id {opts.run_id}): written by the generator,\n"
              "# edit the source topology and render again (docs/deploy.md \"Kubernetes\").\n")
    return files, header + yaml.safe_dump(raw, sort_keys=False), redacted


#: The files ``--out`` holds; a directory with any other file is not the generator's to overwrite.
GENERATED_FILES = ("kustomization.yaml", "topology.yaml", "topics.yaml", "stages.yaml", "trainer.yaml")
GENERATED_NOTE = "# Written by `expstream k8s render`; do not edit: render again.\n"


def write_rendered(out: Path, files: dict[str, list[dict[str, Any]]], topology_text: str) -> list[Path]:
    """The rendered objects as a kustomization directory (the topology becomes a ConfigMap whose name
    carries a hash, so a changed topology rolls the pods). ``out`` must be new, empty, or an earlier
    output: a directory with other files (a hand-written kustomization) is refused, not overwritten."""
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in GENERATED_FILES)
        kust = out / "kustomization.yaml"
        if foreign or (kust.exists() and not kust.read_text().startswith(GENERATED_NOTE)):
            raise ConfigError(f"--out {out}: holds files `expstream k8s render` did not write "
                              f"({', '.join(foreign) or 'kustomization.yaml'})", field="--out",
                              fix="give a directory of its own, e.g. deploy/k8s/base/pipeline")
        for name in GENERATED_FILES:  # a file the new topology no longer has (trainer.yaml) must go
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "topology.yaml"]
    written[0].write_text(topology_text)
    for fname, objs in files.items():
        (out / fname).write_text(GENERATED_NOTE + yaml.safe_dump_all(objs, sort_keys=False))
        written.append(out / fname)
    kust_doc = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                "resources": list(files),
                "configMapGenerator": [{"name": TOPOLOGY_CONFIGMAP, "files": ["topology.yaml"]}]}
    (out / "kustomization.yaml").write_text(GENERATED_NOTE + yaml.safe_dump(kust_doc, sort_keys=False))
    return [*written, out / "kustomization.yaml"]


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings (the topology in its ConfigMap) as YAML literal blocks, readable as printed."""


_BlockDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def add_k8s_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("render", help="the topology's KafkaTopics, stage Deployments, KEDA ScaledObjects, trainer")
    r.add_argument("--topology", help="topology YAML (default: ./topology.yaml when present, else the packaged copy)")
    r.add_argument("--set", dest="overrides", action="append", default=[], metavar="dotted.key=value",
                   help="override a topology value; repeatable")
    r.add_argument("--out", metavar="DIR", help="write a kustomization directory (default: print the objects)")
    r.add_argument("--run-id", default="prod", help="names the consumer groups KEDA watches and the Redis keys")
    r.add_argument("--image", default="expstream:latest", help="the image of every stage and the trainer")
    r.add_argument("--kafka-cluster", default="expstream", help="the Strimzi Kafka's name")
    r.add_argument("--keda", action="append", default=[], metavar="STAGE",
                   help="scale this stage with KEDA too (reward and stages with an autoscale block always are); "
                        "a chain a+b, or a stage in it, scales the chain")
    r.add_argument("--gpus", type=int, default=1,
                   help="nvidia.com/gpu per replica of a model stage, or of a chain holding one")
    r.add_argument("--no-kafka-sasl", action="store_true",
                   help="the Kafka listener takes no SCRAM credentials (no TriggerAuthentication either)")


def k8s_command(topo: Topology, args: argparse.Namespace) -> int:
    if args.gpus < 0:
        raise ConfigError(f"--gpus: {args.gpus}", field="--gpus",
                          fix="give 0 or more GPUs per replica of a model stage (or of a chain holding one)")
    opts = RenderOptions(run_id=args.run_id, image=args.image, kafka_cluster=args.kafka_cluster,
                         keda=tuple(args.keda), gpus=args.gpus, kafka_sasl=not args.no_kafka_sasl)
    files, topology_text, redacted = render(topo, opts)
    if redacted:
        print(f"expstream k8s: credentials of {', '.join(redacted)} are redacted in the ConfigMap; put the real "
              f"values in the Secret {SECRET_NAME}, key topology-secrets, as a JSON object of dotted keys",
              file=sys.stderr)
    if args.out:
        for path in write_rendered(Path(args.out), files, topology_text):
            print(path)
        return EXIT_OK
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": TOPOLOGY_CONFIGMAP},
          "data": {"topology.yaml": topology_text}}
    print(yaml.dump_all([cm, *(o for objs in files.values() for o in objs)], Dumper=_BlockDumper, sort_keys=False),
          end="")
    return EXIT_OK


K8S = Command("k8s", "Kubernetes manifests from the topology (docs/deploy.md \"Kubernetes\")", add_k8s_arguments,
              k8s_command, reads_topology=True)
