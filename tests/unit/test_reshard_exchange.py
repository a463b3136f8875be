"""The live reshard's transfers (``replication/reshard.carry``): rows moved between old and new holders in all-to-all
rounds, and abortable — a member's death releases a survivor waiting in one (``ElasticProcessGroup.side_group``).
Three gloo ranks in threads of one process, on a ``HashStore``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_elan.elastic.failures import PeerFailure
from lightning_elan.elastic.process_group import SideGroup, _Generation
from lightning_elan.replication.reshard import exchange, move_rows
from lightning_elan.replication.shard_layout import shard_rows
from lightning_elan.torch_compat import keep_alive_forever

WORLD = 3


def _in_threads(work: Callable[[int, Any], Any]) -> list[Any]:
    store, results = dist.HashStore(), [None] * WORLD
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            group = dist.ProcessGroupGloo(store, rank, WORLD, timedelta(seconds=30))
            results[rank] = work(rank, group)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(("holders", "receivers"), [([0, 1], [0, 1, 2]), ([0, 1, 2], [0, 1]), ([0, 1], [2, 0]),
                                                     ([2, 0, 1], [1, 2, 0])])
@pytest.mark.parametrize("chunk_bytes", [8, 1 << 20])
def test_every_receiver_gets_its_rows(holders: list[int], receivers: list[int], chunk_bytes: int) -> None:
    whole = torch.arange(23 * 3, dtype=torch.float64).reshape(23, 3)

    def work(rank: int, group: Any) -> torch.Tensor | None:
        held = None
        if rank in holders:
            start, end = shard_rows(23, len(holders), holders.index(rank))
            held = whole[start:end].clone()
        return move_rows(held, 23, holders, receivers, like=whole.to("meta"), group=group, chunk_bytes=chunk_bytes)

    shards = _in_threads(work)
    for rank in range(WORLD):
        if rank in receivers:
            start, end = shard_rows(23, len(receivers), receivers.index(rank))
            assert torch.equal(shards[rank], whole[start:end])
        else:
            assert shards[rank] is None


def test_tensors_of_any_dtype_and_several_per_peer_travel_in_one_exchange() -> None:
    def work(rank: int, group: Any) -> list[torch.Tensor]:
        peer = (rank + 1) % WORLD
        sends = [(peer, torch.full((2, 2), float(rank))), (peer, torch.tensor([rank, 7], dtype=torch.int64))]
        into = [torch.empty(2, 2), torch.empty(2, dtype=torch.int64)]
        exchange(group, sends, [((rank - 1) % WORLD, into[0]), ((rank - 1) % WORLD, into[1])])
        return into

    received = _in_threads(work)
    for rank in range(WORLD):
        source = (rank - 1) % WORLD
        assert torch.equal(received[rank][0], torch.full((2, 2), float(source)))
        assert received[rank][1].tolist() == [source, 7]


def test_a_failed_generation_releases_a_survivor_waiting_in_a_transfer_on_a_live_peer() -> None:
    """Ranks 0 and 1 wait in an all-to-all that rank 2 (alive, elsewhere) has not entered; failing the generation
    releases both at once with the failure (gloo's send and receive could not be released: no future)."""
    store = dist.HashStore()
    groups = [None] * WORLD
    connected = threading.Barrier(WORLD)
    outcome: dict[int, BaseException | None] = {}
    failure = PeerFailure(7)

    def member(rank: int) -> None:
        backend = dist.ProcessGroupGloo(store, rank, WORLD, timedelta(seconds=30))
        keep_alive_forever(backend)  # an abandoned collective's group is never destroyed (as the engine keeps it)
        groups[rank] = SideGroup(_Generation(backend, "elan/gen7/", rank, WORLD), _Parent())
        connected.wait()
        if rank == 2:
            return
        try:
            exchange(groups[rank], [(2, torch.ones(4))], [(2, torch.empty(4))])
            outcome[rank] = None
        except BaseException as error:
            outcome[rank] = error

    threads = [threading.Thread(target=member, args=(rank,), daemon=True) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    threads[2].join(30)
    time.sleep(0.5)
    assert outcome == {}, "nothing completes without rank 2"
    started = time.monotonic()
    for rank in (0, 1):
        groups[rank]._domain.fail(failure)
    for thread in threads[:2]:
        thread.join(10)
    assert time.monotonic() - started < 5
    assert sorted(outcome) == [0, 1]
    assert all("a member of generation 7 died" in str(error) for error in outcome.values()), outcome
    # rank 2 enters at last: gloo's threads finish the abandoned collective before the test ends
    exchange(groups[2], [(0, torch.ones(4)), (1, torch.ones(4))], [(0, torch.empty(4)), (1, torch.empty(4))])


class _Parent:
    def close_side(self, domain: Any) -> None:
        pass
