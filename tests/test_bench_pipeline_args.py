"""bench/pipeline.py's argument checks: a wrong count or size is refused when the arguments are parsed, before
any model loads, with the option and the fix named (the runs themselves are the bench's, not a test's)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import pipeline  # noqa: E402


@pytest.mark.parametrize("option", ["--hop-records", "--repeats", "--baseline-repeats", "--prompts", "--n",
                                    "--max-new-tokens"])
@pytest.mark.parametrize(("value", "says"), [("0", "0 is below 1"), ("-3", "-3 is below 1"),
                                             ("x", "'x' is not a whole number")])
def test_a_count_below_one_is_an_argparse_error_naming_the_option(
        option: str, value: str, says: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # --hop-records 0 was an IndexError in the per-hop table, after every streaming run had finished
    monkeypatch.setattr(sys, "argv", ["pipeline.py", option, value])
    with pytest.raises(SystemExit) as exited:
        pipeline.parse_args()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {says}" in err and ">= 1" in err


def test_counts_of_one_or_more_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["pipeline.py", "--hop-records", "1", "--repeats", "3", "--prompts", "96"])
    args = pipeline.parse_args()
    assert (args.hop_records, args.repeats, args.prompts) == (1, 3, 96)


def test_baseline_batches_must_be_positive_multiples_of_n() -> None:
    assert pipeline.batch_sizes("16, 64", 4) == [16, 64]
    with pytest.raises(ValueError, match="whole numbers separated by commas"):
        pipeline.batch_sizes("16,x", 4)
    with pytest.raises(ValueError, match=r"\[6, 0\] not positive multiples of --n 4"):
        pipeline.batch_sizes("6,0,8", 4)
