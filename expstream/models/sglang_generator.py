"""SGLang as the generate stage's engine (``generate.backend: sglang``; docs/sglang.md).

:class:`SglangGenerator` has the contract of :class:`expstream.models.hf.TransformersGenerator`
(``generate(prompts, n, ...) -> (token_lists, logprob_lists)``, rows ``[g*n, (g+1)*n)`` for prompt
g), so nothing downstream knows which engine sampled. It talks to an SGLang server over HTTP, the way
verl, slime and AReaL do: one ``POST /generate`` per micro-batch with token ids in and out
(``--skip-tokenizer-init``: the stage tokenizes and decodes), ``return_logprob`` for the behaviour
log-probs, ``/abort_request`` when the stage is told to stop, and in-place weight updates with
``/update_weights_from_disk`` followed by ``/flush_cache`` (no prefix computed with the old weights is
reused). The server is the replica's own (:class:`expstream.models.sglang_server.SglangServer`,
stopped with the stage) unless ``generate.sglang_url`` names a running one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from expstream.errors import ConfigError, ShutdownRequested
from expstream.models.engine_weights import EngineWeights
from expstream.models.sglang_server import (
    SETUP_HINT,
    SglangServer,
    SglangServerError,
    http_json,
    sglang_installed,
)

__all__ = ["SglangGenerator", "SglangWeights", "check_generate_config"]

#: Why 0.05 s: how often a running /generate checks the stage's stop flag (an abort is one more request).
STOP_POLL_S = 0.05

_ids = itertools.count()


def check_generate_config(gen: Any) -> None:
    """Refuse the ``generate.*`` settings the SGLang backend cannot honour, naming the knob (exit 2).

    SGLang's returned log-probs are ``log_softmax(logits / temperature)`` *before* its top-k / top-p
    truncation, so with either on they would not be the log-probs of the distribution the tokens were
    sampled from (what the trainer's importance weights need); both are refused. The rest is honoured:
    n_samples_per_prompt, max/min_new_tokens, temperature (0 = greedy), stop at EOS, FIRE, the stage's
    own tokenization and decoding.
    """
    if gen.sglang_url is None and not sglang_installed(gen.sglang_python):
        raise ConfigError("generate.backend=sglang, but there is no SGLang environment"
                          + (f" at generate.sglang_python={gen.sglang_python}" if gen.sglang_python else ""),
                          field="generate.backend", fix=SETUP_HINT + ", or use generate.backend=transformers")
    if gen.top_k is not None and gen.top_k > 0:
        raise ConfigError(f"generate.top_k={gen.top_k} cannot be used with SGLang: its log-probs are those before "
                          "top-k truncation, not of the distribution sampled from", field="generate.top_k",
                          fix="use -1 (no top-k) with generate.backend=sglang, or the transformers/vllm backend")
    if gen.top_k is not None and gen.top_k < -1:
        raise ConfigError(f"generate.top_k={gen.top_k} cannot be given to SGLang", field="generate.top_k",
                          fix="use -1 (or 0) for no top-k")
    if gen.top_p < 1.0:
        raise ConfigError(f"generate.top_p={gen.top_p} cannot be used with SGLang: its log-probs are those before "
                          "top-p truncation, not of the distribution sampled from", field="generate.top_p",
                          fix="use 1.0 with generate.backend=sglang, or the transformers/vllm backend")


class SglangWeights(EngineWeights):
    """The follower's model for SGLang (expstream/models/engine_weights.py)."""

    def __init__(self, generator: SglangGenerator, model_dir: str | os.PathLike[str]) -> None:
        super().__init__(generator, model_dir, "SGLang")


class SglangGenerator:
    """Sampling on an SGLang server; :meth:`generate` as ``TransformersGenerator.generate``."""

    def __init__(self, model_dir: str | os.PathLike[str], tokenizer: Any, *, url: str | None = None,
                 python: str | os.PathLike[str] | None = None, device: str = "cpu", seed: int = 0,
                 stop_token_ids: set[int] | None = None) -> None:
        self.model_dir = str(model_dir)
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else ({int(eos)} if eos is not None
                                                                                       else set())
        t0 = time.perf_counter()
        self.server: SglangServer | None = None
        if url is None:
            self.server = SglangServer(self.model_dir, python=python, device=device, seed=seed)
            url = self.server.url
        self.url = url.rstrip("/")
        http_json(self.url, "/model_info", timeout=30.0)  # an existing server must answer too
        self.startup_s = time.perf_counter() - t0
        self.last_reload_s: float | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sglang-http")
        self._closed = False

    # -- sampling ---------------------------------------------------------------------------------
    def _params(self, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int, min_new_tokens: int,
                seed: int | None, ignore_eos: bool) -> dict[str, Any]:
        p: dict[str, Any] = {
            "temperature": float(temperature), "top_p": float(top_p),
            "top_k": -1 if top_k is None or top_k <= 0 else int(top_k),
            "max_new_tokens": int(max_new_tokens), "min_new_tokens": 0 if ignore_eos else int(min_new_tokens),
            "stop_token_ids": sorted(self.stop_token_ids), "ignore_eos": bool(ignore_eos),
            "skip_special_tokens": False, "no_stop_trim": True,
        }
        if seed is not None:  # honoured by servers in deterministic-inference mode (GPU); ignored otherwise
            p["sampling_seed"] = int(seed) % 2**31
        return p

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 32,
        min_new_tokens: int = 1,
        seed: int | None = None,
        ignore_eos: bool = False,
        should_stop: Callable[[], bool] | None = None,
        return_log_probs: bool = False,
        first_token_temperature: float | None = None,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """``n`` samples per prompt in one ``/generate`` batch of ``len(prompts) * n`` rows.

        ``seed`` goes to every row as ``sampling_seed`` (prompt g's rows ``seed + g*n + j``), which a
        server honours only in deterministic-inference mode (not available on CPU: there a redelivered
        record samples other tokens). ``first_token_temperature`` (FIRE): two calls,
        expstream.models.fire.generate_two_phase.
        """
        from expstream.models.hf import check_generate_args

        check_generate_args(prompts, n, temperature, top_p, max_new_tokens, min_new_tokens)
        if self._closed:
            raise RuntimeError("SglangGenerator.generate after close()")
        if first_token_temperature is not None and first_token_temperature != temperature:
            from expstream.models.fire import generate_two_phase

            tokens, lps = generate_two_phase(
                self.generate, prompts, n, first_token_temperature=first_token_temperature, temperature=temperature,
                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, stop_token_ids=self.stop_token_ids,
                seed=seed, ignore_eos=ignore_eos, top_p=top_p, top_k=top_k, should_stop=should_stop)
            return (tokens, lps) if return_log_probs else tokens
        if not prompts:
            return ([], []) if return_log_probs else []
        if should_stop is not None and should_stop():
            raise ShutdownRequested("stop requested before the generation started")
        rows = [[int(t) for t in p] for p in prompts for _ in range(n)]
        rids = [f"expstream-{os.getpid()}-{next(_ids)}" for _ in rows]
        params = [self._params(temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
                               min_new_tokens=min_new_tokens, seed=None if seed is None else seed + i,
                               ignore_eos=ignore_eos) for i in range(len(rows))]
        body = {"input_ids": rows, "sampling_params": params, "rid": rids, "return_logprob": True,
                "logprob_start_len": -1}
        future = self._pool.submit(http_json, self.url, "/generate", body)
        while True:
            try:
                outs = future.result(timeout=STOP_POLL_S)
                break
            except concurrent.futures.TimeoutError:
                if should_stop is not None and should_stop():
                    for rid in rids:
                        with contextlib.suppress(Exception):
                            http_json(self.url, "/abort_request", {"rid": rid}, timeout=10.0)
                    with contextlib.suppress(Exception):
                        future.result(timeout=30.0)
                    raise ShutdownRequested(f"stop requested with {len(rows)} samples unfinished; generation "
                                            "abandoned") from None
        return self._unpack(outs, rows, return_log_probs)

    def _unpack(self, outs: Any, rows: list[list[int]],
                return_log_probs: bool) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        if not isinstance(outs, list) or len(outs) != len(rows):
            raise SglangServerError(f"/generate returned {len(outs) if isinstance(outs, list) else type(outs).__name__}"
                                    f" outputs for {len(rows)} rows")
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        for i, out in enumerate(outs):
            meta = out.get("meta_info", {})
            reason = (meta.get("finish_reason") or {}).get("type")
            if reason == "abort":
                raise SglangServerError(f"/generate: row {i} was aborted by the server: {meta.get('finish_reason')}")
            toks = [int(t) for t in out["output_ids"]]
            lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
            if len(lps) != len(toks):
                raise SglangServerError(f"/generate: row {i} has {len(toks)} tokens but {len(lps)} log-probs")
            tokens.append(toks)
            logprobs.append(lps)
        return (tokens, logprobs) if return_log_probs else tokens

    # -- weights ------------------------------------------------------------------------------------
    def reload(self, weights_dir: str | os.PathLike[str] | None = None,
               state_dict: Mapping[str, Any] | None = None) -> float:
        """Load new weights in place (a saved model directory, or tensors written to a temporary one) with
        ``/update_weights_from_disk``, then ``/flush_cache``; returns the seconds it took. The server must
        see the directory (the same file system: its own replica's, or a server on this host)."""
        if (weights_dir is None) == (state_dict is None):
            raise ValueError("give exactly one of weights_dir or state_dict")
        t0 = time.perf_counter()
        if weights_dir is not None:
            self._update_from(str(weights_dir))
        else:
            from safetensors.torch import save_file

            tmp = tempfile.mkdtemp(prefix="expstream-sglang-weights-")
            try:
                save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                          str(Path(tmp) / "model.safetensors"))
                shutil.copy(Path(self.model_dir) / "config.json", Path(tmp) / "config.json")
                self._update_from(tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.last_reload_s = time.perf_counter() - t0
        return self.last_reload_s

    def _update_from(self, path: str) -> None:
        out = http_json(self.url, "/update_weights_from_disk", {"model_path": path, "flush_cache": True})
        if isinstance(out, dict) and not out.get("success", False):
            raise RuntimeError(f"SGLang refused the weights at {path}: {out.get('message')}")
        # Mandatory: a prefix cached under the old weights would be reused. update_weights_from_disk flushes
        # already (flush_cache=True); the explicit flush is the contract, whatever a server version defaults to.
        http_json(self.url, "/flush_cache", {}, method="POST")

    def close(self) -> None:
        """Stop the replica's own server (an existing one at generate.sglang_url is left running). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.stop()
