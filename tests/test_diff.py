"""`expstream diff`: run directories recorded by hand (RecordingWriter), compared after known
perturbations; every expected error is computed here from the values written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expstream.cli import main
from expstream.tools.recording import RecordFrame, RecordingWriter
from schemas import PromptBatch, Ragged, SampleBatch, encode

#: group -> action length of each of its 3 samples (ragged on purpose)
LENGTHS = {"1": [5, 3, 6], "2": [4, 4, 2], "10": [1, 7, 3]}


def _rows(group: str, indices: list[int], lens: list[int], field_no: int) -> Ragged:
    """One float row per sample, drawn from a generator of (group, sample, field): a sample's values
    do not depend on which other samples share its record, and a shorter row is a prefix."""
    return Ragged.from_rows([np.random.default_rng([int(group), i, field_no]).normal(size=n).astype(np.float32)
                             for i, n in zip(indices, lens, strict=True)], "float32")


def _scalars(group: str, indices: list[int], field_no: int) -> np.ndarray:
    return np.array([np.random.default_rng([int(group), i, field_no]).normal() for i in indices], np.float32)


def make_batch(group: str, indices: list[int] | None = None, *, lengths: list[int] | None = None,
               batch_id: str | None = None) -> SampleBatch:
    """An experience record of ``group``'s samples; the same arguments give the same values."""
    indices = [0, 1, 2] if indices is None else indices
    lens = [LENGTHS[group][i] for i in indices] if lengths is None else lengths
    b = len(indices)
    ids = Ragged.from_rows([np.arange(10, 10 + n, dtype=np.int32) for n in lens], "int32")
    return SampleBatch(
        batch_id=batch_id or f"g/{group}", policy_version=2, n_samples_per_prompt=3, eos_token_id=3,
        pad_token_id=0, prompt_id=[group] * b, group_id=[group] * b, sample_index=indices, prompt=[f"q{group}"] * b,
        label=[""] * b, reference=[""] * b, response=[f"r{group}.{i}" for i in indices],
        prompt_ids=Ragged.from_rows([np.array([5, 6], np.int32)] * b, "int32"), response_ids=ids, layout="padded",
        action_ids=ids, action_mask=Ragged.from_rows([np.ones(n, bool) for n in lens], "bool"),
        action_log_probs=_rows(group, indices, lens, 0), advantages=_rows(group, indices, lens, 1),
        returns=_rows(group, indices, lens, 2), rewards=_scalars(group, indices, 3),
        info={"kl": _scalars(group, indices, 4)})


def write_run(root, batches: list, topic: str = "experiences", extra: list[bytes] = ()) -> None:
    with RecordingWriter(root) as w:
        for k, value in enumerate([encode(b) for b in batches] + list(extra)):
            w.append(RecordFrame(topic, 0, k, 1_764_000_000_000 + k, None, value))


def base() -> list[SampleBatch]:
    return [make_batch(g) for g in LENGTHS]


