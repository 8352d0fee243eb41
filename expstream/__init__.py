"""expstream: a streaming RLHF experience maker over Kafka and Redis."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
_LAZY = {"read_experiences", "Experience", "split_experience_batch", "make_experience_batch", "BufferItem"}


def __getattr__(name: str) -> Any:  # lazy: `import expstream` must not import torch
    if name in _LAZY:
        from expstream.rl import experience

        return getattr(experience, name)
    raise AttributeError(f"module 'expstream' has no attribute {name!r}")


__all__ = sorted(_LAZY)
