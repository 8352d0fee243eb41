"""The real-deployment files: docker-compose.yml and Dockerfile (parsed, not run: no Docker here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from expstream.config.topology import STAGE_ORDER, load_topology

ROOT = Path(__file__).resolve().parents[1]
MODEL_STAGES = {"generate", "actor-logprob", "reference", "critic", "reward"}
BIG = 64 * 1024 * 1024
REDIS_PASSWORD_REF = "${REDIS_PASSWORD:?set REDIS_PASSWORD in .env (see .env.example)}"


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
    assert "--redis-url" not in args, "the Redis URL holds a password: it comes from $EXPSTREAM_REDIS_URL, not argv"
    assert env_of(svc)["EXPSTREAM_REDIS_URL"] == f"redis://:{REDIS_PASSWORD_REF}@redis:6379/0"
    assert re.fullmatch(r"\$\{EXPSTREAM_RUN_ID:-\w+\}", args["--run-id"])
    assert args["--topology"] == services["init-topics"]["command"][-1], "stages and init-topics share a topology"
    assert svc["build"] == "."
    assert svc["restart"] == "on-failure:5"
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


# ---- issue 8 item 9: exposure, authentication, capped restarts -----------------------------------


def test_published_ports_are_loopback_by_default(services):
    published = [(name, p) for name, svc in services.items() for p in svc.get("ports") or []]
    assert published, "the host listener should still be published (trainers on the host)"
    for name, port in published:
        spec = port if isinstance(port, str) else f"{port.get('host_ip', '')}:{port['published']}:{port['target']}"
        host_ip = spec.rsplit(":", 2)[0] if spec.count(":") >= 2 else ""
        # the default of an overridable ${PUBLISH_ADDR:-...} must be loopback
        default = re.fullmatch(r"\$\{PUBLISH_ADDR:-([^}]*)\}", host_ip)
        assert (default.group(1) if default else host_ip) == "127.0.0.1", f"{name} publishes {spec} on every interface"


def test_host_listener_requires_scram(services):
    env = env_of(services["kafka"])
    protocols = dict(item.split(":") for item in env["KAFKA_LISTENER_SECURITY_PROTOCOL_MAP"].split(","))
    assert protocols["EXTERNAL"] in ("SASL_PLAINTEXT", "SASL_SSL")
    assert env["KAFKA_LISTENER_NAME_EXTERNAL_SASL_ENABLED_MECHANISMS"] == "SCRAM-SHA-512"
    assert "ScramLoginModule" in env["KAFKA_LISTENER_NAME_EXTERNAL_SCRAM___SHA___512_SASL_JAAS_CONFIG"]
    # the published port is the EXTERNAL one; PLAINTEXT 9092 stays on the compose network
    assert all(str(p).endswith(":29092:29092") for p in services["kafka"]["ports"])
    users = services["kafka-users"]
    assert users["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = " ".join(users["command"])
    assert "kafka-configs.sh --bootstrap-server kafka:9092" in script and "SCRAM-SHA-512=" in script
    assert "$$EXPSTREAM_KAFKA_PASSWORD" in script  # expanded in the container, not written here
    assert env_of(users)["EXPSTREAM_KAFKA_PASSWORD"].startswith("${EXPSTREAM_KAFKA_PASSWORD:?")


def test_redis_requires_a_password_from_env(services):
    redis = services["redis"]
    command = redis["command"]
    assert command[0] == "redis-server"
    assert command[command.index("--requirepass") + 1] == REDIS_PASSWORD_REF
    # the image's entrypoint prepends "--protected-mode no"; a later "yes" must override it
    assert command[command.index("--protected-mode") + 1] == "yes"
    assert env_of(redis)["REDISCLI_AUTH"] == REDIS_PASSWORD_REF  # the healthcheck authenticates
    assert "PONG" in " ".join(redis["healthcheck"]["test"])


def test_restarts_are_capped(services):
    for name, svc in services.items():
        policy = svc.get("restart", "no")
        capped = re.fullmatch(r"on-failure:(\d+)", policy)
        assert policy == "no" or (capped and 1 <= int(capped.group(1)) <= 10), f"{name}: restart {policy!r}"


def _strings(node, key=""):
    """(key, string) for every scalar of the parsed compose file; list items carry their parent's key."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif node is not None:
        yield key, str(node)


