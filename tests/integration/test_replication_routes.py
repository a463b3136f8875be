"""Replication routes end to end: the AM plans from every worker's topology, joiners copy from their own source.

Real `elan run` jobs of the float64 probe script on CPU (gloo). On one machine the planner gives every pair level L2
(same host) and the shared-memory transport; forcing the collective and breaking shared memory are checked too. Every
run must still use each sample once per epoch, keep every worker bit-identical, and end equal to a static run.
"""

from __future__ import annotations

import re

import pytest

from tests.integration.elastic_runs import elan_run
from tests.integration.test_elastic_training import PROBE_ARGS, check_elastic_run, static_run  # noqa: F401

pytestmark = pytest.mark.integration

# a slower job (0.3 s per step, no effect on the numbers) leaves the joiners time to warm up on a loaded machine
SLOW_ARGS = [*PROBE_ARGS, "--step-sleep", "0.3"]
RECEIVED = re.compile(r"worker (w\d+) received [\d.]+ MB of state from (w\d+) over (\S+)")


def received_routes(output: str) -> dict[str, tuple[str, str]]:
    """``{joiner: (source, transport)}`` from the workers' log lines."""
    return {joiner: (source, transport) for joiner, source, transport in RECEIVED.findall(output)}


def test_grow_2_to_4_each_joiner_copies_from_its_own_stayer_over_shared_memory(static_run, tmp_path):  # noqa: F811
    run = elan_run(tmp_path, "grow4", 2, SLOW_ARGS, schedule="3:add=2")
    (adjustment,) = check_elastic_run(run, static_run, tmp_path / "grow4-state", expected_adjustments=1)
    transfers = adjustment["transfers"]
    assert [t["joiner"] for t in transfers] == ["w2", "w3"]
    assert {t["source"] for t in transfers} == {"w0", "w1"}, "two joiners, two distinct sources: concurrent copies"
    assert {(t["transport"], t["level"], t["wave"]) for t in transfers} == {("shm", 2, 0)}
    routes = received_routes(run.output)
    assert routes == {t["joiner"]: (t["source"], "shm") for t in transfers}
    for source in ("w0", "w1"):
        assert re.search(rf"worker {source} sent [\d.]+ MB of state \(shm: w[23]\)", run.output), source
    assert adjustment["bytes_replicated"] > 0


def test_forced_collective_replication(static_run, tmp_path, monkeypatch):  # noqa: F811
    """`ELAN_REPLICATION=collective`: no topology is registered, sources round-robin, state broadcast on a group."""
    monkeypatch.setenv("ELAN_REPLICATION", "collective")
    run = elan_run(tmp_path, "coll", 2, SLOW_ARGS, schedule="3:add=2,8:migrate=1")
    first, migration = check_elastic_run(run, static_run, tmp_path / "coll-state", expected_adjustments=2)
    assert first["transfers"] is None and migration["transfers"] is None
    routes = received_routes(run.output)
    assert set(routes) == {"w2", "w3", "w4"}
    assert {transport for _, transport in routes.values()} == {"collective"}
    assert routes["w2"][0] != routes["w3"][0], "round-robin spreads the joiners over distinct sources"


def test_unusable_shared_memory_falls_back_to_the_collective_on_both_sides(static_run, tmp_path, monkeypatch):  # noqa: F811
    """A source that cannot create its segment (here: `ELAN_SHM_DIR` does not exist) tells its joiners; both switch."""
    monkeypatch.setenv("ELAN_SHM_DIR", str(tmp_path / "no-such-dir"))
    run = elan_run(tmp_path, "fallback", 2, SLOW_ARGS, schedule="3:add=2,8:remove=rank:0")
    first, _ = check_elastic_run(run, static_run, tmp_path / "fallback-state", expected_adjustments=2)
    assert {t["transport"] for t in first["transfers"]} == {"shm"}, "the plan said shared memory"
    routes = received_routes(run.output)
    assert {transport for _, transport in routes.values()} == {"shm-fallback"}
    assert "shm to ['w" in run.output and "unavailable" in run.output
