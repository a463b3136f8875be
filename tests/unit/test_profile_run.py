"""EDL's profile(min_p, max_p) on a live job: scale in one worker at a time, grow to max once, settle."""

from __future__ import annotations

import json
from itertools import pairwise

import pytest

from lightning_elan.sizing.profile import ProfileRun


def visit(run: ProfileRun, curve: dict[int, float], start: int) -> list[int]:
    """The sizes a job moves to, measuring each size before asking for the next."""
    current, measured, path = start, {}, []
    for _ in range(50):
        measured[current] = curve[current]
        target = run.next_target(current, measured)
        if target is None:
            break
        path.append(target)
        current = target
    return path


CURVE = {1: 100.0, 2: 190.0, 3: 260.0, 4: 300.0, 5: 300.0}


def test_start_at_max_scales_in_then_returns():
    run = ProfileRun(1, 3, start_size=3)
    assert visit(run, CURVE, 3) == [2, 1, 3]
    assert run.done and run.finished(3, CURVE)


def scale_ins(path: list[int], start: int) -> list[int]:
    """How many workers each scale-in of the path removes."""
    sizes = [start, *path]
    return [before - after for before, after in pairwise(sizes) if after < before]


def scale_outs(path: list[int], start: int) -> int:
    sizes = [start, *path]
    return sum(1 for before, after in pairwise(sizes) if after > before)


def test_start_inside_steps_down_one_at_a_time_grows_once_and_never_revisits():
    assert visit(ProfileRun(1, 3, start_size=2), CURVE, 2) == [1, 3, 2]  # the 2 → 3 → 1 is gone
    path = visit(ProfileRun(1, 4, start_size=2), CURVE, 2)
    assert path == [1, 4, 3, 2]
    assert ProfileRun(1, 4, start_size=2).route() == [2, 1, 4, 3, 2]


@pytest.mark.parametrize("start", [1, 2, 3, 4, 5])
@pytest.mark.parametrize(("low", "high"), [(1, 5), (2, 4), (1, 1), (3, 5)])
def test_every_scale_in_inside_the_range_removes_one_worker_and_there_is_one_scale_out(start, low, high):
    run = ProfileRun(low, high, start_size=start)
    path = visit(run, CURVE, start)
    assert sorted(set(path) | {start}) == sorted(set(range(low, high + 1)) | {start})  # every size, nothing more
    assert path[-1:] in ([start], [])  # back where it started
    assert scale_outs(path, start) <= 1
    inside = scale_ins(path, start)[1 if start > high else 0:]  # a job above the range enters it in one request
    inside = inside[:-1] if start < low else inside  # ... and one below it leaves it in one
    assert all(removed == 1 for removed in inside)
    assert run.route() == [start, *path]


def test_waits_while_current_size_is_unmeasured():
    run = ProfileRun(1, 4, start_size=2)
    assert run.next_target(2, {}) is None and not run.done  # the start is measured first
    assert run.next_target(2, {2: 190.0}) == 1
    assert run.next_target(4, {2: 190.0}) is None and not run.done  # at 4 (an outside resize), not measured yet
    assert run.next_target(4, {2: 190.0, 4: 300.0}) == 1


def test_settle_best_takes_the_smaller_size_on_a_tie():
    run = ProfileRun(2, 5, start_size=2, settle="best")
    assert visit(run, CURVE, 2) == [5, 4, 3, 4]  # R_4 = R_5 = 300: 4
    result = run.result(CURVE)
    assert result["best"] == 4 and result["best_rate"] == 300.0 and result["complete"]
    assert result["rates"] == {2: 190.0, 3: 260.0, 4: 300.0, 5: 300.0}  # 1 is out of range
    assert result["per_worker"][4] == pytest.approx(75.0)
    assert ProfileRun(1, 3, start_size=3, settle="best").final_size({1: 100.0, 2: 190.0, 3: 180.0}) == 2


def test_done_when_settled_at_start_and_partial_result():
    run = ProfileRun(2, 3, start_size=3)
    assert run.next_target(3, {3: 1.0}) == 2
    partial = run.result({3: 1.0})
    assert partial["complete"] is False and partial["best"] == 3
    assert run.next_target(3, {3: 1.0, 2: 1.0}) is None and run.done


def test_round_trip():
    run = ProfileRun(1, 4, start_size=2, steps=10, settle="best")
    run.next_target(2, {2: 1.0, 4: 1.0, 3: 1.0, 1: 2.0})
    restored = ProfileRun.from_dict(json.loads(json.dumps(run.to_dict())))
    expected = {"min_size": 1, "max_size": 4, "start_size": 2, "steps": 10, "settle": "best", "done": False}
    assert restored.to_dict() == run.to_dict() == expected
    assert restored.next_target(1, {2: 1.0, 4: 1.0, 3: 1.0, 1: 2.0}) is None and restored.done


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 3, 2), {}, "min_size must be >= 1"),
        ((4, 3, 3), {}, r"min_size \(4\) must be <= max_size \(3\)"),
        ((1, 3, 0), {}, "start_size"),
        ((1, 3, 2), {"steps": 0}, "steps"),
        ((1, 3, 2), {"settle": "stay"}, "settle"),
    ],
)
def test_validates(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfileRun(*args, **kwargs)


def test_sizes_from_json_keys():
    run = ProfileRun(1, 3, start_size=3, settle="best")
    measured = json.loads(json.dumps({3: 250.0, 2: 260.0, 1: 100.0}))
    assert run.next_target(3, measured) == 2 and run.result(measured)["rates"] == {1: 100.0, 2: 260.0, 3: 250.0}
