"""Where a run's samples are, per stage: in = out + dead-lettered + dropped + in flight.

Read from the run state's flows (every stage records a commit group's rows after the broker has
acknowledged its outputs; stages/commitgroup.py). ``expstream status``, status.jsonl and
summary.json show it (docs/observability.md "Accounting").
"""

from __future__ import annotations

import logging
import time
from typing import Any

__all__ = ["SETTLE_TIMEOUT_S", "accounting", "accounting_block", "wait_balanced"]

#: how long a finished run waits for its stages' last statistics before the final snapshot and summary.json's
#: accounting: a stage records a commit group's rows after the broker acknowledged its outputs, so the run can
#: read the last experience up to a confirm group (<= 50 ms, stages/commitgroup.py) before they are in Redis
SETTLE_TIMEOUT_S = 5.0
SETTLE_POLL_S = 0.05


def accounting(flow: dict[str, int], dropped: int = 0) -> dict[str, Any]:
    """in = out + dead + dropped + in flight; ``balanced`` when in flight is 0 and nothing is negative."""
    s_in, out, dead = int(flow.get("in", 0)), int(flow.get("out", 0)), int(flow.get("dead", 0))
    in_flight = s_in - out - dead - dropped
    return {"samples_in": s_in, "samples_out": out, "samples_dead": dead, "samples_dropped": dropped,
            "in_flight": in_flight, "balanced": in_flight == 0}


def accounting_block(state: Any, topo: Any, log_to: logging.Logger | None = None) -> dict[str, Any]:
    """summary.json's ``accounting``: per stage in/out/dead/dropped/in flight, ``balanced``; a warning per
    stage that does not balance (at the end of a run every sample should be out, dead or dropped)."""
    flows = state.flows()
    dropped_groups = int(state.counters().get("dynamic_sampling_dropped_groups", 0))
    n = topo.generate.n_samples_per_prompt
    out = {}
    for st in topo.enabled_stages():
        acc = accounting(flows.get(st.name, {}), dropped_groups * n if st.name == "advantage" else 0)
        out[st.name] = acc
        if not acc["balanced"] and log_to is not None:
            log_to.warning("accounting: stage %s does not balance: in %d != out %d + dead %d + dropped %d (in flight "
                           "%d)", st.name, acc["samples_in"], acc["samples_out"], acc["samples_dead"],
                           acc["samples_dropped"], acc["in_flight"])
    return out


def wait_balanced(state: Any, topo: Any, collected: int = 0, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Wait until every enabled stage's accounting balances (nothing in flight) and the stage that
    writes the run's output topic has counted at least ``collected`` samples out; at most ``timeout_s``.

    Called once a finite run has every group it fed: the last experience can reach the run before the
    stage that produced it has written its statistics (they follow the broker's acknowledgement), and a
    stage whose last records are not counted yet balances too, on fewer samples (seen on a Redis
    Cluster: advantage 8 in, 8 out of 24). Returns whether it settled; a run that ends with samples in
    flight is reported as it is."""
    last = [st.name for st in topo.enabled_stages() if st.output == topo.output_topic]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            acc = accounting_block(state, topo)
        except Exception:  # noqa: BLE001 - observability never stops a run: the accounting says what it reads
            return False
        if all(a["balanced"] for a in acc.values()) and all(
                acc.get(name, {}).get("samples_out", 0) >= collected for name in last):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(SETTLE_POLL_S)