def test_no_password_is_written_in_the_file(compose):
    secret_keys = re.compile(r"(?i)password|requirepass|_AUTH$")
    for key, value in _strings(compose):
        if secret_keys.search(key):
            assert value.startswith("${"), f"{key}: {value!r} is a literal secret; reference .env instead"
        for m in re.finditer(r"(?i)(?:password=|--requirepass\s+|redis://:)([^\s\"',\]@]*)", value):
            assert m.group(1).startswith("$"), f"{key}: literal secret in {value!r}"
    args = [a for _, a in _strings(compose["services"]["redis"]["command"])]
    assert args[args.index("--requirepass") + 1].startswith("${")
    example = (ROOT / ".env.example").read_text()
    for var in ("REDIS_PASSWORD", "EXPSTREAM_KAFKA_PASSWORD"):
        assert re.search(rf"^{var}=$", example, re.M), f".env.example should leave {var} empty"
    assert ".env" in (ROOT / ".gitignore").read_text().split()
    assert ".env" in (ROOT / ".dockerignore").read_text().split()


def test_redis_command_of_the_compose_file_refuses_clients_without_the_password(tmp_path):
    """The compose Redis arguments, run on a real redis-server: no password -> NOAUTH; with it -> PONG."""
    import shutil
    import subprocess

    import redis as redis_py

    from expstream.launch.localservers import free_port, wait_for_port

    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("no redis-server")
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["redis"]["command"]
    args = [a.replace(REDIS_PASSWORD_REF, "s3cretpw") for a in command[1:]]
    port = free_port()
    proc = subprocess.Popen([server, *args, "--port", str(port), "--dir", str(tmp_path), "--save", ""],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10.0, process=proc)
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port).ping()
        assert redis_py.Redis(port=port, password="s3cretpw").ping() is True
        assert redis_py.Redis(port=port, password="s3cretpw").config_get("protected-mode") == {"protected-mode": "yes"}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---- the SASL profile of host clients (KafkaConfig) ----------------------------------------------
SCRAM = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "SCRAM-SHA-512"}


