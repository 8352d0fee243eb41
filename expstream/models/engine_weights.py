"""The model side of :class:`expstream.train.weights.PolicyFollower` for an inference engine (vLLM, SGLang).

An engine holds its own weights, so the follower gets the checkpoint's names and shapes as meta
tensors read from the safetensors headers (no weights in memory twice): a published version of
another architecture is refused before anything is loaded, and ``load_state_dict`` hands the new
tensors to the engine's ``reload``. docs/vllm.md and docs/sglang.md say how each engine reloads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from expstream.errors import ConfigError


class EngineWeights:
    """``state_dict()`` (meta tensors of ``model_dir``'s checkpoint) and ``load_state_dict`` (the engine reloads).

    Args:
        generator: the engine wrapper; its ``reload(state_dict=...)`` loads new weights in place.
        model_dir: the actor's directory, whose ``*.safetensors`` name every tensor.
        engine: the engine's name, for the error.
    Raises:
        ConfigError: ``model_dir`` has no safetensors files.
    """

    def __init__(self, generator: Any, model_dir: str | os.PathLike[str], engine: str) -> None:
        import torch
        from safetensors import safe_open

        self.generator = generator
        self._template: dict[str, Any] = {}
        files = sorted(Path(model_dir).glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{model_dir}: no *.safetensors files; the {engine} backend follows published weights "
                              "by their safetensors names", field="models.actor",
                              fix="save the actor with save_pretrained(safe_serialization=True)")
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 - safe_open has keys(), not __iter__
                    self._template[name] = torch.empty(fh.get_slice(name).get_shape(), device="meta")

    def state_dict(self) -> dict[str, Any]:
        return dict(self._template)

    def load_state_dict(self, tensors: Mapping[str, Any], strict: bool = True) -> None:
        self.generator.reload(state_dict=tensors)
