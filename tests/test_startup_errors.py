"""`expstream run` with a bad configuration: exit code 2 and one message naming the field and the fix,
before any broker, redis-server or stage is started and before the tiny models are built (each case
checks that none of them was: no output directory, no model cache, no local server in the log).

Also (issue 8, items 6 and 7): values of the wrong type in any topology block, from YAML or --set;
prompt files with bytes that are not UTF-8 or values of the wrong type; an unwritable --output;
and a broker or Redis given on the command line that cannot be reached or refuses the password."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is 2+2?", "label": "4"}\n')
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "expstream", "run", "--prompts", str(prompts), "--output", str(out),
           "--no-progress", "--set", f"models.cache_dir={tmp_path / 'models'}", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def assert_nothing_started(tmp_path: Path, proc: subprocess.CompletedProcess) -> None:
    """What "before anything slow starts" means, observably: no run directory (stage logs, pid files,
    the services file live there), no model cache (``models.cache_dir`` is created by the tiny-model
    build), no local broker or redis-server, and no retry of an unreachable service."""
    assert not (tmp_path / "out").exists(), sorted(p.name for p in (tmp_path / "out").rglob("*"))
    assert not (tmp_path / "models").exists(), "the tiny models were built before the configuration was refused"
    # "local broker at", "local redis at" (launch/services.py), "broker ready at" (launch/localservers.py)
    started = [line for line in proc.stderr.splitlines() if "configuration error" not in line
               and any(f" {name} at " in line or f" {name} ready at " in line for name in ("broker", "redis"))]
    assert started == [], started
    assert "retry" not in proc.stderr, proc.stderr[-3000:]


def redis_errors(client, kind: str) -> int:  # noqa: ANN001 - a redis.Redis
    """How many error replies of ``kind`` (WRONGPASS, NOAUTH) the server has sent since it started."""
    return int(client.info("errorstats").get(f"errorstat_{kind}", {}).get("count", 0))


def bad_topology(tmp_path: Path) -> list[str]:
    path = tmp_path / "topology.yaml"
    path.write_text("algo:\n  advantage_estimater: gae\n")
    return ["--topology", str(path)]


def empty_model_dir(tmp_path: Path) -> list[str]:
    (tmp_path / "not-a-model").mkdir()
    return ["--set", f"models.critic={tmp_path / 'not-a-model'}", "--set", "algo.advantage_estimator=gae"]


def set_(*items: str):  # noqa: ANN202 - a CASES entry's argument maker
    return lambda t: [a for item in items for a in ("--set", item)]


def prompt_file(content: bytes):  # noqa: ANN202
    def make(t: Path) -> list[str]:
        path = t / "bad-prompts.jsonl"
        path.write_bytes(content)
        return ["--prompts", str(path)]
    return make


def output_under_a_file(t: Path) -> list[str]:
    (t / "a-file").write_text("x")
    return ["--output", str(t / "a-file" / "out")]


def kafka_block_type(t: Path) -> list[str]:
    path = t / "topology.yaml"
    path.write_text("kafka:\n  linger_ms: fast\n")
    return ["--topology", str(path)]


CASES = {
    "unknown topology key": (bad_topology, "algo.advantage_estimater", "Did you mean algo.advantage_estimator"),
    "missing model directory": (lambda t: ["--set", "models.actor=/nonexistent/actor-model"], "models.actor",
                                "save_pretrained"),
    "model directory without config.json": (empty_model_dir, "models.critic", "config.json"),
    "reward function module does not import": (lambda t: ["--set", "models.reward_fn=no_such_module_x:score"],
                                               "models.reward_fn", "make it importable"),
    "reward function missing in its module": (lambda t: ["--set", "models.reward_fn=tests.rewardfns:no_such_fn"],
                                              "models.reward_fn", "package.module:function"),
    "gae without a critic": (lambda t: ["--set", "algo.advantage_estimator=gae", "--set", "models.critic=null"],
                             "algo.advantage_estimator", "set models.critic"),
    "missing prompt file": (lambda t: ["--prompts", str(t / "missing.jsonl")], "--prompts",
                            "existing JSON-lines file"),
    # item 6: wrong types name block.field, the expected type and the value got
    "int field given text": (set_("generate.n_samples_per_prompt=abc"), "generate.n_samples_per_prompt",
                             "expected an integer, got 'abc'"),
    "int field given a float": (set_("generate.n_samples_per_prompt=2.5"), "generate.n_samples_per_prompt",
                                "expected an integer, got 2.5"),
    "int field given a list": (set_("generate.n_samples_per_prompt=[1]"), "generate.n_samples_per_prompt",
                               "expected an integer, got [1]"),
    "int field given nothing": (set_("generate.n_samples_per_prompt="), "generate.n_samples_per_prompt",
                                "expected an integer, got null"),
    "float field given text (run)": (set_("run.timeout_s=abc"), "run.timeout_s", "expected a number, got 'abc'"),
    "float field given text (algo)": (set_("algo.gamma=abc"), "algo.gamma", "expected a number, got 'abc'"),
    "kafka block from YAML": (kafka_block_type, "kafka.linger_ms", "expected an integer, got 'fast'"),
    "unwritable --output": (output_under_a_file, "--output", "is a file, not a directory"),
    "prompt file not UTF-8": (prompt_file(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n'), "--prompts",
                              "bad-prompts.jsonl:2: not UTF-8"),
    "prompt label a list": (prompt_file(b'{"prompt": "a", "label": [0]}\n'), "--prompts",
                            'bad-prompts.jsonl:1: "label" is [0]'),
    "prompt id null": (prompt_file(b'{"prompt": "a", "id": 1}\n{"prompt": "b", "id": null}\n'), "--prompts",
                       'bad-prompts.jsonl:2: "id" is null'),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_configuration_exits_2_with_field_and_fix(tmp_path, case):
    make_args, field, fix = CASES[case]
    proc = run_cli(tmp_path, *make_args(tmp_path))
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    message = [line for line in proc.stderr.splitlines() if "configuration error" in line]
    assert len(message) == 1, proc.stderr
    assert field in message[0] and fix in message[0], message[0]
    assert "Traceback" not in proc.stderr
    assert_nothing_started(tmp_path, proc)


# --- item 6, in process: every field of every block, and the prompt file's conversions ----------------

def _bad_value(tp: object) -> object:
    """A value of the wrong type for annotation ``tp`` (None when every value fits)."""
    text = str(tp)
    if tp is bool or text == "bool":
        return 1
    if "int" in text or "float" in text:
        return "abc"
    if "dict" in text:
        return [1]
    if "str" in text:
        return 123
    return None


def _settable_fields() -> list[tuple[str, object]]:
    import dataclasses
    import types
    import typing

    from expstream.config.topology import BLOCK_ATTRS, StageConfig, Topology, valid_tree

    hints_topo = typing.get_type_hints(Topology)
    blocks: dict[str, type] = {name: hints_topo[BLOCK_ATTRS.get(name, name)] for name in valid_tree()
                               if name != "stages"}
    blocks["stages.reward"] = StageConfig
    assert {b.split(".")[0] for b in blocks} == set(valid_tree())  # every block of the loader is covered
    out = []
    for block, cls in blocks.items():
        if typing.get_origin(cls) in (typing.Union, types.UnionType):  # an optional block (environment)
            cls = next(a for a in typing.get_args(cls) if a is not type(None))
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if block.startswith("stages") and f.name in ("name", "input"):
                continue  # set by the loader
            bad = _bad_value(hints[f.name])
            if bad is not None:
                out.append((f"{block}.{f.name}", bad))
    return out


@pytest.mark.parametrize(("key", "bad"), _settable_fields(), ids=lambda v: str(v))
def test_every_field_refuses_a_wrong_type_from_set_and_yaml(tmp_path, key, bad):
    import yaml

    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_topology(None, [f"{key}={yaml.safe_dump(bad, default_flow_style=True).strip().removesuffix('...')}"])
    assert key in str(info.value) and "expected" in str(info.value) and repr(bad) in str(info.value)
    # the same value written in a YAML file
    *blocks, name = key.split(".")
    tree: dict = {name: bad}
    for block in reversed(blocks):
        tree = {block: tree}
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_topology(path)


def test_right_types_still_load_and_ints_become_floats():
    from expstream.config.topology import load_topology

    topo = load_topology(None, ["algo.gamma=1", "run.timeout_s=30", "run.target_groups=", "models.reward_fn=",
                                "kafka.acks=1", "stages.reward.replicas=2"])
    assert topo.algo.gamma == 1.0 and isinstance(topo.algo.gamma, float)
    assert isinstance(topo.run.timeout_s, float) and topo.run.target_groups is None
    assert topo.kafka.acks == 1 and topo.stages["reward"].replicas == 2


def test_a_block_that_is_not_a_mapping_names_the_block():
    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError

    for item, field in (("run=5", "run"), ("stages.reward=5", "stages.reward"), ("kafka=[1]", "kafka")):
        with pytest.raises(ConfigError, match=f"^{field}: expected a mapping"):
            load_topology(None, [item])


def test_prompt_numbers_become_their_text_and_missing_ids_the_line_number(tmp_path):
    from expstream.launch.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a", "label": 0, "reference": 1.50, "id": 7}\n\n'
                     b'{"prompt": "b", "label": null}\n')
    rows = read_prompts(path)
    assert [(r.prompt_id, r.label, r.reference) for r in rows] == [("7", "0", "1.50"), ("3", "", "")]


@pytest.mark.parametrize("line", [b'{"prompt": "a", "label": true}', b'{"prompt": "a", "reference": {"x": 1}}',
                                  b'{"prompt": "a", "id": ""}', b'{"prompt": "a", "id": [1]}',
                                  b'{"prompt": "\xff"}'])
def test_prompt_values_of_the_wrong_type_are_refused_with_the_line(tmp_path, line):
    from expstream.errors import ConfigError
    from expstream.launch.prompts import read_prompts

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n' + line + b"\n")
    with pytest.raises(ConfigError, match=r"p\.jsonl:2: "):
        read_prompts(path)


def test_output_dir_checks(tmp_path):
    import os

    from expstream.errors import ConfigError
    from expstream.launch.preflight import check_output_dir

    check_output_dir(tmp_path / "new" / "deeper")  # creatable: fine, and nothing is created
    assert not (tmp_path / "new").exists()
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        check_output_dir(tmp_path / "f")
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not writable"):
            check_output_dir(locked / "out")


# --- item 7: unreachable services and a wrong password ---------------------------------------------

@pytest.fixture(scope="module")
def password_redis(tmp_path_factory):  # noqa: ANN201
    from expstream.launch.localservers import LocalRedis

    r = LocalRedis(tmp_path_factory.mktemp("redis-auth"), appendonly=False, password="right-pw")
    r.start()
    yield r
    r.stop()


def closed_port() -> int:
    from expstream.launch.localservers import free_port

    return free_port("127.0.0.1")  # free: nothing listens there


def test_closed_broker_port_exits_2_at_once(tmp_path, redis_url):
    port = closed_port()
    proc = run_cli(tmp_path, "--bootstrap-servers", f"127.0.0.1:{port}", "--redis-url", redis_url)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if "configuration error" in x]
    assert len(line) == 1 and f"cannot reach Kafka at 127.0.0.1:{port} (connection refused)" in line[0], proc.stderr
    assert "--bootstrap-servers" in line[0] and "Traceback" not in proc.stderr
    assert_nothing_started(tmp_path, proc)


def test_closed_redis_port_exits_2_at_once(tmp_path, broker):
    port = closed_port()
    proc = run_cli(tmp_path, "--bootstrap-servers", broker, "--redis-url", f"redis://127.0.0.1:{port}/0")
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if "configuration error" in x]
    assert len(line) == 1 and f"cannot reach Redis at redis://127.0.0.1:{port}/0 (connection refused)" in line[0]
    assert "Traceback" not in proc.stderr
    assert_nothing_started(tmp_path, proc)


def test_wrong_redis_password_exits_2_at_once_and_is_not_printed(tmp_path, broker, password_redis):
    import redis

    url = password_redis.url.replace("right-pw", "wrong-pw")
    admin = redis.Redis.from_url(password_redis.url)
    refused_before = redis_errors(admin, "WRONGPASS")
    proc = run_cli(tmp_path, "--bootstrap-servers", broker, "--redis-url", url)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if "configuration error" in x]
    assert len(line) == 1 and "refused the password" in line[0] and "--redis-url" in line[0], proc.stderr
    assert "wrong-pw" not in proc.stderr and "Traceback" not in proc.stderr
    assert_nothing_started(tmp_path, proc)
    # "at once": the server refused the password exactly once; a retried AUTH would be refused again
    assert redis_errors(admin, "WRONGPASS") - refused_before == 1
    admin.close()


@pytest.mark.parametrize("password", ["wrong-pw", None])
def test_redis_state_raises_auth_error_at_once_not_after_the_retry_deadline(password_redis, password, caplog):
    import logging

    import redis

    from expstream.errors import AuthError
    from expstream.state import RedisState

    auth = f":{password}@" if password else ""
    url = f"redis://{auth}127.0.0.1:{password_redis.port}/0"
    kind = "WRONGPASS" if password else "NOAUTH"
    admin = redis.Redis.from_url(password_redis.url)
    refused_before = redis_errors(admin, kind)
    with caplog.at_level(logging.WARNING), pytest.raises(AuthError) as info:
        RedisState(url, "auth-test")
    # not retried until the deadline: one refusal by the server, no retry line
    assert redis_errors(admin, kind) - refused_before == 1
    admin.close()
    assert not [r.getMessage() for r in caplog.records if "retry" in r.getMessage()]
    assert info.value.retriable is False and "password" in str(info.value)
    assert "wrong-pw" not in str(info.value)
    with RedisState(password_redis.url, "auth-test") as ok:  # the right password works
        assert ok.counters() == {}


def test_preflight_passes_for_reachable_services(broker, password_redis):
    from expstream.config.kafka import KafkaConfig
    from expstream.launch.preflight import check_services

    check_services(broker, password_redis.url, KafkaConfig())
