"""Resumable generations (issue 26 item 3) against the real broker and Redis.

A generate replica SIGTERMed mid-generation (as a scale-down does) with
``generate.resumable`` hands the sequences in flight back to its input topic with their prefix and commits
the prompt record; another replica reads that record and continues from the prefix, under the weights it has
loaded by then (announced in Redis, read from the weight store). One rollout record per prompt record, every
sample id once, final tokens = prefix + continuation, per-token versions and log-probs kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from expstream.kafka.clients import read_topic, topic_lag
from expstream.state import RedisState
from expstream.train.weights import open_store
from schemas import PromptBatch, SampleBatch, decode, encode
from stages import generate
from stages.context import make_context
from stages.runner import StageRunner
from tests.runners import Running
from tests.test_runner import produce, stage_topology

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]
SIGTERM_AT = 8  # replica A is SIGTERMed once it reports this decoding step
TOKENS = 32  # min = max new tokens: every row runs the whole length
#: Replica A: the generate stage in a process of its own (tiny models, real broker and Redis), its decoding
#: slowed to 50 ms a step so that a SIGTERM lands mid-generation; it reports every step on stdout.
REPLICA_SCRIPT = textwrap.dedent("""
    import json, logging, sys, time
    from expstream.config.topology import load_topology
    from expstream.state import RedisState
    from stages import generate
    from stages.context import make_context
    from stages.runner import StageRunner

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    bootstrap, redis_url, run_id, overrides = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    ctx = make_context(load_topology(overrides=overrides), "generate", state=RedisState(redis_url, run_id),
                       run_id=run_id)
    generate.setup(ctx)
    runner = StageRunner(ctx, generate.process, bootstrap)
    runner.install_signal_handlers()
    steps = [0]

    def should_stop():
        steps[0] += 1
        print("STEP", steps[0], flush=True)
        time.sleep(0.05)
        return runner.stop_requested

    ctx.should_stop = should_stop
    sys.exit(runner.run())
