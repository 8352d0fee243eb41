"""SGLang as the generation engine (issue 27): equivalence with transformers, weight updates, the stage.

Every test here needs the SGLang venv (`make setup-sglang`); without it they are skipped with that
reason. One SGLang server serves the whole session (it takes 30-60 s to start); the end-to-end test's
generate stage starts its own, supervised by the stage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from expstream.models.sglang_server import sglang_installed

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.sglang,
              pytest.mark.skipif(not sglang_installed(), reason="no SGLang venv: run `make setup-sglang`")]
#: Why 1e-5: the issue's bound; float32 SGLang and transformers agree to ~2e-6 here, a prefix cached
#: under stale weights is off by whole nats.
TOL = 1e-5


@pytest.fixture(scope="session")
def tiny(model_cache) -> dict[str, Path]:
    from expstream.models.tiny import build_tiny_models

    return build_tiny_models(model_cache)


@pytest.fixture(scope="session")
def engine(tiny):
    from expstream.models.hf import load_tokenizer
    from expstream.models.sglang_generator import SglangGenerator

    gen = SglangGenerator(tiny["actor"], load_tokenizer(tiny["tokenizer"]), seed=0)
    pid = gen.server.pid
    yield gen
    gen.close()
    assert not Path(f"/proc/{pid}").exists(), "close() stops the server"


@pytest.fixture(scope="session")
def hf(tiny):
    from expstream.models.hf import TransformersGenerator, load_causal_lm, load_tokenizer

    return TransformersGenerator(load_causal_lm(tiny["actor"]), load_tokenizer(tiny["tokenizer"]))


def prompts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ("def add(a, b):", "hello world", "x = [i for")]


def forward_log_probs(model, rows: list[list[int]], outs: list[list[int]], temps: list[float],
                      banned: list[int] = ()) -> list[list[float]]:
    """An independent forward per row (no padding): log_softmax(logits / temps[step]) at each sampled token;
    ``banned`` tokens masked first (what the engine suppressed)."""
    result = []
    for r, o in zip(rows, outs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r + o])).logits[0, len(r) - 1 : -1].float()
        if banned:
            logits[:, list(banned)] = -float("inf")
        result.append([float(torch.log_softmax(logits[t] / temps[min(t, len(temps) - 1)], -1)[tok])
                       for t, tok in enumerate(o)])
    return result


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def test_greedy_tokens_and_log_probs_equal_transformers(engine, hf):
    ps = prompts(hf.tokenizer)
    ours, lp = engine.generate(ps, 2, temperature=0, max_new_tokens=12, min_new_tokens=0, return_log_probs=True)
    theirs, lp_hf = hf.generate(ps, 2, temperature=0, max_new_tokens=12, min_new_tokens=0, return_log_probs=True)
    assert ours == theirs
    assert len(ours) == 6 and ours[0] == ours[1]  # rows [g*n, (g+1)*n) belong to prompt g
    assert max_diff(lp, lp_hf) <= TOL


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_equal_an_independent_transformers_forward(engine, hf, temperature):
    ps = prompts(hf.tokenizer)
    outs, lp = engine.generate(ps, 3, temperature=temperature, max_new_tokens=10, ignore_eos=True,
                               return_log_probs=True)
    assert len(outs) == 9 and all(len(o) == 10 for o in outs)
    assert len({tuple(o) for o in outs}) > 3, "samples of a prompt differ: this is sampling, not greedy"
    rows = [p for p in ps for _ in range(3)]
    # ignore_eos: the stop tokens are never sampled, but SGLang's log-probs are over the whole vocabulary
    assert max_diff(lp, forward_log_probs(hf.model, rows, outs, [temperature])) <= TOL


def test_fire_first_token_is_sampled_hot_and_the_rest_at_temperature(engine, hf):
    ps = prompts(hf.tokenizer)
    outs, lp = engine.generate(ps, 3, temperature=0.7, max_new_tokens=6, ignore_eos=True, return_log_probs=True,
                               first_token_temperature=10.0)
    assert len(outs) == 9 and all(len(o) == 6 for o in outs)
    rows = [p for p in ps for _ in range(3)]
    assert max_diff(lp, forward_log_probs(hf.model, rows, outs, [10.0, 0.7])) <= TOL
    plain = forward_log_probs(hf.model, rows, outs, [0.7])
    assert max(abs(a[0] - b[0]) for a, b in zip(lp, plain, strict=True)) > 1e-2, "the first token is not at 0.7"


def test_min_new_tokens_suppresses_the_stop_token(engine, hf):
    ps = prompts(hf.tokenizer)
    outs, lp = engine.generate(ps, 4, temperature=1.0, max_new_tokens=5, min_new_tokens=5, return_log_probs=True)
    stops = set(hf.stop_token_ids)
    assert all(len(o) == 5 and not stops & set(o) for o in outs)
    rows = [p for p in ps for _ in range(4)]
    assert max_diff(lp, forward_log_probs(hf.model, rows, outs, [1.0], banned=sorted(stops))) <= TOL


def test_a_published_version_updates_the_server_in_place(engine, hf, tiny, tmp_path):
    """The continuous loop's path: the trainer publishes, the stage's follower updates the server
    (/update_weights_from_disk, /flush_cache). The prompts were generated before the update, so their
    prefixes sit in the radix cache under the old weights."""
    from expstream.models.hf import TransformersGenerator, load_causal_lm
    from expstream.models.sglang_generator import SglangWeights
    from expstream.state import MemoryState
    from expstream.train.weights import DirectoryWeightStore, PolicyFollower

    ps = prompts(hf.tokenizer)
    before, _ = engine.generate(ps, 1, temperature=0, max_new_tokens=10, ignore_eos=True, return_log_probs=True)
    new = load_causal_lm(tiny["actor"])
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    store, state = DirectoryWeightStore(tmp_path / "store"), MemoryState()
    store.publish("actor", 1, new.state_dict(), step=1, offsets={}, run_id="t")
    state.set_policy_version(1)
    follower = PolicyFollower(store, state, "actor", SglangWeights(engine, tiny["actor"]))
    try:
        assert follower.refresh() == 1 and engine.last_reload_s is not None
        after, lp = engine.generate(ps, 1, temperature=0, max_new_tokens=10, ignore_eos=True, return_log_probs=True)
        assert after != before, "the perturbed weights change the greedy tokens"
        want, _ = TransformersGenerator(new, hf.tokenizer).generate(ps, 1, temperature=0, max_new_tokens=10,
                                                                     ignore_eos=True, return_log_probs=True)
        assert after == want
        assert max_diff(lp, forward_log_probs(new, ps, after, [1.0])) <= TOL
        # a version of another architecture is refused before anything is loaded
        store.publish("actor", 2, {"model.embed_tokens.weight": torch.zeros(3, 3)}, step=2, offsets={}, run_id="t")
        state.set_policy_version(2)
        assert follower.refresh() == 1
    finally:
        engine.reload(state_dict=load_causal_lm(tiny["actor"]).state_dict())  # the session server's weights back
    restored, _ = engine.generate(ps, 1, temperature=0, max_new_tokens=10, ignore_eos=True, return_log_probs=True)
    assert restored == before


def test_an_existing_server_at_sglang_url_is_used_and_left_running(engine, hf):
    from expstream.models.sglang_generator import SglangGenerator

    other = SglangGenerator(engine.model_dir, hf.tokenizer, url=engine.url + "/")
    assert other.server is None and other.url == engine.url
    ps = prompts(hf.tokenizer)
    want = engine.generate(ps, 1, temperature=0, max_new_tokens=5, ignore_eos=True)
    assert other.generate(ps, 1, temperature=0, max_new_tokens=5, ignore_eos=True) == want
    other.close()
    assert engine.generate(ps, 1, temperature=0, max_new_tokens=5, ignore_eos=True) == want, "still serving"


def test_a_stop_abandons_the_generation_and_aborts_its_requests(engine, hf):
    """SIGTERM in a stage sets should_stop: the running /generate is aborted (/abort_request per row) and
    ShutdownRequested raised (the micro-batch is left uncommitted); the server serves the next call."""
    from expstream.errors import ShutdownRequested

    ps = prompts(hf.tokenizer)
    t0 = time.monotonic()
    with pytest.raises(ShutdownRequested, match="abandoned"):
        engine.generate(ps, 4, temperature=1.0, max_new_tokens=2000, ignore_eos=True,
                        should_stop=lambda: time.monotonic() > t0 + 0.3)
    assert engine.generate(ps, 1, temperature=0, max_new_tokens=4, ignore_eos=True) == \
        hf.generate(ps, 1, temperature=0, max_new_tokens=4, ignore_eos=True)


def cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "expstream", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_a_knob_sglang_cannot_honour_is_refused_at_start_up(tmp_path):
    from expstream.config.topology import load_topology
    from expstream.errors import ConfigError
    from expstream.models.sglang_generator import check_generate_config

    res = cli("run", "--prompts", "examples/prompts.jsonl", "--output", str(tmp_path / "out"),
              "--set", "generate.backend=sglang", "--set", "generate.top_p=0.9", timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "generate.top_p" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "out" / "run" / "pids.json").exists(), "refused before any stage started"
    for knob, field in (("generate.top_k=20", "generate.top_k"), ("generate.top_k=-3", "generate.top_k"),
                        ("generate.sglang_python=/nonexistent/python", "generate.backend")):
        with pytest.raises(ConfigError, match=field):
            check_generate_config(load_topology(overrides=["generate.backend=sglang", knob]).generate)
    check_generate_config(load_topology(overrides=["generate.backend=sglang", "generate.top_k=-1"]).generate)


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat fields after the command: [state, ppid, pgrp, session, ...] (None: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _processes() -> dict[int, list[str]]:
    return {int(e): st for e in os.listdir("/proc") if e.isdigit() and (st := _stat(int(e))) is not None}


@pytest.mark.e2e
def test_expstream_run_with_sglang_puts_every_group_out_once_and_leaves_no_server(tmp_path, tiny):
    """The example prompts through ``expstream run --set generate.backend=sglang`` (one generate replica,
    which starts and supervises its own SGLang server). At the end the supervisor SIGTERMs the stage: its
    teardown stops the server's process group, and no process the stage started survives (the server
    runs in a session of its own; its scheduler and detokenizer too)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cache = Path(tiny["actor"]).parents[1]
    stderr_path = tmp_path / "stderr.log"
    with stderr_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "expstream", "run", "--prompts", "examples/prompts.jsonl",
                                 "--output", str(out), "--no-progress", "--set", "generate.backend=sglang",
                                 "--set", "stages.generate.replicas=1", "--set", f"models.cache_dir={cache}"],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    generate_pids: dict[int, str] = {}
    started: set[int] = set()  # the generate stage's children (the server) and theirs

    def watch() -> None:
        try:
            pids = json.loads((out / "run" / "pids.json").read_text())
        except (OSError, ValueError):
            return
        generate_pids.update({pid: label for label, pid in pids.items() if label.startswith("generate[")})
        procs = _processes()
        for _ in range(2):  # children, then grandchildren
            started.update(p for p, st in procs.items() if int(st[1]) in generate_pids or int(st[1]) in started)

    try:
        deadline = time.monotonic() + 420
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not finish within 420 s"
            watch()
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = stderr_path.read_text(errors="replace")
    assert proc.returncode == 0, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["groups_complete"] == 6 and summary["samples"] == 24, summary
    from expstream.rl.experience import read_experiences

    ids = [sid for e in read_experiences(out / "experiences.msgpack", dedupe=False) for sid in e.sample_ids]
    assert len(ids) == len(set(ids)) == 24, "every sample out once"
    assert started, "the generate stage started its SGLang server"
    log = (out / "run" / "logs" / "generate-0.log").read_text(errors="replace")
    assert "generate: SGLang server http://127.0.0.1:" in log and "generate: SGLang engine shut down" in log
    bad = [line for line in stderr.splitlines() if "generate[" in line and ("on stop" in line or "did not stop" in line)]
    assert not bad, bad
    alive = _processes()
    assert not [p for p in [*generate_pids, *started] if p in alive], (generate_pids, started)
    assert not [p for p, st in alive.items() if int(st[3]) in started | set(generate_pids)], \
        "a process of the server's session survives"
