"""Three seeded failure storms (``tests/faults/storm.py``): each job ends exit 0 and exact against the static run.

The full run is ``python -m tests.faults.storm --storms 100 --seed 1``; CI runs these three."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from tests.faults.storm import check, run_static, run_storm
from tests.integration.etcd_server import etcd_binary

pytestmark = [pytest.mark.integration, pytest.mark.solo]  # kills at a pace: alone under `pytest -n`


@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory):
    return run_static(tmp_path_factory.mktemp("storm-static"))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_storm_holds(tmp_path, static, seed):
    storm = run_storm(tmp_path, seed)
    result = check(storm, static)
    assert any(not event.startswith("(") for event in storm.events), storm.events  # how many: the machine's speed
    assert result.last_step == 98


@pytest.mark.skipif(etcd_binary() is None or find_spec("etcd3gw") is None,
                    reason="needs etcd (apt-get install -y etcd-server; .ci/run installs it) and etcd3gw")
def test_an_etcd_storm_holds(tmp_path, static):
    """The same storm on a job of `elan worker`s under two AMs (etcd store, one standing by), the leader killed too
    (``tests/faults/etcd_storm.py``; ``python -m tests.faults.etcd_storm --storms N --seed S`` runs more)."""
    from tests.faults.etcd_storm import check as check_etcd_storm
    from tests.faults.etcd_storm import run_etcd_storm

    storm = run_etcd_storm(tmp_path, 1)
    result = check_etcd_storm(storm, static)
    assert any(not event.startswith("(") for event in storm.events), storm.events  # how many: the machine's speed
    assert result.last_step == 98
