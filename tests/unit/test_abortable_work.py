"""AbortableWork on a real two-rank gloo group (both ranks in this process, one thread each): what it hands out
follows the backend's work or a failure, and once disarmed (at process exit) the backend's completion no longer
reaches Python at all."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elan.elastic import process_group
from lightning_elan.elastic.process_group import AbortableWork


def two_ranks() -> list[dist.ProcessGroupGloo]:
    store = dist.HashStore()
    groups: list[dist.ProcessGroupGloo | None] = [None, None]

    def create(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))

    threads = [threading.Thread(target=create, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(groups)
    return groups  # type: ignore[return-value]


def test_the_work_completes_with_the_backend_and_is_released_by_a_failure():
    rank0, rank1 = two_ranks()
    work = AbortableWork(rank0.allreduce([torch.ones(3)]))
    peer = rank1.allreduce([torch.ones(3)])
    assert work.wait() and peer.wait()
    assert work.get_future().value()[0].tolist() == [2.0, 2.0, 2.0]

    stuck = AbortableWork(rank0.allreduce([torch.ones(3)]))  # rank 1 never takes part
    stuck.abort(RuntimeError("a member died"))
    try:
        stuck.get_future().wait()
        raise AssertionError("the aborted work did not raise")
    except RuntimeError as error:
        assert "a member died" in str(error)
    rank1.allreduce([torch.ones(3)]).wait()  # let the backend's collective end before the groups go


def test_a_disarmed_work_is_not_completed_from_the_backend_thread():
    rank0, rank1 = two_ranks()
    work = AbortableWork(rank0.allreduce([torch.ones(3)]))  # pending: rank 1 has not joined yet
    assert work.disarm(timeout_s=1.0) is False  # nothing was under way
    rank1.allreduce([torch.ones(3)]).wait()
    work._inner.wait()  # the backend's own future completed (in C++)...

    assert not work.is_completed()  # ...and nothing of it reached the Python callback


def test_disarming_a_work_the_backend_completed_waits_for_its_callback_and_keeps_the_result():
    rank0, rank1 = two_ranks()
    work = AbortableWork(rank0.allreduce([torch.ones(3)]))
    rank1.allreduce([torch.ones(3)]).wait()
    work.wait()  # may return while the callback on gloo's thread is still finishing: disarm then waits for it
    work.disarm(timeout_s=5.0)
    assert work._relayed.is_set() and work.get_future().value()[0].tolist() == [2.0, 2.0, 2.0]


def test_the_exit_hook_waits_until_the_backend_thread_let_go_of_every_callback():
    """The backend frees a work's callback on its own thread after the waiter woke: the exit hook waits for that
    (a thread taking the GIL while the interpreter finalizes aborts the process)."""
    rank0, rank1 = two_ranks()
    works = [AbortableWork(rank0.allreduce([torch.ones(3)])) for _ in range(4)]
    released = list(process_group._recent_callbacks)[-4:]
    for _ in works:
        rank1.allreduce([torch.ones(3)]).wait()
    for work in works:
        work.wait()
    del works
    process_group._await_released_callbacks(timeout_s=5.0)
    assert all(event.is_set() for event in released)
