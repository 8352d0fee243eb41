"""Multi-turn environments: the environment stage's client of a Python function or an HTTP server.

One call is one step of one episode: the episode so far in, ``(observation, reward, done)`` out
(docs/multi_turn.md has the contract of both kinds). :meth:`Environment.step_all` answers the episodes
of a micro-batch concurrently (``max_in_flight`` calls at once) and returns, per episode, either a
:class:`Step` or the exception that episode failed with (an :class:`EnvironmentFailed`: the stage
dead-letters that episode alone; never a reward of 0 for a failure).

* Python: ``fn(prompt, label, turns) -> (observation | None, reward | None, done)``, called on a thread
  pool; a call over ``timeout_s`` fails its episode (the thread is abandoned, not killed).
* HTTP: ``POST <url>/step`` with a JSON body, the answer a JSON object of the same three fields.
  Refused connections and 429/5xx/timeouts are retried ``retries`` times with backoff; a server
  refusing connections ``BREAKER_FAILURES`` times in a row opens the reward client's
  :class:`~expstream.rewards.http_client.CircuitBreaker`, and while it is open a micro-batch fails
  with the retriable :class:`EnvironmentUnavailable` (the runner backs off; nothing is dead-lettered
  while the server is away). Anything else still failing after the retries fails its episode.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from expstream.config.environment import EnvironmentConfig
from expstream.config.redaction import redact_url
from expstream.errors import ExpstreamError, PoisonRecordError
from expstream.rewards.http_client import (
    RETRY_BACKOFF_MAX_S,
    RETRY_BACKOFF_START_S,
    RETRY_JITTER,
    CircuitBreaker,
)

__all__ = ["Episode", "Step", "Environment", "EnvironmentFailed", "EnvironmentUnavailable", "check_step",
           "build_environment"]


@dataclass
class Episode:
    """One episode so far, as the environment sees it."""

    sample_id: str
    prompt: str
    label: str
    turns: list[str]  # the decoded model turns, the last one just generated
    turn_ids: list[list[int]]  # the exact token ids of each model turn
    observation_ids: list[list[int]]  # the exact token ids of each observation so far (one fewer than turns)


@dataclass
class Step:
    """The environment's answer to one episode."""

    observation: str | None
    reward: float | None
    done: bool


class EnvironmentFailed(PoisonRecordError):
    """The environment failed or timed out on one episode: that episode is dead-lettered alone."""


class EnvironmentUnavailable(ExpstreamError):
    """The HTTP environment refuses connections (circuit breaker open): retriable, the runner backs off."""

    retriable = True


def check_step(value: Any, where: str) -> Step:
    """An environment's return value as a :class:`Step`, or EnvironmentFailed naming what is wrong."""
    if isinstance(value, dict):
        value = (value.get("observation"), value.get("reward"), value.get("done"))
    if not isinstance(value, (tuple, list)) or len(value) != 3:
        raise EnvironmentFailed(f"{where}: returned {str(value)[:80]!r}; return (observation, reward, done)")
    obs, reward, done = value
    if obs is not None and not isinstance(obs, str):
        raise EnvironmentFailed(f"{where}: observation is {type(obs).__name__}; give a str or None")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvironmentFailed(f"{where}: reward is {reward!r}; give a finite number or None")
        reward = float(reward)
    if not isinstance(done, bool):
        raise EnvironmentFailed(f"{where}: done is {done!r}; give true or false")
    return Step(obs, reward, done)