""")


def test_a_sigterm_mid_generation_is_continued_by_another_replica(broker, redis_url, model_cache, tmp_path):
    store_dir = tmp_path / "weights"
    overrides = [f"models.cache_dir={model_cache}", "generate.n_samples_per_prompt=2",
                 f"generate.max_new_tokens={TOKENS}", f"generate.min_new_tokens={TOKENS}", "generate.resumable=true",
                 "generate.in_flight_updates=true", "train.enabled=true", f"train.weight_store={store_dir}",
                 "train.batch_size=64"]
    topo = stage_topology(broker, "generate", *overrides)
    run_id = f"r{uuid.uuid4().hex[:8]}"
    src, dst = topo.stages["generate"].input, topo.stages["generate"].output
    produce(broker, src, [encode(PromptBatch(batch_id="p0", prompt_id=["a", "b"], prompt=["Hello there", "Add two"],
                                             label=["", ""], reference=["", ""]))])
    wiring = [f"topics.input={src}", f"stages.generate.output={dst}"]
    # replica A: a process of its own, SIGTERMed once it is a few decoding steps into the generation
    proc = subprocess.Popen([sys.executable, "-c", REPLICA_SCRIPT, broker, redis_url, run_id,
                             json.dumps([*wiring, *overrides])], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=(tmp_path / "a.log").open("w"), text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for line in proc.stdout:
            if line.strip() == f"STEP {SIGTERM_AT}":
                proc.send_signal(signal.SIGTERM)
                break
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    log_a = (tmp_path / "a.log").read_text()
    assert rc == 0, log_a[-3000:]
    assert "its prefix goes back to" in log_a, log_a[-3000:]
    records = list(read_topic(broker, topo.kafka, src, timeout_s=5))
    assert len(records) == 2, "the prefix went back to the input topic"
    partial = decode(records[1].value)
    assert isinstance(partial, SampleBatch) and partial.batch_id == "p0"
    stop_after = len(partial.response_ids.row(0))  # the steps A took before it saw the stop
    assert 0 < stop_after < TOKENS and [len(r) for r in partial.response_ids.rows()] == [stop_after] * 4
    assert [r.tolist() for r in partial.token_versions.rows()] == [[0] * stop_after] * 4
    assert list(read_topic(broker, topo.kafka, dst, timeout_s=2)) == [], "nothing produced by the stopped replica"

    # the trainer publishes version 1 meanwhile: replica B loads it and continues under it
    state_b = RedisState(redis_url, run_id)
    ctx_b = make_context(topo, "generate", state=state_b, run_id=run_id, replica_id="1")
    generate.setup(ctx_b)
    model = ctx_b.models["generator"].model
    v1 = {k: (v + 0.05 * torch.randn_like(v)) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    open_store(str(store_dir)).publish("actor", 1, v1, step=0, offsets={}, run_id=run_id)
    state_b.set_policy_version(1)
    running_b = Running(StageRunner(ctx_b, generate.process, broker))
    try:
        running_b.wait(lambda: running_b.runner.handled >= 1, 120, "the partial generation continued")
    finally:
        running_b.stop()
    outs = [decode(r.value) for r in read_topic(broker, topo.kafka, dst, timeout_s=5)]
    assert len(outs) == 1, "one rollout record per prompt record"
    final = outs[0]
    assert Counter(final.sample_ids()) == Counter(["a#0", "a#1", "b#0", "b#1"])
    assert msgpack.unpackb(encode(final), raw=False)["version"] == 5
    for pre, full, pre_lp, lp in zip(partial.response_ids.rows(), final.response_ids.rows(),
                                     partial.rollout_log_probs.rows(), final.rollout_log_probs.rows(), strict=True):
        assert len(full) == TOKENS and full[:stop_after].tolist() == pre.tolist()  # prefix + continuation
        np.testing.assert_array_equal(lp[:stop_after], pre_lp)
    assert [r.tolist() for r in final.token_versions.rows()] == [[0] * stop_after + [1] * (TOKENS - stop_after)] * 4
    assert final.rollout_version == [0] * 4, "the oldest token's version (the one admitted under)"
    assert topic_lag(broker, topo.kafka, running_b.runner.group_id, src) == {0: 0}, "both records committed"
    flow = state_b.flows()["generate"]  # accounted once, by the record that finished it: nothing left in flight
    assert (flow.get("in"), flow.get("out"), flow.get("dead", 0)) == (4, 4, 0), flow
    state_b.close()


@pytest.mark.e2e
def test_a_continuous_run_with_in_flight_updates_bounds_staleness_by_the_oldest_token(tmp_path, model_cache):
    """`expstream run --continuous` with in-flight updates (real broker and redis-server of its own): every trained
    sample's oldest token is at most k versions behind the step that trains it (read from the recorded
    experiences, not from the trainer's own histogram), and train.jsonl counts the mixed-version samples."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from expstream.tools.samples import iter_located

    root = Path(__file__).resolve().parents[1]
    steps, k = 4, 1
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"Say {i}?"}) + "\n" for i in range(5)))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "expstream", "run", "--continuous", "--prompts", str(prompts), "--output", str(out),
           "--no-progress"]
    for s in (f"models.cache_dir={model_cache}", "generate.max_new_tokens=32", "generate.min_new_tokens=8",
              "generate.n_samples_per_prompt=2", "run.prompt_batch_size=2", "train.batch_size=8",
              "run.timeout_s=300", f"train.max_steps={steps}", f"async.max_staleness={k}",
              "generate.in_flight_updates=true"):
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    oldest: dict[str, int] = {}
    for loc in iter_located(out, "experiences"):
        rows = [r.tolist() for r in loc.batch.token_versions.rows()]  # in-flight: every record carries them
        for sid, versions, v in zip(loc.batch.sample_ids(), rows, loc.batch.rollout_version, strict=True):
            assert min(versions) >= v, "no token older than the version the sample was admitted under"
            oldest[sid] = min(versions)
    mixed = 0
    for x in lines:
        assert isinstance(x["mixed_version_samples"], int)
        mixed += x["mixed_version_samples"]
        for sid in x["sample_ids"]:
            assert x["step"] - oldest[sid] <= k, (sid, x["step"], oldest[sid])
    print(f"mixed-version samples over {steps} steps: {mixed}")
