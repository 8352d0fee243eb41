"""``expstream train``: the reference trainer of the continuous loop (docs/async.md "The reference trainer").

Per optimisation step u (0-based; trains weights of version u, publishes version u+1):

1. poll ``experiences``; drop a sample id already settled (trained or dropped as stale, within the dedupe
   horizon: :class:`~expstream.train.settled.SettledSamples`) or buffered (Kafka delivers at least once;
   counted as ``duplicates``); ``gate.add`` every new sample with its rollout version;
2. drop buffered samples staler than ``async.max_staleness`` (never trained; counted, logged);
3. wait while the gate names stragglers (admitted samples of versions v <= u - k not yet arrived),
   at most ``async.straggler_timeout_s``;
4. train when ``train.batch_size`` samples are buffered -- or, as a short step (logged), when every
   admitted sample has arrived and the admission bound leaves no room for another prompt record
   (``StalenessGate.starved``: losses left a gap, so waiting longer would deadlock);
   A step whose loss or gradient is not finite takes no optimiser step (``PolicyTrainer.train_step``):
   its samples are consumed, the weights stay as they were, and it is counted (``nonfinite_steps`` in
   ``train.jsonl``, ``done.json`` and the run's Redis counter ``trainer_nonfinite_steps``) and logged
   with the records it came from;
5. publish version u+1 to the weight store, write the checkpoint (every ``train.checkpoint_every``
   steps and the last), announce the version (``policy`` topic + Redis), commit the consumed offsets
   (only after the checkpoint is durable; then fold the admission counts of the versions below the
   checkpoint's step - k into one total, :meth:`Trainer.fold_admission`), delete the versions retention no longer keeps
   (:func:`versions_kept`: the staleness window or ``train.keep_versions``, and the latest
   checkpoint's), report the KL to PipelineControl, append the ``train.jsonl`` line and print one
   progress line.

After ``train.max_steps``: ``DIR/final/`` (a loadable HF directory) and ``DIR/train/done.json``.
Stopped by SIGTERM/SIGINT after at least one step: a checkpoint and ``DIR/final/`` (no done.json).
Resume after a crash: the checkpoint's weights, optimiser state, buffer and settled ids; versions the
store holds beyond it are discarded (never announced); ``train.jsonl`` is cut back to the
checkpoint's steps; the experiences are re-read from the checkpoint's positions.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from expstream.config.topology import Topology
from expstream.errors import EXIT_OK, ConfigError
from expstream.faults import TRAINER_POINTS, fault_plan
from expstream.procs import EXIT_WITH_PARENT_ENV, set_role_title
from expstream.rl.episodes import turn_reward_sums
from expstream.rl.experience import sample_id
from expstream.rl.versions import mixed_rows, oldest_versions
from expstream.train.checkpoint import BufferedRecord, Checkpoint, read_checkpoint, write_checkpoint
from expstream.train.settled import SettledSamples, settle_horizon_s
from expstream.train.step import PolicyTrainer, experience_from_records
from schemas import decode, encode

__all__ = ["BufferedSample", "run_trainer", "experiences_topic", "sample_versions", "versions_kept"]

log = logging.getLogger("expstream.train")

# Why 0.5 s: the poll wait; short enough to notice a stop request and stragglers promptly.
POLL_MS = 500
TRAIN_JSONL = "train.jsonl"
@dataclass
class BufferedSample:
    sid: str  # f"{group_id}#{sample_index}"
    version: int  # rollout version (policy version of the generating weights)
    key: tuple[int, int]  # (partition, offset) of its record
    row: int  # row in that record


def experiences_topic(topo: Topology) -> str:
    """The topic the trainer reads: the last enabled stage's output (``experiences``)."""
    return topo.enabled_stages()[-1].output


def sample_versions(batch: Any) -> list[int]:
    """Per-sample versions staleness is bounded by: the oldest token's (``token_versions``, schema 5), else
    ``rollout_version`` (schema 2), else the batch's ``policy_version`` (expstream/rl/versions.py)."""
    return oldest_versions(batch)


