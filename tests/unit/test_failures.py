"""The survivors' side of a worker failure, in one process: the commit vote, abortable collectives, the watch."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_elan.elastic.error_origin import is_a_collective_timeout
from lightning_elan.elastic.failures import CommitVote, FailureWatch, PeerFailure, StalledVote
from lightning_elan.elastic.process_group import ElasticProcessGroup
from lightning_elan.protocol.contract import failure_key


def votes(store: dist.Store, world: int, voters: list[int], failed: threading.Event) -> dict[int, bool]:
    with ThreadPoolExecutor(len(voters)) as pool:
        futures = {rank: pool.submit(CommitVote(store, 3, rank, world, failed.is_set).commit) for rank in voters}
        return {rank: future.result(timeout=10) for rank, future in futures.items()}


def test_a_step_commits_when_every_member_voted() -> None:
    assert votes(dist.HashStore(), 3, [0, 1, 2], threading.Event()) == {0: True, 1: True, 2: True}


def test_a_queued_leave_rides_on_the_vote_to_every_member() -> None:
    store, failed = dist.HashStore(), threading.Event()
    members = [CommitVote(store, 0, rank, 3, failed.is_set) for rank in range(3)]
    with ThreadPoolExecutor(3) as pool:
        committed = list(pool.map(lambda rank: members[rank].commit(leaving=rank == 2), range(3)))
    assert committed == [True, True, True] and [m.leave_signalled for m in members] == [True, True, True]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: members[rank].commit(), range(3)))
    assert [m.leave_signalled for m in members] == [False, False, False]


def test_a_step_aborts_everywhere_when_a_member_never_votes() -> None:
    failed = threading.Event()
    threading.Timer(0.2, failed.set).start()

    assert votes(dist.HashStore(), 3, [0, 1], failed) == {0: False, 1: False}


def test_a_vote_a_member_never_casts_and_no_failure_explains_times_out_aborted() -> None:
    """A member stopped answering before it voted (frozen): the others' wait ends at the collective timeout with the
    step aborted, in an error that reads as a collective timeout (the worker then asks the AM to fail the generation);
    the frozen member, should it wake, reads the abort."""
    store, never = dist.HashStore(), threading.Event()
    waiting = CommitVote(store, 3, 0, 2, never.is_set, timeout=timedelta(seconds=0.2))

    with pytest.raises(StalledVote, match="timed out after 0 s") as raised:
        waiting.commit()
    assert is_a_collective_timeout(raised.value)
    assert CommitVote(store, 3, 1, 2, never.is_set).commit() is False


def test_a_failure_after_every_vote_does_not_undo_the_commit() -> None:
    store, failed = dist.HashStore(), threading.Event()
    assert votes(store, 2, [0, 1], failed) == {0: True, 1: True}
    failed.set()

    late = CommitVote(store, 3, 1, 2, failed.is_set)  # a member that reads the decision after the failure
    assert late._await_decision("elan/gen3/commit1") == b"commit"


def test_consecutive_votes_use_fresh_keys_and_rank_0_deletes_the_old_ones() -> None:
    store, failed = dist.HashStore(), threading.Event()
    members = [CommitVote(store, 0, rank, 2, failed.is_set) for rank in range(2)]
    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(lambda vote: vote.commit(), members)) == [True, True]
    assert not store.check(["elan/gen0/commit1"]) and store.check(["elan/gen0/commit3"])


def two_rank_groups() -> list[ElasticProcessGroup]:
    store = dist.HashStore()
    groups = [ElasticProcessGroup(store, "gloo", timedelta(seconds=60), torch.device("cpu")) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda rank: groups[rank].configure("elan/gen0/", rank, 2), range(2)))
    return groups


def test_a_failed_generation_releases_a_blocked_collective_and_refuses_new_ones() -> None:
    groups = two_rank_groups()
    work = groups[0].allreduce([torch.ones(4)])  # rank 1 never joins: it would block for the 60 s timeout
    threading.Timer(0.2, groups[0].fail, args=("elan/gen0/", PeerFailure(0))).start()

    started = time.monotonic()
    with pytest.raises(RuntimeError, match="a member of generation 0 died"):  # C++ waiters see it as an error
        work.wait()
    assert time.monotonic() - started < 5
    with pytest.raises(PeerFailure):
        groups[0].broadcast([torch.ones(1)])
    assert not groups[0].fail("elan/gen9/", PeerFailure(9)), "another generation's failure is not this one's"
    groups[0].abort()  # kept, never destroyed: its gloo collective still waits for rank 1


def test_collectives_of_a_healthy_generation_complete_through_the_view() -> None:
    groups = two_rank_groups()
    views = [group.generation_view() for group in groups]
    tensors = [torch.full((3,), float(rank + 1)) for rank in range(2)]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda rank: views[rank].allreduce([tensors[rank]]).wait(), range(2)))
    assert all(torch.equal(t, torch.full((3,), 3.0)) for t in tensors)
    assert [view.size() for view in views] == [2, 2] and [view.rank() for view in views] == [0, 1]


def test_the_watch_calls_back_once_when_the_watched_generation_fails() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    fired: list[int] = []
    watch = FailureWatch(f"127.0.0.1:{server.port}", fired.append, timedelta(seconds=10))
    try:
        watch.watch(4)
        server.set(failure_key(3), "w1")  # not the watched generation
        time.sleep(0.3)
        server.set(failure_key(4), "w2")
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        assert fired == [4] and watch.failed(4) and not watch.failed(3)
    finally:
        watch.close()
