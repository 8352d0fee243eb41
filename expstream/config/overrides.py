"""``--set dotted.key=value``: parsing an override and setting it in the raw topology tree.

The tree of settable keys is :func:`expstream.config.topology.valid_tree` (built from the config
dataclasses); an unknown key is a ConfigError naming the choices (docs/topology.md "Overrides").
"""

from __future__ import annotations

from typing import Any

import yaml

from expstream.errors import ConfigError, unknown_key_error

__all__ = ["FREE_FORM", "parse_override", "set_dotted"]

#: In expstream.config.topology.valid_tree: a key whose sub-keys are names the user chooses (rewards.sources.<name>,
#: rewards.weights.<name>, rewards.recipe.<label>): ``--set`` takes any path below it, and the
#: block's own checks name a wrong one.
FREE_FORM = "free-form"


def set_dotted(raw: dict[str, Any], dotted: str, value: Any, valid: dict[str, Any]) -> None:
    """Set ``value`` at ``dotted`` in ``raw``, creating blocks on the way; ``valid`` says which keys exist.

    Raises:
        ConfigError: a part of the path is not a key of ``valid`` (the choices are named).
    """
    parts = dotted.split(".")
    node, ref = raw, valid
    for i, part in enumerate(parts):
        free = ref == FREE_FORM
        if not free and (not isinstance(ref, dict) or part not in ref):
            choices = list(ref.keys()) if isinstance(ref, dict) else []
            what = "block" if i == 0 else "stage" if i == 1 and parts[0] == "stages" else "key"
            raise unknown_key_error(".".join(parts[:i]), part, choices, what=what, origin="--set")
        if i == len(parts) - 1:
            node[part] = value
        else:
            if not isinstance(node.get(part), dict):  # absent, or null in the file (rewards.sources: null)
                node[part] = {}
            node = node[part]
            ref = FREE_FORM if free else ref[part]



def parse_override(item: str) -> tuple[str, Any]:
    """``"algo.gamma=0.9"`` -> ``("algo.gamma", 0.9)``; the value is parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: write it as dotted.key=value, e.g. --set algo.gamma=0.99")
    key, _, text = item.partition("=")
    return key.strip(), yaml.safe_load(text) if text.strip() else None
