"""Helpers shared by the test modules: start an ``expstream run`` for a test, and run the stages in
process (LocalChain) over the example prompts.

The session fixtures (broker, redis-server, the tiny-model cache) live in ``tests/conftest.py``;
these are plain functions so that a module can call them with its own arguments.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "examples" / "prompts.jsonl"


def expstream_cmd(*args: str, prompts: Path | str | None = PROMPTS, out: Path | None = None,
                  cache: Path | str | None = None, sets: Iterable[str] = (), command: str = "run") -> list[str]:
    """The argv of ``python -m expstream <command>`` as the tests start it: ``--prompts``, ``--output``
    and ``--no-progress`` (when given), the model cache, then ``args``, then one ``--set`` per entry."""
    cmd = [sys.executable, "-m", "expstream", command, *args]
    if prompts is not None:
        cmd += ["--prompts", str(prompts)]
    if out is not None:
        cmd += ["--output", str(out)]
    cmd.append("--no-progress")
    if cache is not None:
        cmd += ["--set", f"models.cache_dir={cache}"]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with ``env`` laid over it."""
    merged = dict(os.environ)
    merged.update(env or {})
    return merged


def run_expstream(tmp_path: Path, *args: str, prompts: Path | str | None = PROMPTS, out: Path | None = None,
                  cache: Path | str | None = None, sets: Iterable[str] = (), env: Mapping[str, str] | None = None,
                  timeout: float = 400, cwd: Path = ROOT,
                  check: bool = False) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run ``expstream run`` to its end from the checkout (so ``./topology.yaml`` is read and
    ``tests.*`` reward functions import); returns the completed process and the output directory
    (``tmp_path / "out"`` unless ``out`` is given). ``check`` asserts exit code 0 with the output shown."""
    out = tmp_path / "out" if out is None else out
    cmd = expstream_cmd(*args, prompts=prompts, out=out, cache=cache, sets=sets)
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=child_env(env))
    if check:
        assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc, out


def start_expstream(tmp_path: Path, *args: str, prompts: Path | str | None = PROMPTS, out: Path | None = None,
                    cache: Path | str | None = None, sets: Iterable[str] = (), env: Mapping[str, str] | None = None,
                    cwd: Path = ROOT, **popen: Any) -> tuple[subprocess.Popen, Path]:
    """Start ``expstream run`` without waiting (a test that signals, pauses or watches it); returns
    the process and the output directory. ``popen`` goes to :class:`subprocess.Popen` (default: text
    mode, stdout and stderr piped)."""
    out = tmp_path / "out" if out is None else out
    cmd = expstream_cmd(*args, prompts=prompts, out=out, cache=cache, sets=sets)
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    popen.setdefault("text", True)
    return subprocess.Popen(cmd, cwd=cwd, env=child_env(env), **popen), out


def chain_experiences(cache: Path | str, *sets: str, prompts: Path | str = PROMPTS) -> list:
    """The experiences of ``prompts`` through every enabled stage in this process (LocalChain with
    the codec between stages), as ``expstream run`` would collect them; ``sets`` are topology
    overrides. For checks about numbers, where a whole run adds nothing."""
    from expstream.config.topology import load_topology
    from expstream.launch.prompts import prompt_batches, read_prompts
    from expstream.rl.experience import Experience
    from stages.local import LocalChain

    topo = load_topology(overrides=[f"models.cache_dir={cache}", *sets])
    chain = LocalChain(topo, through_codec=True).setup()
    batches = prompt_batches(read_prompts(prompts), topo.run.prompt_batch_size)
    return [Experience.from_sample_batch(b) for b in chain.run(batches)]


def example_prompt_batches(topo, tag: str, records: int) -> list:
    """``records`` PromptBatch records of ``topo.run.prompt_batch_size`` example prompts each, cycling
    through examples/prompts.jsonl; ids ``<id>@<tag>-<j>`` (unique per tag)."""
    import json

    from schemas import PromptBatch

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    size = topo.run.prompt_batch_size
    out = []
    for j in range(records):
        recs = [rows[(j * size + i) % len(rows)] for i in range(size)]
        out.append(PromptBatch(batch_id=f"{tag}-{j}", prompt_id=[f"{r['id']}@{tag}-{j}" for r in recs],
                               prompt=[r["prompt"] for r in recs], label=[r["label"] for r in recs],
                               reference=["" for _ in recs]))
    return out


class S3Server:
    """A real S3-protocol server (moto's server mode, what s3fs's own tests use) on a loopback port.

    It runs as a child process (``python -m moto.server``), not a thread of the test process: moto's
    server imports flask, whose context-local proxies in ``sys.modules`` break vLLM's engine start-up
    in the same process (it walks every module's attributes)."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        import socket
        import time
        import urllib.error
        import urllib.request

        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        self.endpoint = f"http://{host}:{port}"
        self._proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(port)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2).close()
                return
            except (urllib.error.URLError, OSError) as exc:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto server on {self.endpoint} did not start: {exc}") from exc
                time.sleep(0.1)

    def env(self) -> dict[str, str]:
        """The standard AWS variables for this server (the only way expstream is configured for a store)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing-key-id",
                "AWS_SECRET_ACCESS_KEY": "testing-secret-never-shown", "AWS_DEFAULT_REGION": "us-east-1"}

    def make_bucket(self) -> str:
        import boto3

        name = f"b{uuid.uuid4().hex[:12]}"
        env = self.env()
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
                     region_name=env["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def alive(pid: int) -> bool:
    """Whether process ``pid`` lives (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def port_open(hostport: str) -> bool:
    """Whether something accepts connections at ``host:port``."""
    host, _, port = hostport.rpartition(":")
    with socket.socket() as s:
        s.settimeout(0.3)
        return s.connect_ex((host, int(port))) == 0


def leftovers(run_dir: Path, *, external_broker: bool = False, redis_port: bool = True) -> list[str]:
    """What a run (its ``run/`` directory) left behind: stage processes of run/pids.json and the broker and
    redis-server of run/services.json still alive, their ports still open (``external_broker``: the broker
    was not the run's, its port is not checked; ``redis_port``: check the redis-server's port too)."""
    pids = json.loads((run_dir / "pids.json").read_text()) if (run_dir / "pids.json").exists() else {}
    services = json.loads((run_dir / "services.json").read_text())
    found = [f"{label} pid {pid}" for label, pid in pids.items() if alive(pid)]
    found += [f"{k} {services[k]}" for k in ("broker_pid", "redis_pid") if k in services and alive(services[k])]
    if not external_broker:
        found += [f"port {services['bootstrap_servers']}"] if port_open(services["bootstrap_servers"]) else []
    if redis_port:
        found += [f"port {services['redis_url']}"] if port_open(services["redis_url"].split("//")[1].split("/")[0]) else []
    return found
