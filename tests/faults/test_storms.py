"""Three seeded failure storms (``tests/faults/storm.py``): each job ends exit 0 and exact against the static run.

The full run is ``python -m tests.faults.storm --storms 100 --seed 1``; CI runs these three."""

from __future__ import annotations

import pytest

from tests.faults.storm import check, run_static, run_storm

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory):
    return run_static(tmp_path_factory.mktemp("storm-static"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_storm_holds(tmp_path, static, seed):
    storm = run_storm(tmp_path, seed)
    result = check(storm, static)
    assert len([event for event in storm.events if not event.startswith("(")]) >= 5, storm.events
    assert result.last_step == 98
