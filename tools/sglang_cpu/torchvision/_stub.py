"""The stand-in's one rule: any public name of any stand-in module is a function that raises when called.

Modules import names from torchvision at import time (SGLang's multimodal processors, transformers'
image utilities once it sees a torchvision); text-only models never call them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def missing(module: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``module``: public names are stubs, dunder names do not exist."""

    def getattr_(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def stub(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{module}.{name}: torchvision is an import-only stand-in in expstream's SGLang CPU environment "
                "(tools/sglang_cpu); vision models are not supported there"
            )

        stub.__name__ = name
        return stub

    return getattr_
