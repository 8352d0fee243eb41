"""``expstream serve-reward``: a local reward model or reward function behind the reward JSON API (aiohttp).

``POST /score`` scores items (200 scores; 400 a bad item with its index; 413 an item over
``--max-len`` tokens, never truncated; 401 without the token when ``EXPSTREAM_REWARD_TOKEN`` is
set) and ``GET /health`` reports liveness. Scoring runs on one worker thread, so the event loop
keeps accepting; a function raising ``ValueError`` is retried item by item to name the bad one,
any other exception (``BaseException`` included) is a 500 and the server stays up. The API and
the handling of a request step by step: docs/reward.md "The JSON API" and "What ``serve-reward``
does with a request".
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import ipaddress
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from expstream.config.cli_args import Command
from expstream.config.redaction import REWARD_TOKEN_ENV, env_reward_token
from expstream.errors import ConfigError

__all__ = ["ServerConfig", "Scorer", "ModelScorer", "FnScorer", "BadItem", "build_app", "build_scorer",
           "serve", "ServerThread", "validate_items", "add_serve_reward_arguments", "serve_reward_command",
           "ScorerCrashed", "bind_warning", "model_max_len"]

log = logging.getLogger("expstream.reward_server")

#: Why 64 MiB: aiohttp refuses bodies over 1 MiB by default; a request of a few hundred long
#: responses is legitimately larger, and a reward server is not exposed to the public.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Why 4096: bounds one request's memory and forward; clients send batch_size (8) items per request.
DEFAULT_MAX_ITEMS = 4096
#: Why these keys: the API's item fields; unknown keys are ignored (forward compatibility).
REQUIRED_FIELDS = ("id", "prompt", "response")
#: Why 4096 tokens when a model says nothing of its context: the tiny models' and most small reward
#: models' max_position_embeddings; beyond its context a model's score means nothing anyway.
DEFAULT_MAX_LEN = 4096
#: Why 32768 padded tokens per forward: bounds one forward's activations (the attention of a row is
#: quadratic in its length) however many items a request holds; a batch above it is split.
FORWARD_TOKENS = 32768
OPTIONAL_FIELDS = ("query", "label", "reference")


@dataclass
class ServerConfig:
    """``expstream serve-reward`` options."""

    model: str | None = None  # a saved reward model directory, or builtin:tiny
    fn: str | None = None  # module:function
    host: str = "127.0.0.1"
    port: int = 8000
    latency_ms: float = 0.0  # simulated per-request latency (a slow judge), for benches and tests
    max_items: int = DEFAULT_MAX_ITEMS
    device: str = "cpu"
    cache_dir: str = ".cache/expstream/models"  # where builtin:tiny is built
    max_len: int | None = None  # --model: tokens per item at most (None: the model's own limit)
    # the bearer token requests must carry (from EXPSTREAM_REWARD_TOKEN; never printed: repr=False)
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.fn is None):
            raise ConfigError("give exactly one of --model and --fn", field="--model/--fn",
                              fix="--model DIR serves a reward model, --fn module:function a reward function")
        if self.latency_ms < 0:
            raise ConfigError(f"--latency-ms must be >= 0, got {self.latency_ms}", field="--latency-ms",
                              fix="give the simulated latency in milliseconds, e.g. 200")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port {self.port} is not a TCP port", field="--port", fix="use 1..65535 (0: any free)")
        if self.max_items < 1:
            raise ConfigError("--max-items must be >= 1", field="--max-items", fix="e.g. 4096")
        if self.max_len is not None and self.max_len < 1:
            raise ConfigError(f"--max-len must be >= 1, got {self.max_len}", field="--max-len",
                              fix="give the reward model's context length in tokens, or leave it out")


class BadItem(Exception):
    """An item the scorer cannot score (its index in the request): answered as ``status`` (400, or
    413 for an item too long for the model)."""

    def __init__(self, index: int | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.index, self.status = index, status


class ScorerCrashed(RuntimeError):
    """A reward function raised a BaseException that is not an Exception (``SystemExit``,
    ``KeyboardInterrupt``, ...) on the worker thread: a bug of the function, answered 500."""


def _guarded(score: Callable[[list[dict[str, str]]], list[float]], items: list[dict[str, str]]) -> list[float]:
    """``score(items)`` on the worker thread, a BaseException turned into :class:`ScorerCrashed`: it
    would otherwise travel through the executor's future into the event loop and stop the server."""
    try:
        return score(items)
    except Exception:
        raise
    except BaseException as exc:  # noqa: BLE001 - only a scorer's own code runs on this thread
        raise ScorerCrashed(f"the scorer raised {type(exc).__name__}({exc}) on the worker thread; a reward "
                            "function must return scores or raise ValueError for a bad item") from exc


