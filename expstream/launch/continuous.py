"""``expstream run --continuous``: feed epochs under flow control while the trainer trains, then stop.

What :func:`expstream.launch.run.run_pipeline` does differently when ``train.enabled`` is true:

1. Before the resolved topology is written, expstream.config.paths.resolve_run_paths makes
   ``train.weight_store`` an absolute path (default ``<output>/weights``), so the stages and the
   trainer, whatever their working directory, read and write the same store.
2. The ``policy`` topic is created with the others (expstream.kafka.topics.loop_topics).
3. The trainer runs under the same Supervisor as the stages, as the one-shot process ``trainer``
   (:func:`trainer_argv`; its Redis URL travels in the environment like a stage's): exit 0 means
   finished, a crash is restarted and the trainer resumes from its checkpoint.
4. :func:`run_continuous` feeds the prompt file epoch after epoch (expstream.launch.prompts.EpochFeeder)
   and keeps at most ``(async.max_staleness + FEED_HEADROOM_STEPS) x train.batch_size`` samples'
   worth of prompts fed beyond what the trainer has consumed (:func:`feed_limit`), prints each
   step the trainer logs to ``train.jsonl``, and returns when the trainer has finished
   (exit 0 and ``train/done.json``), on Ctrl-C, or when no step came for ``run.timeout_s``.
   It also stops, failing the run, when the prompts yield nothing (:class:`YieldWatch`): an
   epoch's worth of samples dead-lettered or dropped by dynamic sampling in a row, no experience
   produced meanwhile, and nothing left in flight (every prompt bad used to be fed epoch after
   epoch, thousands of them, until ``run.timeout_s``).
5. The caller stops the trainer and the stages (SIGTERM) and then writes ``summary.json``
   (expstream.launch.outcome.ContinuousOutcome). Nothing is collected into memory: the trainer is the
   consumer of ``experiences``.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from expstream.config.paths import resolve_weight_store  # noqa: F401  (public here too: tests, the trainer part)
from expstream.config.topology import Topology
from expstream.errors import EXIT_INTERRUPTED
from expstream.kafka.clients import make_producer
from expstream.launch.prompts import EpochFeeder, PromptRow, send_prompt_batches

if TYPE_CHECKING:
    from expstream.launch.scale import Scaler
    from expstream.launch.supervisor import Supervisor
    from expstream.state import State

log = logging.getLogger("expstream.run")

#: The supervised trainer's name (its log: run/logs/trainer-0.log).
TRAINER = "trainer"
#: Files the trainer writes under --output (the "trainer" part's contract).
TRAIN_LOG = "train.jsonl"
DONE_FILE = Path("train") / "done.json"
FINAL_DIR = "final"
# Why k + 2 steps of prompts ahead of the trainer: admission lets generate start samples up to
# (version + k + 1) x batch_size; one more step's worth queued on the input topic means generate
# never idles waiting for the feeder, while the topic never holds more than a step of prompts
# nobody may start yet (no flood, and little to throw away when the run stops).
FEED_HEADROOM_STEPS = 2
# Why 0.3 s: how often the loop looks at the trainer's progress and the supervisor; a step takes
# seconds, and a dead stage is restarted within a backoff of 0.5 s anyway.
LOOP_POLL_S = 0.3


def trainer_argv(topo_path: Path, bootstrap: str, run_id: str, out_dir: Path) -> list[str]:
    """The trainer's command line (no Redis URL: it may hold a password; the environment has it)."""
    return [sys.executable, "-m", "expstream", "train", "--topology", str(topo_path),
            "--bootstrap-servers", bootstrap, "--run-id", run_id, "--output", str(Path(out_dir).resolve())]


def feed_limit(version: int, k: int, batch_size: int, lost: int) -> int:
    """Samples' worth of prompts the run may have fed once the trainer published ``version``.

    The trainer has consumed ``version x batch_size`` samples (step u publishes version u+1); the
    run keeps ``(k + FEED_HEADROOM_STEPS) x batch_size`` more in flight, plus the ``lost`` samples
    (dead-lettered, dropped by dynamic sampling) that will never reach the trainer.
    """
    return (version + k + FEED_HEADROOM_STEPS) * batch_size + lost


