"""Carrying out a replication plan (`replication/exchange.py`): sources and joiners in threads, real shm and gloo;
and what an adjustment leaves in the long-lived store (nothing, once it is complete)."""

from __future__ import annotations

import datetime
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_elan.master.state import AdjustmentPlan
from lightning_elan.protocol.contract import ENV_SHM_DIR
from lightning_elan.replication.exchange import (
    ReplicationContext,
    mark_wave_received,
    plan_transfers_of,
    receive_replica,
    send_replica,
    wait_for_wave,
)
from lightning_elan.replication.keys import delete_prefix
from lightning_elan.replication.planner import Transfer

TIMEOUT = datetime.timedelta(seconds=60)
CPU = torch.device("cpu")


def state_of(seed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(257, generator=g, dtype=torch.float64), torch.randint(0, 9, (31,), generator=g),
               torch.randn(3, 5, generator=g).half()]  # fmt: skip
    return {"step": seed, "position": 12 * seed}, tensors


def transfer(source: str, joiner: str, transport: str, wave: int = 0, level: int = 2) -> Transfer:
    return Transfer(source=source, joiner=joiner, level=level, wave=wave, transport=transport)


def plan_of(transfers: list[Transfer] | None, sources: dict[str, str] | None = None) -> AdjustmentPlan:
    sources = sources if transfers is None else {t.joiner: t.source for t in transfers}
    assert sources is not None
    old = sorted(set(sources.values()))
    return AdjustmentPlan(
        request_id="r1", action="add", generation=1, previous_generation=0, step=10, members=old + list(sources),
        previous_members=old, joiners=list(sources), leavers=[], sources=sources, hosts={}, transfers=transfers,
    )  # fmt: skip


