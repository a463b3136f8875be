"""Worker failures, from the survivors' side: learning that a generation failed, and committing steps atomically.

* :class:`FailureWatch` — a daemon thread polls the rendezvous store for the current generation's failure key
  (:func:`~lightning_elan.protocol.contract.failure_key`, set by ``elan run`` when the AM says a member died) and
  calls back at once, so survivors blocked in a collective are unblocked by aborting its work instead of waiting out
  the collective timeout.
* :class:`CommitVote` — after a step's gradients were all-reduced and before the optimizer applies them, every member
  votes in the store; the step commits only when every member of the generation voted, and once a failure is known it
  is aborted instead. The decision is one ``compare_set`` on a key, so it is the same for every member: no survivor
  applies a step another discarded (a gloo all-reduce may complete on one rank and fail on another when a peer dies
  in the middle of it). The vote also carries whether a member's SIGTERM leave is queued, so every member learns at
  the same step that the job must coordinate at this batch's end, without a collective of its own.

  With an etcd job store the vote runs in a *fast store* of the generation instead (a ``TCPStore`` served by the
  generation's rank 0, see ``ElasticWorker``), so a step costs no etcd round trip and goes on while etcd does not
  answer. Its host may die with the decision in it: a member whose store fails after it began voting cannot know
  whether the others applied the step (:class:`UncertainCommit`). It checks in with the AM as *uncertain*, and the
  recovery decides: the step stands if any survivor committed it (the uncertain member applies its all-reduced
  gradients too), else every survivor discards it. Either way the survivors hold the same state. Rank 0 returns from
  a vote in its own store only once every member has read the decision, so a step rank 0 applied stands too.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lightning_elan.protocol.contract import failure_key

log = logging.getLogger(__name__)

__all__ = ["CommitVote", "FailureWatch", "PeerFailure", "StalledVote", "UncertainCommit"]

WATCH_INTERVAL_S = 0.05
"""How often the watch thread checks the store for the current generation's failure key."""
VOTE_POLL_MAX_S = 0.002
LEAVE_VOTE = 1 << 20
"""Added to a member's vote when its SIGTERM leave is queued (world sizes stay far below it)."""
_COMMIT, _COMMIT_LEAVE, _ABORT = b"commit", b"commit+leave", b"abort"


class PeerFailure(RuntimeError):
    """A member of ``generation`` died: the collective or step in progress is abandoned."""

    def __init__(self, generation: int, detail: str = "") -> None:
        super().__init__(f"a member of generation {generation} died{': ' + detail if detail else ''}")
        self.generation = generation


class FailureWatch:
    """Polls the store for the watched generation's failure key; calls ``on_failure(generation)`` once per failure."""

    def __init__(self, store_address: str, on_failure: Callable[[int], None], timeout: timedelta) -> None:
        self._address = store_address
        self._on_failure = on_failure
        self._timeout = timeout
        self._generation: int | None = None
        self._failed: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._unreachable = False  # the last poll found the store not answering (logged once per outage)
        self._thread = threading.Thread(target=self._run, name="elan-failure-watch", daemon=True)
        self._thread.start()
        # stopped before the interpreter finalizes: a daemon thread inside a store call then would take the GIL after
        # finalization, and Python 3.11 ends it with ``pthread_exit``, unwinding through C++ frames (std::terminate)
        atexit.register(self.close)

    def watch(self, generation: int | None) -> None:
        """Watch ``generation`` from now on (None: nothing)."""
        with self._lock:
            self._generation = generation

    def failed(self, generation: int | None) -> bool:
        """Whether ``generation`` is known to have failed."""
        with self._lock:
            return generation in self._failed

    def close(self) -> None:
        atexit.unregister(self.close)
        self._stop.set()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store

        try:
            store = open_rendezvous_store(self._address, self._timeout)
        except Exception as error:  # no store: failures are then only seen as collective errors
            log.warning("failure watch cannot reach the store at %s: %s", self._address, error)
            return
        while not self._stop.wait(WATCH_INTERVAL_S):
            generation = self._watched()
            if generation is not None and self._failed_in(store, generation):
                self._fire(generation)

    def _failed_in(self, store: dist.Store, generation: int) -> bool:
        """Whether the failure key is set; a store that does not answer (an etcd outage) is asked again later: the
        watch never stops, and it logs once per outage."""
        try:
            found = store.check([failure_key(generation)])
        except Exception as error:  # unreachable for its whole timeout, a reset connection: look again later
            if not self._unreachable:
                log.warning("failure watch: the store does not answer (%s); polling on", error)
            self._unreachable = True
            return False
        if self._unreachable:
            log.warning("failure watch: the store answers again")
            self._unreachable = False
        return found

    def _watched(self) -> int | None:
        with self._lock:
            generation = self._generation
            return None if generation in self._failed else generation

    def _fire(self, generation: int) -> None:
        with self._lock:
            self._failed.add(generation)
        log.warning("generation %d failed: a member died", generation)
        try:
            self._on_failure(generation)
        except Exception:  # the watch must survive a failing callback
            log.exception("failure callback for generation %d failed", generation)


