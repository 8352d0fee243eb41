"""vLLM as the generate stage's engine (``generate.backend: vllm``; docs/vllm.md).

:class:`VllmGenerator` has the contract of :class:`expstream.models.hf.TransformersGenerator`
(``generate(prompts, n, ...) -> (token_lists, logprob_lists)``, rows ``[g*n, (g+1)*n)`` for prompt
g), so nothing downstream knows which engine sampled. One in-process engine per generate process,
built in ``setup``: a micro-batch's requests are all added before the first step, a stop between
steps aborts them (:class:`~expstream.errors.ShutdownRequested`, redelivered), behaviour
log-probs are vLLM's processed log-probs of the sampled tokens, and :meth:`reload` updates the
weights in place and resets the prefix cache (mandatory). Engine mode, threads, reloads and the
measurements: docs/vllm.md "Inside the stage" and bench/README.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import itertools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from expstream.errors import ConfigError, ShutdownRequested
from expstream.models.engine_weights import EngineWeights

#: Why 1 GiB: without VLLM_CPU_KVCACHE_SPACE the CPU backend reserves 0.9 of the NUMA node's memory
#: and may refuse to start next to the other stages; 1 GiB holds ~1M tokens of the tiny models.
DEFAULT_KV_CACHE_GIB = 1
#: Why 512: prompt_max_len + max_new_tokens of the default topology is 80; a longer bound only costs KV memory.
DEFAULT_MAX_MODEL_LEN = 512
#: Why 8192: tokens one engine step may hold without chunked prefill; a micro-batch of 64 prompts of
#: 64 tokens prefills in one step, and a bigger one in several whole-prompt steps.
MAX_BATCHED_TOKENS = 8192
SETUP_HINT = "run `make setup-vllm` (CPU) or `pip install vllm` (GPU) in the project's venv"

_ids = itertools.count()


def vllm_available() -> bool:
    """Whether vLLM can be imported here (without importing it: that costs 5-7 s)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm(field: str = "generate.backend") -> None:
    """Refuse ``generate.backend=vllm`` where vLLM is not installed (a ConfigError: exit 2)."""
    if not vllm_available():
        raise ConfigError("generate.backend=vllm, but vLLM is not installed in this Python environment",
                          field=field, fix=SETUP_HINT + ", or use generate.backend=transformers")


def check_generate_config(gen: Any) -> None:
    """Refuse the ``generate.*`` settings vLLM cannot honour, naming the knob (ConfigError: exit 2).

    Honoured: n_samples_per_prompt, max/min_new_tokens, temperature, top_p, top_k, seed (run.seed),
    stop at EOS, skip_special_tokens (the stage decodes), prompt_max_len / truncate_prompts and
    apply_chat_template (the stage tokenizes). vLLM's sampler needs a finite positive top_k or -1/0.
    """
    require_vllm()
    if gen.top_k is not None and gen.top_k < -1:
        raise ConfigError(f"generate.top_k={gen.top_k} cannot be given to vLLM", field="generate.top_k",
                          fix="use -1 (or 0) for no top-k, or a positive k")
    if gen.max_new_tokens + gen.prompt_max_len > gen.vllm_max_model_len:
        raise ConfigError(
            f"generate.prompt_max_len + generate.max_new_tokens = {gen.prompt_max_len + gen.max_new_tokens} "
            f"exceeds generate.vllm_max_model_len={gen.vllm_max_model_len}", field="generate.vllm_max_model_len",
            fix="raise generate.vllm_max_model_len (it sizes the engine's KV cache) or shorten the sequences")


def _engine_env(kv_cache_gib: int) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(kv_cache_gib)))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the module docstring: "Engine mode"
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # our log format, not vLLM's per-step INFO lines
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _sampled_logprobs(lps: Any, toks: list[int]) -> list[float]:
    """The log-prob of every sampled token: with ``logprobs=0`` and ``flat_logprobs`` the engine keeps
    exactly the sampled token's per position, so the flat list is the answer (checked by its token ids)."""
    flat = getattr(lps, "logprobs", None)
    if flat is not None and lps.token_ids == toks and len(flat) == len(toks):
        return list(flat)
    return [float(step[tok].logprob) for step, tok in zip(lps, toks, strict=True)]


