"""`expstream show`: a run directory recorded in process (LocalChain + RecordingWriter, no broker),
one sample printed, its per-token table checked against the batch's own arrays."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import yaml

from expstream.cli import main
from expstream.config.topology import load_topology
from expstream.errors import ConfigError
from expstream.models.hf import load_tokenizer
from expstream.models.tiny import build_tiny_models
from expstream.tools.recording import RecordFrame, RecordingWriter
from expstream.tools.show import show
from schemas import PromptBatch, encode
from stages import end_of_input
from stages.local import LocalChain

T0 = 1_764_000_000_000  # ms: the first record's timestamp (2025-11-24T16:00:00Z)


def record_run(root, topics: dict[str, list], topo=None, partitions: int = 2) -> dict:
    """Write ``topics`` (topic -> messages, in order) as a recording under ``root``: message k of a
    topic goes to partition k % partitions; returns sample/batch -> (topic, partition, offset)."""
    where: dict = {}
    t = T0
    with RecordingWriter(root) as w:
        for topic, msgs in topics.items():
            next_off = [0] * partitions
            for k, m in enumerate(msgs):
                p = k % partitions
                w.append(RecordFrame(topic, p, next_off[p], t, m.batch_id.encode(), encode(m),
                                     (("stage", b"test"), ("batch_id", m.batch_id.encode()))))
                where[(topic, m.batch_id)] = (p, next_off[p], t)
                next_off[p] += 1
                t += 10
    if topo is not None:
        (root / "topology.yaml").write_text(yaml.safe_dump(topo.raw))
    return where


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory, model_cache):
    """Two prompts through every stage in process; every stage's output topic recorded."""
    cache = model_cache
    topo = load_topology(overrides=[f"models.cache_dir={cache}", "generate.n_samples_per_prompt=2",
                                    "generate.max_new_tokens=6", "algo.micro_rollout_batch_size=2",
                                    "algo.advantage_estimator=gae"])  # gae: the critic runs, values exist
    chain = LocalChain(topo, through_codec=True).setup()
    prompts = [PromptBatch(batch_id="p000000", prompt_id=["0", "1"], prompt=["Hello there", "Add two numbers"],
                           label=["", ""], reference=["", ""])]
    topics: dict[str, list] = {"prompts": prompts}
    data: list = prompts
    for st in topo.enabled_stages():
        data = chain.run_stage(st.name, data) + list(end_of_input(chain.contexts[st.name]))
        topics[st.output] = data
    root = tmp_path_factory.mktemp("run")
    where = record_run(root, topics, topo)
    return root, topics, where, cache


def _sample_of(batches, sid):
    for b in batches:
        if sid in b.sample_ids():
            return b, b.sample_ids().index(sid)
    raise AssertionError(sid)


