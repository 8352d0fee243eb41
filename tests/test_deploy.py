"""The real-deployment files: docker-compose.yml and Dockerfile (parsed, not run: no Docker here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from expstream.topology import STAGE_ORDER, load_topology

ROOT = Path(__file__).resolve().parents[1]
MODEL_STAGES = {"generate", "actor-logprob", "reference", "critic", "reward"}
BIG = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def env_of(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def gpu_devices(service: dict) -> list[dict]:
    return (((service.get("deploy") or {}).get("resources") or {}).get("reservations") or {}).get("devices") or []


def test_kafka_is_single_node_kraft(services):
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka")
    env = env_of(kafka)
    assert set(env["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    node = env["KAFKA_NODE_ID"]
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node}@kafka:9093"
    assert "CONTROLLER://:9093" in env["KAFKA_LISTENERS"] and "PLAINTEXT://:9092" in env["KAFKA_LISTENERS"]
    assert "PLAINTEXT://kafka:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
    assert env["KAFKA_CONTROLLER_LISTENER_NAMES"] == "CONTROLLER"
    assert "CONTROLLER:PLAINTEXT" in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"]
    assert env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    for key in ("KAFKA_MESSAGE_MAX_BYTES", "KAFKA_REPLICA_FETCH_MAX_BYTES", "KAFKA_SOCKET_REQUEST_MAX_BYTES"):
        assert int(env[key]) >= BIG, key
    assert any(v.endswith(":" + env["KAFKA_LOG_DIRS"]) for v in kafka["volumes"])
    assert "healthcheck" in kafka


def test_redis_appends_to_a_volume(compose, services):
    redis = services["redis"]
    assert redis["image"].startswith("redis:7")
    command = redis["command"]
    command = command if isinstance(command, list) else command.split()
    assert command[command.index("--appendonly") + 1] == "yes"
    mounts = [v.split(":")[0] for v in redis["volumes"]]
    assert any(m in (compose.get("volumes") or {}) for m in mounts)


def test_init_topics_creates_the_topics(services):
    init = services["init-topics"]
    assert init["command"][:5] == ["expstream", "topics", "create", "--bootstrap-servers", "kafka:9092"]
    assert init["depends_on"]["kafka"]["condition"] == "service_healthy"


def test_one_service_per_stage(services):
    topo = load_topology()
    assert list(topo.stages) == list(STAGE_ORDER)
    for name in STAGE_ORDER:
        assert name in services, f"docker-compose.yml has no service for stage {name}"
    stage_services = [s for s in services if s in STAGE_ORDER]
    assert stage_services == list(STAGE_ORDER), "stage services should be in pipeline order"


@pytest.mark.parametrize("name", STAGE_ORDER)
def test_stage_service(services, name):
    svc = services[name]
    command = svc["command"]
    assert command[:3] == ["expstream", "stage", name]
    args = dict(zip(command[3::2], command[4::2], strict=False))
    assert args["--bootstrap-servers"] == "kafka:9092"
    assert args["--redis-url"] == "redis://redis:6379/0"
    assert re.fullmatch(r"\$\{EXPSTREAM_RUN_ID:-\w+\}", args["--run-id"])
    assert args["--topology"] == services["init-topics"]["command"][-1], "stages and init-topics share a topology"
    assert svc["build"] == "."
    assert svc["restart"] == "unless-stopped"
    deps = svc["depends_on"]
    assert {"kafka", "redis", "init-topics"} <= set(deps)
    assert deps["init-topics"]["condition"] == "service_completed_successfully"
    assert "./models:/models" in svc["volumes"]
    assert int(svc["deploy"]["replicas"]) >= 1
    devices = gpu_devices(svc)
    if name in MODEL_STAGES:
        assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}], name
    else:
        assert devices == [], f"{name} runs no model and should not reserve a GPU"


def test_dockerfile_installs_the_project():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    assert re.search(r"pip install[^\n;]*/src", text), "the project itself is pip-installed"
    users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
    assert users and users[-1] not in ("root", "0"), "the image runs as a non-root user"
    assert not any(ln.startswith("ENTRYPOINT") for ln in lines)
    assert lines[-1] == 'CMD ["expstream", "--help"]'
    # the topology path that docker-compose.yml passes by default exists in the image
    assert "/etc/expstream/topology.yaml" in text


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "runs", "models"):
        assert entry in ignored
    for needed in ("pyproject.toml", "expstream", "schemas", "stages", "README.md", "topology.yaml"):
        assert needed not in ignored
