"""Nothing outlives ``expstream run``, however it dies; a stop never waits for a long generation.

* ``kill -9`` of the run's main process: every process it started (the fork server, its resource
  tracker, every stage, the broker, redis-server) is gone within seconds (issue 8 item 4: ten were
  left, retrying the dead broker forever).
* SIGTERM to a generate stage in the middle of a long generation: the stage abandons the
  micro-batch between two tokens (long before max_new_tokens) and exits on its own with code 0,
  without committing it, so the next consumer of the group reads it again.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from expstream.config.topology import load_topology
from expstream.errors import ShutdownRequested
from expstream.kafka.clients import make_producer
from expstream.kafka.topics import create_topics
from expstream.procs import ORPHAN_EXIT_CODE, die_with
from schemas import PromptBatch, encode
from tests.harness import start_expstream

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc")
# Why 15 s: PDEATHSIG acts at once (measured: everything gone within 1 s); the margin is for a
# busy 2-core machine reaping a dozen processes.
ORPHANS_GONE_S = 15.0
# Why 4000: min_new_tokens=max_new_tokens=4000 takes minutes on the tiny model; a stop honoured between
# two tokens ends it after a few hundred at most (the count is in the "stop requested after" line).
LONG_TOKENS = 4000


@pytest.fixture(scope="module")
def cache(model_cache: Path) -> Path:
    return model_cache  # the session's tiny-model cache (tests/conftest.py)


def alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped by its new parent, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    if int(fh.read().rsplit(")", 1)[-1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def with_run_id(run_id: str) -> list[int]:
    """Every live process whose command line or title names the run (stage titles: ``run=<id>``)."""
    return [int(e) for e in os.listdir("/proc") if e.isdigit() and f"run={run_id}" in cmdline(int(e))
            and alive(int(e))]


@pytest.mark.e2e
def test_kill_9_of_the_run_leaves_no_process_behind(tmp_path, cache):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}?"}) + "\n" for i in range(300)))
    out = tmp_path / "out"
    run_id = f"orphans-{uuid.uuid4().hex[:6]}"
    proc, _ = start_expstream(tmp_path, "--run-id", run_id, prompts=prompts, out=out, cache=cache,
                              stdout=subprocess.DEVNULL,
                              sets=["generate.max_new_tokens=6", "generate.n_samples_per_prompt=2"])
    run_dir = out / "run"
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "pids.json").exists() or len(json.loads((run_dir / "pids.json").read_text())) < 7:
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "stages did not start within 180 s"
            time.sleep(0.2)
        time.sleep(2)  # stages connected and working
        stages = json.loads((run_dir / "pids.json").read_text())
        services = json.loads((run_dir / "services.json").read_text())
        helpers = children(proc.pid)  # fork server, resource tracker, broker, redis-server
        started = {f"{label} pid {pid}": pid for label, pid in stages.items()}
        started.update({f"{cmdline(pid)[:80]} pid {pid}": pid for pid in helpers})
        assert any("forkserver" in name for name in started), started
        assert services["broker_pid"] in helpers and services["redis_pid"] in helpers
        assert len(with_run_id(run_id)) == len(stages) >= 7
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    killed = time.monotonic()
    while time.monotonic() - killed < ORPHANS_GONE_S:
        left = {pid: name for name, pid in started.items() if alive(pid)}
        left.update({pid: f"{cmdline(pid)[:80]} pid {pid}" for pid in with_run_id(run_id) if pid not in left})
        if not left:
            break
        time.sleep(0.2)
    assert left == {}, f"{len(left)} of {len(started)} processes outlived the run's main process: {sorted(left.values())}"


def test_a_child_whose_parent_is_already_gone_exits_at_once():
    """``die_with``: the parent died between fork and prctl (here: a pid that is not the parent)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            preexec_fn=functools.partial(die_with, 2 ** 22 + 1))
    assert proc.wait(timeout=10) == ORPHAN_EXIT_CODE


