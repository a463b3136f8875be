from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_elan.replication.planner import (
    Transfer,
    contention_key,
    plan_transfers,
    primary_sources,
    wave_sizes,
)
from lightning_elan.replication.topology import (
    L1_P2P,
    L2_HOST_BRIDGE,
    L3_CROSS_SOCKET,
    L4_NETWORK,
    WorkerTopology,
    link_level,
)

ROOTS = {0: "pci0000:00", 1: "pci0000:80"}


def gpu(host: str, socket: int, switch: int, slot: int) -> WorkerTopology:
    """A GPU in slot ``slot`` behind PCIe switch ``switch`` of ``socket`` (switches numbered per host)."""
    base = socket * 0x80 + switch * 0x10
    bus = f"0000:{base + slot + 2:02x}:00.0"
    path = [ROOTS[socket], f"0000:{socket * 0x80:02x}:{switch + 1:02x}.0", f"0000:{base + 1:02x}:00.0"]
    return WorkerTopology(
        host=host, device_type="cuda", device_index=slot, pci_bus_id=bus, socket=socket, pci_path=path
    )


def by_joiner(transfers: list[Transfer]) -> dict[str, Transfer]:
    assert len({t.joiner for t in transfers}) == len(transfers)
    return {t.joiner: t for t in transfers}


# ------------------------------------------------------------------ the papers' examples


def test_elan_figure_9_two_concurrent_copies_from_the_nearest_workers() -> None:
    # A, B on one PCIe switch of socket 0; C on socket 1 of the same node; D on another node.
    stayers = {
        "A": gpu("n0", 0, 0, 0),
        "B": gpu("n0", 0, 0, 1),
        "C": gpu("n0", 1, 2, 0),
        "D": gpu("n1", 0, 0, 0),
    }
    # E sits under C's socket, F on D's node.
    joiners = {"E": gpu("n0", 1, 3, 0), "F": gpu("n1", 0, 1, 0)}

    plan = by_joiner(plan_transfers(stayers, joiners))

    assert (plan["E"].source, plan["F"].source) == ("C", "D")
    assert plan["E"].level == plan["F"].level == L2_HOST_BRIDGE
    assert plan["E"].wave == plan["F"].wave == 0  # concurrent
    assert {t.transport for t in plan.values()} == {"shm"}


def test_elan_figure_9_with_e_on_cs_switch_uses_p2p() -> None:
    stayers = {"A": gpu("n0", 0, 0, 0), "B": gpu("n0", 0, 0, 1), "C": gpu("n0", 1, 2, 0), "D": gpu("n1", 0, 0, 0)}
    joiners = {"E": gpu("n0", 1, 2, 1), "F": gpu("n1", 0, 0, 1)}

    plan = by_joiner(plan_transfers(stayers, joiners))

    assert [(plan[j].source, plan[j].level, plan[j].transport) for j in "EF"] == [
        ("C", L1_P2P, "cuda_ipc"),
        ("D", L1_P2P, "cuda_ipc"),
    ]


