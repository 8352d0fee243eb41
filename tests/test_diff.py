"""`expstream diff`: run directories recorded by hand (RecordingWriter), compared after known
perturbations; every expected error is computed here from the values written."""

from __future__ import annotations

import json

import numpy as np
import pytest

from expstream.cli import main
from expstream.recording import RecordFrame, RecordingWriter
from schemas import Ragged, SampleBatch, encode

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
    assert "corrupt frame" in capsys.readouterr().err
