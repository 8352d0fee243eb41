"""The built-in tiny offline models (``builtin:tiny``): a byte-level BPE tokenizer and random Llama weights.

Built once per ``(seed, hidden, layers)`` under ``models.cache_dir`` (the directory layout and its
completion marker are :mod:`expstream.models.cache`'s), deterministic, safe against racing processes.
They let every stage, test and bench run offline on CPU (docs/topology.md, ``models``); they are
then loaded like a user's model by :mod:`expstream.models.hf`. Apart from the loading and the
forwards because building is a one-off job of its own (``expstream models build``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from expstream.models.cache import MARKER, MODEL_KEYS, TINY_FORMAT, is_complete, tiny_root
from expstream.models.hf import quiet_progress

__all__ = [
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "build_tiny_models",
    "file_lock",
    "tiny_config",
    "train_tokenizer",
]

SPECIAL_TOKENS = ("<|endoftext|>", "<|bos|>", "<|im_start|>", "<|im_end|>", "<|pad|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_VOCAB_SIZE = 512


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


def train_tokenizer(vocab_size: int = _VOCAB_SIZE, special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Any:
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


def tiny_config(tokenizer: Any, hidden: int, layers: int, **extra: Any) -> Any:
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

    tokenizer = train_tokenizer()
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
        cfg = tiny_config(tokenizer, hidden, layers, **extra)
        with torch.random.fork_rng(devices=[]):  # deterministic weights, global RNG untouched
            torch.manual_seed(seed + offset)
            model = auto_cls.from_config(cfg, dtype=torch.float32)
        if key == "actor":
            model.generation_config = GenerationConfig(**ids)
        with quiet_progress():
            model.save_pretrained(root / key, safe_serialization=True)
        tokenizer.save_pretrained(root / key)  # each model dir is self-contained, like a user model
    return {"vocab_size": len(tokenizer), **ids}


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
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
    with file_lock(cache_dir / f".{root.name}.lock"):
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
