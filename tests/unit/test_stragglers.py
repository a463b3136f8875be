"""Straggler detection, pure: Or et al. Algorithm 1 (EWMA of the throughput fraction of the median) with a window of
consecutive rounds below the threshold (EDL §5.2)."""

from __future__ import annotations

import json
import math

import pytest

from lightning_elan.sizing.stragglers import StragglerDetector


def rounds_until_flagged(detector: StragglerDetector, round_: dict[str, float], limit: int = 1000) -> int | None:
    """Observe the same round until something is flagged; the round it happened in."""
    for n in range(1, limit + 1):
        if detector.observe(round_):
            return n
    return None


def test_half_speed_worker_is_flagged_after_the_rounds_the_formula_gives():
    # EWMA_n = 1 - (1 - 0.5)(1 - 0.9^n): n = 4 -> 1 - 0.5 * 0.3439 = 0.82805 (above 0.8),
    # n = 5 -> 1 - 0.5 * 0.40951 = 0.795245 (below): first below at 5, then 5 rounds in a row -> round 9
    window = 5
    expected = 5 + window - 1
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=window)
    round_ = {"w0": 1.0, "w1": 1.0, "slow": 2.0}  # twice the compute time: fraction 0.5 of the median
    for _ in range(4):
        detector.observe(round_)
    assert detector.scores()["slow"] == pytest.approx(0.82805)
    assert detector.observe(round_) == []
    assert detector.scores()["slow"] == pytest.approx(0.795245)
    for _ in range(expected - 6):
        assert detector.observe(round_) == []
    assert detector.observe(round_) == ["slow"]  # round 9
    assert detector.stragglers() == ["slow"]
    assert detector.scores()["w0"] == pytest.approx(1.0)
    assert StragglerDetector.rounds_to_flag(0.5, 0.1, 0.8, window) == expected


def test_rounds_to_flag_other_cases_by_hand():
    # f = 0.7: 0.9^n < (0.8 - 0.7) / 0.3 = 1/3 -> n > ln 3 / ln(1/0.9) = 10.43 -> 11, window 1
    assert StragglerDetector.rounds_to_flag(0.7, 0.1, 0.8, 1) == 11
    assert StragglerDetector.rounds_to_flag(0.0, 1.0, 0.8, 3) == 3  # alpha = 1: the fraction itself
    assert StragglerDetector.rounds_to_flag(0.8, 0.1, 0.8, 1) is None  # never strictly below
    assert StragglerDetector.rounds_to_flag(0.9, 0.1, 0.8, 5) is None
    assert StragglerDetector.rounds_to_flag(0.99, 0.1, 1.0, 1) == 1  # threshold 1: anyone below the median


def test_ninety_percent_worker_is_never_flagged():
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=5)
    assert rounds_until_flagged(detector, {"a": 1.0, "b": 1.0, "c": 1 / 0.9}) is None
    assert detector.scores()["c"] == pytest.approx(0.9)
    assert detector.streaks()["c"] == 0


def test_two_workers_compare_against_the_faster_one():
    # the mean of the two would put a worker at 0.7 of its peer at 0.7 / 0.85 = 0.82 and never flag it
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=1)
    detector.observe({"fast": 1.0, "slow": 1 / 0.7})
    assert detector.scores() == pytest.approx({"fast": 1.0, "slow": 0.1 * 0.7 + 0.9})
    assert rounds_until_flagged(StragglerDetector(0.1, 0.8, 1), {"fast": 1.0, "slow": 1 / 0.7}) == 11


def test_three_workers_the_middle_one_is_the_norm():
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=1)
    detector.observe({"fast": 1.0, "slow1": 2.0, "slow2": 2.0})  # median 0.5/s: the slow pair is the norm
    assert detector.scores() == pytest.approx({"fast": 0.1 * 2.0 + 0.9, "slow1": 1.0, "slow2": 1.0})
    assert rounds_until_flagged(detector, {"fast": 1.0, "slow1": 2.0, "slow2": 2.0}) is None
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=1)
    detector.observe({"a": 1.0, "b": 1.0, "c": 4.0})  # median 1/s: c is at 0.25
    assert detector.scores()["c"] == pytest.approx(0.1 * 0.25 + 0.9)