def test_json_view_matches_the_recorded_batch(chain_run):
    root, topics, where, _ = chain_run
    batch, row = _sample_of(topics["experiences"], "1#1")
    out = io.StringIO()
    show(root, "experiences", sample="1#1", as_json=True, tokenizer=False, out=out)
    [d] = json.loads(out.getvalue())["samples"]
    p, o, t = where[("experiences", batch.batch_id)]
    assert (d["topic"], d["partition"], d["offset"], d["timestamp"]) == ("experiences", p, o, t)
    assert d["where"] == f"experiences[{p}]@{o}" and d["headers"] == {"stage": "test", "batch_id": batch.batch_id}
    assert d["key"] == batch.batch_id and d["sample_index"] == 1 and d["group_id"] == "1"
    assert d["prompt"] == "Add two numbers" and d["response"] == batch.response[row]
    assert d["rollout_version"] == batch.rollout_version[row] and d["policy_version"] == batch.policy_version
    tok = d["tokens"]
    assert tok["level"] == "action"
    assert tok["token_id"] == batch.action_ids.row(row).tolist()
    columns = {"action_log_probs": "logprob", "values": "value", "advantages": "advantage", "returns": "return",
               "rollout_log_probs": "rollout_lp"}  # what the advantage stage's records carry per token
    assert set(tok) == {"level", "token_id", "mask", *columns.values()}
    for field, col in columns.items():
        np.testing.assert_array_equal(np.array(tok[col], np.float32), getattr(batch, field).row(row))
    assert tok["mask"] == batch.action_mask.row(row).tolist()
    assert d["rewards"]["processed_reward"] == pytest.approx(float(batch.processed_rewards[row]))
    assert d["rewards"]["info"]["response_length"] == pytest.approx(float(batch.info["response_length"][row]))
    # the scored topic still carries kl and token rewards: the table has those columns there
    scored, srow = _sample_of(topics["scored"], "1#1")
    out = io.StringIO()
    show(root, "scored", sample="1#1", as_json=True, tokenizer=False, out=out)
    [s] = json.loads(out.getvalue())["samples"]
    np.testing.assert_array_equal(np.array(s["tokens"]["kl"], np.float32), scored.kl.row(srow))
    np.testing.assert_array_equal(np.array(s["tokens"]["tok_reward"], np.float32), scored.token_rewards.row(srow))
    assert s["rewards"]["reward"] == pytest.approx(float(scored.rewards[srow]))
    # the reference log-probs live on the reference topic (postprocess drops them without use_kl_loss)
    ref, rrow = _sample_of(topics["reference"], "1#1")
    out = io.StringIO()
    show(root, "reference", sample="1#1", as_json=True, tokenizer=False, out=out)
    [r] = json.loads(out.getvalue())["samples"]
    np.testing.assert_array_equal(np.array(r["tokens"]["ref_lp"], np.float32), ref.base_action_log_probs.row(rrow))


