"""FIRE sampling: the first generated token at a hot temperature, the rest as configured.

``generate.use_fire`` with ``generate.first_token_temperature`` (default 10.0; arXiv 2410.21236,
"Flaming-hot Initiation with Regular Execution"): the first response token of every sample is drawn
from ``softmax(logits / first_token_temperature)`` and every later one from ``softmax(logits /
temperature)``; top-k and top-p apply to both, and the behaviour log-prob of the first token is its
log-prob under the hot distribution (docs/numerics.md "FIRE sampling").

Three backends, two ways:

* transformers: :class:`FirstTokenTemperature`, a logits processor placed before the temperature
  warper, multiplies the first step's scores by ``temperature / first_token_temperature`` (so the
  warper's division by ``temperature`` leaves ``logits / first_token_temperature``); later steps pass
  through untouched. With equal temperatures the factor is exactly 1.0 and the scores are unchanged
  bit for bit.
* vLLM: the same rescaling by an engine-level logits processor driven by a per-request argument
  (:mod:`expstream.models.vllm_fire`; vLLM refuses temperatures above 2, so the hot temperature cannot
  be a request's own). One engine call, seeds unchanged.
* SGLang (custom logit processors there are pickled callables behind a server flag):
  :func:`generate_two_phase` asks the server for one token per sample at the hot temperature, then
  continues every sample from ``prompt + first token`` at ``temperature`` (the prompt's KV comes from
  the radix cache). With equal temperatures it is not used at all (the plain one-phase call samples
  exactly as without FIRE).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FirstTokenTemperature", "generate_two_phase", "fire_seed", "DEFAULT_FIRST_TOKEN_TEMPERATURE"]

DEFAULT_FIRST_TOKEN_TEMPERATURE = 10.0


class FirstTokenTemperature:
    """A transformers logits processor: the first generated position's scores times ``ratio``.

    ``prompt_width`` is the (left-padded) prompt length, so the first step is the call whose
    ``input_ids`` have exactly that many columns. Put it before ``TemperatureLogitsWarper(temperature)``
    with ``ratio = temperature / first_token_temperature`` (or alone, ``ratio = 1 / first_token_temperature``,
    when temperature is 1.0 and the warper is left out).
    """

    def __init__(self, prompt_width: int, ratio: float) -> None:
        if not ratio > 0:
            raise ValueError(f"FirstTokenTemperature: ratio must be > 0, got {ratio}")
        self.prompt_width = int(prompt_width)
        self.ratio = float(ratio)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if input_ids.shape[1] != self.prompt_width or self.ratio == 1.0:
            return scores
        return scores * self.ratio


def fire_seed(seed: int | None) -> int | None:
    """The seed of the second (continuation) phase: another stream than the first phase's ``seed``,
    the same whenever the record is processed again."""
    return None if seed is None else (int(seed) * 1_000_003 + 0x5F1E) % 2**31


def generate_two_phase(
    generate: Callable[..., tuple[list[list[int]], list[list[float]]]],
    prompts: Sequence[Sequence[int]],
    n: int,
    *,
    first_token_temperature: float,
    temperature: float,
    max_new_tokens: int,
    min_new_tokens: int,
    stop_token_ids: set[int],
    seed: int | None,
    ignore_eos: bool,
    **kwargs: Any,
) -> tuple[list[list[int]], list[list[float]]]:
    """FIRE on an engine: ``generate`` (the backend's one-phase ``generate(prompts, n, ...,
    return_log_probs=True)``) called twice.

    Phase 1: ``n`` samples of one token per prompt at ``first_token_temperature`` (EOS suppressed if
    ``min_new_tokens >= 1``). Phase 2: every sample whose first token is not a stop token (and
    ``max_new_tokens > 1``) continues as its own prompt, ``prompt + [first]``, with one sample at
    ``temperature``, ``max_new_tokens - 1`` and ``min_new_tokens - 1``. ``kwargs`` (top_p, top_k,
    should_stop) go to both calls. Returns rows ``[g*n, (g+1)*n)`` for prompt g, with log-probs, like
    the backends.
    """
    first, first_lp = generate(
        [list(p) for p in prompts], n, temperature=first_token_temperature, max_new_tokens=1,
        min_new_tokens=min(1, min_new_tokens), seed=seed, ignore_eos=ignore_eos, return_log_probs=True, **kwargs)
    rows = [list(prompts[i // n]) for i in range(len(prompts) * n)]
    tokens = [list(t) for t in first]
    logprobs = [list(lp) for lp in first_lp]
    go_on = [i for i, t in enumerate(tokens) if max_new_tokens > 1 and (ignore_eos or t[-1] not in stop_token_ids)]
    if go_on:
        rest, rest_lp = generate(
            [rows[i] + tokens[i] for i in go_on], 1, temperature=temperature, max_new_tokens=max_new_tokens - 1,
            min_new_tokens=max(0, min_new_tokens - 1), seed=fire_seed(seed), ignore_eos=ignore_eos,
            return_log_probs=True, **kwargs)
        for i, toks, lps in zip(go_on, rest, rest_lp, strict=True):
            tokens[i].extend(toks)
            logprobs[i].extend(lps)
    return tokens, logprobs
