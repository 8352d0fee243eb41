"""``expstream run`` without ``--continuous``: feed the prompts, collect the experiences, stop when done.

Steps 5-6 of expstream/launch/run.py, inside the run's services (expstream/launch/services.py;
the continuous counterpart is expstream/launch/continuous.py run_continuous):
:func:`collect_experiences` feeds the prompt file into the input topic (every send confirmed; more
prompts for the groups dynamic sampling dropped, :class:`FeedPlan`) and collects experiences
(deduped by sample id) until every fed prompt group is accounted for: emitted complete, dropped
by dynamic sampling, or dead-lettered, or ``run.target_groups`` complete groups came out. A last
stage that holds samples back for a window that never fills is flushed (:func:`flush_last_window`).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TYPE_CHECKING

from expstream.config.topology import Topology
from expstream.errors import EXIT_INTERRUPTED
from expstream.kafka.topics import dlq_topic
from expstream.launch.collector import REJECTED_FILE, ExperienceCollector
from expstream.launch.outcome import RunOutcome
from expstream.launch.prompts import PromptRow, feed_prompts
from expstream.launch.services import RunServices
from expstream.tools.accounting import wait_balanced

if TYPE_CHECKING:
    from expstream.state import State
    from stages.context import StageContext

log = logging.getLogger("expstream.run")
# Why 5 s: often enough to see progress in a CI log, rare enough not to flood it.
PROGRESS_LOG_INTERVAL_S = 5.0
MONITOR_POLL_MS = 300


class Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = sys.stderr.isatty()
        self.last_log = 0.0
        self.started = time.monotonic()

    def update(self, done: int, samples: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and not force and now - self.last_log < PROGRESS_LOG_INTERVAL_S:
            return
        self.last_log = now
        width = 30
        filled = int(width * done / max(self.total, 1))
        rate = samples / max(now - self.started, 1e-9)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} groups  {samples} samples  " \
               f"{rate:.2f} samples/s"
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)


class FeedPlan:
    """How many prompts to have fed, given how many groups were lost (dropped or dead-lettered).

    The run wants ``run.target_groups`` complete groups (default: one per prompt). With dynamic
    sampling it feeds ``ceil(target · (1 + dynamic_sampling_over_provision))`` prompts up front
    and one more prompt for every group lost, while the file has prompts left, so the
    experience rate holds when constant-reward groups are dropped.
    """

    def __init__(self, topo: Topology, available: int) -> None:
        self.available = available
        self.target = min(topo.run.target_groups or available, available)
        extra = topo.algo.dynamic_sampling_over_provision if topo.algo.dynamic_sampling else 0.0
        self.upfront = math.ceil(self.target * (1 + extra))

    def wanted(self, lost: int) -> int:
        return min(self.available, self.upfront + lost)


def collect_experiences(svc: RunServices, rows: list[PromptRow], out: RunOutcome, stop: dict[str, bool],
                        progress_on: bool = True) -> None:
    """Steps 5-6 of expstream/launch/run.py (the module docstring); sets ``out.finished`` / ``out.status`` /
    ``out.fail``. The collector is closed when the services' block is left, after the outputs are written."""
    topo, bootstrap = svc.topo, svc.bootstrap
    collector = out.collector = ExperienceCollector(
        bootstrap, topo.kafka, topo.output_topic, topo.generate.n_samples_per_prompt,
        dlq_topics=[dlq_topic(t) for t in topo.all_topics()], group_mode=topo.is_group_estimator,
        rejected_path=svc.out_dir / REJECTED_FILE)
    svc.callback(collector.close)
    plan = FeedPlan(topo, len(rows))
    out.target_groups = plan.target
    records = 0
    progress = Progress(plan.target, enabled=progress_on)
    last_new = time.monotonic()
    try:
        while True:
            if stop["stop"]:
                out.status = EXIT_INTERRUPTED
                return
            lost = out.dropped + len(collector.lost_groups())
            if plan.wanted(lost) > out.fed:  # first feed, or a top-up for groups dynamic sampling dropped
                want = plan.wanted(lost)
                collector.expect_groups(r.prompt_id for r in rows[out.fed:want])  # before they can come out
                records += feed_prompts(bootstrap, topo.kafka, topo.topics.input, rows[out.fed:want],
                                        topo.run.prompt_batch_size, first_index=records)
                svc.timeline.mark("prompts_fed")
                log.info("run %s: fed prompts %d..%d to %s", svc.run_id, out.fed, want - 1, topo.topics.input)
                out.fed = want
            if collector.poll(MONITOR_POLL_MS):
                last_new = time.monotonic()
            svc.supervisor.poll()
            svc.scaler.tick()
            out.dropped = int(svc.state.counters().get("dynamic_sampling_dropped_groups", 0))
            flush_last_window(topo, svc.state, collector, out.fed, out.dropped, bootstrap)
            done = collector.complete_groups + lost
            progress.update(min(collector.complete_groups, plan.target), len(collector.samples))
            if collector.complete_groups >= plan.target or (out.fed == len(rows) and done >= out.fed):
                progress.update(min(collector.complete_groups, plan.target), len(collector.samples), force=True)
                if done >= out.fed == len(rows):  # everything fed came out: the final snapshot and the summary
                    wait_balanced(svc.state, topo, len(collector.samples))  # the last statistics (tools/accounting.py)
                out.finished = True
                return
            if time.monotonic() - last_new > topo.run.timeout_s:
                out.fail(f"no experience arrived for {topo.run.timeout_s:.0f}s (run.timeout_s); "
                         f"see {svc.run_dir}/logs")
                return
    finally:
        progress.close()


