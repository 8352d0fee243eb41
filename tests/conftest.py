"""Shared fixtures: one real Tansu broker, one real redis-server and one tiny-model cache per test
session (helpers that start runs or chains: tests/harness.py).

Both run on free loopback ports in a session temp dir and are stopped at session end; they also
die with the test process (PR_SET_PDEATHSIG), so an interrupted session leaves no orphans.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:  # the project is installed editable later; until then import from the checkout
    sys.path.insert(0, str(_ROOT))

from expstream.config.kafka import KafkaConfig  # noqa: E402
from expstream.kafka.topics import create_topics  # noqa: E402
from expstream.launch.localservers import LocalBroker, LocalRedis  # noqa: E402
from expstream.state import MemoryState, RedisState, State  # noqa: E402
from tests.harness import S3Server  # noqa: E402


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's ``models.cache_dir``: the built-in tiny text models, built once here and only
    read afterwards (the tiny VL family is added by the first test that asks for it). Pass it as
    ``models.cache_dir=...`` (or ``cache=`` of tests/harness.py); a test that needs an empty or
    unwritable cache makes its own."""
    from expstream.config.topology import load_topology
    from expstream.models.resolve import build_builtin_models

    root = tmp_path_factory.mktemp("models")
    build_builtin_models(load_topology(overrides=[f"models.cache_dir={root}"]))
    return root


@pytest.fixture(scope="session")
def local_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    """The session-wide Tansu broker process (memory storage). Pausing it affects other tests:
    tests that pause or stop a broker start their own LocalBroker."""
    b = LocalBroker(tmp_path_factory.mktemp("broker"))
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture(scope="session")
def broker(local_broker: LocalBroker) -> str:
    """Bootstrap address ("127.0.0.1:PORT") of the session-wide broker."""
    return local_broker.bootstrap


@pytest.fixture(scope="session")
def local_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """The session-wide redis-server process (appendonly on)."""
    r = LocalRedis(tmp_path_factory.mktemp("redis"), appendonly=True)
    r.start()
    try:
        yield r
    finally:
        r.stop()


@pytest.fixture(scope="session")
def redis_url(local_redis: LocalRedis) -> str:
    """URL ("redis://127.0.0.1:PORT/0") of the session-wide redis-server."""
    return local_redis.url


@pytest.fixture
def run_id() -> str:
    """A fresh run id per test, so Redis keys of different tests never meet."""
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def redis_state(redis_url: str, run_id: str) -> Iterator[RedisState]:
    state = RedisState(redis_url, run_id)
    try:
        yield state
    finally:
        state.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """A session-wide Redis Cluster on loopback: 3 primaries, one replica each (expstream/launch/localcluster.py)."""
    from expstream.launch.localcluster import LocalRedisCluster

    cluster = LocalRedisCluster(tmp_path_factory.mktemp("rediscluster"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.integration),
                        pytest.param("cluster", marks=pytest.mark.integration)])
def state_handles(request: pytest.FixtureRequest, run_id: str) -> Iterator[Callable[[], State]]:
    """Handles on ONE run's state, for the contract suite run against both implementations.

    ``memory``: every call returns the same MemoryState (what a process shares between threads);
    ``redis``: every call opens a new RedisState client on the session's real redis-server (what
    replicas in different processes share); ``cluster``: the same on the session's Redis Cluster, each
    client pointed at another node.
    """
    if request.param == "memory":
        shared = MemoryState(run_id)
        yield lambda: shared
        return
    if request.param == "cluster":
        ports = request.getfixturevalue("redis_cluster").ports
        urls = [f"redis://127.0.0.1:{p}/0" for p in ports]
    else:
        urls = [request.getfixturevalue("redis_url")]
    opened: list[RedisState] = []

    def open_handle() -> State:
        opened.append(RedisState(urls[len(opened) % len(urls)], run_id))
        return opened[-1]

    try:
        yield open_handle
    finally:
        for s in opened:
            s.close()


@pytest.fixture
def state(state_handles: Callable[[], State]) -> State:
    """One handle on a fresh run state: a MemoryState, then (integration) a RedisState."""
    return state_handles()


@pytest.fixture
def kafka_cfg() -> KafkaConfig:
    """The default client settings (short group timeouts, 64 MiB records)."""
    return KafkaConfig()


@pytest.fixture
def fresh_topic(broker: str) -> Callable[..., str]:
    """Factory: ``fresh_topic(partitions=1, *, with_dlq=False, prefix="t")`` creates a uniquely
    named topic on the session broker and returns its name."""

    def make(partitions: int = 1, *, with_dlq: bool = False, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        create_topics(broker, {name: partitions}, with_dlq=with_dlq)
        return name

    return make


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """The session-wide S3 server (moto, a child process on loopback)."""
    pytest.importorskip("moto", reason="moto[server] is in the dev extra: pip install -e .[dev]")
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket on the session's S3 server, with the AWS variables set in this process
    (children get them with ``env=s3_server.env()``); returns its ``s3://`` URL."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3_server.make_bucket()}"


@pytest.fixture(scope="session")
def tiny(model_cache: Path) -> dict[str, Path]:
    """The tiny text models of the session's cache: ``{"tokenizer", "actor", "critic", "reward"} -> directory``
    (a module that needs models of its own overrides it)."""
    from expstream.models.tiny import build_tiny_models

    return build_tiny_models(model_cache)


@pytest.fixture(scope="session")
def hf(tiny: dict[str, Path]):
    """A transformers generator over the tiny actor: what the vLLM and SGLang engines are compared with."""
    from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer

    return TransformersGenerator(load_causal_lm(tiny["actor"]), load_tokenizer(tiny["tokenizer"]))
