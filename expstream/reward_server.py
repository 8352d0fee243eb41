"""``expstream serve-reward``: a local reward model or reward function behind the reward JSON API (aiohttp).

The API (docs/reward.md "Remote reward servers", written so a server can be built in any language):

* ``POST /score`` ``{"items": [{"id", "prompt", "response", "query"?, "label"?, "reference"?}, ...]}``
  -> 200 ``{"scores": [float, ...]}`` (one per item, same order);
  -> 400 ``{"error": str, "index": int | null}``: a bad item (``index``) or a bad request (null).
* ``GET /health`` -> 200 ``{"status": "ok", "model": str, "kind": "model" | "fn", "requests": int}``.

Handling of one ``POST /score``:

1. Parse and validate the body (400 naming the field, e.g. ``items[3].prompt``, and its index).
2. Sleep ``latency_ms`` (``asyncio.sleep``: concurrent requests overlap, as a remote judge's do).
3. Score on one worker thread (the forward or the function blocks; the event loop keeps accepting):
   a reward model tokenizes ``query`` (or prompt + response), appends EOS when missing (the stage
   scores at the repaired EOS) and runs one batched forward; a function is called as
   ``fn(queries, prompts, labels)``.
4. A function that raises ``ValueError`` on the batch is called item by item: the first item that
   raises alone is answered as 400 with its index (that sample is poison, the client dead-letters
   it). Any other exception is a server fault: 500 (the client retries; nothing is dead-lettered).
   A non-finite score is a 400 for its item, as the reward stage dead-letters a non-finite reward.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from expstream.errors import ConfigError

__all__ = ["ServerConfig", "Scorer", "ModelScorer", "FnScorer", "BadItem", "build_app", "build_scorer",
           "serve", "ServerThread", "validate_items", "add_serve_reward_parser", "serve_reward_command"]

log = logging.getLogger("expstream.reward_server")

#: Why 64 MiB: aiohttp refuses bodies over 1 MiB by default; a request of a few hundred long
#: responses is legitimately larger, and a reward server is not exposed to the public.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Why 4096: bounds one request's memory and forward; clients send batch_size (8) items per request.
DEFAULT_MAX_ITEMS = 4096
#: Why these keys: the API's item fields; unknown keys are ignored (forward compatibility).
REQUIRED_FIELDS = ("id", "prompt", "response")
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


class BadItem(Exception):
    """An item the scorer cannot score (its index in the request): answered as 400."""

    def __init__(self, index: int | None, message: str) -> None:
        super().__init__(message)
        self.index = index


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
        from expstream.resolve import reward_fn

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

    def __init__(self, path: str, device: str = "cpu", cache_dir: str = ".cache/expstream/models") -> None:
        from pathlib import Path

        from expstream.models import build_tiny_models, load_tokenizer
        from expstream.topology import BUILTIN_TINY
        from expstream.vl import load_reward_model

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

    def score(self, items: list[dict[str, str]]) -> list[float]:
        import torch

        from expstream.models import forward_reward

        tok = self.tokenizer
        rows = [tok.encode(_query(i), add_special_tokens=False) for i in items]
        eos = tok.eos_token_id
        rows = [r + [eos] if eos is not None and (not r or r[-1] != eos) else r for r in rows]
        width = max(len(r) for r in rows)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        seqs = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, r in enumerate(rows):  # left padding, as the tokenizer and the stage's padded layout do
            seqs[k, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[k, width - len(r):] = 1
        return [float(x) for x in forward_reward(self.model, seqs, mask)]


def build_scorer(cfg: ServerConfig) -> Scorer:
    return FnScorer(cfg.fn) if cfg.fn else ModelScorer(cfg.model or "", cfg.device, cfg.cache_dir)


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


def build_app(scorer: Scorer, *, latency_ms: float = 0.0, max_items: int = DEFAULT_MAX_ITEMS) -> Any:
    """The aiohttp application: ``POST /score`` and ``GET /health``."""
    from aiohttp import web

    # one worker: a torch forward or a user function is not assumed thread-safe; latency overlaps anyway
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-score")
    counts = {"requests": 0, "items": 0}

    def bad(index: int | None, message: str) -> Any:
        return web.json_response({"error": message, "index": index}, status=400)

    async def score(request: web.Request) -> web.Response:
        counts["requests"] += 1
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            return bad(None, f"body: not JSON ({exc})")
        try:
            items = validate_items(body, max_items)
        except BadItem as exc:
            return bad(exc.index, str(exc))
        if latency_ms > 0:
            await asyncio.sleep(latency_ms / 1000.0)
        if not items:
            return web.json_response({"scores": []})
        try:
            scores = await asyncio.get_running_loop().run_in_executor(executor, scorer.score, items)
        except BadItem as exc:
            log.info("400 for item %s (id %s): %s", exc.index, items[exc.index or 0]["id"], exc)
            return bad(exc.index, str(exc))
        except Exception as exc:  # a server fault, not the items': the client retries (step 4)
            log.exception("scoring %d items failed", len(items))
            return web.json_response({"error": f"{type(exc).__name__}: {exc}", "index": None}, status=500)
        for k, s in enumerate(scores):
            if not math.isfinite(s):
                return bad(k, f"items[{k}] (id {items[k]['id']}): the score is {s}, not finite")
        counts["items"] += len(items)
        return web.json_response({"scores": scores})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": scorer.name, "kind": scorer.kind, **counts})

    async def on_cleanup(app: web.Application) -> None:
        executor.shutdown(wait=False, cancel_futures=True)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    app.on_cleanup.append(on_cleanup)
    return app


def serve(cfg: ServerConfig) -> None:
    """Serve until SIGTERM/SIGINT (aiohttp's run_app handles both)."""
    from aiohttp import web

    scorer = build_scorer(cfg)
    app = build_app(scorer, latency_ms=cfg.latency_ms, max_items=cfg.max_items)
    log.info("serving reward %s %s on http://%s:%d (latency %g ms)", scorer.kind, scorer.name, cfg.host,
             cfg.port, cfg.latency_ms)
    web.run_app(app, host=cfg.host, port=cfg.port, print=None, access_log=None)


class ServerThread:
    """The same server on a background thread's event loop (tests, benches): ``start()`` returns the
    url once it listens; ``stop()`` closes it (connections dropped, as a killed server's are)."""

    def __init__(self, scorer: Scorer, *, host: str = "127.0.0.1", port: int = 0, latency_ms: float = 0.0,
                 max_items: int = DEFAULT_MAX_ITEMS) -> None:
        self.scorer, self.host, self.port = scorer, host, port
        self.latency_ms, self.max_items = latency_ms, max_items
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
            app = build_app(self.scorer, latency_ms=self.latency_ms, max_items=self.max_items)
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


def add_serve_reward_parser(sub: Any) -> None:
    p = sub.add_parser("serve-reward", help="serve a reward model or function over HTTP (docs/reward.md)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a saved reward model directory (sequence classification), or builtin:tiny")
    what.add_argument("--fn", help="a reward function module:function, called as fn(queries, prompts, labels)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--latency-ms", type=float, default=0.0,
                   help="sleep this long per request (simulates a slow judge; concurrent requests overlap)")
    p.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS, help="items per request at most")
    p.add_argument("--device", default="cpu", help="torch device of the reward model")
    p.add_argument("--cache-dir", default=".cache/expstream/models", help="where builtin:tiny is built")


def serve_reward_command(args: Any) -> int:
    cfg = ServerConfig(model=args.model, fn=args.fn, host=args.host, port=args.port, latency_ms=args.latency_ms,
                       max_items=args.max_items, device=args.device, cache_dir=args.cache_dir)
    serve(cfg)
    return 0