def _accumulate(acc: dict, out: Any, version: int, return_log_probs: bool) -> None:
    """One step's new tokens (DELTA outputs) of a request, each stamped with the version that sampled it."""
    for o in out.outputs:
        toks = list(o.token_ids)
        row = acc.setdefault((out.request_id, o.index), [[], [], []])
        row[0].extend(toks)
        if return_log_probs and toks:
            row[1].extend(_sampled_logprobs(o.logprobs, toks))
        row[2].extend([version] * len(toks))


class VllmWeights(EngineWeights):
    """The follower's model for vLLM (expstream/models/engine_weights.py)."""

    def __init__(self, generator: VllmGenerator, model_dir: str | os.PathLike[str]) -> None:
        super().__init__(generator, model_dir, "vLLM")


class VllmGenerator:
    """One vLLM engine for ``model_dir``; :meth:`generate` as ``TransformersGenerator.generate``."""

    def __init__(self, model_dir: str | os.PathLike[str], tokenizer: Any, *, seed: int = 0,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN, dtype: str = "float32",
                 kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, stop_token_ids: set[int] | None = None) -> None:
        require_vllm()
        _engine_env(kv_cache_gib)
        from vllm import LLM

        from expstream.models.vllm_fire import FirstTokenScale

        self.model_dir = str(model_dir)
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids = set(stop_token_ids) if stop_token_ids is not None else ({int(eos)} if eos is not None
                                                                                       else set())
        # Every engine call runs on this one thread: the CPU backend binds its OpenMP threads in the
        # thread that creates the engine, and a forward pass from another thread (the stage runner's
        # worker) fails its check `thread_num == thread_num (2 vs. 1)`.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        self._engine_ident = self._thread.submit(threading.get_ident).result()
        t0 = time.perf_counter()
        self.llm = self._on_engine_thread(lambda: LLM(
            model=self.model_dir, tokenizer=self.model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len,
            enforce_eager=True, logprobs_mode="processed_logprobs", disable_log_stats=True,
            # A prompt's prefill is never split over steps: on CPU a seeded request whose partial-prefill
            # sample is discarded fails (`CPU Generator does not use offset`), and seeds are how a
            # redelivered micro-batch samples the same tokens again.
            enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, MAX_BATCHED_TOKENS),
            # FIRE (generate.use_fire): rescales a request's first position; a no-op for other requests
            logits_processors=[FirstTokenScale]))
        self.engine = self.llm.llm_engine
        self.startup_s = time.perf_counter() - t0
        self.last_reload_s: float | None = None
        self._closed = False
        self._in_flight_mode: str | None = None  # keep | recompute while an in-flight generation runs
        self._reset_pending = False  # keep: the prefix cache is reset once the running requests end

    def _on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        if threading.get_ident() == self._engine_ident:  # a reload from an in-flight poll, between two steps
            return fn()
        return self._thread.submit(fn).result()

    # -- sampling ---------------------------------------------------------------------------------
    def _params(self, n: int, *, temperature: float, top_p: float, top_k: int, max_new_tokens: int,
                min_new_tokens: int, seed: int | None, ignore_eos: bool, logprobs: bool, delta: bool = False,
                fire_ratio: float | None = None) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        from expstream.models.vllm_fire import FIRE_ARG

        greedy = temperature == 0
        return SamplingParams(
            n=n, temperature=0.0 if greedy else float(temperature), top_p=1.0 if greedy else float(top_p),
            top_k=0 if greedy or top_k is None or top_k <= 0 else int(top_k),
            max_tokens=int(max_new_tokens), min_tokens=0 if ignore_eos else int(min_new_tokens),
            seed=seed, ignore_eos=ignore_eos, stop_token_ids=sorted(self.stop_token_ids),
            # flat: the engine keeps one float per token instead of a {token: Logprob} dict per step
            logprobs=0 if logprobs else None, flat_logprobs=logprobs, detokenize=False, skip_special_tokens=False,
            # in-flight updates: the new tokens of every step, to stamp each with the version that sampled it
            output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
            **({"extra_args": {FIRE_ARG: fire_ratio}} if fire_ratio is not None else {}),
        )

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
        in_flight: Any = None,
        first_token_temperature: float | None = None,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """``n`` samples per prompt in one engine batch; the contract of TransformersGenerator.generate.

        ``seed`` seeds prompt g's requests with ``seed + g``, so a micro-batch samples the same
        tokens whenever it is (re)processed, whatever else the engine is doing. ``in_flight``
        (expstream.models.decode_loop.InFlight): polled between two engine steps (a reload runs in place on
        the engine thread: keep the running requests' KV cache, or recompute them); each token's version is
        left in ``in_flight.token_versions``.
        ``first_token_temperature`` (FIRE): the engine's FirstTokenScale processor rescales each request's
        first position (expstream/models/vllm_fire.py); equal to ``temperature`` it changes nothing.
        """
        from expstream.models.hf import check_generate_args

        check_generate_args(prompts, n, temperature, top_p, max_new_tokens, min_new_tokens)
        fire_ratio = None
        if first_token_temperature is not None and first_token_temperature != temperature:
            if temperature == 0 or not first_token_temperature > 0:
                raise ValueError(f"first_token_temperature={first_token_temperature} needs temperature > 0 and a "
                                 f"positive first_token_temperature (temperature={temperature})")
            fire_ratio = float(temperature) / float(first_token_temperature)
        if self._closed:
            raise RuntimeError("VllmGenerator.generate after close()")
        if not prompts:
            return ([], []) if return_log_probs else []
        if should_stop is not None and should_stop():
            raise ShutdownRequested("stop requested before the generation started")

        return self._on_engine_thread(lambda: self._generate(
            prompts, n, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new_tokens,
            min_new_tokens=min_new_tokens, seed=seed, ignore_eos=ignore_eos, should_stop=should_stop,
            return_log_probs=return_log_probs, in_flight=in_flight, fire_ratio=fire_ratio))

    def _generate(self, prompts: list[list[int]], n: int, *, temperature: float, top_p: float, top_k: int,
                  max_new_tokens: int, min_new_tokens: int, seed: int | None, ignore_eos: bool,
                  should_stop: Callable[[], bool] | None, return_log_probs: bool,
                  in_flight: Any = None,
                  fire_ratio: float | None = None) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        # vLLM refuses n > 1 with greedy decoding: the n samples of a greedy prompt are one sample, copied.
        per_request = 1 if temperature == 0 else n
        ids = [f"expstream-{os.getpid()}-{next(_ids)}" for _ in prompts]
        ours = set(ids)
        for g, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            params = self._params(per_request, temperature=temperature, top_p=top_p, top_k=top_k,
                                  max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                  seed=None if seed is None else (seed + g) % 2**31, ignore_eos=ignore_eos,
                                  logprobs=return_log_probs, delta=in_flight is not None, fire_ratio=fire_ratio)
            self.engine.add_request(rid, {"prompt_token_ids": [int(t) for t in prompt]}, params)
        done: dict[str, Any] = {}
        acc: dict[tuple[str, int], list[list]] = {}  # in-flight: (request, sample) -> [tokens, log-probs, versions]
        version = None if in_flight is None else int(in_flight.version)
        self._in_flight_mode = None if in_flight is None else in_flight.mode
        try:
            while len(done) < len(ids):
                if should_stop is not None and should_stop():
                    raise ShutdownRequested(f"stop requested with {len(ids) - len(done)} of {len(ids)} prompts "
                                            "unfinished; generation abandoned")
                now = version if in_flight is None else int(in_flight.poll())  # may reload, on this thread
                if now != version:
                    version, in_flight.swaps = now, in_flight.swaps + 1
                for out in self.engine.step():
                    if out.request_id in ours and in_flight is not None:
                        _accumulate(acc, out, version, return_log_probs)
                    if out.finished and out.request_id in ours:
                        done[out.request_id] = out
                if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                    raise RuntimeError(f"vLLM finished without outputs for {len(ids) - len(done)} prompts")
        except BaseException:
            with contextlib.suppress(Exception):
                self.engine.abort_request([r for r in ids if r not in done])
            raise
        finally:
            self._in_flight_mode = None
            if self._reset_pending:  # keep: the prefix cache held blocks of the old weights
                self._reset_pending = not self.llm.reset_prefix_cache()
        return self._collect(ids, done, acc, n, per_request, return_log_probs, in_flight)

    def _collect(self, ids: list[str], done: dict[str, Any], acc: dict, n: int, per_request: int,
                 return_log_probs: bool, in_flight: Any) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """The token lists (and log-probs; versions into ``in_flight``) of every request, rows by prompt."""
        tokens: list[list[int]] = []
        logprobs: list[list[float]] = []
        versions: list[list[int]] = []
        for rid in ids:
            outs = sorted(done[rid].outputs, key=lambda o: o.index)
            if in_flight is None and len(outs) != per_request:
                raise RuntimeError(f"vLLM returned {len(outs)} samples for a prompt, expected {per_request}")
            for j in list(range(per_request)) * (n // per_request):
                if in_flight is not None:
                    toks, lps, vs = acc.get((rid, j), [[], [], []])
                    tokens.append(list(toks))
                    logprobs.append(list(lps))
                    versions.append(list(vs))
                    continue
                toks = list(outs[j].token_ids)
                tokens.append(toks)
                if return_log_probs:
                    logprobs.append(_sampled_logprobs(outs[j].logprobs, toks))
        if in_flight is not None:
            in_flight.token_versions = versions
        return (tokens, logprobs) if return_log_probs else tokens

    # -- weights ------------------------------------------------------------------------------------
    def reload(self, weights_dir: str | os.PathLike[str] | None = None,
               state_dict: Mapping[str, Any] | None = None) -> float:
        """Load new weights in place (a safetensors directory, or tensors), reset the prefix cache;
        returns the seconds it took. The architecture must be the engine's (same names and shapes)."""
        if (weights_dir is None) == (state_dict is None):
            raise ValueError("give exactly one of weights_dir or state_dict")
        t0 = time.perf_counter()

        def reload() -> None:
            if weights_dir is not None:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
            else:
                self._reload_tensors(state_dict)
            # Mandatory: KV blocks cached under the old weights would be reused for shared prefixes. In the middle
            # of an in-flight generation: recompute preempts the running requests (recomputed under the new
            # weights); keep leaves their KV cache and resets the prefix cache once they end.
            if self._in_flight_mode == "recompute":
                self.llm.reset_prefix_cache(reset_running_requests=True)
            elif self._in_flight_mode == "keep":
                self._reset_pending = True
            else:
                self.llm.reset_prefix_cache()

        self._on_engine_thread(reload)
        self.last_reload_s = time.perf_counter() - t0
        return self.last_reload_s

    def _reload_tensors(self, state_dict: Mapping[str, Any]) -> None:
        workers = self._local_workers()
        if workers:  # in-process engine: hand the tensors over directly (no copy through a file)
            items = [(k, v.detach().cpu()) for k, v in state_dict.items()]
            for w in workers:
                w.reload_weights(weights_iterator=iter(items))
            return
        from safetensors.torch import save_file

        with tempfile.TemporaryDirectory(prefix="expstream-vllm-weights-") as tmp:
            save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()},
                      str(Path(tmp) / "model.safetensors"))
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": tmp})

    def _local_workers(self) -> list[Any]:
        """The worker objects when the engine runs in this process (empty otherwise)."""
        core = getattr(self.engine, "engine_core", None)
        executor = getattr(getattr(core, "engine_core", None), "model_executor", None)
        worker = getattr(getattr(executor, "driver_worker", None), "worker", None)
        if worker is not None and hasattr(worker, "reload_weights"):
            return [worker]
        return []

    def close(self) -> None:
        """Shut the engine down (its processes too, in multiprocessing mode). Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            self._on_engine_thread(self.engine.engine_core.shutdown)
        self._thread.shutdown(wait=False)
        self.llm = None  # type: ignore[assignment]
        self.engine = None