class StalledVote(dist.DistError):
    """The members' votes on a step did not all come within the generation's collective timeout, and no failure is
    known: a member stopped answering (frozen, or hung outside the step). The step is aborted (nobody applies it);
    the error reads as a collective timeout (``error_origin.is_a_collective_timeout``), so the worker asks the AM to
    fail the generation."""

    def __init__(self, generation: int, waited_s: float) -> None:
        super().__init__(f"the commit vote of generation {generation} timed out after {waited_s:.0f} s: a member did "
                         "not vote (it stopped answering)")
        self.generation = generation


class UncertainCommit(PeerFailure):
    """This member voted on a step and lost the store holding the vote before it read the decision: whether the step
    committed is decided by the recovery (it did if another survivor applied it)."""

    def __init__(self, generation: int, cause: BaseException) -> None:
        super().__init__(generation, f"the store holding the commit vote failed before the decision was read "
                                     f"({type(cause).__name__}: {cause})")
        self.cause = cause


class CommitVote:
    """The per-step commit decision of one generation (see the module docstring)."""

    def __init__(self, store: dist.Store, generation: int, rank: int, world_size: int,
                 failed: Callable[[], bool], hosted_by_rank_0: bool = False, name: str = "commit",
                 timeout: timedelta | None = None) -> None:
        """``name``: what is voted on (the keys ``elan/gen<g>/<name><n>``; a live reshard's commit has its own);
        ``timeout``: how long a member waits for the others' votes (the generation's collective timeout), None: no
        bound."""
        self._store = store
        self._timeout_s = None if timeout is None else timeout.total_seconds()
        self._hosted_by_rank_0 = hosted_by_rank_0
        self._generation = generation
        self._prefix = f"elan/gen{generation}/{name}"
        self._rank, self._world_size = rank, world_size
        self._failed = failed
        self._count = 0
        self.leave_signalled = False  # the last committed vote carried a member's queued leave

    @property
    def store(self) -> dist.Store:
        """The store this generation votes in (its members' per-step records go there too)."""
        return self._store

    def commit(self, leaving: bool = False) -> bool:
        """Vote for the step whose gradients this member has (``leaving``: its SIGTERM leave is queued); True if every
        member did before any failure. Raises :class:`UncertainCommit` when the store fails during the vote."""
        if self._world_size == 1:
            self.leave_signalled = leaving
            return not self._failed()
        self._count += 1
        try:
            decision = self._decide(f"{self._prefix}{self._count}", leaving)
        except StalledVote:
            raise
        except (RuntimeError, OSError) as error:  # torch's store errors are RuntimeErrors
            raise UncertainCommit(self._generation, error) from error
        if self._hosted_by_rank_0:
            self._confirm_read(f"{self._prefix}{self._count}")
        self.leave_signalled = decision == _COMMIT_LEAVE
        return decision in (_COMMIT, _COMMIT_LEAVE)

    def _decide(self, key: str, leaving: bool) -> bytes:
        if self._rank == 0 and self._count > 1:  # every member passed the previous decision: it can go
            for suffix in ("", "/votes", "/read"):
                self._store.delete_key(f"{self._prefix}{self._count - 1}{suffix}")
        votes = self._store.add(f"{key}/votes", 1 + (LEAVE_VOTE if leaving else 0))
        if votes % LEAVE_VOTE == self._world_size:
            return self._store.compare_set(key, "", _COMMIT_LEAVE if votes >= LEAVE_VOTE else _COMMIT)
        return self._await_decision(key)

    def _await_decision(self, key: str) -> bytes:
        """The decision, once the last voter made it; aborted once a failure is known, or once the members' votes
        did not all come within the timeout (a member stopped answering: :class:`StalledVote`)."""
        pause, deadline = 0.0, None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while not self._store.check([key]):
            if self._failed():
                return self._store.compare_set(key, "", _ABORT)
            if deadline is not None and time.monotonic() > deadline:
                decision = self._store.compare_set(key, "", _ABORT)  # the last voter may have decided just now
                if decision != _ABORT:
                    return decision
                raise StalledVote(self._generation, self._timeout_s or 0.0)
            time.sleep(pause)
            pause = min(VOTE_POLL_MAX_S, pause * 2 or 5e-5)
        return self._store.get(key)

    def _confirm_read(self, key: str) -> None:
        """Every member counts itself as having read the decision; rank 0, the store's host, returns only once all of
        them have (or a failure is known), so a step rank 0 applied was read by every member: it stands. A member
        whose count is lost with the store knows the decision all the same."""
        try:
            read = self._store.add(f"{key}/read", 1)
        except (RuntimeError, OSError):
            if self._rank == 0:
                raise
            return
        pause, deadline = 0.0, None if self._timeout_s is None else time.monotonic() + self._timeout_s
        while self._rank == 0 and read < self._world_size and not self._failed():
            if deadline is not None and time.monotonic() > deadline:
                return  # a member stopped answering after the decision: the step stands; its next collective stalls
            time.sleep(pause)
            pause = min(VOTE_POLL_MAX_S, pause * 2 or 5e-5)
            read = self._store.add(f"{key}/read", 0)
