"""The serialised form of the topology dataclasses: what ``Topology.to_raw`` writes (expstream/config/topology.py).

Plain YAML values, keyed like topology.yaml, so that loading them gives back equal dataclasses;
what the loader fills in itself (``where`` of a block, a stage's ``name``, ``input``) is left out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from expstream.config.rewards import SOURCE_KINDS, RewardSourceConfig

#: Topology block name -> attribute, where the name is a Python keyword.
BLOCK_ATTRS = {"async": "async_"}

def block_raw(block: Any) -> Any:
    """A config block (a dataclass, or what one holds) as plain YAML values; ``where`` is left to the loader."""
    if isinstance(block, RewardSourceConfig):  # only the keys its kind takes (RewardSourceConfig.from_raw)
        return {k: getattr(block, k) for k in ("kind", *SOURCE_KINDS[block.kind])}
    if dataclasses.is_dataclass(block):
        return {f.name: block_raw(getattr(block, f.name)) for f in dataclasses.fields(block) if f.name != "where"}
    if isinstance(block, dict):
        return {k: block_raw(v) for k, v in block.items()}
    if isinstance(block, list | tuple):
        return [block_raw(v) for v in block]
    return block


def stage_raw(st: Any, switched_off: bool) -> dict[str, Any]:
    """``stages.<name>`` as written: a stage the loader switched off as configured (on)."""
    return {"output": st.output, "replicas": st.replicas, "enabled": st.enabled or switched_off,
            "autoscale": block_raw(st.autoscale)}


def topology_raw(topo: Any) -> dict[str, Any]:
    """Every block of a Topology, keyed by its name in topology.yaml (``async``, not ``async_``)."""
    names = {attr: name for name, attr in BLOCK_ATTRS.items()}
    raw = {names.get(f.name, f.name): block_raw(getattr(topo, f.name))
           for f in dataclasses.fields(topo) if f.name not in ("stages", "switched_off", "source")
           and not (f.name == "environment" and topo.environment is None)}  # single-turn: written as before
    raw["stages"] = {name: stage_raw(st, name in topo.switched_off) for name, st in topo.stages.items()}
    return raw