def test_sasl_settings_reach_kafka_python_with_the_password_from_env(monkeypatch):
    from expstream.config.kafka import KafkaConfig

    monkeypatch.setenv("EXPSTREAM_KAFKA_USERNAME", "trainer")
    monkeypatch.setenv("EXPSTREAM_KAFKA_PASSWORD", "pw-from-env")
    cfg = KafkaConfig.from_dict(SCRAM)
    for role in ("producer", "consumer", "admin"):
        kw = cfg.client_kwargs(role)
        assert (kw["security_protocol"], kw["sasl_mechanism"]) == ("SASL_PLAINTEXT", "SCRAM-SHA-512")
        assert (kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("trainer", "pw-from-env")
    assert "pw-from-env" not in repr(cfg.to_dict()), "the password is not part of the config"
    named = KafkaConfig.from_dict({**SCRAM, "sasl_plain_username": "ops", "sasl_password_env": "MY_PW"})
    monkeypatch.setenv("MY_PW", "other")
    kw = named.client_kwargs("admin")
    assert (kw["sasl_plain_username"], kw["sasl_plain_password"]) == ("ops", "other")
    assert "sasl_mechanism" not in KafkaConfig().client_kwargs("admin")  # PLAINTEXT default unchanged


@pytest.mark.parametrize(("block", "field"), [
    ({**SCRAM, "sasl_plain_password": "x"}, "kafka.sasl_plain_password"),
    ({"extra": {"all": {"sasl_plain_password": "x"}}}, "kafka.extra.all.sasl_plain_password"),
    ({"security_protocol": "SASL_PLAINTEXT"}, "kafka.sasl_mechanism"),
    ({**SCRAM, "sasl_mechanism": "SCRAM-SHA-1"}, "kafka.sasl_mechanism"),
    ({"sasl_mechanism": "PLAIN"}, "kafka.security_protocol"),
])
def test_bad_sasl_settings_are_config_errors(block, field):
    from expstream.config.kafka import KafkaConfig
    from expstream.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        KafkaConfig.from_dict(block)
    assert err.value.field == field


def test_missing_sasl_password_exits_2_naming_the_variable(monkeypatch, capsys):
    from expstream.cli import main

    monkeypatch.setenv("EXPSTREAM_KAFKA_USERNAME", "trainer")
    monkeypatch.delenv("EXPSTREAM_KAFKA_PASSWORD", raising=False)
    code = main(["topics", "tail", "experiences", "--bootstrap-servers", "127.0.0.1:1",
                 "--set", "kafka.security_protocol=SASL_PLAINTEXT", "--set", "kafka.sasl_mechanism=SCRAM-SHA-512"])
    assert code == 2
    assert "EXPSTREAM_KAFKA_PASSWORD" in capsys.readouterr().err


# ---- issue 23 item 4: the continuous loop in compose (profile rl), weights through MinIO ---------------
RL = {"minio", "minio-init", "trainer"}
AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def test_the_rl_profile_adds_minio_and_the_trainer_and_nothing_else_needs_them(services):
    assert {name for name, svc in services.items() if "rl" in (svc.get("profiles") or [])} == RL
    for name, svc in services.items():
        if name not in RL:  # a plain `docker compose up` must not wait for a service of a profile it leaves off
            assert not RL & set(svc.get("depends_on") or {}), name
    minio = services["minio"]
    assert minio["image"].startswith("quay.io/minio/minio:RELEASE.")  # pinned, not :latest
    assert "minio server /data" in " ".join(minio["entrypoint"]) and "healthcheck" in minio
    init = services["minio-init"]
    assert init["depends_on"]["minio"]["condition"] == "service_healthy"
    bucket = re.search(r"mc mb --ignore-existing store/([a-z0-9.-]+)", " ".join(init["entrypoint"])).group(1)
    trainer = services["trainer"]
    assert trainer["command"][:2] == ["expstream", "train"]
    args = dict(zip(trainer["command"][2::2], trainer["command"][3::2], strict=False))
    assert args["--bootstrap-servers"] == "kafka:9092" and "--redis-url" not in args and args["--output"]
    assert args["--run-id"] == services["generate"]["command"][services["generate"]["command"].index("--run-id") + 1]
    assert trainer["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"
    assert env_of(trainer)["EXPSTREAM_REDIS_URL"] == f"redis://:{REDIS_PASSWORD_REF}@redis:6379/0"
    # the rl topology the trainer reads by default, mounted where the stages can read it too
    default = re.fullmatch(r"\$\{EXPSTREAM_TOPOLOGY:-([^}]*)\}", args["--topology"]).group(1)
    mount = next(v for v in trainer["volumes"] if v.startswith("./deploy/rl:"))
    source, target = mount.split(":")[:2]
    local = ROOT / source / Path(default).relative_to(target)
    topo = load_topology(local)
    assert topo.train.enabled and topo.train.weight_store.startswith(f"s3://{bucket}/")
    assert topo.run.blob_store.startswith(f"s3://{bucket}/")
    assert re.search(rf"^# EXPSTREAM_TOPOLOGY={re.escape(default)}$", (ROOT / ".env.example").read_text(), re.M)
    for name in (*STAGE_ORDER, "init-topics"):  # the stages read the same file when EXPSTREAM_TOPOLOGY names it
        assert mount in services[name]["volumes"], name


def test_the_store_is_configured_only_by_the_aws_variables_from_env(services):
    minio_env = env_of(services["minio"])
    assert minio_env["MINIO_ROOT_PASSWORD"] == "${MINIO_ROOT_PASSWORD:-}"  # checked by the entrypoint, not `:?`
    assert "MINIO_ROOT_PASSWORD" in " ".join(services["minio"]["entrypoint"])
    for name in (*STAGE_ORDER, "trainer"):
        env = env_of(services[name])
        for var in AWS_VARS:
            assert env[var].startswith("${"), f"{name}: {var} = {env[var]!r} is written in the file"
        assert env["AWS_SECRET_ACCESS_KEY"] == "${MINIO_ROOT_PASSWORD:-}"
        assert env["AWS_ACCESS_KEY_ID"] == minio_env["MINIO_ROOT_USER"]
        assert env["AWS_ENDPOINT_URL"].endswith("http://minio:9000}")
    assert re.search(r"^MINIO_ROOT_PASSWORD=$", (ROOT / ".env.example").read_text(), re.M)
