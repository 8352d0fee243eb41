"""An SGLang server process for one generate replica: started from the SGLang environment, stopped with it.

``generate.backend: sglang`` (docs/sglang.md) talks to SGLang over HTTP, the way RL frameworks do.
Unless ``generate.sglang_url`` names a running server, every generate replica starts its own:
``python -m sglang.launch_server`` of the SGLang venv (``make setup-sglang``; SGLang pins a torch and
transformers of its own, so it cannot live in the project's venv), on a free loopback port.

Never left behind:

* the server runs in a process group (session) of its own, and :meth:`SglangServer.stop` sends the
  whole group SIGTERM, then SIGKILL after a grace; it is called by the stage's teardown, and by an
  ``atexit`` hook for a process that leaves without one;
* the server's main process gets ``PR_SET_PDEATHSIG`` (SIGKILL when the stage dies, even by
  SIGKILL), and SGLang's own scheduler and detokenizer processes die with it (SGLang sets the same
  signal on them).

On a CPU machine the server gets ``SGLANG_USE_CPU_ENGINE=1`` and ``tools/sglang_cpu`` first on its
``PYTHONPATH`` (pure-torch stand-ins for the ops of the CUDA-only ``sgl_kernel`` wheel, and an
import-only torchvision; tools/sglang_cpu/README.md). On a GPU neither is set.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import http.client
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from expstream.errors import ConfigError, ExpstreamError
from expstream.procs import die_with

__all__ = [
    "REPO_ROOT", "CPU_STANDINS", "SETUP_HINT", "default_python", "sglang_installed", "free_port", "http_json",
    "SglangServer", "SglangServerError",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
#: CPU-only compatibility code (tools/sglang_cpu/README.md): first on the server's PYTHONPATH on CPU.
CPU_STANDINS = REPO_ROOT / "tools" / "sglang_cpu"
SETUP_HINT = "run `make setup-sglang` (the SGLang venv .venv-sglang), or set generate.sglang_python / generate.sglang_url"
#: Why 32768: without --max-total-tokens the CPU server reserves most of the RAM for its KV cache
#: (14 GB measured); 32k tokens hold 64 prompts x 4 samples x 128 tokens of the tiny models.
CPU_MAX_TOTAL_TOKENS = 32768
#: Why 300 s: the server starts in 25-50 s on an idle 2-core machine (imports); under a loaded test
#: run several times that.
START_TIMEOUT_S = 300.0
#: Why 10 s: SIGTERM lets SGLang stop its scheduler and detokenizer; then the group is SIGKILLed.
STOP_GRACE_S = 10.0


class SglangServerError(ExpstreamError, RuntimeError):
    """The SGLang server failed to start, died, or answered an error."""

    retriable = False


def default_python() -> Path:
    """The SGLang venv's python that ``make setup-sglang`` builds: ``.venv-sglang`` of this checkout."""
    return REPO_ROOT / ".venv-sglang" / "bin" / "python"


def sglang_installed(python: str | os.PathLike[str] | None = None) -> bool:
    """Whether ``python`` (default :func:`default_python`) is a venv with sglang installed (checked on
    disk: starting that interpreter to import sglang takes seconds)."""
    py = Path(python) if python is not None else default_python()
    if not py.exists():
        return False
    return any(py.parent.parent.glob("lib/python*/site-packages/sglang/__init__.py"))


def free_port() -> int:
    """A loopback port nobody listens on now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, path: str, body: Any = None, *, timeout: float = 600.0, method: str | None = None) -> Any:
    """One HTTP request to the server (JSON in, JSON or text out); SglangServerError on a non-2xx answer."""
    parts = urlsplit(url)
    conn_cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method or ("GET" if body is None else "POST"), path, body=data,
                     headers={"Content-Type": "application/json"} if data is not None else {})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    text = raw.decode(errors="replace")
    if not 200 <= resp.status < 300:
        raise SglangServerError(f"SGLang {path}: HTTP {resp.status}: {text[:500]}")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


class SglangServer:
    """``python -m sglang.launch_server`` for ``model_dir`` on a free loopback port, in a session of its own."""

    def __init__(self, model_dir: str | os.PathLike[str], *, python: str | os.PathLike[str] | None = None,
                 device: str = "cpu", seed: int = 0, port: int | None = None,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        py = Path(python) if python is not None else default_python()
        if not sglang_installed(py):
            raise ConfigError(f"generate.backend=sglang: no SGLang environment at {py}", field="generate.sglang_python",
                              fix=SETUP_HINT)
        self.model_dir = str(model_dir)
        self.port = int(port) if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cpu = not str(device).startswith("cuda")
        cmd = [str(py), "-m", "sglang.launch_server", "--model-path", self.model_dir, "--host", "127.0.0.1",
               "--port", str(self.port), "--random-seed", str(int(seed) % 2**31),
               "--log-level", "warning"]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env["HF_HUB_OFFLINE"] = "1"
        if cpu:
            cmd += ["--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
                    "--sampling-backend", "pytorch", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]
            env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it the scheduler imports vllm._custom_ops
            env["PYTHONPATH"] = str(CPU_STANDINS)  # CPU-only stand-ins; never on a GPU
        self.command = cmd
        fd, log_path = tempfile.mkstemp(prefix=f"expstream-sglang-{self.port}-", suffix=".log")
        self.log_path = Path(log_path)
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as log:
            # a session of its own: stop() signals the whole group (the server, its scheduler and detokenizer)
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True, preexec_fn=functools.partial(die_with, os.getpid()))
        atexit.register(self.stop)
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop(keep_log=True)
            raise
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SglangServerError(f"the SGLang server exited with {self.proc.returncode} while starting; "
                                        f"its log ({self.log_path}) ends with:\n{self.log_tail()}")
            with contextlib.suppress(OSError, SglangServerError, http.client.HTTPException):
                http_json(self.url, "/health_generate", timeout=30.0)
                return
            time.sleep(0.5)
        raise SglangServerError(f"the SGLang server did not answer /health_generate within {timeout_s:.0f} s; "
                                f"its log ({self.log_path}) ends with:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to the server's process group, SIGKILL after the grace. Idempotent."""
        proc = getattr(self, "proc", None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        # the group may hold children that outlive the main process (or a main that ignored SIGTERM)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=STOP_GRACE_S)
        self.proc = None  # type: ignore[assignment]
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if not keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()
