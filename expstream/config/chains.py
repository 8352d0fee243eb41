"""The ``chains:`` block: consecutive stages run in one process (operator chaining, colocation).

``chains: [[actor-logprob, reference, critic], [postprocess, advantage]]`` runs each listed run of
consecutive stages as one *unit*: one process per replica that reads the first stage's input topic,
hands the micro-batch from stage to stage in memory and writes only the last stage's output topic
(stages/chain.py). Every stage not named in a chain is a unit of its own, as by default.

Checked when the topology is loaded (a :class:`~expstream.errors.ConfigError` naming the field):

* ``chains`` is a list of lists of stage names; ``chains[i]`` names at least two stages, each
  known (``chains[i][j]``), in pipeline order, and no stage is in two chains;
* the stages of a chain that are switched on (a stage the algorithm switches off, like ``critic``
  without ``gae``, is dropped from its chain) are consecutive in the enabled pipeline: nothing may
  run between them, since no topic is left to carry a record to it;
* a chain scales as one unit: its stages have the same ``replicas``, and only its first stage may
  have an ``autoscale`` block (it scales the chain).

A chain whose stages are switched off down to one is that stage alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from expstream.config.environment import ENVIRONMENT_STAGE
from expstream.errors import ConfigError

# The Topology and StageConfig arguments are typed Any: expstream/config/topology.py imports this module.

__all__ = ["CHAIN_SEP", "Unit", "check_chains", "parse_chains", "unit_of", "units"]

#: How a chain's unit is named: its enabled stages joined, e.g. ``actor-logprob+reference``.
CHAIN_SEP = "+"


@dataclass(frozen=True)
class Unit:
    """What one process runs: a stage alone, or a chain of consecutive stages.

    ``name`` is the supervisor's, the log file's and the process title's (``reward``,
    ``postprocess+advantage``); the consumer group, the fault plan, rewind and the autoscaler use
    the first stage's name, whose input topic the unit reads (so a topology can chain or unchain
    stages between runs without moving the group of that topic).
    """

    name: str
    stages: tuple[str, ...]

    @property
    def head(self) -> str:
        return self.stages[0]

    @property
    def last(self) -> str:
        return self.stages[-1]

    @property
    def chained(self) -> bool:
        return len(self.stages) > 1


def parse_chains(value: Any, stage_order: tuple[str, ...]) -> list[list[str]]:
    """``chains:`` as written -> a list of stage-name lists, its shape and names checked (before the stages
    are switched on or off)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ConfigError(f"chains: got {value!r}; give a list of chains, each a list of consecutive stage names",
                          field="chains", fix="e.g. chains: [[actor-logprob, reference, critic], [postprocess, advantage]]")
    seen: dict[str, str] = {}
    chains: list[list[str]] = []
    for i, chain in enumerate(value):
        where = f"chains[{i}]"
        if not isinstance(chain, list) or len(chain) < 2:
            raise ConfigError(f"{where}: got {chain!r}; a chain is a list of at least two consecutive stage names",
                              field=where, fix="e.g. [postprocess, advantage]; a stage alone needs no chain")
        for j, name in enumerate(chain):
            if name not in stage_order:
                raise ConfigError(f"{where}[{j}]: {name!r} is not a stage", field=f"{where}[{j}]",
                                  fix=f"name one of {', '.join(stage_order)}")
            if name in seen:
                raise ConfigError(f"{where}[{j}]: {name} is already in {seen[name]}; a stage runs in at most one chain",
                                  field=f"{where}[{j}]", fix=f"remove {name} from one of the two chains")
            seen[name] = where
        positions = [stage_order.index(n) for n in chain]
        if positions != sorted(positions):
            raise ConfigError(f"{where}: {chain} is not in pipeline order", field=where,
                              fix=f"list them as the pipeline runs them: {sorted(chain, key=stage_order.index)}")
        chains.append([str(n) for n in chain])
    return chains


def check_chains(topo: Any) -> None:
    """The checks that need the stages switched on or off and linked (consecutive, one scale)."""
    enabled = [st.name for st in topo.enabled_stages()]
    for i, chain in enumerate(topo.chains):
        where = f"chains[{i}]"
        names = [n for n in chain if topo.stages[n].enabled]
        if len(names) < 2:
            continue
        at = enabled.index(names[0])
        if enabled[at:at + len(names)] != names:
            between = [n for n in enabled[at:enabled.index(names[-1])] if n not in names]
            if ENVIRONMENT_STAGE in between:  # multi-turn: generate also consumes the turns topic, as a unit of its own
                raise ConfigError(f"{where}: {names} has the environment stage between its stages; the environment "
                                  "stage and generate (which also consumes the turns topic) run unchained",
                                  field=where, fix="start the chain after the environment stage, e.g. at shard-preprocess")
            raise ConfigError(f"{where}: {names} are not consecutive stages of this pipeline ({', '.join(between)} "
                              "runs between them)", field=where,
                              fix=f"add {', '.join(between)} to the chain, or split it where {between[0]} runs")
        head = topo.stages[names[0]]
        for name in names[1:]:
            st = topo.stages[name]
            if st.replicas != head.replicas:
                raise ConfigError(f"stages.{name}.replicas: {st.replicas}, but it runs in {where} after {head.name} "
                                  f"(replicas {head.replicas}); a chain scales as one unit",
                                  field=f"stages.{name}.replicas", fix=f"give it {head.replicas}, as {head.name}")
            if st.autoscale is not None:
                raise ConfigError(f"stages.{name}.autoscale: {name} runs in {where} after {head.name}; a chain scales "
                                  "as one unit, by its first stage's block", field=f"stages.{name}.autoscale",
                                  fix=f"move the autoscale block to stages.{head.name}")


def units(topo: Any) -> list[Unit]:
    """The processes of this topology, in pipeline order: each chain's enabled stages, every other stage alone."""
    chain_of = {name: tuple(n for n in chain if topo.stages[n].enabled) for chain in topo.chains for name in chain}
    out: list[Unit] = []
    for st in topo.enabled_stages():
        names = chain_of.get(st.name) or (st.name,)
        if names[0] == st.name:
            out.append(Unit(CHAIN_SEP.join(names), names))
    return out


def unit_of(topo: Any, name: str) -> Unit | None:
    """The unit named ``name`` (``a+b``), or the unit running stage ``name``; None when neither."""
    for unit in units(topo):
        if name == unit.name or name in unit.stages:
            return unit
    return None