class Scorer:
    """What the server scores with: ``name``, ``kind`` and ``score(items) -> list[float]``."""

    name: str = ""
    kind: str = ""

    def score(self, items: list[dict[str, str]]) -> list[float]:  # pragma: no cover - interface
        raise NotImplementedError


def _query(item: dict[str, str]) -> str:
    return item.get("query") or item["prompt"] + item["response"]


class FnScorer(Scorer):
    """A reward function ``fn(queries, prompts, labels) -> floats`` (as ``models.reward_fn``)."""

    kind = "fn"

    def __init__(self, path: str) -> None:
        from expstream.models.resolve import reward_fn

        try:
            self.fn: Callable = reward_fn(path)
        except ConfigError as exc:
            text = str(exc).replace(f" (fix: {exc.fix})", "").replace("models.reward_fn", "--fn")
            raise ConfigError(text, field="--fn", fix=exc.fix) from exc
        self.name = path

    def _call(self, items: list[dict[str, str]]) -> list[float]:
        out = self.fn([_query(i) for i in items], [i["prompt"] for i in items], [i.get("label", "") for i in items])
        scores = [float(s) for s in out]
        if len(scores) != len(items):
            raise RuntimeError(f"{self.name} returned {len(scores)} scores for {len(items)} queries")
        return scores

    def score(self, items: list[dict[str, str]]) -> list[float]:
        try:
            return self._call(items)
        except ValueError as exc:  # a bad input: find the first item that fails alone (step 4)
            for k, item in enumerate(items):
                try:
                    self._call([item])
                except ValueError as one:
                    raise BadItem(k, f"{self.name} raised ValueError for item {k} (id {item['id']}): {one}") from one
            raise RuntimeError(f"{self.name} raised ValueError on the batch but on no item alone: {exc}") from exc