def versions_kept(topo: Topology) -> int:
    """How many of the newest versions the weight store keeps (0: every one): ``train.keep_versions``,
    never fewer than the staleness window ``async.max_staleness + 1``; null means exactly the window."""
    keep, window = topo.train.keep_versions, topo.async_.max_staleness + 1
    if keep is None:
        return window
    return 0 if keep == 0 else max(int(keep), window)


def _batch_ids(batch: Any) -> list[str]:
    return [sample_id(str(g), int(i)) for g, i in zip(batch.group_id, batch.sample_index, strict=True)]


class Trainer:
    """The loop's state; :func:`run_trainer` builds one and runs it."""

    def __init__(self, topo: Topology, args: Any, output: Path) -> None:
        from expstream.models.hf import SamplingSupport, load_causal_lm, load_tokenizer
        from expstream.models.resolve import model_dir
        from expstream.models.vl import load_critic
        from expstream.rl.admission import StalenessGate
        from expstream.state import RedisState
        from expstream.train.control import PipelineControl
        from expstream.train.weights import open_store

        self.topo, self.args, self.output = topo, args, output
        self.run_id = args.run_id
        self.k = topo.async_.max_staleness
        self.bs = topo.train.batch_size
        self.state = RedisState(args.redis_url, args.run_id, group_ttl_s=topo.redis.group_ttl_s)
        self.control = PipelineControl(args.redis_url, args.run_id, topo)
        self.store = open_store(topo.train.weight_store or str(output / "weights"))
        self.tokenizer = load_tokenizer(model_dir(topo, "tokenizer"))
        actor = load_causal_lm(model_dir(topo, "actor"), device=topo.models.device)
        critic = None
        if topo.algo.advantage_estimator == "gae" and topo.train.train_critic and topo.models.critic:
            critic = load_critic(model_dir(topo, "critic"), device=topo.models.device)
        support = SamplingSupport.of(self.tokenizer, actor, topo.generate.backend, topo.generate.min_new_tokens)
        self.trainer = PolicyTrainer(topo, actor, critic, support=support)
        self.gate = StalenessGate(self.k, self.bs)
        self.step = 0
        self.records: dict[tuple[int, int], tuple[Any, str]] = {}  # (p, offset) -> (batch, topic)
        self.buffer: list[BufferedSample] = []
        self.settled = SettledSamples(settle_horizon_s(topo))  # ids trained or dropped, within the horizon
        self.counters: Counter[str] = Counter()
        self.stop = False
        self.last_line: dict[str, Any] | None = None
        self.stream: Any = None
        self.announcer: Any = None  # the policy topic's producer, made at the first announcement, kept till close
        self.fault = fault_plan("trainer", TRAINER_POINTS)  # SIGKILL in step k right after a point
        self._wait_since: float | None = None
        self.record_samples = topo.run.prompt_batch_size * topo.generate.n_samples_per_prompt
        self.checkpoint_version: int | None = None  # the version of the latest durable checkpoint

    # ---- start / resume -------------------------------------------------------------------------
    def restore(self) -> dict[int, int] | None:
        """Load the checkpoint when there is one; returns its positions (None: start fresh)."""
        roles = ["actor"] + (["critic"] if self.trainer.critic is not None else [])
        ckpt = read_checkpoint(self.output)
        if ckpt is None:
            for role in roles:
                dropped = self.store.discard_after(role, 0)
                if dropped:
                    log.warning("trainer: discarded %s versions %s left by a trainer that never checkpointed",
                                role, dropped)
            _cut_jsonl(self.output / TRAIN_JSONL, 0, None)
            return None
        self.trainer.actor.load_state_dict(ckpt.actor, strict=True)
        if ckpt.actor_optim:
            self.trainer.optimizer.load_state_dict(ckpt.actor_optim)
        if self.trainer.critic is not None and ckpt.critic is not None:
            self.trainer.critic.load_state_dict(ckpt.critic, strict=True)
            if ckpt.critic_optim and self.trainer.critic_optimizer is not None:
                self.trainer.critic_optimizer.load_state_dict(ckpt.critic_optim)
        self.step = ckpt.step
        self.checkpoint_version = ckpt.version
        self.counters.update(ckpt.counters)
        self.settled = SettledSamples.from_json(ckpt.settled, settle_horizon_s(self.topo))
        for sid, v in self.settled.items():
            self.gate.add(sid, v)
        for rec in ckpt.buffer:
            batch = decode(rec.value)
            self._add_rows(batch, rec.topic, rec.partition, rec.offset, rows=rec.rows)
        for role in roles:
            dropped = self.store.discard_after(role, ckpt.version)
            if dropped:
                log.warning("trainer: discarded %s versions %s written after the checkpoint (never announced)",
                            role, dropped)
        # the fold the crashed trainer may not have reached after this checkpoint: the ids it no longer keeps
        # are of versions it folds (the gate must not wait for what it has forgotten it received)
        self.fold_admission()
        self.settled.forget(self.step - self.k)
        if ckpt.version > 0:
            self._announce(self.store.manifest("actor", ckpt.version))
        _cut_jsonl(self.output / TRAIN_JSONL, ckpt.step, ckpt.last_line)
        self.last_line = ckpt.last_line
        log.info("trainer: resumed at step %d (version %d), %d samples buffered, %d settled ids kept (%d trained), "
                 "positions %s", ckpt.step, ckpt.version, len(self.buffer), len(self.settled),
                 self.settled.taken_count(), ckpt.positions)
        return ckpt.positions

    def _announce(self, manifest: Any) -> None:
        from expstream.kafka.clients import make_producer
        from expstream.train.weights import announce

        if self.announcer is None:  # one producer for the trainer's life: was one made and closed per step
            self.announcer = make_producer(self.args.bootstrap_servers, self.topo.kafka)
        announce(manifest, bootstrap=self.args.bootstrap_servers, kafka_config=self.topo.kafka, state=self.state,
                 producer=self.announcer)

    # ---- intake ---------------------------------------------------------------------------------
    def _add_rows(self, batch: Any, topic: str, partition: int, offset: int, rows: list[int] | None = None) -> None:
        ids = _batch_ids(batch)
        versions = sample_versions(batch)
        buffered = {s.sid for s in self.buffer}
        kept = 0
        for row in (range(len(ids)) if rows is None else rows):
            sid = ids[row]
            # counted even for a duplicate: a redelivered prompt record regenerated under a newer
            # version moved its admission count to that version, so the gate must see it there
            self.gate.add(sid, versions[row])
            if sid in self.settled or sid in buffered:
                self.counters["duplicates"] += 1
                continue
            buffered.add(sid)
            self.buffer.append(BufferedSample(sid, versions[row], (partition, offset), row))
            kept += 1
        if kept:
            self.records[(partition, offset)] = (batch, topic)

    def _drop_stale(self) -> None:
        keep = []
        for s in self.buffer:
            if self.gate.staleness_ok(self.step, s.version):
                keep.append(s)
                continue
            self.counters["dropped_stale"] += 1
            self.settled.drop(s.sid, s.version, self.step)
            self.counters["dropped_stale_step"] += 1
            batch, topic = self.records[s.key]
            log.warning("trainer: sample %s of %s[%d]@%d batch=%s dropped: version %d is %d steps old at step %d "
                        "> async.max_staleness=%d", s.sid, topic, s.key[0], s.key[1], batch.batch_id, s.version,
                        self.step - s.version, self.step, self.k)
        self.buffer = keep

    # ---- the step -------------------------------------------------------------------------------
    def _admission(self) -> tuple[dict[int, int], dict[int, int]]:
        if self.topo.async_.on_stale != "backpressure":
            return {}, {}
        return self.state.admission_counts()

    def fold_admission(self) -> int:
        """Fold the admission counts of the versions below the durable checkpoint's step - k into one total
        (``State.fold_admission``) and let the gate forget them: no step this trainer takes, or resumes at
        from that checkpoint, trains a sample of them, so the ledger it reads every poll keeps about
        ``k + train.checkpoint_every`` versions however long the run. Returns the fold point (0: none).
        With ``async.on_stale: drop`` there is no ledger, and the gate (whose counts nothing reads then)
        forgets the same versions."""
        if self.checkpoint_version is None:
            return 0
        below = self.checkpoint_version - self.k
        if below <= 0:
            return 0
        self.gate.forget_below(below)
        if self.topo.async_.on_stale != "backpressure":
            return 0
        return self.state.fold_admission(below)

    def ready(self) -> bool:
        """Steps 3-4 of the module docstring: may step ``self.step`` run now?"""
        if not self.buffer:
            return False
        admitted, lost = self._admission()
        waiting = self.gate.wait_for(self.step, admitted, lost)
        if waiting:
            if self._wait_since is None:
                self._wait_since = time.monotonic()
                log.info("trainer: step %d waits for stragglers of versions %s", self.step, waiting)
            if time.monotonic() - self._wait_since < self.topo.async_.straggler_timeout_s:
                return False
            log.warning("trainer: step %d gave up waiting for versions %s after async.straggler_timeout_s=%.0f; "
                        "late arrivals will be dropped as stale", self.step, waiting,
                        self.topo.async_.straggler_timeout_s)
        self._wait_since = None
        if len(self.buffer) >= self.bs:
            return True
        if admitted and self.gate.starved(self.step, admitted, lost, self.record_samples):
            log.info("trainer: short step %d with %d of train.batch_size=%d samples: everything admitted has "
                     "arrived and generation waits for a new version", self.step, len(self.buffer), self.bs)
            return True
        return False

    def train_one(self) -> dict[str, Any]:
        started = time.monotonic()
        chosen = sorted(self.gate.select([s.version for s in self.buffer], self.step))
        picked = [self.buffer[i] for i in chosen]
        by_record: dict[tuple[int, int], list[int]] = {}
        for s in picked:
            by_record.setdefault(s.key, []).append(s.row)
        parts = [(self.records[key][0], rows) for key, rows in by_record.items()]
        exp = experience_from_records(parts)
        if self.topo.algo.use_kl_loss and exp.base_action_log_probs is None and not self.counters["no_reference_warned"]:
            self.counters["no_reference_warned"] = 1
            log.warning("trainer: algo.use_kl_loss is true but the experiences of step %d carry no reference log-probs "
                        "(base_action_log_probs): the loss has no KL term; run the pipeline with this topology and a "
                        "reference model (algo.init_kl_coef > 0)", self.step)
        result = self.trainer.train_step(exp)
        if result.skipped:
            self._count_nonfinite(result.skipped, by_record)
        version = self.step + 1
        offsets: dict[str, list[int]] = {}
        for (p, off) in by_record:
            name = f"{self.records[(p, off)][1]}[{p}]"
            lo, hi = offsets.get(name, [off, off])
            offsets[name] = [min(lo, off), max(hi, off)]
        manifest = self.store.publish("actor", version, self.trainer.actor_state(), step=self.step,
                                      offsets=offsets, run_id=self.run_id)
        critic_state = self.trainer.critic_state()
        critic_manifest = None
        if critic_state is not None and result.value_loss is not None:
            critic_manifest = self.store.publish("critic", version, critic_state, step=self.step, offsets=offsets,
                                                 run_id=self.run_id)
        chosen_set = set(chosen)
        self.buffer = [s for i, s in enumerate(self.buffer) if i not in chosen_set]
        for s in picked:
            self.settled.take(s.sid, s.version, self.step)
        live = {s.key for s in self.buffer}
        for key in [k for k in self.records if k not in live]:
            del self.records[key]
        # a multi-turn episode's reward: the reward stage's plus its environment rewards (docs/multi_turn.md)
        rewards = np.concatenate([(np.asarray(b.rewards, dtype=np.float64) + turn_reward_sums(b).numpy())[list(rows)]
                                  for b, rows in parts])
        hist = Counter(str(self.step - s.version) for s in picked)
        mixed = sum(int(np.asarray(mixed_rows(b), dtype=bool)[list(rows)].sum()) for b, rows in parts)
        kl = result.kl if exp.base_action_log_probs is not None else float(exp.info["kl"].mean()) \
            if "kl" in exp.info else 0.0
        line = {
            "step": self.step, "policy_version": version, "samples": len(picked),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
            "loss": _finite(result.loss), "kl": _finite(kl), "value_loss": _finite(result.value_loss),
            "clip_frac": _finite(result.clip_frac), "is_weight_mean": _finite(result.is_weight_mean),
            "is_masked_frac": _finite(result.is_masked_frac), "grad_norm": _finite(result.grad_norm),
            "trained_tokens": result.trained_tokens, "skipped": "; ".join(result.skipped) or None,
            "nonfinite_steps": int(self.counters["nonfinite_steps"]),
            "staleness_hist": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))), "mixed_version_samples": mixed,
            "dropped_stale": self.counters.pop("dropped_stale_step", 0), "duplicates": self.counters["duplicates"],
            "sample_ids": [s.sid for s in picked], "wait_s": 0.0, "train_s": time.monotonic() - started,
            "time": time.time(),
        }
        self.step += 1
        self.settled.forget(self.step - self.k)  # a copy of what goes is stale from now on
        return {"line": line, "manifests": [m for m in (critic_manifest, manifest) if m is not None], "kl": kl}

    def _count_nonfinite(self, reasons: list[str], by_record: dict[tuple[int, int], list[int]]) -> None:
        """A step that took no optimiser step: counted (train.jsonl, done.json, Redis) and logged."""
        self.counters["nonfinite_steps"] += 1
        where = ", ".join(f"{self.records[k][1]}[{k[0]}]@{k[1]} batch={self.records[k][0].batch_id}"
                          for k in sorted(by_record))
        log.warning("trainer: step %d skipped (%s): no optimiser step, the weights of version %d are published "
                    "unchanged as version %d; %d such steps so far; samples from %s", self.step, "; ".join(reasons),
                    self.step, self.step + 1, self.counters["nonfinite_steps"], where)
        try:
            self.state.incr_counter("trainer_nonfinite_steps", 1, once_id=f"step-{self.step}")
        except Exception as exc:  # noqa: BLE001 - a counter must not stop training
            log.warning("trainer: could not count the skipped step %d in Redis: %s", self.step, exc)

    def _maybe_crash(self, point: str) -> None:
        if self.fault is not None and self.fault == (point, self.step):
            log.error("trainer: fault injection: SIGKILL %s of step %d", point, self.step)
            os.kill(os.getpid(), signal.SIGKILL)

    def checkpoint(self) -> dict[int, int]:
        positions = self.stream.positions()
        buffer = []
        for key in sorted({s.key for s in self.buffer}):
            batch, topic = self.records[key]
            rows = [s.row for s in self.buffer if s.key == key]
            buffer.append(BufferedRecord(value=encode(batch), rows=rows, topic=topic, partition=key[0], offset=key[1]))
        counters = {k: int(v) for k, v in self.counters.items() if k not in ("dropped_stale_step", "no_reference_warned")}
        write_checkpoint(self.output, Checkpoint(
            step=self.step, version=self.step, positions=positions, settled=self.settled.to_json(),
            actor=self.trainer.actor_state(),
            actor_optim=self.trainer.optimizer.state_dict(), critic=self.trainer.critic_state(),
            critic_optim=self.trainer.critic_optimizer.state_dict() if self.trainer.critic_optimizer else None,
            buffer=buffer, counters=counters, last_line=self.last_line, run_id=self.run_id))
        self.checkpoint_version = self.step
        return positions

    def prune(self) -> list[int]:
        """Delete the versions retention no longer keeps (after the announcement: the newest version is
        announced, the checkpoint durable). A failure is logged, never fatal. Returns the actor versions gone."""
        from expstream.train.weights import WeightStoreError, prune_versions

        keep = versions_kept(self.topo)
        removed: list[int] = []
        if not keep:
            return removed
        for role in ("actor", "critic"):
            try:
                gone = prune_versions(self.store, role, keep=keep, checkpoint=self.checkpoint_version)
            except (OSError, WeightStoreError) as exc:
                log.warning("trainer: deleting old %s versions from %s failed (%s); they stay", role, self.store, exc)
                continue
            if gone:
                log.info("trainer: deleted %s versions %s (keeping the newest %d and checkpoint v%s)", role,
                         _span(gone), keep, self.checkpoint_version)
            if role == "actor":
                removed = gone
        return removed

    def run(self) -> int:
        from expstream.train.stream import ExperienceStream

        cfg = self.topo.train
        positions = self.restore()
        self.stream = ExperienceStream(self.args.bootstrap_servers, self.topo.kafka, experiences_topic(self.topo),
                                       f"{self.run_id}.trainer", positions=positions)
        jsonl = self.output / TRAIN_JSONL
        window_start, window_samples = time.monotonic(), 0
        wait_start = time.monotonic()
        try:
            while self.step < cfg.max_steps and not self.stop:
                for batch, topic, p, off in self.stream.poll(POLL_MS):
                    self._add_rows(batch, topic, p, off)
                self._drop_stale()
                if not self.ready():
                    continue
                out = self.train_one()
                line = out["line"]
                line["wait_s"] = round(time.monotonic() - wait_start - line["train_s"], 3)
                window_samples += line["samples"]
                line["samples_per_s"] = window_samples / max(time.monotonic() - window_start, 1e-9)
                self.last_line = line
                self._maybe_crash("after_publish")
                durable = self.step % cfg.checkpoint_every == 0 or self.step >= cfg.max_steps
                ckpt_positions = self.checkpoint() if durable else None
                self._maybe_crash("after_checkpoint")
                for manifest in out["manifests"]:  # the critic first: its followers go by the actor's version
                    self._announce(manifest)
                self._maybe_crash("after_announce")
                if ckpt_positions is not None:
                    self.stream.commit(ckpt_positions)
                    self.fold_admission()
                self.prune()
                if math.isfinite(out["kl"]):  # a non-finite KL would poison the adaptive β for good
                    self.control.report_kl(f"step-{line['step']}", out["kl"], n_steps=line["samples"])
                with jsonl.open("a") as fh:
                    fh.write(json.dumps(line) + "\n")
                skipped = f" SKIPPED ({line['skipped']})" if line["skipped"] else ""
                print(f"step {line['step'] + 1}/{cfg.max_steps} version {line['policy_version']} "
                      f"reward {line['reward_mean']:.4f}±{line['reward_std']:.4f} loss {_fmt(line['loss'])} "
                      f"kl {_fmt(line['kl'])} samples {line['samples']} staleness {line['staleness_hist']} "
                      f"dropped {line['dropped_stale']}{skipped}", flush=True)
                wait_start = time.monotonic()
            if self.step >= cfg.max_steps:
                self._finish()
            elif self.stop:
                positions = self.checkpoint()
                self.stream.commit(positions)
                if self.step:  # Ctrl-C ends a run too: its weights so far, loadable, as after max_steps
                    self._save_final()
                log.info("trainer: stopped at step %d (checkpoint written%s)", self.step,
                         ", weights in final/" if self.step else "")
        finally:
            self.stream.close()
            if self.announcer is not None:
                self.announcer.close()
            self.control.close()
            self.state.close()
        return EXIT_OK

    def _save_final(self) -> Path:
        """``DIR/final/``: the actor as a loadable model directory (weights, config, tokenizer)."""
        final = self.output / "final"
        self.trainer.actor.save_pretrained(final, safe_serialization=True)
        self.tokenizer.save_pretrained(final)
        return final

    def _finish(self) -> None:
        final = self._save_final()
        done = {"steps": self.step, "policy_version": self.step, "run_id": self.run_id,
                "dropped_stale": int(self.counters["dropped_stale"]), "duplicates": int(self.counters["duplicates"]),
                "nonfinite_steps": int(self.counters["nonfinite_steps"]),
                "undecodable": self.stream.undecodable, "time": time.time()}
        (self.output / "train" / "done.json").write_text(json.dumps(done, indent=1))
        log.info("trainer: %d steps done; final weights in %s", self.step, final)


