"""Models: loading through ``from_pretrained`` and the transformers generator.

Everything here works offline (``HF_HUB_OFFLINE=1`` is set by default when this module is imported)
and on CPU. The built-in tiny models are built by :mod:`expstream.models.tiny`; the forward passes
on a loaded model (log-probs, values, reward; padded and packed) are :mod:`expstream.models.passes`.

The critic and the reward model of a vision-language run are :class:`expstream.models.vl.VisionValueModel` s
(a Qwen2-VL backbone plus a value head); ``load_critic`` / ``load_reward_model`` pick them from the
directory's config.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from expstream.errors import ShutdownRequested  # noqa: E402
from expstream.models.decode_loop import cut_at_stop, finished_in_prefix  # noqa: E402

if TYPE_CHECKING:
    from expstream.models.decode_loop import InFlight

__all__ = [
    "ModelNotFoundError",
    "load_tokenizer",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "TransformersGenerator",
    "never_sampled_token_ids",
    "stop_token_ids",
    "SamplingSupport",
]


class ModelNotFoundError(FileNotFoundError):
    """A model or tokenizer directory named in the topology is missing or unreadable."""


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' per-shard progress bars (noise in stage logs), restoring the setting."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    if enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _resolve(path: str | Path, field: str | None, what: str, need_config: bool) -> str:
    """Check that ``path`` exists (a local directory, or a repo id in the local HF cache)."""
    label = field or what
    p = Path(path).expanduser()
    if p.is_dir():
        if need_config and not (p / "config.json").is_file():
            raise ModelNotFoundError(
                f"{label}: {p} has no config.json, so it is not a saved {what} "
                f"(expected a directory written by save_pretrained)"
            )
        return str(p)
    if p.exists():
        raise ModelNotFoundError(f"{label}: {p} is not a directory (expected a saved {what})")
    return str(path)  # maybe a hub repo id available in the offline cache; from_pretrained decides


def _missing(path: str | Path, field: str | None, what: str, err: Exception) -> ModelNotFoundError:
    label = field or what
    return ModelNotFoundError(
        f"{label}: {what} directory {Path(path).expanduser()} does not exist or cannot be loaded "
        f"offline ({type(err).__name__}: {err}). Set {label} to a directory written by "
        f"save_pretrained, or build tiny test models with `expstream models`."
    )


def _dtype_arg(dtype: torch.dtype | str | None) -> dict[str, Any]:
    if dtype is None:
        return {}
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    return {"dtype": dtype}


def to_inference(model: Any, device: str | torch.device) -> Any:
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str | Path, *, field: str | None = None) -> Any:
    """Load a tokenizer with ``AutoTokenizer.from_pretrained`` (offline).

    ``field`` (e.g. ``"models.tokenizer"``) names the topology key in the error raised when the
    directory is missing (:class:`ModelNotFoundError`, a ``FileNotFoundError``).
    """
    from transformers import AutoTokenizer

    src = _resolve(path, field, "tokenizer", need_config=False)
    try:
        return AutoTokenizer.from_pretrained(src)
    except (OSError, ValueError) as err:
        if Path(src).is_dir():
            raise
        raise _missing(path, field, "tokenizer", err) from err


def load_auto_model(
    auto_name: str,
    what: str,
    path: str | Path,
    device: str | torch.device,
    dtype: torch.dtype | str | None,
    field: str | None,
    **kwargs: Any,
) -> Any:
    import transformers

    auto_cls = getattr(transformers, auto_name)
    src = _resolve(path, field, what, need_config=True)
    try:
        with quiet_progress():
            model = auto_cls.from_pretrained(src, **_dtype_arg(dtype), **kwargs)
    except (OSError, ValueError) as err:
        if Path(src).is_dir():
            raise
        raise _missing(path, field, what, err) from err
    return to_inference(model, device)


def load_causal_lm(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    field: str | None = None,
) -> Any:
    """Load an actor or reference model (``AutoModelForCausalLM``; a vision-language model, one with a
    ``vision_config``, with ``AutoModelForImageTextToText``), in eval mode, without grads."""
    from expstream.models.media import is_vl_dir

    if is_vl_dir(path):
        return load_auto_model("AutoModelForImageTextToText", "vision-language model", path, device, dtype, field)
    return load_auto_model("AutoModelForCausalLM", "causal LM", path, device, dtype, field)


def load_critic(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    field: str | None = None,
) -> Any:
    """Load a text critic (``AutoModelForTokenClassification``, ``num_labels=1``): one value per token.

    A Qwen2-VL / Qwen2.5-VL directory is refused here (transformers has no token-classification head
    for it): ``expstream.models.vl.load_critic`` loads either kind (this module never imports expstream.models.vl,
    which builds on it).
    """
    _refuse_vl_scorer(path, "critic", field)
    return load_auto_model("AutoModelForTokenClassification", "critic", path, device, dtype, field, num_labels=1)


def _refuse_vl_scorer(path: str | Path, kind: str, field: str | None) -> None:
    from expstream.models.media import is_vl_dir, is_vl_scoring_dir

    if is_vl_dir(path) or is_vl_scoring_dir(path):
        raise ModelNotFoundError(f"{field or kind}: {path} is a vision-language model; load it with "
                                 f"expstream.models.vl.load_{'critic' if kind == 'critic' else 'reward_model'} (a backbone "
                                 "plus a value head, fed the pixels)")


def load_reward_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    field: str | None = None,
    pad_token_id: int | None = None,
) -> Any:
    """Load a reward model (``AutoModelForSequenceClassification``, ``num_labels=1``).

    The score is read at the last non-pad token, which needs ``config.pad_token_id``: pass
    ``pad_token_id`` to set it when the saved config has none. A Qwen2-VL / Qwen2.5-VL directory is
    refused here: ``expstream.models.vl.load_reward_model`` loads either kind.
    """
    _refuse_vl_scorer(path, "reward", field)
    model = load_auto_model("AutoModelForSequenceClassification", "reward model", path, device, dtype, field, num_labels=1)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def _as_id_set(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def check_generate_args(prompts: list[list[int]], n: int, temperature: float, top_p: float, max_new_tokens: int,
                        min_new_tokens: int, first_token_temperature: float | None = None) -> None:
    """The argument checks of every generator's ``generate`` (ValueError naming the argument)."""
    if first_token_temperature is not None and (temperature == 0 or not first_token_temperature > 0):
        raise ValueError(f"first_token_temperature={first_token_temperature} needs temperature > 0 and a "
                         f"positive first_token_temperature (temperature={temperature})")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 <= min_new_tokens <= max_new_tokens:
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {min_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class _BehaviourLogProbs:
    """A pass-through logits processor that keeps the log-prob of each sampled token.

    At step t it sees the tokens so far (the token of step t-1 is ``input_ids[:, -1]``), so it
    gathers that token's log-prob from the distribution it kept at step t-1, then keeps step t's.
    Only one (rows, vocab) distribution is held at a time (``output_scores`` would keep all).
    """

    def __init__(self) -> None:
        self.steps: list[Tensor] = []  # (rows,) float32 per finished step
        self.pending: Tensor | None = None  # (rows, vocab) float32 log-softmax of the current step

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, generated: Tensor) -> Tensor:
        """(rows, T) log-probs of ``generated`` (the (rows, T) new tokens; T may be fewer steps than
        were recorded when HF undid deferred steps)."""
        t = generated.shape[1]
        steps = self.steps[:t]
        if len(steps) < t and self.pending is not None:
            steps.append(self.pending.gather(-1, generated[:, len(steps) : len(steps) + 1]).squeeze(-1))
        if len(steps) != t:
            raise RuntimeError(f"generate: {t} tokens but {len(steps)} recorded steps of log-probs")
        if not steps:
            return torch.zeros((generated.shape[0], 0), dtype=torch.float32)
        return torch.stack(steps, dim=1).float()