class ModelScorer(Scorer):
    """A sequence-classification reward model: one batched forward over the tokenized queries."""

    kind = "model"

    def __init__(self, path: str, device: str = "cpu", cache_dir: str = ".cache/expstream/models",
                 max_len: int | None = None) -> None:
        from pathlib import Path

        from expstream.config.topology import BUILTIN_TINY
        from expstream.models.hf import load_tokenizer
        from expstream.models.tiny import build_tiny_models
        from expstream.models.vl import load_reward_model

        if path == BUILTIN_TINY:
            model_path = tok_path = Path(build_tiny_models(cache_dir)["reward"])
        else:
            model_path = tok_path = Path(path).expanduser()
            if not (model_path / "config.json").is_file():
                raise ConfigError(f"{path!r} holds no saved model (no config.json)", field="--model",
                                  fix="point it at a directory save_pretrained wrote (model and tokenizer), "
                                      "or use builtin:tiny")
        self.tokenizer = load_tokenizer(tok_path, field="--model")
        self.model = load_reward_model(model_path, device=device, field="--model",
                                       pad_token_id=self.tokenizer.pad_token_id)
        self.name = path
        self.max_len = max_len or model_max_len(self.model, self.tokenizer)
        # no text of more characters than this can fit in max_len tokens: refused before tokenizing
        self.max_chars = self.max_len * max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))

    def _too_long(self, k: int, item: dict[str, str], what: str) -> BadItem:
        return BadItem(k, f"items[{k}] (id {item['id']}): {what}, over this reward model's limit of {self.max_len} "
                          "tokens (--max-len); items are not truncated: generate shorter responses, or serve a model "
                          "with a longer context", status=413)

    def score(self, items: list[dict[str, str]]) -> list[float]:
        tok = self.tokenizer
        for k, item in enumerate(items):
            if len(_query(item)) > self.max_chars:
                raise self._too_long(k, item, f"{len(_query(item))} characters")
        rows = [tok.encode(_query(i), add_special_tokens=False) for i in items]
        eos = tok.eos_token_id
        rows = [r + [eos] if eos is not None and (not r or r[-1] != eos) else r for r in rows]
        for k, r in enumerate(rows):
            if len(r) > self.max_len:
                raise self._too_long(k, items[k], f"{len(r)} tokens")
        out: list[float] = []
        start = 0
        while start < len(rows):  # forwards of at most FORWARD_TOKENS padded tokens (one row at least)
            end, width = start + 1, len(rows[start])
            while end < len(rows) and (end + 1 - start) * max(width, len(rows[end])) <= FORWARD_TOKENS:
                width = max(width, len(rows[end]))
                end += 1
            out.extend(self._forward(rows[start:end]))
            start = end
        return out

    def _forward(self, rows: list[list[int]]) -> list[float]:
        import torch

        from expstream.models.passes import forward_reward

        tok = self.tokenizer
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        seqs = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):  # left padding, as the tokenizer and the stage's padded layout do
            seqs[k, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[k, width - len(r):] = 1
        return [float(x) for x in forward_reward(self.model, seqs, mask)]


def model_max_len(model: Any, tokenizer: Any) -> int:
    """The longest input a reward model takes: the smallest of its config's position limit and the
    tokenizer's ``model_max_length`` that are set (a tokenizer's "very large" default is not a limit);
    DEFAULT_MAX_LEN when neither says."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "text_config", None) or config
    limits = [getattr(text_config, key, None) for key in ("max_position_embeddings", "n_positions", "max_seq_len",
                                                          "seq_length")]
    limits.append(getattr(tokenizer, "model_max_length", None))
    known = [int(x) for x in limits if isinstance(x, int) and not isinstance(x, bool) and 0 < x < 10**7]
    return min(known) if known else DEFAULT_MAX_LEN


def build_scorer(cfg: ServerConfig) -> Scorer:
    return FnScorer(cfg.fn) if cfg.fn else ModelScorer(cfg.model or "", cfg.device, cfg.cache_dir, cfg.max_len)


def validate_items(body: Any, max_items: int) -> list[dict[str, str]]:
    """The request's items, or BadItem naming the field (step 1)."""
    if not isinstance(body, dict) or "items" not in body:
        raise BadItem(None, 'body: expected a JSON object {"items": [...]}')
    items = body["items"]
    if not isinstance(items, list):
        raise BadItem(None, f"items: expected a list, got {type(items).__name__}")
    if len(items) > max_items:
        raise BadItem(None, f"items: {len(items)} items exceed this server's limit of {max_items}; send smaller requests")
    out = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadItem(k, f"items[{k}]: expected an object, got {type(item).__name__}")
        for key in REQUIRED_FIELDS:
            if key not in item:
                raise BadItem(k, f"items[{k}].{key}: missing (required: {', '.join(REQUIRED_FIELDS)})")
        for key in REQUIRED_FIELDS + OPTIONAL_FIELDS:
            if key in item and not isinstance(item[key], str):
                raise BadItem(k, f"items[{k}].{key}: expected a string, got {type(item[key]).__name__}")
        out.append({key: item[key] for key in REQUIRED_FIELDS + OPTIONAL_FIELDS if key in item})
    return out


def build_app(scorer: Scorer, *, latency_ms: float = 0.0, max_items: int = DEFAULT_MAX_ITEMS,
              token: str | None = None) -> Any:
    """The aiohttp application: ``POST /score`` and ``GET /health``; ``token``: the bearer token
    ``/score`` requires (None: none)."""
    from aiohttp import web

    # one worker: a torch forward or a user function is not assumed thread-safe; latency overlaps anyway
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-score")
    counts = {"requests": 0, "items": 0}
    expected = f"Bearer {token}".encode() if token else None

    def bad(index: int | None, message: str, status: int = 400) -> Any:
        return web.json_response({"error": message, "index": index}, status=status)

    def authorized(request: web.Request) -> bool:
        if expected is None:
            return True
        return hmac.compare_digest(request.headers.get("Authorization", "").encode(), expected)

    async def score(request: web.Request) -> web.Response:
        if not authorized(request):
            return web.json_response(
                {"error": f"unauthorized: this server requires Authorization: Bearer <token> (the client reads "
                          f"it from {REWARD_TOKEN_ENV})", "index": None},
                status=401, headers={"WWW-Authenticate": 'Bearer realm="expstream-reward"'})
        counts["requests"] += 1
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            return bad(None, f"body: not JSON ({exc})")
        except RecursionError:  # "[[[[...": the parser's recursion limit, the client's mistake (not a 500)
            return bad(None, "body: JSON nested too deeply to parse; send {\"items\": [...]} of flat objects")
        try:
            items = validate_items(body, max_items)
        except BadItem as exc:
            return bad(exc.index, str(exc))
        if latency_ms > 0:
            await asyncio.sleep(latency_ms / 1000.0)
        if not items:
            return web.json_response({"scores": []})
        try:
            scores = await asyncio.get_running_loop().run_in_executor(executor, _guarded, scorer.score, items)
        except BadItem as exc:
            log.info("%d for item %s (id %s): %s", exc.status, exc.index, items[exc.index or 0]["id"], exc)
            return bad(exc.index, str(exc), exc.status)
        except Exception as exc:  # a server fault, not the items': the client retries (step 4)
            log.exception("scoring %d items failed", len(items))
            return web.json_response({"error": f"{type(exc).__name__}: {exc}", "index": None}, status=500)
        for k, s in enumerate(scores):
            if not math.isfinite(s):
                return bad(k, f"items[{k}] (id {items[k]['id']}): the score is {s}, not finite")
        counts["items"] += len(items)
        return web.json_response({"scores": scores})

    async def health(request: web.Request) -> web.Response:
        if not authorized(request):  # a probe without the token learns that it is up, nothing more
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "ok", "model": scorer.name, "kind": scorer.kind, **counts})

    async def on_cleanup(app: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    app.on_cleanup.append(on_cleanup)
    return app


def bind_warning(host: str, token: str | None) -> str | None:
    """The warning for listening on ``host`` without a token: None on a loopback address or with a token."""
    if token:
        return None
    name = host.strip("[]")
    if name == "localhost":
        return None
    try:
        if ipaddress.ip_address(name).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any interface
    return (f"serve-reward listens on {host or 'every address'} without a token: anyone who can reach this port "
            f"can query the reward model or function; set {REWARD_TOKEN_ENV} (the same value for the server and "
            "the run), or listen on 127.0.0.1")


def serve(cfg: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT (aiohttp's run_app handles both)."""
    from aiohttp import web

    warning = bind_warning(cfg.host, cfg.token)
    if warning:
        log.warning("%s", warning)
    scorer = build_scorer(cfg)
    app = build_app(scorer, latency_ms=cfg.latency_ms, max_items=cfg.max_items, token=cfg.token)
    log.info("serving reward %s %s on http://%s:%d (latency %g ms%s%s)", scorer.kind, scorer.name, cfg.host,
             cfg.port, cfg.latency_ms, f", inputs of at most {scorer.max_len} tokens" if isinstance(
                 scorer, ModelScorer) else "", f", bearer token from {REWARD_TOKEN_ENV}" if cfg.token else "")
    web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None)


class ServerThread:
    """The same server on a background thread's event loop (tests, benches): ``start()`` returns the
    url once it listens; ``stop()`` closes it (connections dropped, as a killed server's are)."""

    def __init__(self, scorer: Scorer, *, host: str = "127.0.0.1", port: int = 0, latency_ms: float = 0.0,
                 max_items: int = DEFAULT_MAX_ITEMS, token: str | None = None) -> None:
        self.scorer, self.host, self.port = scorer, host, port
        self.latency_ms, self.max_items, self._token = latency_ms, max_items, token
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-server", daemon=True)
        self._thread.start()

        async def up() -> int:
            app = build_app(self.scorer, latency_ms=self.latency_ms, max_items=self.max_items, token=self._token)
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
            await site.start()
            return self._runner.addresses[0][1]  # the bound port when 0 was asked

        self.port = asyncio.run_coroutine_threadsafe(up(), self._loop).result(10)
        return self.url

    def stop(self) -> None:
        if self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
        self._loop = None


def add_serve_reward_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a saved reward model directory (sequence classification), or builtin:tiny")
    what.add_argument("--fn", help="a reward function module:function, called as fn(queries, prompts, labels)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="sleep this long per request (simulates a slow judge; concurrent requests overlap)")
    p.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS, help="items per request at most")
    p.add_argument("--max-len", type=int, default=None,
                   help="--model: tokens per item at most, longer items answered 413 (default: the model's "
                        f"max_position_embeddings / tokenizer limit, else {DEFAULT_MAX_LEN})")
    p.add_argument("--device", default="cpu", help="torch device of the reward model")
    p.add_argument("--cache-dir", default=".cache/expstream/models", help="where builtin:tiny is built")


def serve_reward_command(args: Any) -> int:
    # the token comes from the environment only: a command line is readable by every user (ps)
    cfg = ServerConfig(model=args.model, fn=args.fn, host=args.host, port=args.port, latency_ms=args.latency_ms,
                       max_items=args.max_items, device=args.device, cache_dir=args.cache_dir, max_len=args.max_len,
                       token=env_reward_token())
    serve(cfg)
    return 0


SERVE_REWARD = Command("serve-reward", "serve a reward model or function over HTTP (docs/reward.md)",
                       add_serve_reward_arguments, serve_reward_command, reads_topology=False)
