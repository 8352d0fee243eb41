"""Models: tiny offline models, loading through ``from_pretrained``, forward passes and a generator.

Everything here works offline (``HF_HUB_OFFLINE=1`` is set by default when this module is imported)
and on CPU. The forward passes follow docs/numerics.md §1.3:

* ``forward_action_log_probs``: ``log_softmax(logits[b, L-1-A+t])[seq[b, L-A+t]]`` over raw logits
  (no temperature), with ``position_ids = cumsum(attention_mask) - 1`` and masked positions set to 1;
* ``forward_values``: the critic's per-token output at positions ``[:-1]``, last A entries
  (``V_t`` = value of the state before action t);
* ``forward_reward``: the sequence-classification score read at the last non-pad token.

The critic and the reward model of a vision-language run are :class:`expstream.vl.VisionValueModel` s
(a Qwen2-VL backbone plus a value head); ``load_critic`` / ``load_reward_model`` pick them from the
directory's config, and the forwards take their visual inputs like the actor's.

The packed variants take the docs/numerics.md §1.4 layout (segments concatenated in one row, position ids
restarting at 0 in each segment) and give the same numbers as the padded layout: segments never attend to each
other (a block-diagonal causal 4-D mask, or the position ids for flash attention).

All outputs are float32, whatever the model's dtype (the seed keeps bf16 log-probs in bf16; we
compute the log-softmax in float32).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from expstream.errors import ShutdownRequested  # noqa: E402
from expstream.layout import position_ids_from_attention  # noqa: E402
from expstream.modelcache import MARKER, MODEL_KEYS, TINY_FORMAT, is_complete, tiny_root  # noqa: E402

__all__ = [
    "MODEL_KEYS",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "ModelNotFoundError",
    "build_tiny_models",
    "load_tokenizer",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "TransformersGenerator",
    "never_sampled_token_ids",
    "stop_token_ids",
    "SamplingSupport",
    "forward_action_log_probs",
    "forward_values",
    "forward_reward",
    "forward_packed_action_log_probs",
    "forward_packed_values",
    "forward_packed_reward",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VOCAB_SIZE = 512


class ModelNotFoundError(FileNotFoundError):
    """A model or tokenizer directory named in the topology is missing or unreadable."""


# ---------------------------------------------------------------------------------------------
# Tiny offline models
# ---------------------------------------------------------------------------------------------

_CORPUS_PARAGRAPHS = (
    "Reinforcement learning from human feedback trains a policy model with rewards. The actor "
    "generates a response for every prompt, the reference model scores the same tokens, the "
    "critic estimates the value of each state and the reward model gives one score per sequence.",
    "An experience holds the sequences, the attention mask, the action mask, the log probabilities "
    "of the actions under the actor and under the reference, the values, the rewards, the "
    "advantages and the returns. The advantage of an action says how much better it was than "
    "expected; the return is the discounted sum of the rewards that follow it.",
    "The streaming experience maker reads prompts from a topic, generates samples in groups, and "
    "passes micro-batches from stage to stage: generate, preprocess, actor log-probs, reference "
    "log-probs, critic values, rewards, post-processing and advantages. Each stage consumes a "
    "record, processes it, produces the result and commits its offset.",
    "Beautiful is better than ugly. Explicit is better than implicit. Simple is better than "
    "complex. Complex is better than complicated. Flat is better than nested. Sparse is better "
    "than dense. Readability counts. Errors should never pass silently, unless explicitly silenced.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i, add(i, i))\n",
    "Question: what is the capital of France? Answer: Paris. Question: what colour is the sky on a "
    "clear day? Answer: blue. Please think step by step and put the final answer in a box.",
)


def _training_corpus() -> list[str]:
    """A small fixed text (independent of the Python version) for training the tiny tokenizer."""
    lines = list(_CORPUS_PARAGRAPHS)
    for a in range(12):
        for b in range(0, 12, 3):
            lines.append(f"What is {a} + {b}? The answer is {a + b}.")
            lines.append(f"Compute {a} * {b}. Result: {a * b}")
    lines.append(" ".join(chr(c) for c in range(33, 127)))
    return lines


def _train_tokenizer(vocab_size: int = _VOCAB_SIZE, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        unk_token=None,
        padding_side="left",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _heads(hidden: int) -> int:
    """Attention heads of a built-in model: heads of 32 below hidden 256, 4 heads from there.

    Why 32: vLLM's CPU attention supports head sizes from 32 up (16 is refused: ``Unsupported CPU
    attention configuration: head_dim=16``), and the built-in models must run on both backends.
    """
    if hidden >= 256 and hidden % 8 == 0:
        return 4
    if hidden <= 0 or hidden % 32 != 0:
        raise ValueError(f"hidden must be a positive multiple of 32 (heads of size 32), got {hidden}")
    return hidden // 32


def _tiny_config(tokenizer: Any, hidden: int, layers: int, **extra: Any) -> Any:
    from transformers import LlamaConfig

    heads = _heads(hidden)
    if layers <= 0:
        raise ValueError(f"layers must be positive, got {layers}")
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        **extra,
    )


def _build_into(root: Path, seed: int, hidden: int, layers: int) -> dict[str, Any]:
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
        GenerationConfig,
    )

    tokenizer = _train_tokenizer()
    tokenizer.save_pretrained(root / "tokenizer")
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }

    specs = (
        ("actor", AutoModelForCausalLM, {}),
        ("critic", AutoModelForTokenClassification, {"num_labels": 1}),
        ("reward", AutoModelForSequenceClassification, {"num_labels": 1}),
    )
    for offset, (key, auto_cls, extra) in enumerate(specs):
        cfg = _tiny_config(tokenizer, hidden, layers, **extra)
        with torch.random.fork_rng(devices=[]):  # deterministic weights, global RNG untouched
            torch.manual_seed(seed + offset)
            model = auto_cls.from_config(cfg, dtype=torch.float32)
        if key == "actor":
            model.generation_config = GenerationConfig(**ids)
        with _quiet_progress():
            model.save_pretrained(root / key, safe_serialization=True)
        tokenizer.save_pretrained(root / key)  # each model dir is self-contained, like a user model
    return {"vocab_size": len(tokenizer), **ids}


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
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


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename below still keeps the cache consistent
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def build_tiny_models(
    cache_dir: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2
) -> dict[str, Path]:
    """Build (once) tiny random-weight models and return their directories.

    Returns ``{"tokenizer", "actor", "critic", "reward"} -> Path``, all under
    ``cache_dir / f"tiny-llama-h{hidden}-l{layers}-s{seed}-f{TINY_FORMAT}"``. The actor (a ``LlamaForCausalLM``)
    doubles as the reference model; the critic is a ``LlamaForTokenClassification`` and the reward
    model a ``LlamaForSequenceClassification``, both with ``num_labels=1``. Every model directory
    also holds the tokenizer (a byte-level BPE with vocab 512; bos ``<|bos|>``, eos ``<|im_end|>``,
    pad ``<|pad|>``, left padding, a chat template), so it loads like a user model.

    Idempotent and safe to call from racing processes: when the directory exists with its
    completion marker it is returned without rebuilding; otherwise the models are built into a
    temporary sibling directory (under a file lock) and renamed into place atomically.
    Weights are deterministic: the actor, critic and reward model are initialised after
    ``torch.manual_seed(seed)``, ``seed + 1`` and ``seed + 2`` (the global RNG is left untouched).
    """
    cache_dir = Path(cache_dir)
    root = tiny_root(cache_dir, seed, hidden, layers)
    paths = {key: root / key for key in MODEL_KEYS}
    if is_complete(root):
        return paths
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _file_lock(cache_dir / f".{root.name}.lock"):
        if is_complete(root):
            return paths
        if root.exists():  # a leftover without the marker (not ours to keep: we hold the lock)
            shutil.rmtree(root, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.tmp-", dir=cache_dir))
        try:
            t0 = time.perf_counter()
            info = _build_into(tmp, seed, hidden, layers)
            marker = {
                "format": TINY_FORMAT,
                "seed": seed,
                "hidden": hidden,
                "layers": layers,
                "build_seconds": round(time.perf_counter() - t0, 3),
                **info,
            }
            (tmp / MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
            try:
                os.rename(tmp, root)
            except OSError:
                if not is_complete(root):  # lost a race without a lock and the winner is incomplete
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return paths


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


def _finish(model: Any, device: str | torch.device) -> Any:
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


def _load(
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
        with _quiet_progress():
            model = auto_cls.from_pretrained(src, **_dtype_arg(dtype), **kwargs)
    except (OSError, ValueError) as err:
        if Path(src).is_dir():
            raise
        raise _missing(path, field, what, err) from err
    return _finish(model, device)


def load_causal_lm(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    field: str | None = None,
) -> Any:
    """Load an actor or reference model (``AutoModelForCausalLM``; a vision-language model, one with a
    ``vision_config``, with ``AutoModelForImageTextToText``), in eval mode, without grads."""
    from expstream.vision import is_vl_dir

    if is_vl_dir(path):
        return _load("AutoModelForImageTextToText", "vision-language model", path, device, dtype, field)
    return _load("AutoModelForCausalLM", "causal LM", path, device, dtype, field)


def load_critic(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    field: str | None = None,
) -> Any:
    """Load a text critic (``AutoModelForTokenClassification``, ``num_labels=1``): one value per token.

    A Qwen2-VL / Qwen2.5-VL directory is refused here (transformers has no token-classification head
    for it): ``expstream.vl.load_critic`` loads either kind (this module never imports expstream.vl,
    which builds on it).
    """
    _refuse_vl_scorer(path, "critic", field)
    return _load("AutoModelForTokenClassification", "critic", path, device, dtype, field, num_labels=1)


def _refuse_vl_scorer(path: str | Path, kind: str, field: str | None) -> None:
    from expstream.vision import is_vl_dir, is_vl_scoring_dir

    if is_vl_dir(path) or is_vl_scoring_dir(path):
        raise ModelNotFoundError(f"{field or kind}: {path} is a vision-language model; load it with "
                                 f"expstream.vl.load_{'critic' if kind == 'critic' else 'reward_model'} (a backbone "
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
    refused here: ``expstream.vl.load_reward_model`` loads either kind.
    """
    _refuse_vl_scorer(path, "reward", field)
    model = _load("AutoModelForSequenceClassification", "reward model", path, device, dtype, field, num_labels=1)
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
                        min_new_tokens: int) -> None:
    """The argument checks of every generator's ``generate`` (ValueError naming the argument)."""
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
        """The support of ``generate.backend`` (``transformers`` | ``vllm``) for this tokenizer and model."""
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
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 32,
        min_new_tokens: int = 1,
        seed: int | None = None,
        ignore_eos: bool = False,
        should_stop: Callable[[], bool] | None = None,
        return_log_probs: bool = False,
        model_inputs: Callable[[Tensor], dict[str, Any]] | None = None,
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
        """
        from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

        check_generate_args(prompts, n, temperature, top_p, max_new_tokens, min_new_tokens)
        if not prompts:
            return ([], []) if return_log_probs else []

        rows = [list(map(int, p)) for p in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attention_mask[i, width - len(r) :] = 1

        greedy = temperature == 0
        # The whole logits chain is ours (HF adds none: no suppress_tokens / min_new_tokens /
        # warpers in the config), in HF's own order and with HF's own classes, so the tokens are
        # those of plain `model.generate` with these settings, and the behaviour log-probs can be
        # read from the exact distribution sampled from.
        recorder = _BehaviourLogProbs() if return_log_probs else None
        chain = self._logits_chain(
            width, greedy, temperature, top_k, top_p,
            max_new_tokens if ignore_eos else max(min_new_tokens, 0), recorder,
        )  # fmt: skip
        cfg = GenerationConfig(
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

        criteria = None
        if should_stop is not None:
            not_done: dict[tuple, Tensor] = {}  # one all-False answer per (rows, device), reused every step

            class _AbandonOnStop(StoppingCriteria):
                def __call__(self, input_ids: Tensor, scores: Any, **kwargs: Any) -> Tensor:
                    if should_stop():
                        raise ShutdownRequested(f"stop requested after {input_ids.shape[1] - width} of "
                                                f"max_new_tokens={max_new_tokens} tokens; generation abandoned")
                    key = (input_ids.shape[0], input_ids.device)
                    if key not in not_done:
                        not_done[key] = torch.zeros(key[0], dtype=torch.bool, device=key[1])
                    return not_done[key]

            criteria = StoppingCriteriaList([_AbandonOnStop()])
            if should_stop():
                raise ShutdownRequested("stop requested before the generation started")

        rng: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if seed is not None:
            devices = [self.device] if self.device.type == "cuda" else []
            rng = torch.random.fork_rng(devices=devices)
        with rng, torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            extra = {k: (v.to(self.device) if isinstance(v, Tensor) else v)
                     for k, v in (model_inputs(input_ids) if model_inputs is not None else {}).items()}
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                generation_config=cfg,
                logits_processor=chain,
                stopping_criteria=criteria,
                **extra,
            )
        generated_t = out[:, width:]
        generated = generated_t.tolist()

        stops = set(self.stop_token_ids)
        result: list[list[int]] = []
        for row in generated:
            cut = next((j + 1 for j, tok in enumerate(row) if tok in stops), None)
            # A row without a stop token ran to max_new_tokens (generation only ends early once
            # every row has stopped), so it is never padded.
            result.append(row[:cut] if cut is not None else row[:max_new_tokens])
        if recorder is None:
            return result
        logp = recorder.finish(generated_t).cpu().tolist()  # (rows, steps) float32
        logprobs = [logp[i][: len(r)] for i, r in enumerate(result)]
        for i, (r, lp) in enumerate(zip(result, logprobs, strict=True)):
            if len(lp) != len(r) or not all(math.isfinite(x) for x in lp):
                raise RuntimeError(f"generate: row {i} has {len(r)} tokens but behaviour log-probs {lp[:8]}...; "
                                   "a sampled token must have a finite log-prob (report this as a bug)")
        return result, logprobs

    def _logits_chain(
        self, width: int, greedy: bool, temperature: float, top_k: int, top_p: float, min_new_tokens: int,
        recorder: _BehaviourLogProbs | None,
    ) -> Any:
        """The logits processors of one generation, in the order HF builds them.

        Token suppression (EOS before ``min_new_tokens``; the pad token), then, when sampling,
        temperature -> top-k -> top-p. ``recorder`` reads the raw logits when greedy (the plain
        softmax) and the fully processed scores when sampling (the distribution sampled from).
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
            if float(temperature) != 1.0:
                chain.append(TemperatureLogitsWarper(float(temperature)))
            if top_k > 0:
                chain.append(TopKLogitsWarper(top_k=int(top_k), min_tokens_to_keep=1))
            if float(top_p) < 1.0:
                chain.append(TopPLogitsWarper(top_p=float(top_p), min_tokens_to_keep=1))
            if recorder is not None:
                chain.append(recorder)
        return chain


