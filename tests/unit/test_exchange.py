"""Carrying out a replication plan (`replication/exchange.py`): sources and joiners in threads, real shm and gloo."""

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

from lightning_elan.replication.exchange import (
    ReplicationContext,
    plan_transfers_of,
    receive_replica,
    send_replica,
)
from lightning_elan.replication.planner import Transfer
from lightning_elan.replication.shm import SHM_DIR_ENV

TIMEOUT = datetime.timedelta(seconds=60)
CPU = torch.device("cpu")


def state_of(seed: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(257, generator=g, dtype=torch.float64), torch.randint(0, 9, (31,), generator=g),
               torch.randn(3, 5, generator=g).half()]  # fmt: skip
    return {"step": seed, "position": 12 * seed}, tensors


def transfer(source: str, joiner: str, transport: str, wave: int = 0, level: int = 2) -> dict[str, Any]:
    return Transfer(source=source, joiner=joiner, level=level, wave=wave, transport=transport).to_dict()


def plan_of(transfers: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "generation": 1,
        "joiners": [t["joiner"] for t in transfers],
        "sources": {t["joiner"]: t["source"] for t in transfers},
        "transfers": transfers,
    }


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


def sender(ctx: ReplicationContext, plan: dict, source: str, seed: int):
    def send() -> Any:
        outgoing = send_replica(ctx, plan, source, *state_of(seed))
        outgoing.finish(TIMEOUT)
        assert not outgoing.pending
        return outgoing

    return send


def receiver(ctx: ReplicationContext, plan: dict, joiner: str):
    return lambda: receive_replica(ctx, plan, joiner, lambda _: CPU)


def assert_received(result: tuple, seed: int, transport: str) -> None:
    cpu_state, tensors, nbytes, used = result
    want_cpu, want = state_of(seed)
    assert used == transport and nbytes > 0 and cpu_state == want_cpu
    assert len(tensors) == len(want)
    for got, expected in zip(tensors, want, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_a_plan_without_transfers_is_all_collective_from_its_sources() -> None:
    plan = {"generation": 1, "joiners": ["w2", "w3"], "sources": {"w2": "w0", "w3": "w0"}}
    transfers = plan_transfers_of(plan)
    assert [(t.source, t.joiner, t.transport) for t in transfers] == [("w0", "w2", "collective"), ("w0", "w3",
                                                                                                   "collective")]


def test_only_first_slices_are_used() -> None:
    sliced = [
        {**transfer("w0", "w2", "shm"), "slice_count": 2},
        {**transfer("w1", "w2", "shm"), "slice_index": 1, "slice_count": 2},
    ]
    assert [t.source for t in plan_transfers_of(plan_of(sliced))] == ["w0"]


def test_one_source_serves_shared_memory_and_collective_joiners_at_once() -> None:
    store = dist.HashStore()
    ctx = context(store)
    plan = plan_of([transfer("w0", "w2", "shm"), transfer("w0", "w3", "collective", level=4),
                    transfer("w0", "w4", "collective", level=4)])  # fmt: skip
    results = run_all({"w0": sender(ctx, plan, "w0", 5), **{j: receiver(ctx, plan, j) for j in ("w2", "w3", "w4")}})
    assert results["w0"].joiners == {"shm": ["w2"], "collective": ["w3", "w4"]}
    assert_received(results["w2"], 5, "shm")
    assert_received(results["w3"], 5, "collective")
    assert_received(results["w4"], 5, "collective")


def test_a_joiner_owns_what_it_received_over_shared_memory(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The joiner's tensors are its own memory, not views of the segment: nothing stays mapped from /dev/shm."""
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path))
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
    monkeypatch.setenv(SHM_DIR_ENV, str(tmp_path / "missing"))
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