def run_all(targets: dict[str, Any]) -> dict[str, Any]:
    """Run each callable in its own thread; returns their results (re-raises the first error)."""
    results: dict[str, Any] = {}

    def call(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except BaseException as error:  # handed to the test thread
            results[name] = error

    threads = [threading.Thread(target=call, args=item) for item in targets.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    for value in results.values():
        if isinstance(value, BaseException):
            raise value
    return results


def context(store: dist.Store) -> ReplicationContext:
    return ReplicationContext(store, "elan/gen1/transfer", "gloo", TIMEOUT, CPU)


def sender(ctx: ReplicationContext, plan: AdjustmentPlan, source: str, seed: int):
    def send() -> Any:
        outgoing = send_replica(ctx, plan, source, *state_of(seed))
        outgoing.finish(TIMEOUT)
        assert not outgoing.pending
        return outgoing

    return send


def receiver(ctx: ReplicationContext, plan: AdjustmentPlan, joiner: str):
    return lambda: receive_replica(ctx, plan, joiner, lambda _: CPU)


def assert_received(result: tuple, seed: int, transport: str) -> None:
    received, used = result
    cpu_state, tensors, nbytes = received.cpu_state, received.tensors, received.nbytes
    want_cpu, want = state_of(seed)
    assert used == transport and nbytes > 0 and cpu_state == want_cpu
    assert len(tensors) == len(want)
    for got, expected in zip(tensors, want, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_plan_without_transfers_is_all_collective_from_its_sources() -> None:
    transfers = plan_transfers_of(plan_of(None, {"w2": "w0", "w3": "w0"}))
    assert [(t.source, t.joiner, t.transport) for t in transfers] == [
        ("w0", "w2", "collective"),
        ("w0", "w3", "collective"),
    ]


def test_one_source_serves_shared_memory_and_collective_joiners_at_once() -> None:
    store = dist.HashStore()  # a store that lists its keys: the source's shutdown leaves none of its channels
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm"), transfer("w0", "w3", "collective", level=4),
                    transfer("w0", "w4", "collective", level=4)])  # fmt: skip
    results = run_all({"w0": sender(ctx, plan, "w0", 5), **{j: receiver(ctx, plan, j) for j in ("w2", "w3", "w4")}})
    assert results["w0"].joiners == {"shm": ["w2"], "collective": ["w3", "w4"]}
    assert_received(results["w2"], 5, "shm")
    assert_received(results["w3"], 5, "collective")
    assert_received(results["w4"], 5, "collective")
    assert [key for key in store.list_keys() if "/w0/" in key] == []


def test_a_joiner_owns_what_it_received_over_shared_memory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The joiner's tensors are its own memory, not views of the segment: nothing stays mapped from /dev/shm."""
    monkeypatch.setenv(ENV_SHM_DIR, str(tmp_path))
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm")])
    results = run_all({"w0": sender(ctx, plan, "w0", 6), "w2": receiver(ctx, plan, "w2")})
    assert_received(results["w2"], 6, "shm")
    assert list(tmp_path.iterdir()) == [], "the source unlinked its segment"
    mapped = Path(f"/proc/{os.getpid()}/maps").read_text()
    assert str(tmp_path) not in mapped, "a received tensor still maps the segment"


def test_two_sources_send_concurrently_each_to_its_own_joiner() -> None:
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm"), transfer("w1", "w3", "shm")])
    results = run_all({"w0": sender(ctx, plan, "w0", 1), "w1": sender(ctx, plan, "w1", 2),
                       "w2": receiver(ctx, plan, "w2"), "w3": receiver(ctx, plan, "w3")})  # fmt: skip
    assert_received(results["w2"], 1, "shm")
    assert_received(results["w3"], 2, "shm")


def test_a_joiner_of_wave_one_reads_only_after_wave_zero_was_received() -> None:
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm", wave=0, level=3), transfer("w1", "w3", "shm", wave=1, level=3)])
    late: dict[str, Any] = {}
    early = threading.Thread(target=lambda: late.update(w3=receiver(ctx, plan, "w3")()))
    send_w1 = threading.Thread(target=sender(ctx, plan, "w1", 2))
    early.start()
    send_w1.start()
    time.sleep(0.5)
    assert early.is_alive() and "w3" not in late, "wave 1 must wait for wave 0"
    results = run_all({"w0": sender(ctx, plan, "w0", 1), "w2": receiver(ctx, plan, "w2")})
    early.join(timeout=60)
    send_w1.join(timeout=60)
    assert_received(results["w2"], 1, "shm")
    assert_received(late["w3"], 2, "shm")


def test_shared_memory_unavailable_switches_both_sides_to_the_collective(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path) -> None:
    monkeypatch.setenv(ENV_SHM_DIR, str(tmp_path / "missing"))
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm"), transfer("w0", "w3", "shm")])
    results = run_all({"w0": sender(ctx, plan, "w0", 3), "w2": receiver(ctx, plan, "w2"),
                       "w3": receiver(ctx, plan, "w3")})  # fmt: skip
    assert_received(results["w2"], 3, "shm-fallback")
    assert_received(results["w3"], 3, "shm-fallback")


def test_cuda_ipc_on_a_cpu_source_falls_back_to_the_collective() -> None:
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "cuda_ipc", level=0)])
    results = run_all({"w0": sender(ctx, plan, "w0", 4), "w2": receiver(ctx, plan, "w2")})
    assert_received(results["w2"], 4, "cuda_ipc-fallback")


def test_a_joiner_missing_from_the_plan_is_an_error() -> None:
    with pytest.raises(ValueError, match="no transfer to joiner w9"):
        receive_replica(context(dist.HashStore()), plan_of([transfer("w0", "w2", "shm")]), "w9", lambda _: CPU)


def test_waves_release_the_next_wave_once_the_previous_was_received() -> None:
    store = dist.HashStore()
    short = datetime.timedelta(seconds=0.1)
    wait_for_wave(store, "g1", 0, 5, short)  # wave 0 never waits
    mark_wave_received(store, "g1", 0)
    with pytest.raises(TimeoutError, match="wave 0: 1 of 2"):
        wait_for_wave(store, "g1", 1, 2, short)
    mark_wave_received(store, "g1", 0)
    wait_for_wave(store, "g1", 1, 2, short)