def run_diff(capsys, a, b, *flags: str) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def test_equal_runs_exit_0(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    write_run(tmp_path / "b", base())
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "EQUAL within tolerance" in out and "compared 9 samples" in out


def test_one_float_changed_is_reported_at_its_position_with_its_error(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    changed = base()
    adv = changed[0].advantages  # group "1": rows of 5, 3, 6; change sample 1#2 at position 4
    values = adv.values.copy()
    before = values[5 + 3 + 4]
    values[5 + 3 + 4] = np.float32(before + np.float32(1e-3))
    changed[0] = changed[0].replace(advantages=Ragged(values, adv.lengths.copy(), "float32"))
    write_run(tmp_path / "b", changed)
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1 and not res["equal"]
    [d] = res["differences"]
    want_abs = abs(float(values[12]) - float(before))  # float32 on both sides, widened here
    assert (d["sample"], d["field"], d["kind"], d["first_position"], d["positions"]) == ("1#2", "advantages",
                                                                                        "values", 4, 1)
    assert d["max_abs"] == pytest.approx(want_abs, rel=1e-12) and want_abs == pytest.approx(1e-3, rel=1e-3)
    assert d["max_rel"] == pytest.approx(want_abs / abs(float(values[12])), rel=1e-12)
    assert (d["a"], d["b"]) == (pytest.approx(float(before)), pytest.approx(float(values[12])))
    assert res["fields"] == {"advantages": {"samples_differing": 1, "max_abs": d["max_abs"], "max_rel": d["max_rel"],
                                            "first_sample": "1#2"}}
    # the text view names the same thing, and the summary table
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    text = capsys.readouterr().out
    assert "1#2 advantages: 1 position(s) differ, first at 4" in text and "DIFFERENT" in text
    assert any(line.split()[:2] == ["advantages", "1"] for line in text.splitlines())
    # tolerances: an atol above the change, or an rtol above its relative size, make the runs equal
    assert run_diff(capsys, tmp_path / "a", tmp_path / "b", "--atol", "2e-3")[0] == 0
    rel = want_abs / abs(float(values[12]))
    assert run_diff(capsys, tmp_path / "a", tmp_path / "b", "--atol", "0", "--rtol", str(rel * 1.01))[0] == 0
    assert run_diff(capsys, tmp_path / "a", tmp_path / "b", "--atol", "0", "--rtol", str(rel * 0.99))[0] == 1


def test_missing_and_extra_samples(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    b = base()
    b[1] = make_batch("2", [0, 2])  # 2#1 missing from B
    b.append(make_batch("10", [0], batch_id="g/10", lengths=[2]).replace(group_id=["11"], prompt_id=["11"]))
    write_run(tmp_path / "b", b)
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1 and res["only_in_a"] == ["2#1"] and res["only_in_b"] == ["11#0"]
    assert res["differences"] == [] and res["compared"] == 8


def test_ragged_length_strings_and_ints(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    b = base()
    b[2] = make_batch("10", lengths=[1, 5, 3])  # 10#1: 7 actions in A, 5 in B
    b[0] = b[0].replace(response=["r1.0", "changed", "r1.2"], policy_version=4)
    write_run(tmp_path / "b", b)
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    got = {(d["sample"], d["field"]): d for d in res["differences"]}
    assert code == 1
    assert got[("1#1", "response")]["kind"] == "string" and got[("1#1", "response")]["b"] == "changed"
    assert {s for s, f in got if f == "policy_version"} == {"1#0", "1#1", "1#2"}
    assert got[("1#0", "policy_version")]["a"] == 2 and got[("1#0", "policy_version")]["b"] == 4
    # B's rows of 10#1 are A's cut to 5 values: equal prefix, so the first difference is the length
    for field in ("returns", "advantages", "action_ids", "action_mask"):
        ln = got[("10#1", field)]
        assert (ln["kind"], ln["a"], ln["b"], ln["first_position"], ln["positions"]) == ("length", 7, 5, 5, 0)
    assert ln["max_abs"] == 0
    assert {s for s, _ in got} == {"1#0", "1#1", "1#2", "10#1"}  # 10#0 and 10#2 are untouched
    # --ignore drops a field from the comparison
    _, res2 = run_diff(capsys, tmp_path / "a", tmp_path / "b", "--ignore", "policy_version")
    assert not any(d["field"] == "policy_version" for d in res2["differences"])


def test_duplicates_first_occurrence_wins_and_are_counted(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    dup = make_batch("1").replace(response=["x", "y", "z"])  # a later, different copy: ignored
    write_run(tmp_path / "b", [*base(), dup])
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and res["b"]["duplicates"] == 3 and res["a"]["duplicates"] == 0 and res["b"]["records"] == 4


def test_experiences_msgpack_when_the_topic_is_not_recorded(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "experiences.msgpack").write_bytes(b"".join(encode(b) for b in base()))
    write_run(tmp_path / "b", base())
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 0 and res["a"]["source"].endswith("experiences.msgpack") and res["a"]["samples"] == 9


def test_undecodable_records_make_a_difference(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    write_run(tmp_path / "b", base(), extra=[b"\x81\xa1x\x01"])
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1 and res["differences"] == [] and len(res["b"]["undecodable"]) == 1
    assert res["b"]["undecodable"][0].startswith("experiences[0]@3:")


def test_bad_arguments_exit_2(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--topic", "scored"]) == 2
    assert "--topic" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a"), "--atol", "-1"]) == 2
    assert "--atol" in capsys.readouterr().err
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "zz")]) == 2
    assert "RUN_B" in capsys.readouterr().err
    # a corrupt recording (a frame damaged before the end) is refused, not read around
    path = tmp_path / "a" / "topics" / "experiences" / "partition-0.rec"
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    path.write_bytes(bytes(data))
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "a")]) == 2
    assert "corrupt at byte 8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# topics that are not samples: prompts, dead letters, other records (issue 21, item 4)
# ------------------------------------------------------------------------------------------------


def prompt_batch(batch_id: str, ids: list[str], texts: list[str] | None = None) -> PromptBatch:
    texts = texts or [f"question {i}" for i in ids]
    return PromptBatch(batch_id=batch_id, prompt_id=ids, prompt=texts, label=[""] * len(ids),
                       reference=[f"ref {i}" for i in ids])


def write_frames(root, topic: str, frames: list[tuple[bytes, dict[str, str]]]) -> None:
    with RecordingWriter(root) as w:
        for k, (value, headers) in enumerate(frames):
            w.append(RecordFrame(topic, 0, k, 1_764_000_000_000 + k, None, value,
                                 tuple((n, v.encode()) for n, v in headers.items())))


def test_prompt_records_are_compared_prompt_by_prompt(tmp_path, capsys):
    two = [prompt_batch("p000000", ["0", "1"]), prompt_batch("p000001", ["2", "3"])]
    write_run(tmp_path / "a", two[:1], topic="prompts")  # 1 record, 2 prompts
    write_run(tmp_path / "b", two, topic="prompts")  # 2 records, 4 prompts
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b", "--topic", "prompts")
    assert code == 1, res  # was: EQUAL, exit 0, 0 compared
    assert res["compared"] == 2 and res["only_in_b"] == ["2", "3"] and res["unit"] == "prompts"
    write_run(tmp_path / "c", [prompt_batch("p000000", ["0", "1"], ["question 0", "changed"]), two[1]],
              topic="prompts")
    code, res = run_diff(capsys, tmp_path / "b", tmp_path / "c", "--topic", "prompts")
    assert code == 1 and res["compared"] == 4
    assert [(d["sample"], d["field"], d["kind"], d["b"]) for d in res["differences"]] == [
        ("1", "prompt", "string", "changed")]
    assert main(["diff", str(tmp_path / "b"), str(tmp_path / "b"), "--topic", "prompts"]) == 0
    assert "compared 4 prompts of topic prompts" in capsys.readouterr().out


def test_dead_letters_are_compared_by_headers_and_original_value(tmp_path, capsys):
    def letters(junk: bytes, message: str, replica: str, reward: float) -> list[tuple[bytes, dict[str, str]]]:
        b = make_batch("1", [0])
        b = b.replace(rewards=np.array([reward], np.float32))
        common = {"stage": "reward", "error_class": "PoisonRecordError", "original_topic": "scored"}
        return [
            (junk, {**common, "error_class": "DecodeError", "error_message": "not msgpack",
                    "original_partition": "0", "original_offset": "4", "replica": replica}),
            (encode(b), {**common, "error_message": message, "batch_id": b.batch_id, "sample_ids": "1#0",
                         "original_partition": "0", "original_offset": "7", "replica": replica}),
            (encode(prompt_batch("p000009", ["9"])), {**common, "batch_id": "p000009", "error_message": "m"}),
        ]

    write_frames(tmp_path / "a", "scored.dlq", letters(b"\xc1junk-a", "too long", "r-1", 0.5))
    # the same letters from other replicas: equal (replica, positions follow scheduling)
    write_frames(tmp_path / "b", "scored.dlq", letters(b"\xc1junk-a", "too long", "r-2", 0.5))
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b", "--topic", "scored.dlq")
    assert code == 0 and res["compared"] == 3 and res["unit"] == "dead letters", res
    # was: EQUAL after comparing nothing, whatever the letters held
    write_frames(tmp_path / "c", "scored.dlq", letters(b"\xc1junk-B", "too short", "r-1", 0.75))
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "c", "--topic", "scored.dlq")
    got = {(d["sample"], d["field"]): d for d in res["differences"]}
    assert code == 1 and set(got) == {("@scored[0]@4", "value"), ("g/1", "headers.error_message"),
                                      ("g/1", "value.1#0.rewards")}, got
    v = got[("@scored[0]@4", "value")]
    assert (v["kind"], v["a"], v["b"], v["first_position"]) == ("bytes", 7, 7, 6)  # \xc1 j u n k - | a vs B
    assert got[("g/1", "headers.error_message")]["b"] == "too short"
    assert got[("g/1", "value.1#0.rewards")]["max_abs"] == pytest.approx(0.25)
    _, res = run_diff(capsys, tmp_path / "a", tmp_path / "c", "--topic", "scored.dlq", "--ignore", "headers",
                      "--atol", "0.3")
    assert [d["field"] for d in res["differences"]] == ["value"]