class _AbandonOnStop:
    """A stopping criterion that raises ShutdownRequested once ``should_stop()`` says so (else: not done)."""

    def __init__(self, should_stop: Callable[[], bool], width: int, max_new_tokens: int) -> None:
        self.should_stop, self.width, self.max_new_tokens = should_stop, width, max_new_tokens
        self.not_done: dict[tuple, Tensor] = {}  # one all-False answer per (rows, device), reused every step

    def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
        if self.should_stop():
            raise ShutdownRequested(f"stop requested after {input_ids.shape[1] - self.width} of "
                                    f"max_new_tokens={self.max_new_tokens} tokens; generation abandoned")
        key = (input_ids.shape[0], input_ids.device)
        if key not in self.not_done:
            self.not_done[key] = torch.zeros(key[0], dtype=torch.bool, device=key[1])
        return self.not_done[key]


@contextlib.contextmanager
def seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Inside: torch's RNG seeded with ``seed`` and restored afterwards (no-op when seed is None)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def left_padded(rows: list[list[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """(input_ids, attention_mask), both (len(rows), longest row) long, each row left-padded with the pad id."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
        attention_mask[i, width - len(r) :] = 1
    return input_ids, attention_mask


def checked_log_probs(result: list[list[int]], logp: list[list[float]]) -> list[list[float]]:
    """Row i of ``logp`` cut to the length of ``result[i]``; every value must be finite.

    Raises:
        RuntimeError: a row has fewer log-probs than tokens, or a non-finite one (a bug, not bad input).
    """
    logprobs = [logp[i][: len(r)] for i, r in enumerate(result)]
    for i, (r, lp) in enumerate(zip(result, logprobs, strict=True)):
        if len(lp) != len(r) or not all(math.isfinite(x) for x in lp):
            raise RuntimeError(f"generate: row {i} has {len(r)} tokens but behaviour log-probs {lp[:8]}...; "
                               "a sampled token must have a finite log-prob (report this as a bug)")
    return logprobs


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokens generation stops at: the tokenizer's EOS and any EOS id of the model's ``generation_config``."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id")
    return sorted({int(eos)} | _as_id_set(getattr(getattr(model, "generation_config", None), "eos_token_id", None)))