def test_four_workers_upper_median():
    detector = StragglerDetector(alpha=1.0, threshold=0.8, window=1)
    assert detector.observe({"a": 1.0, "b": 1.0, "c": 1.0, "d": 2.0}) == ["d"]
    assert detector.scores()["d"] == pytest.approx(0.5)
    assert detector.observe({"a": 1.0, "b": 1.0, "c": 2.0, "d": 2.0}) == ["c", "d"]  # upper middle: 1/s


def test_intermittent_straggler_is_still_caught():
    # Or et al.'s case against "N slow batches in a row": slow except every 3rd round
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=3)
    slow, normal = {"a": 1.0, "b": 1.0, "s": 2.0}, {"a": 1.0, "b": 1.0, "s": 1.0}
    flagged_at = None
    for n in range(1, 100):
        if detector.observe(normal if n % 3 == 0 else slow):
            flagged_at = n
            break
    assert flagged_at is not None and flagged_at < 30


def test_recovery_unflags_and_lone_worker_rounds_are_skipped():
    detector = StragglerDetector(alpha=0.5, threshold=0.8, window=1)
    assert detector.observe({"a": 1.0, "s": 4.0}) == ["s"]  # 0.5 * 0.25 + 0.5 = 0.625
    assert detector.observe({"a": 1.0}) == ["s"] and detector.rounds == 1  # one worker: nothing to compare
    assert detector.observe({"a": 1.0, "s": 1.0}) == []  # 0.5 + 0.3125 = 0.8125
    assert detector.scores()["s"] == pytest.approx(0.8125)


def test_absent_and_unmeasured_workers_keep_their_state():
    detector = StragglerDetector(alpha=1.0, threshold=0.8, window=2)
    detector.observe({"a": 1.0, "b": 1.0, "s": 2.0})
    assert detector.streaks()["s"] == 1
    detector.observe({"a": 1.0, "b": 1.0, "s": 0.0})  # no usable time: treated as absent
    detector.observe({"a": 1.0, "b": 1.0, "s": math.nan})
    assert detector.streaks()["s"] == 1 and detector.scores()["s"] == pytest.approx(0.5)
    assert detector.observe({"a": 1.0, "b": 1.0, "s": 2.0}) == ["s"]
    assert detector.observe({"a": 1.0, "b": 1.0}) == ["s"]  # kept until forget()


def test_forget_drops_workers_and_a_returning_one_starts_fresh():
    detector = StragglerDetector(alpha=1.0, threshold=0.8, window=1)
    detector.observe({"a": 1.0, "b": 1.0, "s": 2.0})
    detector.forget(["a", "b"])
    assert sorted(detector.scores()) == ["a", "b"] and detector.stragglers() == []
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=1)
    detector.observe({"a": 1.0, "b": 1.0, "s": 2.0})
    detector.forget({"a", "b"})
    detector.observe({"a": 1.0, "b": 1.0, "s": 1.0})
    assert detector.scores()["s"] == pytest.approx(1.0)


def test_round_trip_keeps_scores_and_streaks():
    detector = StragglerDetector(alpha=0.1, threshold=0.8, window=5)
    round_ = {"w0": 1.0, "w1": 1.0, "slow": 2.0}
    for _ in range(7):
        detector.observe(round_)
    restored = StragglerDetector.from_dict(json.loads(json.dumps(detector.to_dict())))
    assert restored.to_dict() == detector.to_dict()
    assert restored.streaks()["slow"] == 3
    assert restored.observe(round_) == [] and restored.observe(round_) == ["slow"]  # rounds 8 and 9, as before


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"threshold": 1.2}, "threshold"),
        ({"window": 0}, "window"),
    ],
)
def test_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StragglerDetector(**kwargs)


def test_help_and_docs_give_the_round_the_members_report_interval() -> None:
    """A round ends once every member has reported; each reports every ``STATS_EVERY_S``: --help and the docs say so."""
    from pathlib import Path

    from lightning_elan.cli import build_parser
    from lightning_elan.elastic.compute import STATS_EVERY_S

    said = f"about {STATS_EVERY_S:g} s"
    assert said in " ".join(build_parser().commands["run"].format_help().split())
    docs = " ".join((Path(__file__).parents[2] / "docs" / "autoscaling.md").read_text().split())
    assert f"each sends it every second, so {said}" in docs and STATS_EVERY_S == 1.0
