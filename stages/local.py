"""The stages called one after another in one process: the seed's synchronous shape.

Used by tests (an in-memory source and sink), by replays of recorded topics, and by
``bench/pipeline.py`` as the baseline the streaming pipeline is measured against. The
records still go through ``schemas.encode``/``decode`` between stages when ``through_codec`` is
set, so a replay sees exactly what Kafka would carry.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from expstream.config.topology import Topology
from expstream.state import MemoryState, State
from schemas import decode, encode
from stages import STAGES, end_of_input
from stages.context import StageContext, make_context


@dataclass
class LocalChain:
    topology: Topology
    # One state shared by every stage of the chain: groups split across micro-batches complete here
    # as they do across Redis, and a replay sees the same answers.
    state: State = field(default_factory=MemoryState)
    through_codec: bool = False
    contexts: dict[str, StageContext] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    batches: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def setup(self) -> LocalChain:
        if self.topology.environment is not None:  # the turns loop goes through topics (docs/multi_turn.md)
            from expstream.errors import ConfigError

            raise ConfigError("a multi-turn topology runs on a broker only (the turns loop)", field="environment",
                              fix="run it with `expstream run`, or drop the environment block for LocalChain/replay")
        for st in self.topology.enabled_stages():
            ctx = make_context(self.topology, st.name, state=self.state)
            STAGES[st.name].setup(ctx)
            self.contexts[st.name] = ctx
        return self

    def run_stage(self, name: str, inputs: Iterable[Any]) -> list[Any]:
        out: list[Any] = []
        for batch in inputs:
            if self.through_codec:
                batch = decode(encode(batch))
            started = time.perf_counter()
            out.extend(STAGES[name].process(batch, self.contexts[name]))
            self.seconds[name] += time.perf_counter() - started
            self.batches[name] += 1
        return out

    def run(self, prompt_batches: Iterable[Any]) -> list[Any]:
        """Every enabled stage over all inputs, stage by stage; returns the experiences.

        The input is finite: after a stage has seen all of it, its ``end_of_input`` hook releases
        what it held back (the last normalisation window), and those batches go on downstream.
        """
        data: list[Any] = list(prompt_batches)
        for st in self.topology.enabled_stages():
            data = self.run_stage(st.name, data)
            data.extend(end_of_input(self.contexts[st.name]))
        return data