def test_a_topic_of_no_comparable_records_is_refused(tmp_path, capsys):
    import msgpack

    manifest = msgpack.packb({"version": 1, "sha256": "ab", "role": "actor"})
    for side in ("a", "b"):
        write_frames(tmp_path / side, "policy", [(manifest, {"producer": "trainer"})])
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--topic", "policy"]) == 2  # was: EQUAL, exit 0
    err = capsys.readouterr().err
    assert "--topic" in err and "no record diff can compare" in err and "policy[0]@0" in err


def test_a_damaged_recording_is_an_error_and_a_torn_one_a_warning(tmp_path, capsys):
    write_run(tmp_path / "a", base())
    write_run(tmp_path / "b", base())
    path = tmp_path / "a" / "topics" / "experiences" / "partition-0.rec"
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(100))  # zero padding: was a traceback and exit 1 ("differs")
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert f"partition-0.rec: corrupt at byte {len(whole)}" in err and "zero bytes" in err
    assert "Traceback" not in err
    path.write_bytes(whole[:-10])  # a killed writer: the last record is read as missing, with a warning
    code, res = run_diff(capsys, tmp_path / "a", tmp_path / "b")
    assert code == 1 and res["only_in_b"] == ["10#0", "10#1", "10#2"] and len(res["a"]["torn"]) == 1
    main(["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert "warning:" in err and "partition-0.rec: torn last frame at byte" in err
