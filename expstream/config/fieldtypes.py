"""Type checks for configuration blocks: every value against its dataclass annotation.

One helper for every block of a topology (``run``, ``kafka``, ``generate``, ``algo``, stage
blocks, ...), whether a value came from the YAML file or from ``--set`` (both are parsed as YAML,
so ``--set generate.n_samples_per_prompt=abc`` arrives here as the string ``'abc'``). A wrong type
is a :class:`~expstream.errors.ConfigError` naming ``block.field``, the expected type and the
value got, raised when the topology is loaded, before anything slow starts.

The rules (what a user writing YAML expects, and nothing looser):

* ``int`` takes whole numbers only: not ``true``/``false``, not ``2.5`` or ``2.0``, not strings;
* ``float`` takes ints and floats (an int is converted: ``gamma: 1`` is ``1.0``), not booleans;
* ``bool`` takes only ``true``/``false`` (not ``1``, not ``"yes"`` in quotes);
* ``str`` takes only strings (``--set models.actor=123`` must be quoted: ``models.actor="'123'"``);
* ``X | None`` also takes ``null`` (an empty ``--set key=`` value is ``null``);
* ``list[X]`` / ``dict[str, X]`` check their items; ``Any`` takes anything.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from expstream.errors import ConfigError

__all__ = ["check_block", "check_fields", "check_value", "describe"]

_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
_EXAMPLES = {int: 4, float: 0.5, bool: True}


def describe(tp: Any) -> str:
    """A reader's name for annotation ``tp``: ``int | None`` -> "an integer or null"."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "any value"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        args = typing.get_args(tp)
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin in (dict, Mapping):
        args = typing.get_args(tp)
        return f"a mapping of {_plural(args[1])}" if len(args) == 2 and args[1] in _NAMES else "a mapping"
    return _NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    text = describe(tp)
    return text[3:] + "s" if text.startswith("an ") else text[2:] + "s" if text.startswith("a ") else text


def _got(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


def check_value(tp: Any, value: Any, where: str, example: Any = None) -> Any:
    """``value`` if it fits annotation ``tp`` (an int converted to float for a float), else a
    ConfigError naming ``where``; ``example`` (e.g. the field's default) goes into the fix."""
    ok, converted = _fits(tp, value)
    if ok:
        return converted
    if example is None or isinstance(example, (list, dict)):
        example = _EXAMPLES.get(tp)
    shown = "" if example is None else str(example).lower() if isinstance(example, bool) else str(example)
    fix = f"write {describe(tp)}" + (f", e.g. {where}={shown}" if shown else "")
    if value is None:
        fix += "; an empty --set value is null"
    elif isinstance(value, (bool, int, float)) and _fits(tp, str(value))[0]:
        fix += f"; quote it if you mean the text, e.g. {where}=\"'{value}'\""
    raise ConfigError(f"expected {describe(tp)}, got {_got(value)}", field=where, fix=fix)


def _fits(tp: Any, value: Any) -> tuple[bool, Any]:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, converted = _fits(arg, value)
            if ok:
                return True, converted
        return False, value
    if tp is type(None):
        return value is None, value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False, value
        return True, float(value)
    if tp is str:
        return isinstance(value, str), value
    if origin in (list, tuple):
        if not isinstance(value, list):
            return False, value
        (item,) = typing.get_args(tp)[:1] or (Any,)
        items = [_fits(item, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin in (dict, Mapping):
        if not isinstance(value, Mapping):
            return False, value
        key_tp, val_tp = typing.get_args(tp) or (Any, Any)
        out = {}
        for k, v in value.items():
            ok_k, _ = _fits(key_tp, k)
            ok_v, cv = _fits(val_tp, v)
            if not (ok_k and ok_v):
                return False, value
            out[k] = cv
        return True, out
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value  # an annotation this module does not know: leave it to __post_init__


def check_fields(cls: type, data: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``data`` with every value checked against ``cls``'s field annotations (ints made floats
    where a float is wanted). ``where`` is the block's dotted name, e.g. ``"generate"``.

    Keys that are not fields of ``cls`` are left alone (the caller reports unknown keys first).
    """
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out = dict(data)
    for key, value in data.items():
        if key in defaults:
            default = defaults[key] if defaults[key] is not dataclasses.MISSING else None
            out[key] = check_value(hints[key], value, f"{where}.{key}" if where else str(key), default)
    return out


def check_block(data: Any, where: str) -> dict[str, Any]:
    """A block must be a mapping (or absent/empty): ``run: 5`` names the block and the fix."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping of settings, got {_got(data)}", field=where,
                          fix=f"write {where} as 'key: value' lines, e.g. --set {where}.KEY=VALUE for one value")
    return dict(data)