# ---------------------------------------------------------------------------------------------
# Forward passes (padded layout, docs/numerics.md §1.3)
# ---------------------------------------------------------------------------------------------


def _model_device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _check_padded(sequences: Tensor, attention_mask: Tensor, num_actions: int | None) -> None:
    if sequences.dim() != 2 or sequences.shape != attention_mask.shape:
        raise ValueError(
            f"sequences and attention_mask must both be (B, L), got {tuple(sequences.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if num_actions is not None and not 1 <= num_actions <= sequences.shape[1] - 1:
        raise ValueError(
            f"num_actions must be in [1, L-1] = [1, {sequences.shape[1] - 1}], got {num_actions}"
        )


def _log_probs_and_entropy(
    logits: Tensor, targets: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = (-(logp_all.exp() * logp_all).sum(-1)).clamp_min(0.0)
    return logp, entropy


def _padded_forward(model: Any, sequences: Tensor, attention_mask: Tensor, visual: dict[str, Any] | None = None,
                    **kwargs: Any) -> tuple[Any, Tensor]:
    """One forward of a padded batch on the model's device with docs/numerics.md §1.3 position ids.

    Returns the model output and ``sequences`` moved to that device. ``visual`` (a vision-language
    model, expstream/vl.py): pixel_values / image_grid_thw / mm_token_type_ids, and ``input_ids``
    when the model input differs from ``sequences`` (the image-token repair); the model then
    computes its own (3-D rope) position ids from the attention mask and the grids.
    """
    device = _model_device(model)
    sequences = sequences.to(device)
    attention_mask = attention_mask.to(device)
    if visual:
        extra = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in visual.items()}
        inputs = extra.pop("input_ids", sequences)
        return model(input_ids=inputs, attention_mask=attention_mask, **extra, **kwargs), sequences
    out = model(
        input_ids=sequences,
        attention_mask=attention_mask,
        position_ids=position_ids_from_attention(attention_mask),
        **kwargs,
    )
    return out, sequences


@torch.inference_mode()
def forward_action_log_probs(
    model: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int, with_entropy: bool = False,
    visual: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the last ``num_actions`` tokens, each (B, A) float32.

    ``logp[b, t] = log_softmax(logits[b, L-1-A+t])[sequences[b, L-A+t]]`` over raw logits, with
    ``position_ids = cumsum(attention_mask) - 1`` (masked positions set to 1). The entropy is that of
    ``softmax(logits)`` at the same positions; ``None`` unless ``with_entropy``.
    """
    _check_padded(sequences, attention_mask, num_actions)
    kwargs: dict[str, Any] = {"use_cache": False}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = num_actions + 1
    out, sequences = _padded_forward(model, sequences, attention_mask, visual, **kwargs)
    logits = out.logits[:, -(num_actions + 1) : -1]
    return _log_probs_and_entropy(logits, sequences[:, -num_actions:], with_entropy)


@torch.inference_mode()
def forward_values(critic: Any, sequences: Tensor, attention_mask: Tensor, num_actions: int,
                   visual: dict[str, Any] | None = None) -> Tensor:
    """Critic values (B, A) float32: outputs at positions ``[:-1]``, last A (V_t = V(state before t)).

    ``visual``: a vision-language critic's extra inputs, as in :func:`forward_action_log_probs`.
    """
    _check_padded(sequences, attention_mask, num_actions)
    out, _ = _padded_forward(critic, sequences, attention_mask, visual)
    values = out.logits[..., 0] if out.logits.dim() == 3 else out.logits
    return values[:, :-1][:, -num_actions:].float()


@torch.inference_mode()
def forward_reward(rm: Any, sequences: Tensor, attention_mask: Tensor, visual: dict[str, Any] | None = None) -> Tensor:
    """Reward scores (B,) float32: the sequence-classification output at the last non-pad token.

    Needs ``rm.config.pad_token_id`` for batches of more than one row (see ``load_reward_model``).
    ``visual``: a vision-language reward model's extra inputs, as in :func:`forward_action_log_probs`.
    """
    _check_padded(sequences, attention_mask, None)
    out, sequences = _padded_forward(rm, sequences, attention_mask, visual)
    return out.logits.reshape(sequences.shape[0], -1)[:, 0].float()


# ---------------------------------------------------------------------------------------------
# Forward passes (packed layout, docs/numerics.md §1.4)
# ---------------------------------------------------------------------------------------------


def _check_packed(
    sequences: Tensor, position_ids: Tensor, seq_lens: Sequence[int], num_actions: Sequence[int] | None
) -> None:
    if sequences.dim() != 2 or sequences.shape[0] != 1 or tuple(position_ids.shape) != tuple(sequences.shape):
        raise ValueError(
            f"packed sequences and position_ids must both be (1, T), got {tuple(sequences.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    if not seq_lens or any(s < 1 for s in seq_lens):
        raise ValueError(f"seq_lens must be positive, got {list(seq_lens)}")
    if sum(seq_lens) > sequences.shape[1]:
        raise ValueError(f"sum(seq_lens) = {sum(seq_lens)} exceeds T = {sequences.shape[1]}")
    if num_actions is not None:
        if len(num_actions) != len(seq_lens):
            raise ValueError(f"{len(num_actions)} num_actions for {len(seq_lens)} segments")
        for i, (s, a) in enumerate(zip(seq_lens, num_actions, strict=True)):
            if not 1 <= a <= s - 1:
                raise ValueError(f"segment {i}: num_actions {a} must be in [1, seq_len-1] = [1, {s - 1}]")


def _packed_attention_kwargs(model: Any, seq_lens: Sequence[int], total: int) -> dict[str, Any]:
    """A block-diagonal causal additive 4-D mask; flash attention gets none (it uses position_ids)."""
    impl = str(getattr(model.config, "_attn_implementation", "") or "")
    if "flash" in impl:
        return {"attention_mask": None}
    device = _model_device(model)
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    lens = list(seq_lens) + [1] * (total - sum(seq_lens))  # trailing padding: each token alone
    segment = torch.repeat_interleave(
        torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
    )
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(
        total, total, dtype=torch.bool, device=device
    ).tril()
    mask = torch.zeros(total, total, dtype=dtype, device=device)
    mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)
    return {"attention_mask": mask[None, None]}


def _action_index(seq_lens: Sequence[int], num_actions: Sequence[int], device: torch.device) -> Tensor:
    """Positions of the state tokens (the logits that predict each action), concatenated."""
    idx: list[int] = []
    off = 0
    for s, a in zip(seq_lens, num_actions, strict=True):
        idx.extend(range(off + s - a - 1, off + s - 1))
        off += s
    return torch.tensor(idx, dtype=torch.long, device=device)


@torch.inference_mode()
def forward_packed_action_log_probs(
    model: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int], num_actions: list[int]
) -> Tensor:
    """Packed log-probs (N,) float32, N = sum(num_actions): the last ``num_actions[i]`` tokens of each
    segment, concatenated. Equal to :func:`forward_action_log_probs` on the padded layout."""
    logp, _ = forward_packed_action_log_probs_and_entropy(model, sequences, position_ids, seq_lens, num_actions)
    return logp


@torch.inference_mode()
def forward_packed_action_log_probs_and_entropy(
    model: Any,
    sequences: Tensor,
    position_ids: Tensor,
    seq_lens: list[int],
    num_actions: list[int],
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """:func:`forward_packed_action_log_probs` plus, when ``with_entropy``, the entropy (N,) float32 of
    ``softmax(logits)`` at the same state tokens (as :func:`forward_action_log_probs`), in one pass."""
    _check_packed(sequences, position_ids, seq_lens, num_actions)
    device = _model_device(model)
    sequences = sequences.to(device)
    out = model(
        input_ids=sequences,
        position_ids=position_ids.to(device),
        use_cache=False,
        **_packed_attention_kwargs(model, seq_lens, sequences.shape[1]),
    )
    idx = _action_index(seq_lens, num_actions, device)
    return _log_probs_and_entropy(out.logits[0, idx], sequences[0, idx + 1], with_entropy)


@torch.inference_mode()
def forward_packed_values(
    critic: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int], num_actions: list[int]
) -> Tensor:
    """Packed critic values (N,) float32: the value of the state before each action, per segment."""
    _check_packed(sequences, position_ids, seq_lens, num_actions)
    device = _model_device(critic)
    out = critic(
        input_ids=sequences.to(device),
        position_ids=position_ids.to(device),
        **_packed_attention_kwargs(critic, seq_lens, sequences.shape[1]),
    )
    values = out.logits[0, :, 0] if out.logits.dim() == 3 else out.logits[0]
    return values[_action_index(seq_lens, num_actions, device)].float()


@torch.inference_mode()
def forward_packed_reward(rm: Any, sequences: Tensor, position_ids: Tensor, seq_lens: list[int]) -> Tensor:
    """Packed reward scores (num_segments,) float32: the score at each segment's last token.

    Uses the backbone plus the ``score`` head in one pass when the model has them (the transformers
    ``*ForSequenceClassification`` decoders); otherwise runs each segment on its own.
    """
    _check_packed(sequences, position_ids, seq_lens, None)
    device = _model_device(rm)
    sequences = sequences.to(device)
    position_ids = position_ids.to(device)
    ends = torch.tensor(seq_lens, device=device).cumsum(0) - 1
    backbone = getattr(rm, "base_model", None)
    head = getattr(rm, "score", None)
    if backbone is not None and backbone is not rm and isinstance(head, torch.nn.Module):
        hidden = backbone(
            input_ids=sequences,
            position_ids=position_ids,
            use_cache=False,
            **_packed_attention_kwargs(rm, seq_lens, sequences.shape[1]),
        ).last_hidden_state
        return head(hidden[0, ends]).reshape(len(seq_lens), -1)[:, 0].float()
    scores = []
    off = 0
    for s in seq_lens:
        seg = sequences[:, off : off + s]
        out = rm(
            input_ids=seg, attention_mask=torch.ones_like(seg), position_ids=position_ids[:, off : off + s]
        )
        scores.append(out.logits.reshape(-1)[0])
        off += s
    return torch.stack(scores).float()
