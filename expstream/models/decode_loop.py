"""The transformers backend's own decode loop, for in-flight weight updates (docs/async.md "In-flight updates").

``generate.in_flight_updates: false`` (the default) keeps ``model.generate``; with it on,
:class:`~expstream.models.hf.TransformersGenerator` samples through :func:`sample_loop` instead: a prefill,
then one forward per token with the KV cache (``past_key_values``), the logits of the last position in
float32 through the generator's logits chain (the same processors as ``model.generate``: suppression,
temperature, top-k, top-p, the behaviour log-prob recorder, and whatever else the chain holds), then
``torch.multinomial`` on the softmax (or argmax when greedy), as HF's sampling loop does.

Between two decoding steps the loop asks :attr:`InFlight.poll` for the version now loaded (the stage's
poll loads a newly announced version in place, into the same model object). When it changed:

* ``keep``: decoding goes on with the cache as it is. The keys and values of the tokens so far stay
  those the old weights computed; the next token's logits come from the new weights over that cache.
* ``recompute``: the cache is dropped and prompt + tokens so far are prefilled again under the new
  weights, so every later token is sampled from exactly the new policy given the prefix.

Every token is stamped with the version of the weights of the forward that gave its logits
(:attr:`LoopResult.versions`), and its behaviour log-prob is the one of the distribution it was sampled
from (the recorder in the chain), so the trainer's off-policy correction weighs each token by the
policy that really produced it.

A stop request (SIGTERM, scale-down, a revoked partition) between two steps ends the loop with
:class:`PartialGeneration` (the tokens, versions and log-probs so far) when the caller asked for it
(``InFlight.keep_partial``), else with ``ShutdownRequested`` as ``model.generate`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from expstream.errors import ShutdownRequested

__all__ = ["IN_FLIGHT_MODES", "InFlight", "LoopResult", "PartialGeneration", "cut_at_stop", "finished_in_prefix",
           "prefix_tensor", "sample_loop"]

#: ``generate.in_flight_mode`` values (see the module docstring).
IN_FLIGHT_MODES = ("keep", "recompute")


@dataclass
class InFlight:
    """How a generation follows the policy between decoding steps.

    ``poll()`` returns the version of the weights now loaded (loading a newer announced one in place);
    ``version`` is the version loaded when the generation starts. ``keep_partial``: a stop request ends the
    generation with :class:`PartialGeneration` instead of ``ShutdownRequested``. After ``generate`` returns,
    ``token_versions`` holds the version of every returned token (rows as the token lists).
    """

    poll: Callable[[], int]
    version: int
    mode: str = "keep"
    keep_partial: bool = False
    token_versions: list[list[int]] = field(default_factory=list)
    swaps: int = 0

    def __post_init__(self) -> None:
        if self.mode not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight_mode must be one of {list(IN_FLIGHT_MODES)}, got {self.mode!r}")


@dataclass
class LoopResult:
    """(rows, T) new tokens (pad after a row's stop token) and the version behind each."""

    tokens: Tensor
    versions: Tensor
    swaps: int


class PartialGeneration(ShutdownRequested):
    """A stop between two decoding steps: ``result`` holds what was generated so far (the caller cuts rows at
    their stop tokens and reads the log-probs from its recorder)."""

    def __init__(self, message: str, result: LoopResult) -> None:
        super().__init__(message)
        self.result = result


def _forward(model: Any, tokens: Tensor, mask: Tensor, cache: Any) -> tuple[Tensor, Any]:
    """Logits (rows, vocab) float32 of the last position and the cache; ``cache`` None: a (re)prefill of
    ``tokens`` (the whole left-padded sequence), else one new token per row over ``cache``."""
    if cache is None:
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    else:
        pos = mask.sum(-1, keepdim=True) - 1
    out = model(input_ids=tokens, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].to(copy=True, dtype=torch.float32), out.past_key_values


def _stopped(result: LoopResult, step: int, max_new_tokens: int) -> PartialGeneration:
    return PartialGeneration(f"stop requested after {step} of max_new_tokens={max_new_tokens} tokens; the prefix "
                             "is kept", result)


def sample_loop(
    model: Any, input_ids: Tensor, attention_mask: Tensor, chain: Any, *, greedy: bool, max_new_tokens: int,
    stop_ids: list[int], pad_id: int, should_stop: Callable[[], bool] | None, in_flight: InFlight,
    prefix: Tensor | None = None,
) -> LoopResult:
    """Sample up to ``max_new_tokens`` new tokens per row of the left-padded ``input_ids`` (see the module
    docstring). ``prefix`` (rows, T0): tokens already generated (a resumed generation): they are prefilled
    with the prompt and count towards ``max_new_tokens``; the result holds only the new ones."""
    seq, mask = input_ids, attention_mask
    rows = seq.shape[0]
    done = torch.zeros(rows, dtype=torch.bool, device=seq.device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=seq.device)
    if prefix is not None and prefix.shape[1]:
        done = torch.isin(prefix, stops).any(dim=1)
        seq = torch.cat([seq, prefix], dim=1)
        mask = torch.cat([mask, torch.ones_like(prefix)], dim=1)
    start = seq.shape[1]
    version, swaps, cache, pending = int(in_flight.version), 0, None, seq
    versions: list[int] = []
    for step in range(start - input_ids.shape[1], max_new_tokens):
        if bool(done.all()):
            break
        if step and should_stop is not None and should_stop():
            result = LoopResult(seq[:, start:], _versions(versions, rows), swaps)
            if in_flight.keep_partial:
                raise _stopped(result, step, max_new_tokens)
            raise ShutdownRequested(f"stop requested after {step} of max_new_tokens={max_new_tokens} tokens; "
                                    "generation abandoned")
        now = int(in_flight.poll())
        if now != version:
            version, swaps = now, swaps + 1
            if in_flight.mode == "recompute":
                cache, pending = None, seq
        logits, cache = _forward(model, pending, mask, cache)
        scores = chain(seq, logits)
        if greedy:
            nxt = torch.argmax(scores, dim=-1)
        else:
            nxt = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        seq = torch.cat([seq, nxt[:, None]], dim=-1)
        mask = torch.cat([mask, mask.new_ones((rows, 1))], dim=-1)
        versions.append(version)
        done = done | torch.isin(nxt, stops)
        pending = nxt[:, None]
    return LoopResult(seq[:, start:], _versions(versions, rows), swaps)


def cut_at_stop(generated: list[list[int]], stops: set[int], max_new_tokens: int) -> list[list[int]]:
    """Each row up to and including its first stop token, else its first ``max_new_tokens`` tokens.

    A row without a stop token ran to max_new_tokens (generation only ends early once every row
    has stopped), so it is never padded.
    """
    result: list[list[int]] = []
    for row in generated:
        cut = next((j + 1 for j, tok in enumerate(row) if tok in stops), None)
        result.append(row[:cut] if cut is not None else row[:max_new_tokens])
    return result


def finished_in_prefix(prefix: list[list[int]] | None, result: list[list[int]], stops: list[int]) -> list[list[int]]:
    """A resumed generation's rows: a row whose prefix already ended at a stop token gets no continuation
    (the loop only padded it); the others as they are."""
    if prefix is None:
        return result
    ends = set(stops)
    return [[] if any(t in ends for t in p) else r for p, r in zip(prefix, result, strict=True)]


def prefix_tensor(prefix: list[list[int]], pad_id: int, device: torch.device) -> Tensor:
    """(rows, T) long: the rows of a resumed generation's prefix, right-padded with ``pad_id`` (a row shorter
    than the longest ended at a stop token: it stays done)."""
    width = max((len(r) for r in prefix), default=0)
    rows = [list(map(int, r)) + [pad_id] * (width - len(r)) for r in prefix]
    return torch.tensor(rows, dtype=torch.long).reshape(len(prefix), width).to(device)


def _versions(versions: list[int], rows: int) -> Tensor:
    return torch.tensor(versions, dtype=torch.long).expand(rows, len(versions)).clone()
