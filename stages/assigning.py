"""A replica's input partitions given by hand (``expstream stage --assign i/n``), without a group join.

Why: a consumer-group join waits on the broker before it answers: Tansu's JoinGroup sleeps in 1 s
steps until half the session timeout has passed (3 s at ``kafka.session_timeout_ms`` 6000), Apache
Kafka holds a new group's first join for ``group.initial.rebalance.delay.ms`` (3 s by default). When
``expstream run`` starts a stage it knows the membership already: ``n`` replicas, replica ``i`` of
them. So it starts each replica with ``--assign i/n`` (``run.assign_partitions``, on by default when
the run starts its own broker) and the replica takes the partitions ``p`` with ``p % n == i`` of its
input topic (``consumer.assign``).
It still reads and commits its offsets under the stage's group id, so everything that reads the
group's committed offsets (the autoscaler's lag, ``expstream rewind``'s plan, status) is unchanged.

What changes, and why it is safe:

* **Commits carry no generation** (kafka-python commits for a hand-assigned consumer as a "simple
  consumer": generation -1, no member id). Nothing fences a replica's commit against another's, so
  the run keeps two replicas off one partition: replica ``i`` of ``n`` owns exactly its share, a
  restarted replica (the supervisor restarts it with the same ``--assign``) takes the same share
  after the old process has died, and an ``expstream scale`` (or autoscaler step) of the stage
  stops every hand-assigned replica (SIGTERM, each finishes and commits its micro-batch and exits;
  SIGKILL after the grace) before it starts the new count, each with its new share
  (expstream/launch/supervisor.py ``Supervisor.reassign``). Should a commit of a process that is gone
  still land after the new replicas' (a request already in the broker's socket buffer), no record
  is lost either: a replica commits an offset only after the outputs of every record below it are
  confirmed (stages/commitgroup.py), so a late commit can only move the offset to records that were
  handled (forward) or make handled records be read again (back: duplicates, which every consumer
  drops by batch or sample id). And once the stage has group members, the broker refuses a
  generation-less commit (UNKNOWN_MEMBER_ID; Apache Kafka and the embedded Tansu alike, checked by
  tests/test_assigning.py): a straggler cannot move a grouped stage's offsets at all.
* **Rewind** works as before: the replica acknowledges under its heartbeat name, and at the ``move``
  step seeks and commits every partition it owns (its share).
* **A replica that dies** leaves its share unread until the supervisor restarts it (a group would
  hand the share to the others after ``kafka.session_timeout_ms``); the restart comes within the
  supervisor's backoff (0.5 s doubling), faster than a session timeout.

``expstream stage`` started by hand or in a container (docker-compose, Kubernetes) has no
``--assign`` and joins the group as before: there the membership is not known up front. For the same
reason a run on a shared broker (``--bootstrap-servers``) assigns nothing unless told to
(``run.assign_partitions: true``): a replica started on another machine joins the stage's group
(docs/deploy.md "Adding machines"), and a hand-assigned replica beside it would read the same
partitions, its commits refused (nothing lost, the work done twice).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import TopicPartition

from expstream.errors import BrokerUnavailableError, ConfigError
from stages.revocations import RevocationTracker

__all__ = ["METADATA_WAIT_S", "assign_share", "parse_assignment", "share"]

# Why 30 s: the run creates the topics before it starts a stage, so the first metadata answer has them;
# the wait covers a broker that is slow to answer at start, not a missing topic.
METADATA_WAIT_S = 30.0


def parse_assignment(text: str) -> tuple[int, int]:
    """``"i/n"`` -> ``(i, n)`` with ``0 <= i < n``; a ConfigError naming ``--assign`` otherwise."""
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ConfigError(f"--assign {text!r}: not a replica index and count", field="--assign",
                          fix="give INDEX/COUNT with 0 <= INDEX < COUNT, e.g. --assign 0/2, or leave it out to "
                              "join the stage's consumer group")
    return i, n


def share(partitions: set[int] | list[int], index: int, count: int) -> list[int]:
    """The partitions replica ``index`` of ``count`` takes: every ``count``-th, from ``index`` on."""
    return sorted(p for p in partitions if p % count == index)


def assign_share(consumer: Any, tracker: RevocationTracker, topic: str, assignment: tuple[int, int],
                 log: logging.Logger) -> list[TopicPartition]:
    """Assign this replica's share of ``topic`` to ``consumer`` and tell ``tracker`` it owns it.

    Returns:
        The partitions assigned (empty when the topic has fewer partitions than replicas: the
        replica then reads nothing, as a group member past the partition count would).
    Raises:
        BrokerUnavailableError: the topic's partitions were not known within METADATA_WAIT_S.
    """
    index, count = assignment
    deadline = time.monotonic() + METADATA_WAIT_S
    while not (partitions := consumer.partitions_for_topic(topic)):
        if time.monotonic() > deadline:
            raise BrokerUnavailableError(f"no partitions of {topic} known after {METADATA_WAIT_S:.0f}s (the run "
                                         "creates its topics before the stages start)")
        time.sleep(0.2)
    tps = [TopicPartition(topic, p) for p in share(partitions, index, count)]
    if tps:
        consumer.assign(tps)
        tracker.on_partitions_assigned(tps)
        log.info("%s: partitions %s assigned by the run (replica %d of %d, no group join)", topic,
                 [tp.partition for tp in tps], index, count)
    else:
        log.warning("%s: %d partitions for %d replicas: replica %d reads nothing", topic, len(partitions), count,
                    index)
    return tps