def test_watch_parent_notices_that_the_parent_is_gone(tmp_path):
    """The belt and braces behind PDEATHSIG: a process sees its parent pid change and is told."""
    marker = tmp_path / "orphaned"
    grandchild = (f"import time\nfrom expstream.procs import watch_parent\n"
                  f"watch_parent(lambda old: open({str(marker)!r}, 'w').write(str(old)), interval_s=0.1)\n"
                  f"time.sleep(60)\n")
    middle = subprocess.Popen([sys.executable, "-c", f"import subprocess, sys, time\n"
                               f"print(subprocess.Popen([sys.executable, '-c', {grandchild!r}]).pid, flush=True)\n"
                               f"time.sleep(60)\n"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid = int(middle.stdout.readline())
    try:
        time.sleep(1)  # the watch has started
        assert not marker.exists()
        middle.kill()
        middle.wait()
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists() and marker.read_text() == str(middle.pid)
    finally:
        middle.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_the_generator_stops_between_tokens(cache):
    from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer
    from expstream.models.tiny import build_tiny_models

    paths = build_tiny_models(cache)
    tok = load_tokenizer(paths["tokenizer"])
    gen = TransformersGenerator(load_causal_lm(paths["actor"]), tok)
    prompt = [tok("Hello there", add_special_tokens=False)["input_ids"]]
    calls = []

    def stop_after_5() -> bool:
        calls.append(1)
        return len(calls) > 5

    with pytest.raises(ShutdownRequested, match="after 5 of max_new_tokens=4000"):
        gen.generate(prompt, 2, max_new_tokens=4000, min_new_tokens=4000, seed=1, should_stop=stop_after_5)
    assert len(calls) == 6
    # never stopping changes nothing
    assert gen.generate(prompt, 2, max_new_tokens=8, seed=1, should_stop=lambda: False) == \
        gen.generate(prompt, 2, max_new_tokens=8, seed=1)


@pytest.mark.integration
def test_sigterm_mid_generation_exits_promptly_and_leaves_the_batch_uncommitted(tmp_path, cache, broker, redis_url):
    from stages.context import make_context
    from stages.runner import StageRunner

    src, dst = f"in-{uuid.uuid4().hex[:10]}", f"out-{uuid.uuid4().hex[:10]}"
    create_topics(broker, {src: 1, dst: 1}, with_dlq=True)
    sets = [f"topics.input={src}", f"stages.generate.output={dst}", f"models.cache_dir={cache}",
            "generate.n_samples_per_prompt=2", f"generate.max_new_tokens={LONG_TOKENS}",
            f"generate.min_new_tokens={LONG_TOKENS}"]
    run_id = f"stop-{uuid.uuid4().hex[:6]}"
    producer = make_producer(broker)
    # two prompts: an abandoned batch of several must not be split and dead-lettered as if it were poisoned
    value = encode(PromptBatch(batch_id="p-long", prompt_id=["long-0", "long-1"],
                               prompt=["Tell me everything", "And more"], label=["", ""], reference=["", ""]))
    producer.send(src, value=value, key=b"p-long").get(timeout=30)
    producer.close()
    log_path = tmp_path / "generate.log"
    with open(log_path, "wb") as log:
        argv = [sys.executable, "-m", "expstream", "stage", "generate", "--bootstrap-servers", broker,
                "--redis-url", redis_url, "--run-id", run_id, "--replica-id", "0"]
        for item in sets:
            argv += ["--set", item]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "still in hand" not in log_path.read_text(errors="replace"):  # generating for 1 s already
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "the stage did not start generating within 180 s"
            time.sleep(0.2)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        try:  # a deadline on the wait (nothing here escalates to SIGKILL): not a bound on how fast
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the stage ignored SIGTERM for 300 s\n{log_path.read_text(errors='replace')[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    # It exited on its own (code 0, its "stopped after" line), having cut the generation between two
    # tokens: the stop came long before the generation's end, so it was the signal that ended it.
    assert code == 0, text[-3000:]
    stops = [int(n) for n in re.findall(rf"stop requested after (\d+) of max_new_tokens={LONG_TOKENS} tokens; "
                                        r"generation abandoned; not committing it", text)]
    assert len(stops) == 1 and 0 < stops[0] < LONG_TOKENS, text[-3000:]
    after = text.split("still in hand", 1)[1]
    assert "splitting" not in after and "(0 dead letters, 0 batches split" in after, after  # abandoned only
    assert "replica 0: stopped after 0 records" in after, after

    # The micro-batch was not committed: the next consumer of the group reads it again.
    seen = []
    topo = load_topology(overrides=sets)
    runner = StageRunner(make_context(topo, "generate", run_id=run_id),
                         lambda batch, ctx: seen.append(batch.batch_id) or [], broker, max_records=1)
    thread = threading.Thread(target=runner.run, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():  # nothing to read: the record was committed
        runner.stop_requested = True
        thread.join(30)
    assert seen == ["p-long"]
    assert runner.dead_lettered == 0