# ------------------------------------------------------------------ keys left in the long-lived store


@pytest.fixture
def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


def test_an_adjustment_leaves_no_key_once_complete(tcp_store: dist.TCPStore, tmp_path, monkeypatch) -> None:
    """Send, receive, finish (disallow + shutdown) over every route, then delete the adjustment's prefix: the store
    holds only what was there before (the job's own keys, and other generations')."""
    monkeypatch.setenv(ENV_SHM_DIR, str(tmp_path))
    tcp_store.set("elan/job", "kept")
    tcp_store.set("elan/gen10/transfer/x", "another generation")
    before = set(tcp_store.list_keys())
    plan = plan_of([
        transfer("w0", "w2", "shm"),
        transfer("w0", "w3", "collective", level=4),
        transfer("w1", "w4", "shm", wave=1, level=3),
        transfer("w1", "w5", "cuda_ipc", level=0),
    ])
    outgoing: dict[str, Any] = {}

    def ctx() -> ReplicationContext:  # one client per worker, as in a job (a client serves one blocking call at once)
        client = dist.TCPStore("127.0.0.1", tcp_store.port, is_master=False, timeout=TIMEOUT)
        return ReplicationContext(client, "elan/gen1/transfer", "gloo", TIMEOUT, CPU)

    def send(source: str, seed: int) -> Any:
        outgoing[source] = send_replica(ctx(), plan, source, *state_of(seed))
        return outgoing[source]

    results = run_all({"w0": lambda: send("w0", 1), "w1": lambda: send("w1", 2),
                       **{j: (lambda j=j: receiver(ctx(), plan, j)()) for j in ("w2", "w3", "w4", "w5")}})  # fmt: skip
    assert_received(results["w5"], 2, "cuda_ipc-fallback")
    assert all(o.pending for o in outgoing.values())
    channels = {key.removeprefix("elan/gen1/transfer/").removesuffix("/header") for key in tcp_store.list_keys()
                if key.endswith("/header")}  # fmt: skip
    assert channels == {"w0/shm", "w0/collective", "w1/shm", "w1/cuda_ipc", "w1/cuda_ipc-fallback"}

    for o in outgoing.values():
        o.finish(TIMEOUT)

    left = set(tcp_store.list_keys()) - before
    assert left == {"elan/gen1/transfer/wave0/received", "elan/gen1/transfer/wave1/received"}  # the joiners' counts
    assert delete_prefix(tcp_store, "elan/gen1/") == 2
    assert set(tcp_store.list_keys()) == before
    assert list(tmp_path.iterdir()) == []


def test_delete_prefix_deletes_only_that_prefix(tcp_store: dist.TCPStore) -> None:
    for key in ("elan/gen1/a", "elan/gen1/b/c", "elan/gen10/a", "elan/job"):
        tcp_store.set(key, "x")
    tcp_store.add("elan/gen1/count", 3)
    assert delete_prefix(tcp_store, "elan/gen1/") == 3
    assert sorted(tcp_store.list_keys()) == ["elan/gen10/a", "elan/job"]
    assert delete_prefix(tcp_store, "elan/gen1/") == 0


def test_delete_prefix_through_a_prefix_store_and_on_a_store_that_cannot_list(tcp_store: dist.TCPStore) -> None:
    tcp_store.set("elanother", "not under elan/")
    view = dist.PrefixStore("elan", tcp_store)
    view.set("gen1/a", "x")
    assert delete_prefix(view, "gen1/") == 1
    assert sorted(tcp_store.list_keys()) == ["elanother"]  # PrefixStore lists it as "ther": not deleted

    class Unlisted:
        def list_keys(self) -> list[str]:
            raise RuntimeError("not implemented for this store")

    assert delete_prefix(Unlisted(), "gen1/") == 0  # type: ignore[arg-type]