def test_text_view_aligns_the_table_and_names_the_tokens(chain_run, capsys):
    root, topics, _, cache = chain_run
    tokenizer = load_tokenizer(build_tiny_models(cache)["tokenizer"])
    batch, row = _sample_of(topics["experiences"], "0#0")
    assert main(["show", str(root), "--sample", "0#0"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["pos", "token", "text"])
    assert lines[head].split()[3:] == ["mask", "rollout_lp", "logprob", "value", "advantage", "return"]
    ids = batch.action_ids.row(row)
    adv = batch.advantages.row(row)
    for i in range(len(ids)):
        cells = lines[head + 1 + i].split()
        assert cells[0] == str(i) and cells[1] == str(ids[i])
        assert float(cells[-2]) == pytest.approx(float(adv[i]), rel=1e-5, abs=1e-6)
        assert repr(tokenizer.decode([int(ids[i])])) in lines[head + 1 + i]  # the token's text, quoted
    assert all(len(lines[head + 1 + i]) == len(lines[head]) for i in range(len(ids)))  # aligned
    assert "prompt:   'Hello there'" in text and "processed reward (postprocess)" in text


def test_before_shard_preprocess_the_rows_are_the_raw_response(chain_run):
    root, topics, _, _ = chain_run
    batch, row = _sample_of(topics["rollouts"], "0#1")
    out = io.StringIO()
    show(root, "rollouts", sample="0#1", as_json=True, tokenizer=False, out=out)
    [d] = json.loads(out.getvalue())["samples"]
    assert d["tokens"]["level"] == "response" and d["tokens"]["token_id"] == batch.response_ids.row(row).tolist()
    assert set(d["tokens"]) == {"level", "token_id", "rollout_lp"}


def test_batch_and_offset_select_a_whole_record(chain_run):
    root, topics, where, _ = chain_run
    rec = topics["batches"][1]
    p, o, _ = where[("batches", rec.batch_id)]
    for kwargs in ({"batch": rec.batch_id}, {"offset": f"{p}:{o}"}):
        out = io.StringIO()
        show(root, "batches", as_json=True, tokenizer=False, out=out, **kwargs)
        assert [d["sample_id"] for d in json.loads(out.getvalue())["samples"]] == rec.sample_ids()


def test_an_absent_sample_names_the_topics_that_hold_it(chain_run, tmp_path):
    root, topics, _, _ = chain_run
    # a run whose `rewarded` lacks sample 1#0 but whose `scored` has it
    only = {"rewarded": [b.select([i for i, s in enumerate(b.sample_ids()) if s != "1#0"])
                         for b in topics["rewarded"]],
            "scored": topics["scored"]}
    record_run(tmp_path, only)
    with pytest.raises(ConfigError, match="holds no sample 1#0") as err:
        show(tmp_path, "rewarded", sample="1#0", tokenizer=False, out=io.StringIO())
    assert err.value.field == "--sample" and "scored" in err.value.fix and "rewarded" not in err.value.fix
    with pytest.raises(ConfigError, match="not recorded") as err:
        show(tmp_path, "critic", sample="1#0", tokenizer=False, out=io.StringIO())
    assert err.value.field == "--topic" and "rewarded, scored" in err.value.fix


def test_duplicates_show_the_first_and_name_the_others(chain_run, tmp_path):
    _, topics, _, _ = chain_run
    exp = topics["experiences"]
    record_run(tmp_path, {"experiences": [*exp, *exp]}, partitions=1)
    out = io.StringIO()
    show(tmp_path, "experiences", sample="0#0", as_json=True, tokenizer=False, out=out)
    d = json.loads(out.getvalue())
    first = next(k for k, b in enumerate(exp) if "0#0" in b.sample_ids())
    assert d["samples"][0]["offset"] == first and d["also_at"] == [f"experiences[0]@{first + len(exp)}"]


def test_bad_flags_exit_2_naming_the_flag(chain_run, tmp_path, capsys):
    root, _, _, _ = chain_run
    assert main(["show", str(root)]) == 2
    assert "--sample" in capsys.readouterr().err
    assert main(["show", str(root), "--sample", "7"]) == 2
    assert "group_id#sample_index" in capsys.readouterr().err
    assert main(["show", str(root), "--offset", "x", "--topic", "batches"]) == 2
    assert "--offset" in capsys.readouterr().err
    assert main(["show", str(tmp_path / "nope"), "--sample", "0#0"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_show_never_builds_the_tokenizer(chain_run, tmp_path, capsys):
    _, topics, _, _ = chain_run
    topo = load_topology(overrides=[f"models.cache_dir={tmp_path / 'empty-cache'}"])
    record_run(tmp_path, {"experiences": topics["experiences"]}, topo)
    assert main(["show", str(tmp_path), "--sample", "0#0"]) == 0
    captured = capsys.readouterr()
    assert "not built" in captured.err and "pos  token  mask" in captured.out
    assert not (tmp_path / "empty-cache").exists()


# ------------------------------------------------------------------------------------------------
# any recorded record: prompts, dead letters, other bytes (issue 21, item 4); damage (item 7)
# ------------------------------------------------------------------------------------------------


def test_prompt_records_are_shown(chain_run, capsys):
    root, topics, where, _ = chain_run
    rec = topics["prompts"][0]
    p, o, _ = where[("prompts", rec.batch_id)]
    for flags in (["--batch", rec.batch_id], ["--offset", f"{p}:{o}"]):  # was: "holds no batch p000000"
        assert main(["show", str(root), "--topic", "prompts", *flags]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"PromptBatch record prompts[{p}]@{o}")
        assert "prompt '0': 'Hello there'" in text and "prompt '1': 'Add two numbers'" in text
    out = io.StringIO()
    show(root, "prompts", batch=rec.batch_id, as_json=True, out=out)
    [d] = json.loads(out.getvalue())["records"]
    assert d["kind"] == "prompts" and [x["prompt"] for x in d["prompts"]] == rec.prompt
    assert d["value"]["schema"] == "expstream.PromptBatch" and d["value"]["bytes"] == len(encode(rec))
    with pytest.raises(ConfigError, match="holds no sample 0#0") as err:  # a sample id on prompts: say why
        show(root, "prompts", sample="0#0", out=io.StringIO(), err=io.StringIO())
    assert "PromptBatch records" in err.value.fix and "--batch" in err.value.fix


def letter(value: bytes, **headers: str) -> tuple[bytes, tuple[tuple[str, bytes], ...]]:
    return value, tuple((k, v.encode()) for k, v in headers.items())


def write_letters(root, topic: str, letters: list) -> None:
    with RecordingWriter(root) as w:
        for k, (value, headers) in enumerate(letters):
            w.append(RecordFrame(topic, 0, k, T0 + k, b"key", value, headers))


def test_dead_letters_show_headers_and_the_original(chain_run, tmp_path, capsys):
    _, topics, _, _ = chain_run
    prompts = topics["prompts"][0]
    sample_batch = topics["rewarded"][0]
    write_letters(tmp_path, "prompts.dlq", [
        letter(encode(prompts), stage="generate", error_class="PoisonRecordError",
               error_message="prompt too long\nsecond line", original_topic="prompts", original_partition="0",
               original_offset="0", batch_id=prompts.batch_id),
        letter(b"\xc1\x00not msgpack at all", stage="generate", error_class="DecodeError",
               error_message="bad \x1b]0;owned\x07 bytes \x1b[2J", original_topic="prompts",
               original_partition="0", original_offset="1"),
    ])
    write_letters(tmp_path, "rewarded.dlq", [
        letter(encode(sample_batch), stage="postprocess", error_class="ValueError", error_message="nan",
               original_topic="rewarded", batch_id=sample_batch.batch_id,
               sample_ids=",".join(sample_batch.sample_ids()))])
    # a letter whose value decodes: its prompts shown (was: "holds no batch")
    assert main(["show", str(tmp_path), "--topic", "prompts.dlq", "--batch", prompts.batch_id]) == 0
    text = capsys.readouterr().out
    assert text.startswith("dead letter prompts.dlq[0]@0")
    assert "dead-lettered by stage generate: PoisonRecordError: prompt too long" in text
    assert "from prompts[0]@0" in text and "prompt '0': 'Hello there'" in text
    # undecodable: the error, the hex of its start, and no raw escape sequence from a header
    assert main(["show", str(tmp_path), "--topic", "prompts.dlq", "--offset", "0:1"]) == 0
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\x07" not in text
    assert "bad \\x1b]0;owned\\x07 bytes \\x1b[2J" in text
    assert "not an expstream message" in text and b"\xc1\x00not".hex(" ") in text
    # a SampleBatch letter: found by a sample id it holds, its rows shown as samples
    sid = sample_batch.sample_ids()[1]
    out = io.StringIO()
    show(tmp_path, "rewarded.dlq", sample=sid, as_json=True, tokenizer=False, out=out)
    [d] = json.loads(out.getvalue())["records"]
    assert d["kind"] == "letter" and d["headers"]["error_message"] == "nan"
    assert [s["sample_id"] for s in d["samples"]] == sample_batch.sample_ids()


def test_a_record_that_is_no_expstream_message_is_shown(tmp_path, capsys):
    import msgpack

    write_letters(tmp_path, "policy", [letter(msgpack.packb({"version": 3, "role": "actor"}), producer="trainer")])
    assert main(["show", str(tmp_path), "--topic", "policy", "--offset", "0:0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("record policy[0]@0") and "msgpack: {'version': 3, 'role': 'actor'}" in text


def test_a_damaged_recording_is_shown_up_to_the_damage_with_a_warning(chain_run, tmp_path, capsys):
    _, topics, _, _ = chain_run
    record_run(tmp_path, {"experiences": topics["experiences"]}, partitions=1)
    path = tmp_path / "topics" / "experiences" / "partition-0.rec"
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(100))  # was: a traceback
    assert main(["show", str(tmp_path), "--sample", "0#0", "--no-tokenizer"]) == 0
    captured = capsys.readouterr()
    assert "sample 0#0" in captured.out
    assert f"warning: {path}: corrupt at byte {len(whole)}" in captured.err and "Traceback" not in captured.err