def never_sampled_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """The tokens :class:`TransformersGenerator` never samples: the pad token (the tokenizer's, else the
    EOS), unless it is also a stop token."""
    pad = tokenizer.eos_token_id if tokenizer.pad_token_id is None else tokenizer.pad_token_id
    return [] if pad in stop_token_ids(tokenizer, model) else [int(pad)]


@dataclass(frozen=True)
class SamplingSupport:
    """Which tokens generation can sample at response position t (0-based), whatever the weights.

    ``never`` are never sampled (the transformers backend's pad token); ``stops`` are not sampled
    before ``min_new_tokens`` (both backends). The reference trainer leaves the rest out of its
    policy's softmax (docs/numerics.md §14.12): it trains the distribution the actions were sampled
    from, and the policy gradient cannot pile probability onto a token that is never sampled, which
    the sampled KL estimates cannot see.
    """

    never: tuple[int, ...] = ()
    stops: tuple[int, ...] = ()
    min_new_tokens: int = 0

    @classmethod
    def of(cls, tokenizer: Any, model: Any, backend: str, min_new_tokens: int) -> SamplingSupport:
        """The support of ``generate.backend`` (``transformers`` | ``vllm`` | ``sglang``) for this tokenizer and model."""
        never = never_sampled_token_ids(tokenizer, model) if backend == "transformers" else []
        return cls(tuple(never), tuple(stop_token_ids(tokenizer, model)), max(0, int(min_new_tokens)))

    def banned(self, position: Tensor, vocab: int) -> Tensor:
        """(..., vocab) bool: True for the tokens that cannot be sampled at response positions ``position``
        (a long tensor of any shape)."""
        out = torch.zeros((*position.shape, vocab), dtype=torch.bool, device=position.device)
        if self.never:
            out[..., list(self.never)] = True
        if self.stops and self.min_new_tokens > 0:
            early = (position < self.min_new_tokens).unsqueeze(-1)
            stops = torch.zeros(vocab, dtype=torch.bool, device=position.device)
            stops[list(self.stops)] = True
            out |= early & stops
        return out


