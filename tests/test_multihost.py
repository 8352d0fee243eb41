"""A stage on another host joins a live run (issue 23 item 2 of "What to build"; docs/deploy.md "Adding
machines").

"Another host" is a network namespace of its own (``ip netns``), joined to this one by a veth pair
on a /30 the test creates and deletes: the broker, Redis and the S3 server listen on the host-side
veth address only, and two extra reward replicas run inside the namespace, each from an empty
working directory, with nothing but ``expstream stage reward --bootstrap-servers B --run-id R
--topology FILE``, the AWS variables and ``EXPSTREAM_REDIS_URL``. The prompts carry images, so the
replicas fetch the blobs from the object store. The run must account for every group exactly once
and ``expstream status`` must show the replicas. Skipped, with the reason, where a namespace cannot
be created (not root, no ``ip``, no CAP_NET_ADMIN in a container).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest
import yaml

from tests.harness import ROOT, S3Server, child_env, expstream_cmd

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


@contextlib.contextmanager
def veth_namespace() -> Iterator[tuple[str, str, str]]:
    """(namespace, host address, namespace address) of a fresh namespace joined by a veth /30."""
    if shutil.which("ip") is None:
        pytest.skip("network-namespace test: the `ip` command (iproute2) is not installed")
    if os.geteuid() != 0:
        pytest.skip("network-namespace test: creating a network namespace (ip netns add) needs root")
    tag = uuid.uuid4().hex[:6]
    ns, host_if, ns_if = f"xs-{tag}", f"xh{tag}", f"xn{tag}"
    used = _ip("-o", "addr", check=False).stdout
    third = next(n for n in random.sample(range(256), 256) if f"10.213.{n}." not in used)
    host_addr, ns_addr = f"10.213.{third}.1", f"10.213.{third}.2"
    try:
        try:
            _ip("netns", "add", ns)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"network-namespace test: cannot create a network namespace: {exc.stderr.strip()}")
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{host_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{ns_addr}/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns, host_addr, ns_addr
    finally:
        _ip("link", "del", host_if, check=False)  # deletes both ends
        _ip("netns", "del", ns, check=False)


def test_reward_replicas_in_another_network_namespace_join_a_live_run(tmp_path, model_cache):
    pytest.importorskip("moto", reason="moto[server] is in the dev extra")
    from expstream.config.paths import resolve_run_paths
    from expstream.config.topology import load_topology
    from expstream.kafka.topics import create_topics
    from expstream.launch.localservers import LocalBroker, LocalRedis
    from expstream.rl.experience import read_experiences
    from expstream.tools.status import collect_status
    from tests.test_vision import png

    with veth_namespace() as (ns, host, _ns_addr):
        broker, redis, s3 = LocalBroker(tmp_path / "broker", host=host), LocalRedis(tmp_path / "redis", host=host,
                                                                                      password=uuid.uuid4().hex), None
        remotes: list[subprocess.Popen] = []
        run = None
        try:
            bootstrap, redis_url = broker.start(), redis.start()
            s3 = S3Server(host)
            bucket = s3.make_bucket()
            env = {**s3.env(), "EXPSTREAM_REDIS_URL": redis_url}
            run_id = f"mh-{uuid.uuid4().hex[:8]}"
            sets = ["models.actor=builtin:tiny-vl", f"models.cache_dir={model_cache}", "run.prompt_batch_size=1",
                    "generate.max_new_tokens=6", "generate.n_samples_per_prompt=2", "run.timeout_s=200",
                    f"run.blob_store=s3://{bucket}/blobs", "topics.partitions=3"]
            # 3 partitions for the 3 reward replicas (these two and the run's own), 12 prompts: 4 records each, so
            # that each replica has work once the group has formed (with 8 partitions and 6 records one of the
            # remote replicas held 2 empty partitions and handled nothing: 1 of 4 whole-suite runs)
            # what an operator copies to the new machine: the run's topology (here written before the run,
            # so that the replicas are in the group before the first record)
            topo = resolve_run_paths(load_topology(None, sets), tmp_path / "out", media=True)
            create_topics(bootstrap, topo.all_topics(), with_dlq=True)
            for i in range(2):
                home = tmp_path / f"host-{i}"
                home.mkdir()
                (home / "topology.yaml").write_text(yaml.safe_dump(topo.to_raw(), sort_keys=False))
                cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "expstream", "stage", "reward",
                       "--bootstrap-servers", bootstrap, "--run-id", run_id, "--topology", "topology.yaml",
                       "--replica-id", f"ns-{i}"]
                remotes.append(subprocess.Popen(cmd, cwd=home, env=child_env({**env, "PYTHONPATH": str(ROOT)}),
                                                stdout=subprocess.DEVNULL, stderr=open(home / "stage.log", "w")))
            deadline = time.monotonic() + 120
            while not all("ready in" in (tmp_path / f"host-{i}" / "stage.log").read_text() for i in range(2)):
                assert time.monotonic() < deadline, [(tmp_path / f"host-{i}" / "stage.log").read_text()[-2000:]
                                                     for i in range(2)]
                assert all(p.poll() is None for p in remotes), "a remote replica exited"
                time.sleep(0.5)
            (tmp_path / "ok.png").write_bytes(png((80, 60)))
            data_uri = f"data:image/png;base64,{base64.b64encode(png()).decode()}"
            rows = [{"id": f"q{i}", "prompt": f"what {i}?", "images": ["ok.png" if i % 2 else data_uri]}
                    for i in range(12)]
            prompts = tmp_path / "p.jsonl"
            prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
            out = tmp_path / "out"
            cmd = expstream_cmd("--bootstrap-servers", bootstrap, "--redis-url", redis_url, "--run-id", run_id,
                                prompts=prompts, out=out, sets=sets)
            run = subprocess.Popen(cmd, cwd=ROOT, env=child_env(s3.env()), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            shown: set[str] = set()
            while run.poll() is None and not {"ns-0", "ns-1"} <= shown:
                with contextlib.suppress(Exception):  # the run may not have written its state yet
                    snap = collect_status(topo, bootstrap=bootstrap, redis_url=redis_url, run_id=run_id)
                    shown = {r.split(":")[0] for r in snap["stages"]["reward"]["replica_ids"]}  # <id>:<pid>
                time.sleep(1.0)
            stdout, stderr = run.communicate(timeout=300)
            assert run.returncode == 0, stderr[-4000:]
            assert {"ns-0", "ns-1"} <= shown, shown  # the replicas of the other host, seen while the run ran
            # and the command an operator types (the Redis URL from the environment, as for the stages)
            status = subprocess.run([sys.executable, "-m", "expstream", "status", "--bootstrap-servers", bootstrap,
                                     "--run-id", run_id, "--topology", str(tmp_path / "host-0" / "topology.yaml"),
                                     "--json"], cwd=ROOT, env=child_env(env), capture_output=True, text=True,
                                    timeout=120)
            assert status.returncode == 0, status.stderr[-2000:]
            reward = json.loads(status.stdout)["stages"]["reward"]
            assert {"ns-0", "ns-1"} <= {r.split(":")[0] for r in reward["replica_ids"]}, reward
            assert reward["replicas_alive"] >= 2, reward
            summary = json.loads((out / "summary.json").read_text())
            assert summary["groups_complete"] == len(rows) and not summary["groups_dead_lettered"], summary
            ids = [s for e in read_experiences(out / "experiences.msgpack") for s in e.sample_ids]
            assert len(ids) == len(set(ids)) == 2 * len(rows)  # every group exactly once
        finally:
            for p in remotes:
                p.terminate()
            for p in remotes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=30)
                if p.poll() is None:
                    p.kill()
            if run is not None and run.poll() is None:
                run.kill()
            if s3 is not None:
                s3.stop()
            redis.stop()
            broker.stop()
        done = [re.search(r"stopped after (\d+) records", (tmp_path / f"host-{i}" / "stage.log").read_text())
                for i in range(2)]
        assert all(m and int(m.group(1)) > 0 for m in done), [m and m.group(0) for m in done]
        for i in range(2):  # nothing but what the operator put there: blobs and weights live in the store
            assert sorted(os.listdir(tmp_path / f"host-{i}")) == ["stage.log", "topology.yaml"]