def records_to_feed(fed_samples: int, record_samples: int, limit: int) -> int:
    """Whole records that fit under ``limit`` samples after ``fed_samples``."""
    return max(0, (limit - fed_samples) // record_samples)


#: Why 30 s: how long a :class:`YieldWatch` holds the feeding while samples stay in flight without any
#: change (neither lost nor produced). Far above a micro-batch's time through the stages (ms to seconds),
#: so only samples that wait for more input (a cross-batch advantage window) stall it; those need the
#: feeding to go on.
HOLD_STALL_S = 30.0


class YieldWatch:
    """Does feeding still yield experiences? (:func:`run_continuous`, step 4 of the module docstring).

    Every loop turn :meth:`check` gets the experiences produced so far (samples out of the last
    stage), the samples lost (dead-lettered or dropped by dynamic sampling; the admission counts)
    and the samples fed, and answers:

    * ``feed`` while fewer than ``epoch_samples`` (a whole epoch: prompts x n) were lost since the
      last experience came out;
    * ``hold`` once that many were lost in a row: stop feeding and see what the samples still in
      flight (fed - produced - lost) give. (A good prompt among bad ones is still on its way
      through the stages while the bad ones are rejected at once: losses in a row alone prove nothing.)
    * ``barren`` when nothing is in flight any more and still no experience came: every sample of at
      least an epoch was lost, and feeding the same prompts again gives the same. The run fails.
    * Any experience resets the count (``feed``). In flight but nothing changes for ``stall_s``
      (samples held for more input, e.g. an advantage window): ``feed`` again, counting anew.
    """

    FEED, HOLD, BARREN = "feed", "hold", "barren"

    def __init__(self, epoch_samples: int, stall_s: float = HOLD_STALL_S) -> None:
        self.epoch_samples, self.stall_s = epoch_samples, stall_s
        self.produced: int | None = None
        self.lost_at = 0  # samples lost when the last experience came out
        self._seen: tuple[int, int] | None = None
        self._changed_at = 0.0

    def check(self, produced: int, lost: int, fed: int, now: float) -> str:
        if produced != self.produced:  # an experience came out: count the losses in a row from here
            self.produced, self.lost_at = produced, lost
        if (produced, lost) != self._seen:
            self._seen, self._changed_at = (produced, lost), now
        if lost - self.lost_at < self.epoch_samples:
            return self.FEED
        if fed - produced - lost <= 0:
            return self.BARREN
        if now - self._changed_at >= self.stall_s:
            self.lost_at = lost
            return self.FEED
        return self.HOLD


def produced_samples(state: State, topo: Topology) -> int:
    """Samples out of the last enabled stage (experiences), from the run's flow accounting."""
    return int(state.flows().get(topo.enabled_stages()[-1].name, {}).get("out", 0))


def lost_samples(state: State) -> int:
    """Samples counted lost for admission (dead-lettered, dropped by dynamic sampling)."""
    _admitted, lost = state.admission_counts()
    return int(sum(lost.values()))


class TrainLog:
    """Follows ``train.jsonl`` as the trainer appends to it: complete lines only, each parsed once.

    A line that is not a JSON object is refused with one log line naming the file and line
    number, and skipped (it is the trainer's log, not a record the run depends on). A trainer that
    resumes from its checkpoint cuts the file back to the checkpoint's steps: a file shorter than
    what was read (or no longer ending a line where the last read ended) is read again from the
    start, and only steps not seen before are returned as new.

    What it keeps does not grow with the run: the summary's totals (:meth:`totals`) and the
    :data:`KEPT` fields of the last :data:`RECENT_STEPS` steps, so that a step logged again is counted
    once, the last line written winning. Whole lines kept per step (16 sample ids and 20 numbers of
    the tiny loop, ~3.8 KB parsed) made the CLI's memory grow ~0.4 MB per 100 steps, the six fields
    alone ~0.15 MB (bench/README.md "The fork server's curve was the trainer's"). :meth:`read_new`
    returns whole lines.
    """

    #: The fields of a step kept for the summary (expstream/launch/outcome.py).
    KEPT = ("step", "policy_version", "samples", "reward_mean", "dropped_stale", "skipped")
    #: Why 256: a trainer logs a step again only after resuming from its checkpoint, which cuts the file
    #: back first (read again from the start here); a step logged again without that is a recent one.
    RECENT_STEPS = 256

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._lineno = 0
        self._reset()

    def _reset(self) -> None:
        self.recent: dict[int, dict[str, Any]] = {}
        self.first: dict[str, Any] | None = None
        self.max_step: int | None = None
        self.count = self.samples = self.dropped_stale = self.skipped = 0

    def read_new(self) -> list[dict[str, Any]]:
        start = max(self._offset - 1, 0)
        try:
            with open(self.path, "rb") as fh:
                fh.seek(start)
                data = fh.read()
        except FileNotFoundError:
            return []
        if self._offset and (not data or data[:1] != b"\n"):  # cut back (shorter, or rewritten)
            log.info("%s was rewritten (the trainer resumed from its checkpoint); reading it again", self.path)
            before = self.max_step
            self._offset, self._lineno = 0, 0
            self._reset()
            return [line for line in self.read_new()
                    if before is None or not isinstance(line.get("step"), int) or line["step"] > before]
        if self._offset:
            data = data[1:]
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self._offset += end + 1
        new: list[dict[str, Any]] = []
        for raw in data[: end + 1].splitlines():
            self._lineno += 1
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                log.error("%s:%d: not a JSON object, skipped: %r", self.path, self._lineno, raw[:120])
                continue
            new.append(obj)
            self._count(obj)
        return new

    def _count(self, line: dict[str, Any]) -> None:
        step = line.get("step")
        if not isinstance(step, int):
            return  # lines without a step number are left out of the totals
        kept = {k: line[k] for k in self.KEPT if k in line}
        old = self.recent.get(step)
        if old is None and self.max_step is not None and step <= self.max_step:
            log.warning("%s: step %d logged again, %d steps after it: not counted twice", self.path, step,
                        self.max_step - step)
            return
        for sign, row in ((-1, old), (1, kept)):
            if row is not None:
                self.count += sign
                self.samples += sign * int(row.get("samples") or 0)
                self.dropped_stale += sign * int(row.get("dropped_stale") or 0)
                self.skipped += sign * (1 if row.get("skipped") else 0)
        self.recent[step] = kept
        if self.first is None or step <= int(self.first["step"]):
            self.first = kept
        self.max_step = step if self.max_step is None else max(self.max_step, step)
        while len(self.recent) > self.RECENT_STEPS:
            del self.recent[min(self.recent)]

    def totals(self) -> dict[str, Any]:
        """The summary's figures over every step read, each step once (the last line of a step wins):
        ``steps``, ``samples``, ``dropped_stale``, ``skipped`` (steps skipped as non-finite), and the
        kept fields of the ``first`` and ``last`` step ({} when none)."""
        last = self.recent.get(self.max_step) if self.max_step is not None else None
        return {"steps": self.count, "samples": self.samples, "dropped_stale": self.dropped_stale,
                "skipped": self.skipped, "first": dict(self.first or {}), "last": dict(last or {})}


def step_line(step: dict[str, Any]) -> str:
    """One printed line per trainer step: reward, loss, KL, staleness, speed."""
    def num(key: str, fmt: str) -> str:
        value = step.get(key)
        return format(value, fmt) if isinstance(value, int | float) else "?"

    hist = step.get("staleness_hist") or {}
    stale = " ".join(f"{k}:{v}" for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])))
    dropped = f"  dropped stale {step['dropped_stale']}" if step.get("dropped_stale") else ""
    skipped = f"  SKIPPED ({step['skipped']})" if step.get("skipped") else ""
    return (f"step {step.get('step', '?'):>4}  v{step.get('policy_version', '?')}  reward {num('reward_mean', '.4f')}"
            f" ± {num('reward_std', '.4f')}  loss {num('loss', '.4f')}  kl {num('kl', '.5f')}  "
            f"staleness {{{stale}}}{dropped}  {num('samples_per_s', '.2f')} samples/s{skipped}")


