"""Replication routes end to end: the AM plans from every worker's topology, joiners copy from their own source.

Real `elan run` jobs of the float64 probe script on CPU (gloo). On one machine the planner gives every pair level L2
(same host) and the shared-memory transport; forcing the collective and breaking shared memory are checked too. Every
run must still use each sample once per epoch, keep every worker bit-identical, and end equal to a static run.
"""

from __future__ import annotations

import pytest

from tests.integration.elastic_runs import PROBE_ARGS, check_elastic_run, elan_run, received_routes

pytestmark = pytest.mark.integration

# rank 0 waits for the joiners due at a step (a loaded machine starts them slowly; no effect on the numbers)
ARGS = [*PROBE_ARGS, "--wait-for-joiners"]


def test_grow_2_to_4_each_joiner_copies_from_its_own_stayer_over_shared_memory(static_run, tmp_path):
    run = elan_run(tmp_path, "grow4", 2, ARGS, schedule="3:add=2")
    (adjustment,) = check_elastic_run(run, static_run, "3:add=2", sizes=[4])
    transfers = adjustment["transfers"]
    assert [t["joiner"] for t in transfers] == ["w2", "w3"]
    assert {t["source"] for t in transfers} == {"w0", "w1"}, "two joiners, two distinct sources: concurrent copies"
    assert {(t["transport"], t["level"], t["wave"]) for t in transfers} == {("shm", 2, 0)}
    assert {joiner: adjustment["sources"][joiner] for joiner in ("w2", "w3")} == {
        t["joiner"]: t["source"] for t in transfers
    }, "the plan's sources and its transfers agree"
    assert received_routes(run) == {t["joiner"]: (t["source"], "shm") for t in transfers}, "what the joiners used"
    assert adjustment["bytes_replicated"] > 0
    # each joiner took the parameters straight into its own model (Adam's moments into memory faulted in ahead only
    # when rank 0 published their size before the adjustment: these joiners start with the job, so maybe not)
    model_bytes = sum(tensor.numel() * tensor.element_size() for tensor in run.final_state().values())
    assert model_bytes > 0
    assert [received["in_place_bytes"] for received in adjustment["received"].values()] == [model_bytes] * 2


def test_forced_collective_replication(static_run, tmp_path, monkeypatch):
    """`ELAN_REPLICATION=collective`: no topology is registered, sources round-robin, state broadcast on a group."""
    monkeypatch.setenv("ELAN_REPLICATION", "collective")
    schedule = "3:add=2,8:migrate=1"
    run = elan_run(tmp_path, "coll", 2, ARGS, schedule=schedule)
    first, migration = check_elastic_run(run, static_run, schedule, sizes=[4, 4])
    assert first.get("transfers") is None and migration.get("transfers") is None, "no topology: no planned routes"
    routes = received_routes(run)
    assert set(routes) == {"w2", "w3", "w4"}
    assert {transport for _, transport in routes.values()} == {"collective"}
    received = [r for a in (first, migration) for r in a["received"].values()]
    assert {(r["in_place_bytes"], r["prefaulted"]) for r in received} == {(0, False)}, "the collective allocates"
    assert {joiner: source for joiner, (source, _) in routes.items()} == {**first["sources"], **migration["sources"]}
    assert first["sources"]["w2"] != first["sources"]["w3"], "round-robin spreads the joiners over distinct sources"


def test_unusable_shared_memory_falls_back_to_the_collective_on_both_sides(static_run, tmp_path, monkeypatch):
    """A source that cannot create its segment (here: `ELAN_SHM_DIR` does not exist) tells its joiners; both switch."""
    monkeypatch.setenv("ELAN_SHM_DIR", str(tmp_path / "no-such-dir"))
    schedule = "3:add=2,8:remove=rank:0"
    run = elan_run(tmp_path, "fallback", 2, ARGS, schedule=schedule)
    first, _ = check_elastic_run(run, static_run, schedule, sizes=[4, 3])
    assert {t["transport"] for t in first["transfers"]} == {"shm"}, "the plan said shared memory"
    routes = received_routes(run)
    assert set(routes) == {"w2", "w3"}
    # a joiner can only receive over the fallback collective if its source published the fallback and sent on it
    assert {transport for _, transport in routes.values()} == {"shm-fallback"}
    assert {joiner: source for joiner, (source, _) in routes.items()} == first["sources"]
