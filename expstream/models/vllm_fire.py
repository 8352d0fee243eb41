"""FIRE on vLLM: a logits processor that rescales a request's first sampled position.

vLLM refuses temperatures above 2, and FIRE's first token is sampled at 10 by default, so the hot
temperature cannot go into ``SamplingParams.temperature``. Instead the engine is built with this
processor (``LLM(logits_processors=[FirstTokenScale])``, which does nothing for requests without the
argument), and a FIRE request carries ``extra_args={"expstream_fire_ratio": temperature /
first_token_temperature}``: while the request has no output token yet, its row of logits is multiplied
by the ratio before vLLM's temperature, top-k and top-p. The first token is therefore sampled from
``softmax(logits / first_token_temperature)`` (truncated by top-k/top-p as configured), and vLLM's
processed log-probs are those of that distribution; later tokens are untouched. One engine call, the
request's seed unchanged.

Imports vLLM: only :mod:`expstream.models.vllm_generator` imports this module, when it builds an engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

__all__ = ["FIRE_ARG", "FirstTokenScale"]

#: The SamplingParams.extra_args key of a FIRE request: temperature / first_token_temperature.
FIRE_ARG = "expstream_fire_ratio"


class FirstTokenScale(LogitsProcessor):
    """Multiplies the logits of every request with ``extra_args[FIRE_ARG]`` while it has no output token."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[float, Sequence[int]]] = {}  # batch index -> (ratio, live output token ids)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        ratio = (sampling_params.extra_args or {}).get(FIRE_ARG)
        if ratio is not None and not (isinstance(ratio, float) and ratio > 0):
            raise ValueError(f"extra_args[{FIRE_ARG!r}] must be a positive float, got {ratio!r}")

    def is_argmax_invariant(self) -> bool:
        return False  # applied with the processors before temperature, top-k and top-p

    @staticmethod
    def _new(params: Any, _prompt: list[int] | None, output_tok_ids: list[int]) -> tuple[float, Sequence[int]] | None:
        ratio = (params.extra_args or {}).get(FIRE_ARG)
        if ratio is None or ratio == 1.0 or len(output_tok_ids) > 0:
            return None
        return float(ratio), output_tok_ids

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.rows, batch_update, self._new)
        for index in [i for i, (_, out) in self.rows.items() if len(out) > 0]:
            del self.rows[index]  # past the first token: plain sampling from here on

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (ratio, out) in self.rows.items():
            if len(out) == 0:
                logits[index] *= ratio
        return logits