def run_continuous(topo: Topology, rows: list[PromptRow], out: Any, sup: Supervisor, state: State,
                   bootstrap: str, stop: dict[str, bool], scaler: Scaler | None = None) -> None:
    """Step 4 of the module docstring; sets ``out.finished`` / ``out.status`` / ``out.fail``.

    ``out`` is the run's :class:`expstream.launch.outcome.ContinuousOutcome` (not imported here: outcome
    imports this module's train-log reader). ``scaler`` (expstream/launch/scale.py) answers ``expstream
    scale`` requests and runs the autoscalers once per loop turn.
    """
    train, k = topo.train, topo.async_.max_staleness
    record_samples = topo.run.prompt_batch_size * topo.generate.n_samples_per_prompt
    feeder = out.feeder = EpochFeeder(rows, topo.run.prompt_batch_size, topo.run.seed)
    train_log = out.train_log = TrainLog(out.out_dir / TRAIN_LOG)
    producer = make_producer(bootstrap, topo.kafka, spread=True)
    last_step_at = time.monotonic()
    watch = YieldWatch(len(rows) * topo.generate.n_samples_per_prompt)
    try:
        while True:
            if stop["stop"]:
                out.status = EXIT_INTERRUPTED
                return
            version, lost = state.policy_version(), lost_samples(state)
            verdict = watch.check(produced_samples(state, topo), lost, feeder.records_fed * record_samples,
                                  time.monotonic())
            if verdict == YieldWatch.BARREN:
                out.fail(f"the prompts yield nothing: {lost - watch.lost_at} samples in a row (at least an epoch: "
                         f"{len(rows)} prompts x {topo.generate.n_samples_per_prompt}) were dead-lettered or dropped by "
                         f"dynamic sampling and none became an experience; feeding them again gives the same. The "
                         f"reasons: the 'dead-lettered' lines of {sup.log_dir}/*.log, and the dead-letter topics "
                         f"(`expstream dlq inspect --all`, or recorded under {out.out_dir}/topics)")
                return
            limit = feed_limit(version, k, train.batch_size, lost)
            count = records_to_feed(feeder.records_fed * record_samples, record_samples, limit)
            if count and verdict == YieldWatch.FEED and not sup.finished(TRAINER):
                first = feeder.records_fed
                send_prompt_batches(producer, topo.kafka, topo.topics.input, feeder.batches(count))
                log.info("run %s: fed records p%06d..p%06d (epoch %d) to %s; policy version %d", out.run_id, first,
                         feeder.records_fed - 1, feeder.epoch, topo.topics.input, version)
            for step in train_log.read_new():
                print(step_line(step), flush=True)
                last_step_at = time.monotonic()
            sup.poll()
            if scaler is not None:
                scaler.tick()
            if sup.finished(TRAINER):
                for step in train_log.read_new():  # what it wrote just before exiting
                    print(step_line(step), flush=True)
                out.finished = True
                if not (out.out_dir / DONE_FILE).exists():
                    out.fail(f"the trainer exited 0 after {train_log.totals()['steps']} of {train.max_steps} steps without "
                             f"writing {out.out_dir / DONE_FILE} (stopped from outside?); see its log "
                             f"{sup.log_dir / f'{TRAINER}-0.log'}")
                return
            if time.monotonic() - last_step_at > topo.run.timeout_s:
                out.fail(f"no trainer step for {topo.run.timeout_s:.0f}s (run.timeout_s); "
                         f"see {sup.log_dir} ({TRAINER}-0.log and the stages' logs)")
                return
            time.sleep(LOOP_POLL_S)
    finally:
        producer.close(timeout=10)
