"""A local Redis Cluster on loopback for the tests and bench/redis_wait.py: 6 redis-server processes, 3
primaries with one replica each (``redis-cli --cluster create ... --cluster-replicas 1``),
``cluster-node-timeout`` 1000 ms so that a SIGKILLed primary's replica takes over within a few seconds.
(``expstream run`` never starts one: a deployment points ``--redis-url`` at its own cluster, docs/redis.md.)

Each server dies with the test process (PR_SET_PDEATHSIG) and is stopped by :meth:`LocalRedisCluster.stop`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis
from redis.crc import key_slot

from expstream.launch.localservers import free_port, wait_for_port
from expstream.procs import set_death_signal

NODE_TIMEOUT_MS = 1000


def _preexec() -> None:  # pragma: no cover - runs in the child
    os.setpgid(0, 0)
    set_death_signal(signal.SIGKILL)


class LocalRedisCluster:
    """``start()`` returns the URL of one node (``redis://127.0.0.1:PORT/0``); ``nodes`` every port."""

    def __init__(self, root: Path, primaries: int = 3, replicas: int = 1) -> None:
        self.root, self.primaries, self.replicas = Path(root), primaries, replicas
        self.ports: list[int] = []
        self.bus: dict[int, int] = {}  # port -> cluster bus port (cluster-port: free_port may be above 55535)
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _spawn(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                "--cluster-enabled", "yes", "--cluster-port", str(self.bus[port]), "--cluster-config-file", str(d / "nodes.conf"),
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
                "--dir", str(d), "--daemonize", "no", "--logfile", str(d / "redis.log")]
        self.procs[port] = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            preexec_fn=_preexec)
        wait_for_port("127.0.0.1", port, 20, process=self.procs[port])

    def start_nodes(self) -> None:
        """Start every node, empty and unjoined (no slots: ``start`` creates the cluster)."""
        n = self.primaries * (1 + self.replicas)
        picked: list[int] = []
        while len(picked) < 2 * n:  # distinct client and bus ports
            if (port := free_port()) not in picked:
                picked.append(port)
        self.ports, self.bus = picked[:n], dict(zip(picked[:n], picked[n:], strict=True))
        for port in self.ports:
            self._spawn(port)

    def start(self) -> str:
        self.start_nodes()
        proc = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                               "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({proc.returncode}): {proc.stdout[-2000:]}"
                               f"{proc.stderr[-2000:]}")
        self.wait_ok()
        return self.url

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2, socket_connect_timeout=2)

    def wait_ok(self, timeout_s: float = 60.0, ports: list[int] | None = None, with_replicas: bool = True) -> None:
        """Until every live node says cluster_state:ok (and, ``with_replicas``, every primary has its replicas)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                states = []
                for port in ports or [p for p in self.ports if self.alive(p)]:
                    c = self.client(port)
                    try:
                        states.append(c.cluster("info")["cluster_state"])
                    finally:
                        c.close()
                if states and all(s == "ok" for s in states) and (not with_replicas or self.slots_list_replicas()):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not ok within {timeout_s}s: {states}")
            time.sleep(0.1)

    def slots_list_replicas(self) -> bool:
        """CLUSTER SLOTS names ``replicas`` replicas for every range: Redis lists a replica only once it has
        replication data (an empty cluster's replicas stay unlisted), so every primary gets a write first."""
        c = self.client(next(p for p in self.ports if self.alive(p)))
        try:
            rows = c.execute_command("CLUSTER SLOTS")
            for row in rows:
                start, end, port = int(row[0]), int(row[1]), int(row[2][1])
                key = next(f"warm{i}" for i in range(100000) if start <= key_slot(f"warm{i}".encode()) <= end)
                node = self.client(port)
                try:
                    node.set(key, b"1", px=1000)
                except redis.RedisError:
                    pass
                finally:
                    node.close()
            return all(len(row) >= 3 + self.replicas for row in rows)
        finally:
            c.close()

    def alive(self, port: int) -> bool:
        proc = self.procs.get(port)
        return proc is not None and proc.poll() is None

    def primary_ports(self) -> list[int]:
        """Ports of the live primaries, as a live node's CLUSTER SLOTS says."""
        c = self.client(next(p for p in self.ports if self.alive(p)))
        try:
            return sorted({int(row[2][1]) for row in c.execute_command("CLUSTER SLOTS")})
        finally:
            c.close()

    def replicas_of(self, port: int) -> int:
        c = self.client(port)
        try:
            return int(c.info("replication").get("connected_slaves", 0))
        finally:
            c.close()

    def kill(self, port: int) -> None:
        """SIGKILL one node (no shutdown, no save)."""
        self.procs[port].kill()
        self.procs[port].wait(10)

    def revive(self, port: int) -> None:
        """Start a killed node again on its port and config: it rejoins (a failed-over primary as a replica)."""
        self._spawn(port)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