def _span(versions: list[int]) -> str:
    return f"v{versions[0]}" if len(versions) == 1 else f"v{versions[0]}..v{versions[-1]} ({len(versions)})"


def _finite(x: float | None) -> float | None:
    """``x``, or None when it is not finite (train.jsonl stays strict JSON: no NaN/Infinity)."""
    return None if x is None or not math.isfinite(x) else x


def _fmt(x: float | None) -> str:
    return "nan" if x is None else f"{x:.4f}"


def _cut_jsonl(path: Path, steps: int, last_line: dict[str, Any] | None) -> None:
    """Keep the lines of steps < ``steps`` - 1 and end with the checkpoint's own line (step ``steps`` - 1)."""
    if not path.exists():
        return
    lines = []
    for raw in path.read_text().splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            log.warning("trainer: %s: a torn line (a crash while appending) dropped", path)
            continue
        if int(rec.get("step", -1)) < steps - 1:
            lines.append(raw)
    if last_line is not None and steps > 0:
        lines.append(json.dumps(last_line))
    path.write_text("".join(line + "\n" for line in lines))


def run_trainer(topo: Topology, args: Any) -> int:
    """``expstream train``: checks the arguments, then the loop until max_steps or SIGTERM."""
    if args.run_id:  # `ps`, `top` and bench/growth.py name it (a forked trainer showed the fork server's command line)
        set_role_title("trainer", args.run_id)
    orphaned: list[Trainer] = []  # filled once the trainer exists; the watch starts before the slow loads
    if os.environ.get(EXIT_WITH_PARENT_ENV) == "1":  # started by a supervisor: stop when it is gone
        _stop_when_orphaned(orphaned)
    import torch

    if not args.bootstrap_servers:
        raise ConfigError("--bootstrap-servers: the trainer needs the broker address", field="--bootstrap-servers",
                          fix="pass --bootstrap-servers HOST:PORT (the run's broker)")
    if not args.redis_url:
        raise ConfigError("--redis-url: the trainer needs the run's Redis (policy version, admission counts, KL)",
                          field="--redis-url", fix="pass --redis-url or set $EXPSTREAM_REDIS_URL")
    if not args.output:
        raise ConfigError("--output: the trainer needs a directory", field="--output", fix="pass --output DIR")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(topo.run.torch_threads)
    if (output / "train" / "done.json").exists():
        log.info("trainer: %s/train/done.json exists: training already finished", output)
        return EXIT_OK
    trainer = Trainer(topo, args, output)
    orphaned.append(trainer)
    if orphaned[0] is not trainer:  # the parent went away during the loads: stop before the first poll
        return EXIT_OK

    def on_signal(signum: int, frame: Any) -> None:  # noqa: ARG001
        log.info("trainer: signal %d: stopping after the step in hand", signum)
        trainer.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return trainer.run()


def _stop_when_orphaned(trainers: list[Trainer]) -> None:
    """The belt and braces behind PDEATHSIG (as expstream/launch/replica.py does for a stage): once the parent
    is gone, the trainer (``trainers[0]`` once it exists) stops after the step in hand and writes a
    checkpoint on the way out; gone during the loads, it stops before its first poll."""
    from expstream.procs import watch_parent

    def on_orphan(parent: int) -> None:
        log.error("trainer: parent process %d is gone (now %d); stopping after the step in hand", parent,
                  os.getppid())
        if trainers:
            trainers[0].stop = True
        else:
            trainers.append(None)  # type: ignore[arg-type] - a marker: not the trainer

    watch_parent(on_orphan)
