"""Multi-turn episodes on the wire (docs/multi_turn.md): exact token ids, turn segments, per-turn rewards.

An episode's ``response_ids`` is the concatenation of the ids the model generated and the ids of the
observations, in order (model turn 1, observation 1, model turn 2, ..., a model turn last); nothing is
ever re-tokenized. ``turn_lengths`` holds the segments' lengths (model turns at even positions), so

* :func:`model_token_mask` is True exactly on the model's tokens (shard-preprocess ANDs it into the
  action mask: observation tokens are not actions);
* :func:`turn_ends` are the last model token of each turn, where the environment's per-turn rewards
  sit for the estimators that read token rewards (:func:`turn_reward_tokens`, docs/numerics.md §15).

:class:`TurnBoundary` renders an observation as the text between two model turns: the chat template
applied once per turn boundary (the exact rule in its docstring and docs/multi_turn.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from schemas import Ragged, SampleBatch

__all__ = ["TurnBoundary", "model_token_mask", "turn_ends", "turn_segments", "first_turn_fields",
           "with_turn", "with_observation", "turn_reward_tokens", "turn_reward_sums", "PER_TOKEN_ESTIMATORS"]

#: Estimators whose advantages read the token rewards position by position (cumulative returns, GAE):
#: they get each turn's reward at its turn's last model token; every other estimator shapes one scalar
#: per sample and gets the sum of the turn rewards added to it (docs/numerics.md §15).
PER_TOKEN_ESTIMATORS = ("gae", "reinforce")
_U, _R, _O = "\x00user\x00", "\x00model\x00", "\x00observation\x00"


class TurnBoundary:
    """The text of an observation between two model turns.

    Without a chat template (``generate.apply_chat_template: false`` or a tokenizer without one) it is
    the observation as given. With one, rendering ``[user U, assistant R]`` gives A and
    ``[user U, assistant R, user O]`` with the generation prompt gives B (B must start with A); the text
    is ``close + B[len(A):]`` with O replaced by the observation, where ``close`` is what A holds after
    R (the template's end of an assistant message, e.g. ``<|im_end|>\\n``) less the tokenizer's EOS text
    when the model's turn already ended with the EOS token. That text is tokenized once, without
    special tokens added, and appended after the model's own ids.
    """

    def __init__(self, tokenizer: Any, apply_chat_template: bool) -> None:
        self.tok = tokenizer
        self.close, self.open = "", _O
        if apply_chat_template and getattr(tokenizer, "chat_template", None):
            a = tokenizer.apply_chat_template([{"role": "user", "content": _U}, {"role": "assistant", "content": _R}],
                                              tokenize=False)
            b = tokenizer.apply_chat_template([{"role": "user", "content": _U}, {"role": "assistant", "content": _R},
                                               {"role": "user", "content": _O}], tokenize=False,
                                              add_generation_prompt=True)
            if not b.startswith(a) or _R not in a or _O not in b:
                raise ValueError("the tokenizer's chat template does not render a conversation as a prefix of its "
                                 "continuation; set generate.apply_chat_template=false (observations as given)")
            self.close, self.open = a[a.index(_R) + len(_R):], b[len(a):]

    def text(self, observation: str, ended_with_eos: bool) -> str:
        close = self.close
        eos = getattr(self.tok, "eos_token", None)
        if ended_with_eos and eos and close.startswith(eos):
            close = close[len(eos):]
        return close + self.open.replace(_O, observation)

    def ids(self, observation: str, ended_with_eos: bool) -> list[int]:
        return list(self.tok(self.text(observation, ended_with_eos), add_special_tokens=False)["input_ids"])


def model_token_mask(lengths: np.ndarray) -> np.ndarray:
    """(sum(lengths),) bool: True on the model's segments (even positions of ``lengths``)."""
    return np.concatenate([np.full(int(n), i % 2 == 0) for i, n in enumerate(lengths)] or [np.zeros(0, bool)])


def turn_ends(lengths: np.ndarray) -> list[int]:
    """Index in the response of the last token of each model turn (generate gives every turn >= 1 token)."""
    ends, pos = [], 0
    for i, n in enumerate(lengths):
        pos += int(n)
        if i % 2 == 0:
            ends.append(pos - 1)
    return ends


def turn_segments(ids: np.ndarray, lengths: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """(model turns' ids, observations' ids) of one response row."""
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(int)
    segs = [ids[bounds[i]: bounds[i + 1]].tolist() for i in range(len(lengths))]
    return segs[0::2], segs[1::2]


def _ragged(rows: list, dtype: str) -> Ragged:
    return Ragged.from_rows([np.asarray(r, dtype=dtype) for r in rows], dtype)


def first_turn_fields(outputs: list[list[int]], version: int) -> dict[str, Ragged]:
    """The turn fields of the samples generate just sampled from their prompts (one model turn each)."""
    return {"turn_lengths": _ragged([[len(o)] for o in outputs], "int32"),
            "turn_rewards": _ragged([[] for _ in outputs], "float32"),
            "turn_versions": _ragged([[version] for _ in outputs], "int32")}


def with_turn(batch: SampleBatch, outputs: list[list[int]], log_probs: list[list[float]], version: int,
              decode: Any) -> SampleBatch:
    """``batch`` with one more model turn per row: its ids and behaviour log-probs appended."""
    resp = [np.concatenate([r, np.asarray(o, np.int32)]) for r, o in zip(batch.response_ids.rows(), outputs, strict=True)]
    lps = [np.concatenate([r, np.asarray(lp, np.float32)])
           for r, lp in zip(batch.rollout_log_probs.rows(), log_probs, strict=True)]
    return batch.replace(
        response_ids=_ragged(resp, "int32"), rollout_log_probs=_ragged(lps, "float32"), response=decode(resp),
        turn_lengths=_ragged([np.append(t, len(o)) for t, o in zip(batch.turn_lengths.rows(), outputs, strict=True)],
                             "int32"),
        turn_versions=_ragged([np.append(v, version) for v in batch.turn_versions.rows()], "int32"))


def with_observation(batch: SampleBatch, obs_ids: list[list[int]], rewards: list[float], decode: Any) -> SampleBatch:
    """``batch`` with each row's observation appended (behaviour log-prob 0.0 there: not an action)."""
    resp = [np.concatenate([r, np.asarray(o, np.int32)]) for r, o in zip(batch.response_ids.rows(), obs_ids, strict=True)]
    lps = [np.concatenate([r, np.zeros(len(o), np.float32)])
           for r, o in zip(batch.rollout_log_probs.rows(), obs_ids, strict=True)]
    return batch.replace(
        response_ids=_ragged(resp, "int32"), rollout_log_probs=_ragged(lps, "float32"), response=decode(resp),
        turn_lengths=_ragged([np.append(t, len(o)) for t, o in zip(batch.turn_lengths.rows(), obs_ids, strict=True)],
                             "int32"),
        turn_rewards=_ragged([np.append(r, x) for r, x in zip(batch.turn_rewards.rows(), rewards, strict=True)],
                             "float32"))


def turn_reward_tokens(batch: SampleBatch, width: int) -> torch.Tensor:
    """(B, width) float32: each turn's reward at its last model token (action t = response token t)."""
    out = torch.zeros((len(batch), width), dtype=torch.float32)
    if batch.turn_rewards is None:
        return out
    for b, (lengths, rewards) in enumerate(zip(batch.turn_lengths.rows(), batch.turn_rewards.rows(), strict=True)):
        for end, r in zip(turn_ends(lengths), rewards, strict=False):
            if 0 <= end < width:
                out[b, end] += float(r)
    return out


def turn_reward_sums(batch: SampleBatch) -> torch.Tensor:
    """(B,) float32: the sum of each episode's turn rewards (zeros for a single-turn batch)."""
    if batch.turn_rewards is None:
        return torch.zeros(len(batch), dtype=torch.float32)
    return torch.tensor([float(np.sum(r)) for r in batch.turn_rewards.rows()], dtype=torch.float32)
