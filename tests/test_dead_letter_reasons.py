"""A record dead-lettered whole: each group keeps its own reason, and the stage's accounting counts it
(issue 21 item 12).

A prompt record of three prompts, each bad for a reason of its own, goes through the real runner
on the real broker with a RedisState: the whole record fails (on its first prompt), every prompt
fails alone too, so the record is dead-lettered whole, bytes untouched. Before, every group of it
was reported with the first prompt's error, and generate's accounting showed 0 in, 0 dead.
"""

from __future__ import annotations

import uuid

import pytest

from expstream.errors import PoisonRecordError
from expstream.kafka.clients import read_topic
from expstream.kafka.letters import sample_errors
from expstream.launch.collector import ExperienceCollector
from expstream.tools.accounting import accounting_block
from schemas import PromptBatch, encode
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running
from tests.test_runner import headers_of, produce, stage_topology

pytestmark = pytest.mark.integration

N = 2
REASONS = {"bomb": "image 0: decompression bomb (178956970 pixels)",
           "long": "prompt is 900 tokens, over generate.prompt_max_len=40",
           "empty": "prompt is empty"}


def refuse_each_prompt(batch: PromptBatch, ctx) -> list:
    """A generate stand-in that refuses every prompt, each for the reason its text names."""
    for text in batch.prompt:
        raise PoisonRecordError(REASONS[text])
    return []


def test_a_record_dead_lettered_whole_gives_each_group_its_own_reason_and_is_counted(broker, redis_state):
    topo = stage_topology(broker, "generate", f"generate.n_samples_per_prompt={N}")
    dlq = f"{topo.topics.input}.dlq"
    collector = ExperienceCollector(broker, topo.kafka, topo.stages["generate"].output, N, dlq_topics=[dlq])
    texts = ["bomb", "long", "empty"]
    ids = [f"q{i}-{uuid.uuid4().hex[:4]}" for i in range(len(texts))]
    collector.expect_groups(ids)
    value = encode(PromptBatch(batch_id="p000000", prompt_id=ids, prompt=texts, label=[""] * 3, reference=[""] * 3))
    produce(broker, topo.topics.input, [value])
    runner = StageRunner(make_context(topo, "generate", state=redis_state, run_id=redis_state.run_id),
                         refuse_each_prompt, broker)
    running = Running(runner)
    try:
        running.wait(lambda: runner.handled >= 1, 120, "the record handled")
    finally:
        running.stop()

    [letter] = read_topic(broker, topo.kafka, dlq)
    h = headers_of(letter)
    assert letter.value == value and "split_from" not in h  # whole, bytes untouched: a redrive reproduces it
    assert h["error_class"] == "PoisonRecordError" and REASONS["bomb"] in h["error_message"]  # the record's failure
    assert sample_errors(h) == {pid: f"PoisonRecordError: {REASONS[t]}" for pid, t in zip(ids, texts, strict=True)}

    while not collector.dead_letters:
        collector.poll(200)
    lost = collector.lost_group_reasons(finished=True)
    collector.close()
    for pid, text in zip(ids, texts, strict=True):
        assert lost[pid] == f"dead letter from generate: PoisonRecordError: {REASONS[text]}", lost

    # 3 prompts x n samples came in, all dead; summary.json's accounting block reads the same state
    acc = accounting_block(redis_state, topo)["generate"]
    assert (acc["samples_in"], acc["samples_out"], acc["samples_dead"], acc["balanced"]) == (3 * N, 0, 3 * N, True)