def flush_last_window(topo: Topology, state: State, collector: ExperienceCollector, prompts: int, dropped: int,
                      bootstrap: str) -> None:
    """Release what the last stage holds back once every other sample has come out.

    In a continuous deployment a stage may hold samples across micro-batches (the advantage
    stage's cross-batch normalisation window closes when it holds ``algo.rollout_batch_size``
    samples); a finite run's last window never fills. So once the held samples are the only ones
    missing, the run calls the stage's ``end_of_input`` hook and publishes what it returns.
    """
    from expstream.config.estimators import uses_window

    last = topo.enabled_stages()[-1].name
    if last == "advantage" and not uses_window(topo.algo):
        return  # nothing held back; and the stage modules (torch) stay out of this process
    from stages import held_samples
    from stages.context import make_context

    ctx = make_context(topo, last, state=state)
    pending = held_samples(ctx)
    n = topo.generate.n_samples_per_prompt
    expected = (prompts - dropped) * n - len(collector.dead_samples - collector.samples)
    if pending == 0 or len(collector.samples) + pending < expected:
        return
    publish_end_of_input(topo, ctx, bootstrap, pending)


def publish_end_of_input(topo: Topology, ctx: StageContext, bootstrap: str, held: int) -> int:
    """Call the last stage's ``end_of_input`` and publish what it returns to the output topic (every send
    confirmed); returns the number of micro-batches published."""
    from expstream.kafka.clients import make_producer, send_all_and_confirm
    from expstream.kafka.provenance import provenance_headers
    from schemas import encode
    from stages import end_of_input

    outputs = end_of_input(ctx)
    producer = make_producer(bootstrap, topo.kafka, spread=True)
    try:
        send_all_and_confirm(producer, [(topo.output_topic, encode(b), b.batch_id.encode(),
                                         provenance_headers(ctx.stage.name, b.policy_version)) for b in outputs],
                             topo.kafka.produce_timeout_s)
    finally:
        producer.close(timeout=10)
    log.info("%s end of input: published %d held micro-batches, %d samples", ctx.stage.name, len(outputs), held)
    return len(outputs)