class TransformersGenerator:
    """Sampling with ``model.generate`` (the CPU / no-vLLM engine).

    Stops at the tokenizer's EOS and at any EOS id in the model's ``generation_config`` (like vLLM).
    Sampling parameters are explicit (the model's ``generation_config`` sampling defaults, such as
    ``top_k=50`` or a repetition penalty, are not applied). The pad token is never sampled unless it
    is also a stop token (``suppress_pad``), so that a response never holds a pad in its middle.
    """

    def __init__(
        self, model: Any, tokenizer: Any, device: str | torch.device = "cpu", *, suppress_pad: bool = True
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_token_id: int = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id")
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = self.eos_token_id if pad is None else pad
        self.stop_token_ids: list[int] = stop_token_ids(tokenizer, model)
        self.suppress_token_ids: list[int] = never_sampled_token_ids(tokenizer, model) if suppress_pad else []

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        *,
        temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
        max_new_tokens: int = 32, min_new_tokens: int = 1,
        seed: int | None = None,
        ignore_eos: bool = False,
        should_stop: Callable[[], bool] | None = None,
        return_log_probs: bool = False,
        model_inputs: Callable[[Tensor], dict[str, Any]] | None = None,
        in_flight: InFlight | None = None,
        prefix: list[list[int]] | None = None,
        first_token_temperature: float | None = None,
    ) -> list[list[int]] | tuple[list[list[int]], list[list[float]]]:
        """Generate ``n`` samples per prompt; returns ``len(prompts) * n`` token lists.

        ``model_inputs(input_ids)``: extra model inputs for the left-padded (len(prompts)*n, P)
        prompt rows (a vision-language model's pixel_values, image_grid_thw, mm_token_type_ids).

        With ``return_log_probs`` it returns ``(token_lists, logprob_lists)``: the behaviour
        log-prob of every returned token, float32 values, under the distribution it was sampled
        from (after the token suppression, temperature, top-k and top-p); with
        ``temperature == 0`` (greedy) under the plain softmax of the raw logits.

        Rows ``[g*n, (g+1)*n)`` belong to prompt g. Each output holds the generated tokens up to and
        including the first stop token (no padding), at most ``max_new_tokens`` of them.
        ``temperature == 0`` is greedy; ``top_k = -1`` (or 0) is off. ``seed`` makes the sampling
        deterministic without touching the global RNG. ``ignore_eos`` does not stop at EOS: stop
        tokens are suppressed, so every output has exactly ``max_new_tokens`` tokens.

        ``should_stop`` is called before every decoding step; once it returns True the generation
        is abandoned with :class:`~expstream.errors.ShutdownRequested` (nothing is returned, so a
        stage never emits a cut-short response). A stop therefore waits for at most one forward
        pass (the prompt's prefill, or one token), not for ``max_new_tokens`` of them.

        ``in_flight`` (:class:`expstream.models.decode_loop.InFlight`): sample with that module's decode loop
        (new weights between two steps; each token's version left in ``in_flight.token_versions``); ``prefix``:
        tokens an interrupted generation already has, one row per output row (only the continuation returns).
        ``first_token_temperature`` (FIRE, expstream/models/fire.py): the first token at that temperature.
        """
        from transformers import StoppingCriteriaList

        check_generate_args(prompts, n, temperature, top_p, max_new_tokens, min_new_tokens, first_token_temperature)
        if not prompts:
            return ([], []) if return_log_probs else []
        input_ids, attention_mask = left_padded([list(map(int, p)) for p in prompts for _ in range(n)],
                                                self.pad_token_id)
        width = input_ids.shape[1]
        greedy = temperature == 0
        # The whole logits chain is ours (HF adds none: no suppress_tokens / min_new_tokens / warpers in the
        # config), in HF's order with HF's classes: the tokens of plain `model.generate` with these settings,
        # and the behaviour log-probs read from the exact distribution sampled from (also in the decode loop).
        recorder = _BehaviourLogProbs() if return_log_probs else None
        chain = self._logits_chain(
            width, greedy, temperature, top_k, top_p,
            max_new_tokens if ignore_eos else max(min_new_tokens, 0), recorder, first_token_temperature,
        )  # fmt: skip

        if should_stop is not None and should_stop():
            raise ShutdownRequested("stop requested before the generation started")
        with seeded(seed, self.device), torch.inference_mode():
            if in_flight is not None and model_inputs is None:  # a vision-language generation: model.generate
                generated_t = self._decode_in_flight(input_ids, attention_mask, chain, recorder, greedy,
                                                     max_new_tokens, should_stop, in_flight, prefix)
            else:
                criteria = None if should_stop is None else StoppingCriteriaList(
                    [_AbandonOnStop(should_stop, width, max_new_tokens)])
                generated_t = self._hf_generate(input_ids, attention_mask, chain, criteria, greedy, max_new_tokens,
                                                model_inputs)
                in_flight = None
        result = finished_in_prefix(prefix, cut_at_stop(generated_t.tolist(), set(self.stop_token_ids),
                                                        max_new_tokens), self.stop_token_ids)
        if in_flight is not None:
            in_flight.token_versions = [v[: len(r)] for v, r in zip(in_flight.token_versions, result, strict=True)]
        if recorder is None:
            return result
        return result, checked_log_probs(result, recorder.finish(generated_t).cpu().tolist())

    def _hf_generate(self, input_ids: Tensor, attention_mask: Tensor, chain: Any, criteria: Any, greedy: bool,
                     max_new_tokens: int, model_inputs: Callable[[Tensor], dict[str, Any]] | None) -> Tensor:
        """``model.generate`` with our chain: the (rows, T) new tokens (in-flight updates off)."""
        extra = {k: (v.to(self.device) if isinstance(v, Tensor) else v)
                 for k, v in (model_inputs(input_ids) if model_inputs is not None else {}).items()}
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=self._generation_config(greedy, max_new_tokens),
            logits_processor=chain,
            stopping_criteria=criteria,
            **extra,
        )
        return out[:, input_ids.shape[1]:]

    def _decode_in_flight(self, input_ids: Tensor, attention_mask: Tensor, chain: Any,
                          recorder: _BehaviourLogProbs | None, greedy: bool, max_new_tokens: int,
                          should_stop: Callable[[], bool] | None, in_flight: InFlight,
                          prefix: list[list[int]] | None) -> Tensor:
        """The decode loop (expstream/models/decode_loop.py): (rows, T) new tokens; their versions go to
        ``in_flight.token_versions``. A stop with ``in_flight.keep_partial`` raises PartialGeneration with
        ``tokens``, ``log_probs`` and ``versions`` (rows cut at their stop token) set on it."""
        from expstream.models.decode_loop import PartialGeneration, prefix_tensor, sample_loop

        pre = None if prefix is None else prefix_tensor(prefix, self.pad_token_id, self.device)
        try:
            loop = sample_loop(self.model, input_ids.to(self.device), attention_mask.to(self.device), chain,
                               greedy=greedy, max_new_tokens=max_new_tokens, stop_ids=list(self.stop_token_ids),
                               pad_id=self.pad_token_id, should_stop=should_stop, in_flight=in_flight, prefix=pre)
        except PartialGeneration as stop:
            tokens = finished_in_prefix(prefix, cut_at_stop(stop.result.tokens.tolist(), set(self.stop_token_ids),
                                                            max_new_tokens), self.stop_token_ids)
            stop.tokens, stop.versions = tokens, [v[: len(r)] for v, r in zip(stop.result.versions.tolist(), tokens,
                                                                                strict=True)]
            stop.log_probs = None if recorder is None else checked_log_probs(
                tokens, recorder.finish(stop.result.tokens).cpu().tolist())
            raise
        in_flight.token_versions, in_flight.swaps = loop.versions.tolist(), loop.swaps
        return loop.tokens

    def _generation_config(self, greedy: bool, max_new_tokens: int) -> Any:
        """HF's GenerationConfig with every processor of its own off (the chain is ours, see generate)."""
        from transformers import GenerationConfig

        return GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else 1.0,
            top_p=None if greedy else 1.0,
            top_k=None if greedy else 0,
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            eos_token_id=list(self.stop_token_ids),
            pad_token_id=self.pad_token_id,
            bos_token_id=getattr(self.tokenizer, "bos_token_id", None),
            suppress_tokens=None,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            num_beams=1,
            num_return_sequences=1,
            use_cache=True,
        )

    def _logits_chain(
        self, width: int, greedy: bool, temperature: float, top_k: int, top_p: float, min_new_tokens: int,
        recorder: _BehaviourLogProbs | None, first_token_temperature: float | None = None,
    ) -> Any:
        """The logits processors of one generation, in the order HF builds them.

        Token suppression (EOS before ``min_new_tokens``; the pad token), then, when sampling,
        temperature -> top-k -> top-p. ``recorder`` reads the raw logits when greedy (the plain
        softmax) and the fully processed scores when sampling (the distribution sampled from).
        FIRE's first-step rescaling (``first_token_temperature``) comes right before the temperature warper.
        """
        from transformers import (
            LogitsProcessorList,
            MinNewTokensLengthLogitsProcessor,
            SuppressTokensLogitsProcessor,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        chain = LogitsProcessorList()
        if recorder is not None and greedy:
            chain.append(recorder)
        if min_new_tokens > 0:
            chain.append(MinNewTokensLengthLogitsProcessor(width, min_new_tokens, list(self.stop_token_ids),
                                                           device=self.device))
        if self.suppress_token_ids:
            chain.append(SuppressTokensLogitsProcessor(list(self.suppress_token_ids), device=self.device))
        if not greedy:
            if first_token_temperature is not None:
                from expstream.models.fire import FirstTokenTemperature

                chain.append(FirstTokenTemperature(width, float(temperature) / float(first_token_temperature)))
            if float(temperature) != 1.0:
                chain.append(TemperatureLogitsWarper(float(temperature)))
            if top_k > 0:
                chain.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
            if float(top_p) < 1.0:
                chain.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
            if recorder is not None:
                chain.append(recorder)
        return chain