class Environment:
    """Answers the episodes of one micro-batch concurrently; subclasses implement :meth:`step`."""

    def __init__(self, cfg: EnvironmentConfig) -> None:
        self.cfg = cfg
        self.pool = concurrent.futures.ThreadPoolExecutor(cfg.max_in_flight, thread_name_prefix="environment")

    def step(self, episode: Episode) -> Step:  # pragma: no cover - overridden
        raise NotImplementedError

    def step_all(self, episodes: Sequence[Episode]) -> list[Step | Exception]:
        """Per episode a Step or the exception it failed with; EnvironmentUnavailable is raised (retriable)."""
        futures = [self.pool.submit(self.step, e) for e in episodes]
        deadline = time.monotonic() + self.cfg.timeout_s * (self.cfg.retries + 1) + 1.0
        out: list[Step | Exception] = []
        for ep, fut in zip(episodes, futures, strict=True):
            try:
                out.append(fut.result(timeout=max(0.0, deadline - time.monotonic())))
            except EnvironmentUnavailable:
                for f in futures:
                    f.cancel()
                raise
            except concurrent.futures.TimeoutError:
                fut.cancel()
                out.append(EnvironmentFailed(f"environment: episode {ep.sample_id} timed out after "
                                             f"{self.cfg.timeout_s:g}s (environment.timeout_s)"))
            except EnvironmentFailed as exc:
                out.append(exc)
            except Exception as exc:  # noqa: BLE001 - the environment's own error fails its episode
                out.append(EnvironmentFailed(f"environment: episode {ep.sample_id}: {type(exc).__name__}: {exc}"))
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class PythonEnvironment(Environment):
    """``fn(prompt, label, turns)``; a call over ``timeout_s`` fails its episode."""

    def __init__(self, cfg: EnvironmentConfig, fn: Callable[..., Any]) -> None:
        super().__init__(cfg)
        self.fn = fn
        # the calls run here, so that step() can wait for one with a timeout
        self.calls = concurrent.futures.ThreadPoolExecutor(cfg.max_in_flight, thread_name_prefix="environment-fn")

    def step(self, episode: Episode) -> Step:
        fut = self.calls.submit(self.fn, episode.prompt, episode.label, list(episode.turns))
        try:
            value = fut.result(timeout=self.cfg.timeout_s)
        except concurrent.futures.TimeoutError:
            raise EnvironmentFailed(f"environment: episode {episode.sample_id}: {self.cfg.fn} did not answer "
                                    f"within environment.timeout_s={self.cfg.timeout_s:g}s") from None
        return check_step(value, f"environment {self.cfg.fn} on episode {episode.sample_id}")

    def close(self) -> None:
        super().close()
        self.calls.shutdown(wait=False, cancel_futures=True)


class HttpEnvironment(Environment):
    """``POST <url>/step`` per episode (docs/multi_turn.md "The HTTP contract")."""

    def __init__(self, cfg: EnvironmentConfig) -> None:
        super().__init__(cfg)
        self.url = cfg.url.rstrip("/") + "/step"
        self.shown = redact_url(self.url)
        self.breaker = CircuitBreaker()

    def step(self, episode: Episode) -> Step:
        body = json.dumps({"sample_id": episode.sample_id, "prompt": episode.prompt, "label": episode.label,
                           "turns": episode.turns, "turn_ids": episode.turn_ids,
                           "observation_ids": episode.observation_ids}).encode()
        delay, last = RETRY_BACKOFF_START_S, "no attempt"
        for attempt in range(self.cfg.retries + 1):
            if self.breaker.admit() == "open":
                raise EnvironmentUnavailable(f"environment {self.shown}: circuit breaker open after refused "
                                             f"connections ({last}); retrying later")
            status, text = self._post(body)
            if status == 200:
                self.breaker.success()
                try:
                    answer = json.loads(text)
                except ValueError:
                    raise EnvironmentFailed(f"environment {self.shown}: episode {episode.sample_id}: the answer "
                                            f"is not JSON: {text[:80]!r}") from None
                return check_step(answer, f"environment {self.shown} on episode {episode.sample_id}")
            if status == -1:  # refused: the server is away (counts towards the breaker)
                if self.breaker.failure():
                    raise EnvironmentUnavailable(f"environment {self.shown}: circuit breaker opened after "
                                                 f"{self.breaker.failures} refused connections ({text}); retrying later")
            else:
                self.breaker.end_probe() if status == -2 else self.breaker.success()
            last = f"HTTP {status}: {text[:120]}" if status > 0 else text
            if status > 0 and status not in (429,) and status < 500:
                break  # the server says this episode, as sent, is wrong: no retry
            if attempt < self.cfg.retries:
                time.sleep(delay * (1 + random.uniform(-RETRY_JITTER, RETRY_JITTER)))
                delay = min(delay * 2, RETRY_BACKOFF_MAX_S)
        raise EnvironmentFailed(f"environment {self.shown}: episode {episode.sample_id} failed after "
                                f"{self.cfg.retries} retries: {last}")

    def _post(self, body: bytes) -> tuple[int, str]:
        """(status, text); status -1 for a refused connection, -2 for a timeout or another transport error."""
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.cfg.timeout_s) as resp:  # noqa: S310 - http(s) checked
                return int(resp.status), resp.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return int(exc.code), exc.read().decode("utf-8", "replace")
        except urllib.error.URLError as exc:
            refused = isinstance(exc.reason, ConnectionRefusedError)
            return (-1 if refused else -2), f"{type(exc.reason).__name__}: {exc.reason}"
        except (TimeoutError, OSError) as exc:
            return -2, f"{type(exc).__name__}: {exc} (environment.timeout_s={self.cfg.timeout_s:g})"


def build_environment(cfg: EnvironmentConfig, import_function: Callable[[str, str], Callable]) -> Environment:
    """The environment of ``cfg``: a Python function (imported with ``import_function``) or an HTTP server."""
    if cfg.fn is not None:
        return PythonEnvironment(cfg, import_function(cfg.fn, "environment.fn"))
    return HttpEnvironment(cfg)