def etl_node() -> dict[str, WorkerTopology]:
    """ETL fig. 2: 8 GPUs, two sockets, two PCIe switches (S) per socket, two GPUs per switch."""
    return {f"G{i}": gpu("n0", i // 4, i // 2, i % 2) for i in range(8)}


def test_etl_figure_2_four_joiners_copy_within_their_socket() -> None:
    g = etl_node()
    stayers = {name: g[name] for name in ("G2", "G3", "G6", "G7")}
    joiners = {name: g[name] for name in ("G0", "G1", "G4", "G5")}

    plan = by_joiner(plan_transfers(stayers, joiners))

    assert primary_sources(plan.values()) == {"G0": "G2", "G1": "G3", "G4": "G6", "G5": "G7"}
    assert all(t.level == L2_HOST_BRIDGE and t.wave == 0 for t in plan.values())  # no copy crosses the sockets


def test_etl_figure_2_one_source_per_socket_broadcasts_to_both_neighbours() -> None:
    # "G2 broadcasts to G0 and G1": with one old worker per socket, two broadcasts run in parallel.
    g = etl_node()
    stayers = {"G2": g["G2"], "G6": g["G6"]}
    joiners = {name: g[name] for name in ("G0", "G1", "G4", "G5")}

    plan = plan_transfers(stayers, joiners)

    assert primary_sources(plan) == {"G0": "G2", "G1": "G2", "G4": "G6", "G5": "G6"}
    assert {t.wave for t in plan} == {0}
    assert [t.joiner for t in plan if t.source == "G2"] == ["G0", "G1"]


# ------------------------------------------------------------------ rules


def test_copies_sharing_a_cross_socket_link_run_in_turn() -> None:
    g = etl_node()
    stayers = {"G0": g["G0"], "G1": g["G1"]}
    joiners = {"G4": g["G4"], "G6": g["G6"]}

    plan = by_joiner(plan_transfers(stayers, joiners))

    assert {plan["G4"].source, plan["G6"].source} == {"G0", "G1"}  # still distinct sources
    assert plan["G4"].level == plan["G6"].level == L3_CROSS_SOCKET
    assert sorted(t.wave for t in plan.values()) == [0, 1]
    assert wave_sizes(plan.values()) == {0: 1, 1: 1}


def test_nearest_beats_balance() -> None:
    stayers = {"A": gpu("n0", 0, 0, 0), "B": gpu("n1", 0, 0, 0)}
    joiners = {"E": gpu("n0", 0, 0, 1), "F": gpu("n0", 0, 1, 0)}

    assert primary_sources(plan_transfers(stayers, joiners)) == {"E": "A", "F": "A"}


def test_most_constrained_joiner_does_not_lose_its_only_near_source() -> None:
    # E is near A and B; F only near A: E must take B.
    a, b = gpu("n0", 0, 0, 0), gpu("n0", 0, 1, 0)
    e = WorkerTopology(host="n0", device_type="cuda", pci_bus_id="0000:70:00.0", nvlink_peers=[a.pci_bus_id])
    e.nvlink_peers.append(b.pci_bus_id)
    f = WorkerTopology(host="n0", device_type="cuda", pci_bus_id="0000:71:00.0", nvlink_peers=[a.pci_bus_id])

    plan = by_joiner(plan_transfers({"A": a, "B": b}, {"E": e, "F": f}))

    assert (plan["E"].source, plan["F"].source) == ("B", "A")
    assert plan["E"].level == plan["F"].level == L1_P2P


def test_cpu_workers_on_one_host_use_shared_memory_across_hosts_the_network() -> None:
    cpu = lambda host: WorkerTopology(host=host, socket=0)  # noqa: E731
    plan = by_joiner(plan_transfers({"w0": cpu("a"), "w1": cpu("b")}, {"w2": cpu("b"), "w3": cpu("c")}))

    assert (plan["w2"].source, plan["w2"].transport) == ("w1", "shm")
    assert (plan["w3"].level, plan["w3"].transport) == (L4_NETWORK, "collective")


def test_leavers_are_sources_only_when_nobody_stays() -> None:
    cpu = WorkerTopology(host="a")
    assert primary_sources(plan_transfers({}, {"w2": cpu}, {"w0": cpu})) == {"w2": "w0"}
    assert primary_sources(plan_transfers({"w1": cpu}, {"w2": cpu}, {"w0": cpu})) == {"w2": "w1"}


def test_errors() -> None:
    cpu = WorkerTopology(host="a")
    with pytest.raises(ValueError, match="no source"):
        plan_transfers({}, {"w2": cpu})
    with pytest.raises(ValueError, match="both as joiners"):
        plan_transfers({"w1": cpu}, {"w1": cpu})
    assert plan_transfers({}, {}) == []


def test_topologies_may_be_plain_dicts() -> None:
    stayers = {"w0": WorkerTopology(host="a").to_dict()}
    plan = plan_transfers(stayers, {"w1": {"host": "a"}})
    assert [t.to_dict() for t in plan] == [
        {"source": "w0", "joiner": "w1", "level": 2, "wave": 0, "transport": "shm"}
    ]
    assert Transfer.from_dict(plan[0].to_dict()) == plan[0]
    assert Transfer.from_dict({**plan[0].to_dict(), "slice_index": 0, "slice_count": 1}) == plan[0]  # an older plan


# ------------------------------------------------------------------ properties

HOSTS = ["h0", "h1"]


@st.composite
def worker_topologies(draw: st.DrawFn) -> WorkerTopology:
    host = draw(st.sampled_from(HOSTS))
    socket = draw(st.integers(0, 1))
    if draw(st.booleans()):
        return WorkerTopology(host=host, socket=socket)
    switch = draw(st.integers(0, 1))
    return gpu(host, socket, socket * 2 + switch, draw(st.integers(0, 3)))


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[dict[str, WorkerTopology], dict[str, WorkerTopology]]:
    sources = draw(st.lists(worker_topologies(), min_size=1, max_size=5))
    joiners = draw(st.lists(worker_topologies(), min_size=0, max_size=6))
    return {f"s{i}": t for i, t in enumerate(sources)}, {f"j{i}": t for i, t in enumerate(joiners)}


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_plan_properties(scenario: tuple[dict[str, WorkerTopology], dict[str, WorkerTopology]]) -> None:
    stayers, joiners = scenario
    plan = plan_transfers(stayers, joiners)

    # every joiner exactly one entry, from a real source
    assert sorted(t.joiner for t in plan) == sorted(joiners)
    assert all(t.source in stayers for t in plan)
    # levels respected: the level is the link's, and it is the nearest any source offers
    for t in plan:
        assert t.level == link_level(joiners[t.joiner], stayers[t.source])
        assert t.level == min(link_level(joiners[t.joiner], s) for s in stayers.values())
    # no source overloaded beyond the rule: no joiner could move to a nearest source with load <= its own - 2
    load = Counter(t.source for t in plan)
    for t in plan:
        for other, topo in stayers.items():
            if link_level(joiners[t.joiner], topo) == t.level:
                assert load[other] >= load[t.source] - 1
    # and the largest load is the best possible (brute force over the nearest candidates)
    if plan:
        assert max(load.values()) == best_max_load(stayers, joiners)
    # waves: only L3 copies are serialised, never two on the same link in one wave, waves numbered from 0
    per_wave = Counter(
        (t.wave, contention_key(stayers[t.source], joiners[t.joiner], t.level)) for t in plan if t.level == 3
    )
    assert all(count == 1 for count in per_wave.values())
    assert all(t.wave == 0 for t in plan if t.level != L3_CROSS_SOCKET)
    for key in {k for _, k in per_wave}:
        waves = sorted(w for w, k in per_wave if k == key)
        assert waves == list(range(len(waves)))


def best_max_load(stayers: dict[str, WorkerTopology], joiners: dict[str, WorkerTopology]) -> int:
    candidates = []
    for jt in joiners.values():
        levels = {s: link_level(jt, st) for s, st in stayers.items()}
        best = min(levels.values())
        candidates.append([s for s, level in levels.items() if level == best])
    return min(max(Counter(choice).values()) for choice in itertools.product(*candidates))


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_distinct_sources_whenever_there_are_enough_equally_near(
    scenario: tuple[dict[str, WorkerTopology], dict[str, WorkerTopology]],
) -> None:
    stayers, joiners = scenario
    # put every worker on one host and socket, CPU only: all sources are equally near
    flat = {k: WorkerTopology(host="h") for k in stayers}
    plan = plan_transfers(flat, {k: WorkerTopology(host="h") for k in joiners})
    load = Counter(t.source for t in plan)
    assert max(load.values(), default=0) == -(-len(joiners) // len(stayers))


@settings(max_examples=200, deadline=None)
@given(worker_topologies(), worker_topologies())
def test_link_level_is_symmetric(a: WorkerTopology, b: WorkerTopology) -> None:
    assert link_level(a, b) == link_level(b, a)
