"""HttpRewardSource: the reward stage's client of a remote reward server (docs/reward.md "Remote reward servers").

One sub-batch of samples goes out as requests of ``batch_size`` items, up to ``max_in_flight`` at
once (asyncio + aiohttp on one event loop thread per source, its connections kept alive), and each
answer becomes scores or one of two errors the runner already knows: :class:`RewardRejected` (a
``PoisonRecordError``: the server named a bad item, which alone is dead-lettered) or
:class:`RewardServerUnavailable` (retriable: 429, 5xx, timeouts, refused connections, 401/403, or
the circuit breaker open). With ``EXPSTREAM_REWARD_TOKEN`` set every request carries a bearer
token; a url's own credentials are redacted in every message. The API, retries, breaker, event
loop (and its measurement): docs/reward.md "The JSON API" and "The client: HttpRewardSource".
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from expstream.config.redaction import REWARD_TOKEN_ENV, env_reward_token, is_redacted, redact_url
from expstream.errors import ExpstreamError, PoisonRecordError

__all__ = [
    "HttpRewardSource",
    "CircuitBreaker",
    "RewardServerUnavailable",
    "RewardRejected",
    "RewardServerError",
    "score_url",
    "items_from_batch",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RETRIES",
]

log = logging.getLogger("expstream.reward_http")

#: Why 10 s: a large reward model or an LLM judge takes seconds per batch; a request still open after
#: 10 s is more likely a hung server than a slow one, and the retry is cheaper than waiting longer.
DEFAULT_TIMEOUT_S = 10.0
#: Why 8: a judge's latency is mostly waiting; 8 requests in flight keep a replica busy with ~8x the
#: throughput of one at a time without flooding a small server (the issue's in-flight 1 vs 8 bench).
DEFAULT_MAX_IN_FLIGHT = 8
#: Why 8 items per request: small enough that 8 requests of one micro-batch spread over a server's
#: workers, large enough that a reward model's batched forward is not one row at a time.
DEFAULT_BATCH_SIZE = 8
#: Why 3 retries: rides out a restart or a dropped connection (~0.1+0.2+0.4 s of backoff) inside one
#: call; a longer outage is the runner's to wait out (it backs off up to 10 s and keeps membership).
DEFAULT_RETRIES = 3
#: Why 0.1 s: a refused connection or a 503 during a restart clears in a fraction of a second.
RETRY_BACKOFF_START_S = 0.1
#: Why 2 s: inside one call the retries must stay short; the stage runner owns the long waits.
RETRY_BACKOFF_MAX_S = 2.0
#: Why +-25 % jitter: replicas that failed together must not retry in lockstep against a recovering server.
RETRY_JITTER = 0.25
#: Why 5: one unlucky request is not an outage, five failed tries in a row (no success in between) are.
BREAKER_FAILURES = 5
#: Why 1 s: while open, calls fail fast (the runner backs off); after 1 s one probe request may test
#: the server again, so a restarted server is used within about a second of the runner's next retry.
BREAKER_RESET_S = 1.0
#: Why 5 s: closing the session or joining the loop thread must not hang a stopping stage.
CLOSE_TIMEOUT_S = 5.0
#: HTTP statuses that mean "this request, as sent, is wrong": the items are poison, never retried.
POISON_STATUSES = frozenset({400, 413, 422})
#: HTTP statuses that mean "not with these credentials": retriable (the samples are not at fault), named.
AUTH_STATUSES = frozenset({401, 403})


class RewardServerUnavailable(ExpstreamError):
    """The reward server is down, overloaded, slow or refusing: retriable. The stage runner backs off
    and keeps its membership; the micro-batch is scored again later, nothing is dead-lettered."""

    retriable = True


class RewardRejected(PoisonRecordError):
    """The server answered 400 for an item (or the whole request): that sample is poison. Not retriable."""

    def __init__(self, message: str, *, sample_id: str | None = None) -> None:
        super().__init__(message)
        self.sample_id = sample_id


class RewardServerError(ExpstreamError):
    """The server answered 200 with a body that breaks the API (not JSON, wrong number of scores, a
    score that is not a number). Not retriable: the same request gets the same answer."""

    retriable = False


def score_url(url: str) -> str:
    """``http://host:port`` -> ``http://host:port/score``; a url already ending in ``/score`` is kept
    (the seed's ``remote_rm_url`` style)."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        from expstream.errors import ConfigError

        raise ConfigError(f"reward server url {redact_url(url)!r} is not an http(s) url",
                          field="rewards.sources.<name>.url", fix="write it as http://host:port")
    return base if base.endswith("/score") else base + "/score"


def items_from_batch(batch: Any, tokenizer: Any | None = None) -> list[dict[str, str]]:
    """One API item per sample of a SampleBatch. ``query`` is the decoded prompt + repaired response
    (special tokens kept, as a local reward function gets it) when a tokenizer is given and the batch
    has ``action_ids``; otherwise prompt + response text."""
    ids = batch.sample_ids()
    if tokenizer is not None and batch.action_ids is not None:
        queries = [tokenizer.decode(list(p) + list(a), skip_special_tokens=False)
                   for p, a in zip(batch.prompt_ids.rows(), batch.action_ids.rows(), strict=True)]
    else:
        queries = [p + r for p, r in zip(batch.prompt, batch.response, strict=True)]
    return [{"id": ids[i], "prompt": batch.prompt[i], "response": batch.response[i], "query": queries[i],
             "label": batch.label[i], "reference": batch.reference[i]} for i in range(len(batch))]


@dataclass
class _BreakerState:
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False


class CircuitBreaker:
    """closed -> (``failures`` consecutive failed tries) -> open -> (``reset_s`` later) -> half-open:
    one probe is let through; its success closes the breaker, its failure opens it again.

    Thread-safe (the loop thread records, the caller may read ``state``); ``clock`` is an argument so
    that the transitions are tested without waiting.
    """

    def __init__(self, failures: int = BREAKER_FAILURES, reset_s: float = BREAKER_RESET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1:
            raise ValueError("failures must be >= 1")
        self.failures, self.reset_s, self.clock = failures, reset_s, clock
        self._s = _BreakerState()
        self._lock = threading.Lock()
        self.opened = 0  # how many times it opened (logged, tested)

    @property
    def state(self) -> str:
        with self._lock:
            return self._state()

    def _state(self) -> str:
        if self._s.opened_at is None:
            return "closed"
        return "half-open" if self.clock() - self._s.opened_at >= self.reset_s else "open"

    def admit(self) -> str:
        """Before a call: "closed" (go), "probe" (go, alone: you are the half-open probe) or "open" (fail fast)."""
        with self._lock:
            state = self._state()
            if state == "closed":
                return "closed"
            if state == "half-open" and not self._s.probing:
                self._s.probing = True
                return "probe"
            return "open"

    def is_open(self) -> bool:
        with self._lock:
            return self._s.opened_at is not None and not self._s.probing

    def end_probe(self) -> None:
        """After a probe: when neither success() nor failure() settled it (cancelled), it failed."""
        with self._lock:
            settled = not self._s.probing
        if not settled:
            self.failure()

    def success(self) -> None:
        with self._lock:
            self._s = _BreakerState()

    def failure(self) -> bool:
        """Record a failed try; True when this one opened (or re-opened) the breaker."""
        with self._lock:
            if self._s.probing:  # the probe failed: open again for another reset_s
                self._s = _BreakerState(failures=self._s.failures + 1, opened_at=self.clock())
                self.opened += 1
                return True
            self._s.failures += 1
            if self._s.opened_at is None and self._s.failures >= self.failures:
                self._s.opened_at = self.clock()
                self.opened += 1
                return True
            return False


class _LoopThread:
    """One asyncio event loop in a daemon thread; ``run(coro)`` waits for its result from any thread."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT_S)
        if not self.thread.is_alive():
            self.loop.close()


class _Retry(Exception):
    """A retriable failure of one try (internal: becomes RewardServerUnavailable when final)."""


class HttpRewardSource:
    """A reward source that asks a remote reward server (the contract's ``RewardSource``: ``name``,
    ``score(batch) -> float32 (B,)``, ``close()``).

    ``tokenizer`` (optional, beyond the contract) builds each item's ``query`` from the token ids as
    a local reward function sees it; without it ``query`` is prompt + response text. ``breaker`` may
    be shared or tuned (tests); by default each source has its own. ``token``: the bearer token
    (None: ``EXPSTREAM_REWARD_TOKEN`` from the environment; "": none).
    """

    def __init__(self, name: str, url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, batch_size: int = DEFAULT_BATCH_SIZE,
                 retries: int = DEFAULT_RETRIES, tokenizer: Any | None = None,
                 breaker: CircuitBreaker | None = None, token: str | None = None) -> None:
        field = f"rewards.sources.{name}"
        from expstream.errors import ConfigError

        for key, value, low in (("max_in_flight", max_in_flight, 1), ("batch_size", batch_size, 1),
                                ("retries", retries, 0)):
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}", field=f"{field}.{key}",
                                  fix=f"set {key} to {low} or more")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}", field=f"{field}.timeout_s",
                              fix="set timeout_s to the seconds one request may take, e.g. 10")
        if is_redacted(url):
            raise ConfigError(f"the credentials of {url!r} were redacted when the run directory's topology was "
                              "written", field=f"{field}.url",
                              fix=f"give the url with its credentials again: --set {field}.url=..., or the "
                                  "EXPSTREAM_TOPOLOGY_SECRETS variable (docs/reward.md \"Authentication\")")
        self.name, self.url = name, score_url(url)
        self.shown_url = redact_url(self.url)  # what messages show
        token = env_reward_token() if token is None else token
        if token and urlsplit(url).username is not None:
            raise ConfigError(f"{self.shown_url} carries credentials and {REWARD_TOKEN_ENV} is set too; a request "
                              "has one Authorization header", field=f"{field}.url",
                              fix=f"drop the user:password@ part of the url, or unset {REWARD_TOKEN_ENV}")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s, self.max_in_flight, self.batch_size, self.retries = (
            float(timeout_s), max_in_flight, batch_size, retries)
        self.tokenizer = tokenizer
        self.breaker = breaker or CircuitBreaker()
        self.stats = {"requests": 0, "failed_tries": 0, "retries": 0, "fast_failures": 0}
        self._loop: _LoopThread | None = None
        self._session: Any = None
        self._lock = threading.Lock()

    # --- the synchronous face the reward stage calls ------------------------------------------------

    def score(self, batch: Any) -> np.ndarray:
        """Scores (B,) float32 for the rows of ``batch``, in order (protocol steps in the module docstring)."""
        items = items_from_batch(batch, self.tokenizer)
        return self.score_items(items)

    def score_items(self, items: Sequence[dict[str, str]]) -> np.ndarray:
        """Scores of API items (steps 2-5); the part of :meth:`score` that needs no SampleBatch."""
        if not items:
            return np.zeros(0, dtype=np.float32)
        with self._lock:
            if self._loop is None:
                self._loop = _LoopThread(f"reward-http-{self.name}")
        return self._loop.run(self._score(list(items)))

    def close(self) -> None:
        """Close the session and stop the loop thread (idempotent)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            if self._session is not None:
                loop.run(self._session.close(), timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:  # closing is best effort: the process is stopping anyway
            log.debug("reward source %s: closing the session failed: %s", self.name, exc)
        self._session = None
        loop.stop()

    # --- the coroutines (run on the loop thread) --------------------------------------------------

    async def _score(self, items: list[dict[str, str]]) -> np.ndarray:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_in_flight),
                json_serialize=json.dumps)
        return await score_with_session(self, self._session, items)


async def score_with_session(src: HttpRewardSource, session: Any, items: list[dict[str, str]]) -> np.ndarray:
    """Steps 2-5 of the protocol with a given ``aiohttp.ClientSession`` (the loop-thread path and the
    ``asyncio.run``-per-call comparison of docs/reward.md share it)."""
    chunks = [items[i:i + src.batch_size] for i in range(0, len(items), src.batch_size)]
    admitted = src.breaker.admit()
    if admitted == "open":
        src.stats["fast_failures"] += 1
        raise RewardServerUnavailable(
            f"reward source {src.name}: circuit breaker open after {src.breaker.failures} consecutive failures "
            f"against {src.shown_url}; failing fast until a probe succeeds (every {src.breaker.reset_s:g}s)")
    results: list[list[float] | None] = [None] * len(chunks)
    start = 0
    if admitted == "probe":  # the probe goes alone; the rest only when it succeeded
        try:
            results[0] = await _request(src, session, chunks[0])
        finally:
            src.breaker.end_probe()  # a probe cancelled before any answer counts as failed
        start = 1
    gate = asyncio.Semaphore(src.max_in_flight)

    async def one(k: int) -> None:
        async with gate:
            results[k] = await _request(src, session, chunks[k])

    tasks = [asyncio.ensure_future(one(k)) for k in range(start, len(chunks))]
    try:
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
    return np.asarray([s for r in results for s in (r or [])], dtype=np.float32)


async def _request(src: HttpRewardSource, session: Any, chunk: list[dict[str, str]]) -> list[float]:
    """One request with its retries (step 4): scores, or RewardRejected / RewardServerError /
    RewardServerUnavailable."""
    from expstream.retry import Backoff

    backoff = Backoff(RETRY_BACKOFF_START_S, RETRY_BACKOFF_MAX_S)
    last = ""
    for attempt in range(src.retries + 1):
        try:
            scores = await _try(src, session, chunk)
        except (RewardRejected, RewardServerError):
            src.breaker.success()  # the server answered: it is up, these items are the problem
            raise
        except _Retry as exc:
            last = str(exc)
            src.stats["failed_tries"] += 1
            if src.breaker.failure():
                log.warning("reward source %s: circuit breaker opened (%s); failing fast for %.1fs",
                            src.name, last, src.breaker.reset_s)
            if attempt == src.retries or src.breaker.is_open():
                break
            src.stats["retries"] += 1
            delay = backoff.next() * (1 + random.uniform(-RETRY_JITTER, RETRY_JITTER))
            log.info("reward source %s: %s; retry %d/%d in %.2fs", src.name, last, attempt + 1, src.retries, delay)
            await asyncio.sleep(delay)
            continue
        src.breaker.success()
        return scores
    raise RewardServerUnavailable(
        f"reward source {src.name}: {src.shown_url} unavailable for items {chunk[0]['id']}..{chunk[-1]['id']} "
        f"({last}; breaker {src.breaker.state})")


async def _try(src: HttpRewardSource, session: Any, chunk: list[dict[str, str]]) -> list[float]:
    import aiohttp

    src.stats["requests"] += 1
    try:
        async with session.post(src.url, json={"items": chunk}, headers=src._headers,
                                timeout=aiohttp.ClientTimeout(total=src.timeout_s)) as resp:
            status = resp.status
            text = await resp.text()
    except asyncio.TimeoutError as exc:
        raise _Retry(f"no answer within {src.timeout_s:g}s") from exc
    except aiohttp.ClientError as exc:  # refused, reset, DNS, a broken response
        raise _Retry(f"{type(exc).__name__}: {exc}") from exc
    if status == 200:
        return _parse_scores(src, text, chunk)
    if status in POISON_STATUSES:
        raise _rejected(src, status, text, chunk)
    if status in AUTH_STATUSES:
        if urlsplit(src.url).username is not None:
            raise _Retry(f"HTTP {status}: the server refused the credentials of the url {src.shown_url}")
        has = "a token that it refused" if src._headers else "no token"
        raise _Retry(f"HTTP {status}: the server wants a bearer token and this process sent {has}; set "
                     f"{REWARD_TOKEN_ENV} to the server's token in the run's environment")
    # 404/405 too: a server being redeployed, or a wrong url; either way not the samples' fault, and
    # the runner's give-up (exit 1, nothing dead-lettered) reports a url that never works.
    raise _Retry(f"HTTP {status}: {text[:200]}")


def _parse_scores(src: HttpRewardSource, text: str, chunk: list[dict[str, str]]) -> list[float]:
    try:
        body = json.loads(text)
        scores = body["scores"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RewardServerError(f"reward source {src.name}: {src.shown_url} answered 200 without a JSON "
                                f"{{\"scores\": [...]}} body: {text[:200]!r}") from exc
    if not isinstance(scores, list) or len(scores) != len(chunk):
        n = len(scores) if isinstance(scores, list) else type(scores).__name__
        raise RewardServerError(f"reward source {src.name}: {src.shown_url} returned {n} scores for {len(chunk)} "
                                "items; the API answers one score per item, in order")
    out = []
    for item, s in zip(chunk, scores, strict=True):
        if isinstance(s, bool) or not isinstance(s, (int, float)):
            raise RewardServerError(f"reward source {src.name}: score for {item['id']} is {s!r}, not a number")
        if not math.isfinite(s):
            raise RewardRejected(f"reward source {src.name}: non-finite score {s!r} for sample {item['id']}",
                                 sample_id=item["id"])
        out.append(float(s))
    return out


def _rejected(src: HttpRewardSource, status: int, text: str, chunk: list[dict[str, str]]) -> RewardRejected:
    try:
        body = json.loads(text)
        message, index = str(body.get("error", text)), body.get("index")
    except (ValueError, AttributeError):
        message, index = text[:500], None
    if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(chunk):
        sid = chunk[index]["id"]
        return RewardRejected(f"reward source {src.name}: server rejected sample {sid} (HTTP {status}): {message}",
                              sample_id=sid)
    ids = [it["id"] for it in chunk]
    return RewardRejected(f"reward source {src.name}: server rejected the request of samples {ids} "
                          f"(HTTP {status}): {message}")
