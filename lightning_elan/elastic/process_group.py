"""The worker's one default process group, reconfigured in place at every generation.

Modelled on torchft's ``ProcessGroup.configure()``: a Python subclass of torch's ``ProcessGroup`` forwards every
collective to the backend of the current generation (gloo, or NCCL with gloo for CPU tensors), and
:meth:`ElasticProcessGroup.configure` swaps that backend for a new store prefix, rank and world size, shutting the old
one down first (:meth:`abort` for a broken one). It is installed as torch's default group once, so
``torch.distributed.*`` calls, Lightning's collectives and DDP all talk to the live generation through the same object
and the default group is never destroyed and re-created.

One thing does not follow a reconfiguration: the C++ ``ProcessGroup::getSize()``/``getRank()`` of this object are the
values given to its constructor. Python callers (``torch.distributed.get_world_size``, object collectives, Lightning)
ask :meth:`size`/:meth:`rank`, which are live; C++ callers that size buffers from the group — DDP's reducer and its
parameter check — are given :meth:`ElasticProcessGroup.generation_view`, a :class:`GenerationGroup` of the
generation's own sizes.

When a member dies, :meth:`ElasticProcessGroup.fail` releases every collective of its generation: each collective's
work is an :class:`AbortableWork`, completed by the backend or by the failure, whichever comes first (gloo's
``abort()`` does not wake a blocked collective). A failed generation's group is never destroyed (``_keep_forever``).

A sharded front-end's model runs collectives inside the user's own calls (FSDP2's all-gather in ``model(x)``), where
nothing of ours can catch a member's death. Its mesh is a :class:`TolerantGenerationGroup`: while its owner says the
step may still be discarded, a failed collective returns (its output left as it is) and the failure is kept for the
owner to take at the step's next call it controls (``backward``, the optimizer step), which discards the step.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_elan import torch_compat
from lightning_elan.elastic.etcd_rendezvous import EtcdRendezvousStore
from lightning_elan.elastic.start_hooks import StartHookResults

log = logging.getLogger(__name__)

__all__ = ["ElasticProcessGroup", "SideGroup", "StaleGroupError", "TolerantGenerationGroup", "UserGroup",
           "blocked_seconds", "group_of_this_process", "install_default_group", "uninstall_default_group"]

BACKEND_NAME = "elan"
"""The name the group is registered under with ``torch.distributed.Backend``."""

DISARM_WAIT_S = 5.0
"""At exit, how long a collective's Python callback already running on the backend's thread is waited for."""
ARRIVED_KEY = "arrived"
"""Under a generation's prefix: one key per rank that has arrived to form it."""
ARRIVAL_POLL_MIN_S, ARRIVAL_POLL_MAX_S = 0.0005, 0.05
"""A member waiting for the others to arrive looks again after 0.5 ms, doubling up to 50 ms (and whether the
generation failed meanwhile)."""
ALONE_PREFIX = "alone/"
"""The prefix of the world of one a process out of the job is in (see :meth:`ElasticProcessGroup.go_alone`)."""
CALLBACK_RELEASE_S = 0.05
"""At exit, after such a callback returned: time for the backend's thread to free it (it takes the GIL to do so)."""

_install_lock = threading.Lock()
_installing: ElasticProcessGroup | None = None
_exit_hook_registered = False


class _Failed:
    """The result a failed collective's source future carries; unwrapped into an error of the future handed out."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class AbortableWork(dist.Work):
    """A backend's work whose ``wait()`` also returns, with the failure, when its generation is failed.

    gloo's ``abort()`` does not wake a thread blocked in a collective; this work completes its own future from the
    backend's future, or with the failure first, so DDP's reducer and every ``wait()`` are released at once. The
    future handed out is a ``then`` of a source future: a Python ``Future.set_exception`` only marks the error for
    Python callers (C++ waiters such as DDP's reducer would read the exception object as the result), while a ``then``
    callback that raises completes its future with a real error.
    """

    def __init__(self, inner: dist.Work) -> None:
        super().__init__()
        self._source: torch.futures.Future = torch.futures.Future()
        self._future = self._source.then(_unwrap_result)
        self._lock = threading.Lock()
        self._settled = False
        self._relayed = threading.Event()
        self._work = inner
        self._inner = inner.get_future()
        self._relay = torch.futures.collect_all([self._inner])
        self._relay.add_done_callback(_RelayCallback(self))

    def _relay_done(self, relay: torch.futures.Future) -> None:
        try:
            if not self._inner.done():
                return  # disarmed
            try:
                value = self._inner.value()
            except Exception as error:
                self._settle(_Failed(error))
            else:
                self._settle(value)
        finally:
            self._relayed.set()

    def disarm(self, timeout_s: float) -> bool:
        """Let the backend's work end in C++ only; returns whether its Python callback was under way (waited for).

        The backend completes its future on its own thread, and whatever takes the GIL there during or after
        interpreter finalization kills the process (an abandoned generation's collective ends when its peers exit,
        which may be while we do). Two things would: a Python callback, and freeing the last reference to a Python
        object (the work's tensors, a Python value). So the callback hangs on a relay future (torch's C++
        ``collectAll``): completing the relay here makes the backend's later completion a no-op in C++
        (``setErrorIfNeeded`` on a completed future); and the work, its future and the relay are kept for the life of
        the process, so the backend's thread never drops the last reference to them. If the backend completed the
        relay first, its callback is waited for (the caller holds the interpreter up meanwhile)."""
        for owned in (self._work, self._inner, self._relay):
            torch_compat.keep_alive_forever(owned)
        try:
            self._relay.set_result([])
        except RuntimeError:  # the backend's work completed first: its callback runs, or ran, on its thread
            under_way = not self._relayed.is_set()
            self._relayed.wait(timeout_s)
            return under_way
        return False

    def _settle(self, value: Any) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self._source.set_result(value)

    def abort(self, error: BaseException) -> None:
        self._settle(_Failed(error))

    def wait(self, timeout: timedelta | None = None) -> bool:
        started = time.perf_counter()
        self._future.wait()
        _note_blocked(time.perf_counter() - started)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


class _RelayCallback:
    """A work's relay callback that says when the backend's thread has let go of it.

    The backend runs the callback on its own thread and frees it there afterwards, taking the GIL to do so: after the
    collective's waiter has been woken. Were the interpreter finalizing by then, Python 3.11 ends that thread with
    ``pthread_exit``, whose unwinding through a C++ destructor is ``std::terminate`` ("terminate called without an
    active exception": a worker that had finished training, seen in CI). The exit hook waits for the recent ones
    (:func:`_await_released_callbacks`)."""

    def __init__(self, work: AbortableWork) -> None:
        self._work = work
        self.released = threading.Event()
        _recent_callbacks.append(self.released)

    def __call__(self, relay: torch.futures.Future) -> None:
        self._work._relay_done(relay)

    def __del__(self) -> None:
        self.released.set()


RECENT_CALLBACKS = 256
"""How many of the latest collectives' callbacks the exit hook checks were freed (a backend lags a few at most)."""
_recent_callbacks: collections.deque[threading.Event] = collections.deque(maxlen=RECENT_CALLBACKS)


def _await_released_callbacks(timeout_s: float) -> None:
    """Before the interpreter finalizes: every recent collective's callback is freed by its backend's thread, and
    that thread had time to drop the work (which may free Python tensors, with the GIL): see :class:`_RelayCallback`."""
    if not _recent_callbacks:
        return
    deadline = time.monotonic() + timeout_s
    for released in list(_recent_callbacks):
        released.wait(max(0.0, deadline - time.monotonic()))
    time.sleep(CALLBACK_RELEASE_S)


_blocked_s = 0.0


def _note_blocked(seconds: float) -> None:
    global _blocked_s
    _blocked_s += seconds


def blocked_seconds() -> float:
    """Seconds this process has spent so far in ``wait()`` of a collective (e.g. a metric synced in
    ``training_step``): time a slower peer can add, subtracted from a member's compute time."""
    return _blocked_s


def _unwrap_result(source: torch.futures.Future) -> Any:
    value = source.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class _ReducedChunk(dist.Work):
    """A reduce-scatter done as an all-reduce of a copy of the input: complete when the all-reduce is, this rank's
    chunk of the sum copied into the output.

    gloo's reduce-scatter work has no future, so it could not be an :class:`AbortableWork`: when a member died, a
    survivor that waited in it on a live peer (gloo's ring: any rank not next to the dead one) stayed there until a
    connection closed — the AM declared it dead 60 s later. An all-reduce's work can be failed at once. It moves twice
    a reduce-scatter's bytes (and holds a copy of the input meanwhile): on CPU only, where a member's death must not
    hang the others."""

    def __init__(self, allreduce: dist.Work, summed: torch.Tensor, output: torch.Tensor, rank: int) -> None:
        super().__init__()
        self._allreduce, self._summed, self._output, self._rank = allreduce, summed, output, rank
        self._copied = False

    def _copy_out(self) -> None:
        if not self._copied:
            chunk = self._output.numel()
            self._output.copy_(self._summed.reshape(-1).narrow(0, self._rank * chunk, chunk).view_as(self._output))
            self._copied = True

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._allreduce.wait()  # raises the generation's failure, if it was failed
        self._copy_out()
        return True

    def get_future(self) -> torch.futures.Future:
        def copied(_: torch.futures.Future) -> list[torch.Tensor]:
            _.value()
            self._copy_out()
            return [self._output]

        return self._allreduce.get_future().then(copied)

    def is_completed(self) -> bool:
        return self._allreduce.is_completed()


class _Generation:
    """One generation's backend group and the work outstanding on it, failed as a whole."""

    def __init__(self, group: ProcessGroup, prefix: str, rank: int, world_size: int) -> None:
        self.group, self.prefix, self.rank, self.world_size = group, prefix, rank, world_size
        self.failure: BaseException | None = None
        self._outstanding: weakref.WeakSet[AbortableWork] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._groups_made: dict[tuple[int, ...], int] = {}
        self.user_backends: list[ProcessGroup] = []
        """The backends of the groups user code made in this generation: freed with the generation (see _retire)."""

    def next_group_key(self, ranks: list[int]) -> str:
        """The store key of the next group over ``ranks`` made in this generation: the same on every member.

        Every member makes the groups it belongs to in the same order (torch's rule for ``new_group``), so counting
        them per set of ranks agrees across members, also for ``use_local_synchronization`` (only the group's
        ranks call it) and for a joiner that made none before it was admitted."""
        members = tuple(ranks)
        count = self._groups_made.get(members, 0)
        self._groups_made[members] = count + 1
        digest = hashlib.sha1(",".join(map(str, members)).encode(), usedforsecurity=False).hexdigest()[:16]
        return f"{self.prefix}groups/{digest}/{count}/"

    def guard(self, start: Callable[[], dist.Work]) -> dist.Work:
        """Start a collective; its work is abortable unless the backend's work has no future (send/recv)."""
        self._raise_if_failed()
        inner = start()
        try:
            work = AbortableWork(inner)
        except RuntimeError:  # e.g. gloo send/recv work without a future
            return inner
        with self._lock:
            self._outstanding.add(work)
            failure = self.failure
        if failure is not None:
            work.abort(failure)
        return work

    def fail(self, failure: BaseException) -> None:
        """Every outstanding and later collective of this generation raises ``failure``."""
        with self._lock:
            if self.failure is None:
                self.failure = failure
            outstanding = list(self._outstanding)
        for work in outstanding:
            work.abort(failure)

    def disarm(self, timeout_s: float) -> None:
        """Disarm every outstanding work (see :meth:`AbortableWork.disarm`)."""
        with self._lock:
            outstanding = list(self._outstanding)
        for work in outstanding:
            work.disarm(timeout_s)

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def check_usable(self) -> None:
        self._raise_if_failed()


class _Forming:
    """A generation being formed: the failure reported for it before it was formed, if any."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.failure: BaseException | None = None

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure


class _Completed(dist.Work):
    """The work of a collective that completed without the group (a joiner's, whose result the members published)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result([])
        return future

    def is_completed(self) -> bool:
        return True


class _ForwardingCollectives:
    """Every collective forwarded to :meth:`_target` through :meth:`_guarded` (abortable work)."""

    def _target(self) -> ProcessGroup:
        raise NotImplementedError

    def _guarded(self, start: Any) -> Any:
        raise NotImplementedError

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.allreduce(tensors, opts) if opts is not None else target.allreduce(tensors))

    def allreduce_coalesced(self, tensors: Any, opts: Any) -> Any:
        target = self._target()
        return self._guarded(lambda: target.allreduce_coalesced(tensors, opts))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.broadcast(tensors, opts) if opts is not None else target.broadcast(tensors))

    def barrier(self, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.barrier(opts) if opts is not None else target.barrier())

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.allgather(output_tensors, input_tensors, opts))

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target._allgather_base(output, input, opts))

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.allgather_coalesced(output_lists, input_list, opts))

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.allgather_into_tensor_coalesced(outputs, inputs, opts))

    def all_gather_single(self, *args: Any) -> Any:
        """torch 2.13's ``dist.all_gather_single`` (FSDP2's all-gather) calls this method of the group."""
        target = self._target()
        return self._guarded(lambda: target.all_gather_single(*args))

    def all_gather_single_coalesced(self, *args: Any) -> Any:
        target = self._target()
        return self._guarded(lambda: target.all_gather_single_coalesced(*args))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        """torch 2.13's ``dist.reduce_scatter_single`` (FSDP2's reduce-scatter) calls this method of the group. On
        CPU tensors (gloo) it is an all-reduce (see :class:`_ReducedChunk`)."""
        target = self._target()
        if input.device.type == "cpu":
            return self._reduce_scatter_by_allreduce(target, output, input, opts)
        return self._guarded(lambda: target.reduce_scatter_single(output, input, opts))

    def _reduce_scatter_by_allreduce(self, target: ProcessGroup, output: torch.Tensor, input: torch.Tensor,
                                     opts: Any) -> dist.Work:
        summed = input.detach().clone()
        allreduce_opts = dist.AllreduceOptions()
        if opts is not None:
            allreduce_opts.reduceOp = opts.reduceOp
        work = self._guarded(lambda: target.allreduce([summed], allreduce_opts))
        return _ReducedChunk(work, summed, output, self.rank())

    def reduce_scatter_single_coalesced(self, *args: Any) -> Any:
        target = self._target()
        return self._guarded(lambda: target.reduce_scatter_single_coalesced(*args))

    def reduce_scatter_tensor_coalesced(self, *args: Any) -> Any:
        target = self._target()
        return self._guarded(lambda: target.reduce_scatter_tensor_coalesced(*args))

    def all_to_all_single(self, *args: Any) -> Any:
        target = self._target()
        return self._guarded(lambda: target.all_to_all_single(*args))

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.gather(output_tensors, input_tensors, opts))

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.scatter(output_tensors, input_tensors, opts))

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.reduce(tensors, opts))

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.reduce_scatter(output_tensors, input_tensors, opts))

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target._reduce_scatter_base(output, input, opts))

    def alltoall_base(self, output: Any, input: Any, output_splits: Any, input_splits: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.alltoall_base(output, input, output_splits, input_splits, opts))

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> Any:
        target = self._target()
        return self._guarded(lambda: target.send(tensors, dst_rank, tag))

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> Any:
        target = self._target()
        return self._guarded(lambda: target.recv(tensors, src_rank, tag))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        target = self._target()
        return self._guarded(lambda: target.recv_anysource(tensors, tag))

    def alltoall(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        target = self._target()
        return self._guarded(lambda: target.alltoall(output_tensors, input_tensors, opts))

    def monitored_barrier(self, timeout: timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """gloo's barrier that names the ranks that did not arrive (synchronous: it returns no work)."""
        target = self._target()
        self._check_usable()
        if timeout is None:
            return target.monitored_barrier(wait_all_ranks=wait_all_ranks)
        return target.monitored_barrier(timeout, wait_all_ranks)

    def _check_usable(self) -> None:
        """Raise where a collective on this group cannot run (a failed generation, a group of an earlier one)."""
        raise NotImplementedError


class ElasticProcessGroup(_ForwardingCollectives, ProcessGroup):
    """A process group whose members, rank and world size change while the object stays the same."""

    def __init__(self, store: dist.Store, backend: str, timeout: timedelta, device: torch.device | None) -> None:
        super().__init__(0, 1)  # C++ rank/size: fixed at construction, never read by us (see the module docstring)
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")
        self.store = store
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self.prefix: str | None = None
        self.hosts: list[str] = [socket.gethostname()]
        """The host name of each member of the current generation, by rank."""
        self._rank = 0
        self._size = 1
        self._current: ProcessGroup | None = None
        self._generation: _Generation | None = None
        self._retired: tuple[ProcessGroup, list[ProcessGroup]] | None = None
        self._forming: _Forming | None = None
        self._sides: list[_Generation] = []
        """The failure domains of the side groups in use (:meth:`side_group`)."""
        self._failed_prefixes: dict[str, BaseException] = {}
        """Each generation prefix :meth:`fail` was called for, with its failure (a side group made later fails too)."""
        self._start_hooks: StartHookResults | None = None
        self._taking_start_results: Callable[[], bool] = lambda: False

    # ------------------------------------------------------------------ the training's start hooks

    def follow_start_hooks(self, results: StartHookResults, taking: Callable[[], bool]) -> None:
        """Collectives called on this group directly in the training's start hooks: a member's results are published,
        a joiner's (``taking()``) taken from the members' without reaching the group (``elastic/start_hooks.py``)."""
        self._start_hooks, self._taking_start_results = results, taking

    def _following_raw(self) -> bool:
        """Whether a call on this group now is one made directly in a start hook."""
        return self._start_hooks is not None and self._start_hooks.following_raw

    def _in_start_hook(self, outputs: list[torch.Tensor], run: Callable[[], dist.Work],
                       own: torch.Tensor | None = None) -> dist.Work:
        results = self._start_hooks
        if results is None or not results.following_raw:
            return run()
        if self._taking_start_results():
            results.raw_taken(outputs, own)
            return _Completed()
        work = run()
        work.wait()
        results.raw_completed(outputs, publisher=self._rank == 0)
        return work

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        forward = super().allreduce
        return self._in_start_hook(list(tensors), lambda: forward(tensors, opts))

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        forward = super().broadcast
        return self._in_start_hook(list(tensors), lambda: forward(tensors, opts))

    def barrier(self, opts: Any = None) -> Any:
        forward = super().barrier
        return self._in_start_hook([], lambda: forward(opts))

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        forward = super().allgather
        if len(output_tensors) != 1:  # one input per device: torch.distributed.all_gather passes one
            return forward(output_tensors, input_tensors, opts)
        return self._in_start_hook(list(output_tensors[0]), lambda: forward(output_tensors, input_tensors, opts),
                                   own=input_tensors[0])

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        forward = super()._allgather_base
        if not self._following_raw():
            return forward(output, input, opts)
        slots = list(output.view(-1).split(input.numel()))  # all_gather_into_tensor: one slot per rank
        return self._in_start_hook(slots, lambda: forward(output, input, opts), own=input.reshape(-1))

    # ------------------------------------------------------------------ membership

    def configure(self, prefix: str, rank: int, world_size: int) -> float:
        """Leave the current generation and join the one whose rendezvous is under ``prefix``; returns seconds."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of size {world_size}")
        started = time.perf_counter()
        self.shutdown()
        forming = _Forming(prefix)
        self._forming = forming
        try:
            self.hosts = self._await_members(forming, dist.PrefixStore(prefix, self.store), rank, world_size)
            self._current = self._create(forming, prefix, _own_client(self.store), rank, world_size)
        finally:
            self._forming = None
        self._generation = _Generation(self._current, prefix, rank, world_size)
        self.prefix, self._rank, self._size = prefix, rank, world_size
        _publish_generation(self)
        elapsed = time.perf_counter() - started
        log.debug("process group %s: rank %d of %d in %.1f ms", prefix, rank, world_size, elapsed * 1e3)
        return elapsed

    def go_alone(self) -> None:
        """This process is out of the job (it left; a joiner not admitted yet): leave its generation for a world of this
        process alone, so that the collectives it makes (a leaver's ``teardown`` hooks, its script's ``finally:``
        blocks, a ``destroy_process_group``) complete at once, as the strategy's own do there, instead of failing on a
        group it does not have."""
        self.shutdown()
        group = group_of_this_process()
        torch_compat.keep_alive_forever(group)  # never freed: not by interpreter finalization (keep_backends_for_life)
        torch_compat.set_default_backend(self, ProcessGroup.BackendType.GLOO)
        _register_backends_of(group, self)
        self._current, self._generation = group, _Generation(group, ALONE_PREFIX, 0, 1)
        self.prefix, self._rank, self._size, self.hosts = ALONE_PREFIX, 0, 1, [socket.gethostname()]
        torch_compat.publish_default_group(self, dist.HashStore(), 1)

    def _await_members(self, forming: _Forming, store: dist.Store, rank: int, world_size: int) -> list[str]:
        """Wait until every member of the generation has arrived, or raise the failure :meth:`fail` reports for it;
        returns each member's host name, by rank (an arrival key holds its member's host).

        gloo's rendezvous waits for a missing peer for the whole collective timeout; a member that dies before it
        arrives (killed while it started, or during an adjustment) would hold the others that long. Arrival is a key
        per rank, awaited in short waits between which a failure of the generation being formed is noticed."""
        store.set(f"{ARRIVED_KEY}/{rank}", socket.gethostname().encode())
        keys = [f"{ARRIVED_KEY}/{member}" for member in range(world_size)]
        pause, deadline = ARRIVAL_POLL_MIN_S, time.monotonic() + self.timeout.total_seconds()
        while not store.check(keys):  # check(): a TCPStore wait() that times out leaves its socket out of step
            forming.raise_if_failed()
            if time.monotonic() > deadline:  # what gloo's own rendezvous would have waited
                missing = [key for key in keys if not store.check([key])]
                raise dist.DistStoreError(f"generation {forming.prefix!r}: timed out after {self.timeout}: {missing} "
                                          "did not arrive")  # a store wait's timeout: ``is_a_collective_timeout``
            time.sleep(pause)
            pause = min(ARRIVAL_POLL_MAX_S, pause * 2)
        return [store.get(key).decode() for key in keys]

    def shutdown(self) -> None:
        """Let go of the current generation's backend (its pending work is complete: we are at a batch boundary)."""
        current, generation = self._current, self._generation
        self._current, self._generation = None, None
        if current is not None:
            self._release(current, abort=False)
            self._retire(current, generation.user_backends if generation is not None else [])

    def _retire(self, group: ProcessGroup, user_backends: list[ProcessGroup]) -> None:
        """Free the generation retired before ``group``; keep ``group`` until the next one is retired.

        Freeing a gloo group joins its worker threads while holding the GIL, and a worker thread that still holds the
        last reference to a collective it has just finished needs the GIL to free that work's Python tensors: a
        deadlock in the moments after a collective completes (seen with plain DDP's teardown in torch 2.13). The
        threads of a group retired a whole generation ago are idle. The groups user code made in it go with it."""
        self._retired = (group, user_backends)  # frees the one retired before it

    def keep_backends_for_life(self) -> None:
        """The group's last generation is never freed: once this object is uninstalled, nothing frees it before the
        interpreter finalizes, and a gloo group freed during finalization aborted a worker that had finished training
        ("terminate called without an active exception", no Python frame left; seen in CI after a rank 0's death).
        The process is ending: the OS reclaims it."""
        retired = self._retired
        if retired is not None:
            torch_compat.keep_alive_forever(retired)

    def abort(self) -> None:
        """Tear a broken generation down without waiting for its peers (NCCL: ``ncclCommAbort``)."""
        generation, self._current, self._generation = self._generation, None, None
        if generation is not None:
            self._release(generation.group, abort=True)
            _keep_forever(generation)

    def fail(self, prefix: str, failure: BaseException) -> bool:
        """A member of the generation formed under ``prefix`` died: its outstanding and later collectives raise
        ``failure`` (callable from any thread; the group is released by the next :meth:`configure`/:meth:`abort`).
        Returns whether ``prefix`` was the current generation."""
        forming = self._forming
        if forming is not None and forming.prefix == prefix:
            forming.failure = failure
        self._failed_prefixes.setdefault(prefix, failure)
        self._fail_sides(prefix, failure)
        generation = self._generation
        if generation is None or generation.prefix != prefix:
            return False
        generation.fail(failure)
        if self.backend == "nccl" and generation.failure is failure:
            self._release(generation.group, abort=True)  # a kernel waiting on a dead peer only returns on abort
        return True

    def new_group(self, ranks: list[int], timeout: timedelta | None = None, pg_options: Any = None,
                  group_name: str | None = None, group_desc: str | None = None,
                  tolerating: Callable[[], bool] | None = None) -> ProcessGroup | None:
        """``torch.distributed.new_group`` (and ``new_subgroups``, Lightning's ``_InfiniteBarrier``) on this group.

        torch (2.13) hands subgroup creation to a default group that implements it (``_new_group_with_tag``). The
        group is formed among the current generation's ranks on a store key of that generation, and is valid for
        that generation only: used after a resize it raises :class:`StaleGroupError`. ``None``: not a member.
        ``tolerating``: a :class:`TolerantUserGroup` (an HSDP mesh's subgroup in user code)."""
        generation = self._generation
        if generation is None:
            raise RuntimeError("torch.distributed.new_group: this worker is not a member of the job right now "
                               "(it joins or leaves it)")
        key = generation.next_group_key(ranks)
        if generation.rank not in ranks:
            return None
        client = _own_client(self.store)
        store = dist.PrefixStore(key, client)
        group_timeout = timeout if timeout is not None else self.timeout
        backend = _connect_watching(
            lambda: self._backend_group(store, ranks.index(generation.rank), len(ranks), group_timeout, True),
            generation.check_usable, client)
        generation.user_backends.append(backend)
        log.debug("new_group %s over ranks %s of %s (%s)", group_name, ranks, generation.prefix, group_desc)
        if tolerating is not None:
            return TolerantUserGroup(backend, generation, self, ranks, tolerating)
        return UserGroup(backend, generation, self, ranks)

    def side_group(self, prefix: str, connect: Callable[[dist.Store], ProcessGroup]) -> SideGroup:
        """A group built beside the generations by ``connect(store client)`` (a live reshard's transfer group, which
        a leaver in no generation shares) whose collectives fail with the generation formed under ``prefix``: its work
        is an :class:`AbortableWork` that :meth:`fail` releases, as a generation's own. gloo's rendezvous runs in a
        thread while this one watches for that failure (a member that died before it connected holds no one). Only
        collectives whose backend work has a future are abortable (gloo's send/recv are not: use ``alltoall_base``).
        Close it once done; a failed one is kept for the life of the process (see :func:`_keep_forever`)."""
        client = _own_client(self.store)
        backend = _connect_watching(lambda: connect(client), lambda: self._raise_if_prefix_failed(prefix), client)
        domain = _Generation(backend, prefix, backend.rank(), backend.size())
        self._sides.append(domain)
        failure = self._failed_prefixes.get(prefix)
        if failure is not None:
            self._fail_side(domain, failure)
        return SideGroup(domain, self)

    def _raise_if_prefix_failed(self, prefix: str) -> None:
        failure = self._failed_prefixes.get(prefix)
        if failure is not None:
            raise failure

    def _fail_sides(self, prefix: str, failure: BaseException) -> None:
        for domain in [side for side in self._sides if side.prefix == prefix]:
            self._fail_side(domain, failure)

    def _fail_side(self, domain: _Generation, failure: BaseException) -> None:
        domain.fail(failure)
        if domain.failure is failure and domain in self._sides:
            self._sides.remove(domain)
            _keep_forever(domain)  # its collective may still wait on a peer: never destroyed, disarmed at exit

    def close_side(self, domain: _Generation) -> None:
        """A side group is done (its collectives completed): it is no longer failed with its generation."""
        if domain in self._sides:
            self._sides.remove(domain)

    def generation_view(self, tolerating: Callable[[], bool] | None = None) -> ProcessGroup:
        """The current generation as a process group of its own size (for DDP, which reads the C++ size); with
        ``tolerating``, a :class:`TolerantGenerationGroup`."""
        generation = self._generation
        if generation is None:
            raise RuntimeError("the elastic process group is not part of any generation (not configured)")
        if tolerating is not None:
            return TolerantGenerationGroup(generation, self, tolerating)
        return GenerationGroup(generation, self)

    def _create(self, forming: _Forming, prefix: str, client: dist.Store, rank: int, world_size: int) -> ProcessGroup:
        """The generation's backends, connected on ``client`` under ``prefix`` while watching for the generation's
        failure (see :func:`_connect_watching`)."""
        store = dist.PrefixStore(prefix, client)
        group = _connect_watching(lambda: self._backend_group(store, rank, world_size, self.timeout),
                                  forming.raise_if_failed, client)
        default = ProcessGroup.BackendType.NCCL if self.backend == "nccl" else ProcessGroup.BackendType.GLOO
        torch_compat.set_default_backend(self, default)
        _register_backends_of(group, self)  # DDP's construction logging and object collectives look them up here
        return group

    def _backend_group(self, store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                       default_gloo: bool = False) -> ProcessGroup:
        """A plain process group of gloo (CPU tensors) and, for an NCCL job, NCCL (CUDA tensors) over ``store``."""
        group = ProcessGroup(store, rank, world_size)
        gloo = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        torch_compat.start_sequence_numbers(gloo)
        devices = [(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)]
        default = ProcessGroup.BackendType.GLOO
        if self.backend == "nccl":
            nccl = torch_compat.nccl_backend(dist.PrefixStore("nccl/", store) if default_gloo else store, rank,
                                             world_size, timeout)
            torch_compat.start_sequence_numbers(nccl)
            devices.append((torch.device("cuda"), ProcessGroup.BackendType.NCCL, nccl))
            default = ProcessGroup.BackendType.GLOO if default_gloo else ProcessGroup.BackendType.NCCL
        elif torch.cuda.is_available():
            devices.append((torch.device("cuda"), ProcessGroup.BackendType.GLOO, gloo))
        torch_compat.set_default_backend(group, default)
        for device, kind, backend in devices:
            torch_compat.register_backend(group, device, kind, backend)
        return group

    @staticmethod
    def _release(group: ProcessGroup, abort: bool) -> None:
        for device in ("cuda", "cpu"):
            backend = torch_compat.backend_of(group, device)
            if backend is None:
                continue
            if abort and hasattr(backend, "abort"):
                backend.abort()
            elif hasattr(backend, "shutdown") and device == "cuda" and backend.name() == "nccl":
                backend.shutdown()

    # ------------------------------------------------------------------ what torch.distributed asks

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def getBackendName(self) -> str:
        return self.backend

    def name(self) -> str:
        return self.backend

    @property
    def failure(self) -> BaseException | None:
        """What the current generation's collectives were failed with (:meth:`fail`), if they were."""
        generation = self._generation
        return None if generation is None else generation.failure

    @property
    def current(self) -> ProcessGroup:
        if self._current is None:
            raise RuntimeError("the elastic process group is not part of any generation (not configured)")
        return self._current

    def _target(self) -> ProcessGroup:
        return self.current

    def _guarded(self, start: Callable[[], dist.Work]) -> dist.Work:
        generation = self._generation
        if generation is None:
            raise RuntimeError("the elastic process group is not part of any generation (not configured)")
        return generation.guard(start)

    def _check_usable(self) -> None:
        generation = self._generation
        if generation is None:
            raise RuntimeError("the elastic process group is not part of any generation (not configured)")
        generation.check_usable()

    def __repr__(self) -> str:
        return f"ElasticProcessGroup({self.backend}, {self.prefix!r}, rank {self._rank} of {self._size})"


class GenerationGroup(_ForwardingCollectives, ProcessGroup):
    """One generation seen as a process group of fixed rank and size, with abortable work (what DDP is given)."""

    def __init__(self, generation: _Generation, parent: ElasticProcessGroup) -> None:
        super().__init__(generation.rank, generation.world_size)
        self._generation = generation
        self._parent = parent
        backend_type = ProcessGroup.BackendType.NCCL if parent.backend == "nccl" else ProcessGroup.BackendType.GLOO
        torch_compat.set_default_backend(self, backend_type)
        _register_backends_of(generation.group, self)

    @property
    def generation(self) -> object:
        """The generation this view shows (the same object for every view of it)."""
        return self._generation

    def _target(self) -> ProcessGroup:
        return self._generation.group

    def _guarded(self, start: Callable[[], dist.Work]) -> dist.Work:
        return self._generation.guard(start)

    def _check_usable(self) -> None:
        self._generation.check_usable()

    def size(self) -> int:
        return self._generation.world_size

    def rank(self) -> int:
        return self._generation.rank

    def getBackendName(self) -> str:
        return self._parent.backend

    def name(self) -> str:
        return self._parent.backend


class _ToleratingCollectives:
    """Collectives that, while ``tolerating()`` says so, do not raise when they fail: the first failure is kept
    (:meth:`take_failure`) and the collective returns, its output tensors as they were. For the collectives a sharded
    model makes inside user code (FSDP2's all-gather in the forward, its reduce-scatter in the backward, HSDP's
    replica all-reduce): the step they belong to is discarded once its owner takes the failure."""

    _tolerating: Callable[[], bool]
    _failure: BaseException | None = None

    def take_failure(self) -> BaseException | None:
        """The first collective failure tolerated since the last call (None: none)."""
        failure, self._failure = self._failure, None
        return failure

    def _tolerate(self, error: BaseException) -> None:
        if self._failure is None:
            log.debug("a collective of a sharded model failed (%s); its step is discarded", error)
            self._failure = error

    def _guarded(self, start: Callable[[], dist.Work]) -> dist.Work:
        if not self._tolerating():
            return super()._guarded(start)  # type: ignore[misc]
        try:
            work = super()._guarded(start)  # type: ignore[misc]
        except Exception as error:
            self._tolerate(error)
            return _Tolerated(None, self._tolerate)
        return _Tolerated(work, self._tolerate)


class TolerantGenerationGroup(_ToleratingCollectives, GenerationGroup):
    """A generation's view whose collectives tolerate failures while ``tolerating()`` (see
    :class:`_ToleratingCollectives`)."""

    def __init__(self, generation: _Generation, parent: ElasticProcessGroup, tolerating: Callable[[], bool]) -> None:
        super().__init__(generation, parent)
        self._tolerating = tolerating
        self._failure = None


class _Tolerated(dist.Work):
    """A collective's work whose failure goes to ``tolerate`` instead of raising (``inner`` None: it never started)."""

    def __init__(self, inner: dist.Work | None, tolerate: Callable[[BaseException], None]) -> None:
        super().__init__()
        self._inner, self._tolerate_error = inner, tolerate

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._inner is not None:
            try:
                self._inner.wait()
            except Exception as error:
                self._tolerate_error(error)
        return True

    def is_completed(self) -> bool:
        return self._inner is None or self._inner.is_completed()

    def get_future(self) -> torch.futures.Future:
        if self._inner is None:
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(None)
            return done
        return self._inner.get_future().then(self._value_or_tolerated)

    def _value_or_tolerated(self, future: torch.futures.Future) -> Any:
        try:
            return future.value()
        except Exception as error:
            self._tolerate_error(error)
            return None


class SideGroup(_ForwardingCollectives):
    """A backend built beside the generations whose collectives fail with one generation (see
    :meth:`ElasticProcessGroup.side_group`): used through its own methods (``alltoall_base``, ``allreduce``, ...), as a
    c10d backend is."""

    def __init__(self, domain: _Generation, parent: ElasticProcessGroup) -> None:
        self._domain, self._parent = domain, parent

    def _target(self) -> ProcessGroup:
        return self._domain.group

    def _guarded(self, start: Callable[[], dist.Work]) -> dist.Work:
        return self._domain.guard(start)

    def _check_usable(self) -> None:
        self._domain.check_usable()

    def rank(self) -> int:
        return self._domain.rank

    def size(self) -> int:
        return self._domain.world_size

    def close(self) -> None:
        """Done with it: a later failure of its generation no longer concerns it."""
        self._parent.close_side(self._domain)


class StaleGroupError(RuntimeError):
    """A process group made with ``new_group`` in one generation was used after the job was resized."""


class UserGroup(_ForwardingCollectives, ProcessGroup):
    """A group user code made with ``torch.distributed.new_group``: some ranks of one generation, valid in it only.

    Its collectives are abortable like the generation's own (a member's death releases them), and a collective in
    a later generation raises :class:`StaleGroupError` instead of waiting forever for ranks that moved."""

    def __init__(self, backend: ProcessGroup, generation: _Generation, parent: ElasticProcessGroup,
                 ranks: list[int]) -> None:
        super().__init__(ranks.index(generation.rank), len(ranks))
        self._backend_group, self._generation, self._parent, self.ranks = backend, generation, parent, ranks
        torch_compat.set_default_backend(self, ProcessGroup.BackendType.GLOO)
        _register_backends_of(backend, self)

    def _target(self) -> ProcessGroup:
        return self._backend_group

    def _guarded(self, start: Callable[[], dist.Work]) -> dist.Work:
        self._check_usable()
        return self._generation.guard(start)

    def _check_usable(self) -> None:
        current = self._parent._generation
        if current is not self._generation:
            now = f"{current.prefix!r} (rank {current.rank} of {current.world_size})" if current else "no generation"
            raise StaleGroupError(
                f"a process group made with torch.distributed.new_group in generation {self._generation.prefix!r} "
                f"(ranks {self.ranks} of {self._generation.world_size}) was used after the job's resize to {now}: "
                "its ranks no longer exist. Make such groups again after a resize (e.g. in the step that uses them)")
        self._generation.check_usable()

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(self._generation.rank)

    def getBackendName(self) -> str:
        return "gloo"

    def name(self) -> str:
        return "gloo"


class TolerantUserGroup(_ToleratingCollectives, UserGroup):
    """A subgroup of a generation (an HSDP mesh's shard or replica group) whose collectives tolerate failures while
    ``tolerating()`` (see :class:`_ToleratingCollectives`)."""

    def __init__(self, backend: ProcessGroup, generation: _Generation, parent: ElasticProcessGroup, ranks: list[int],
                 tolerating: Callable[[], bool]) -> None:
        super().__init__(backend, generation, parent, ranks)
        self._tolerating = tolerating
        self._failure = None


def _backend_type(backend: Any) -> ProcessGroup.BackendType:
    return ProcessGroup.BackendType.NCCL if backend.name() == "nccl" else ProcessGroup.BackendType.GLOO


def group_of_this_process() -> ProcessGroup:
    """A gloo group of this process alone (its collectives return at once); it serves CUDA tensors too: nothing ever
    leaves the process."""
    store = dist.HashStore()
    group = ProcessGroup(store, 0, 1)
    gloo = dist.ProcessGroupGloo(store, 0, 1, timedelta(minutes=5))
    torch_compat.set_default_backend(group, ProcessGroup.BackendType.GLOO)
    for device in ("cpu", "cuda"):
        torch_compat.register_backend(group, device, ProcessGroup.BackendType.GLOO, gloo)
    return group


def _register_backends_of(group: ProcessGroup, outer: ProcessGroup) -> None:
    """Register ``group``'s backends on ``outer`` (C++ callers such as DDP's logging look them up on it)."""
    for device in ("cpu", "cuda"):
        backend = torch_compat.backend_of(group, device)
        if backend is not None:
            torch_compat.register_backend(outer, device, _backend_type(backend), backend)


def _publish_generation(group: ElasticProcessGroup) -> None:
    """What torch keeps of the default group is the current generation's: its ranks and its store
    (``init_process_group`` recorded a world of one and a local ``HashStore``; see
    :func:`torch_compat.publish_default_group`)."""
    if group.prefix is None:
        return
    torch_compat.publish_default_group(group, dist.PrefixStore(f"{group.prefix}default/", group.store), group.size())

_abandoned: list[_Generation] = []
_abandoned_connects: list[_Connecting] = []


def _own_client(store: dist.Store) -> dist.Store:
    """A client of ``store`` with a connection of its own: a ``TCPStore`` client holds its one connection through a
    blocking wait (torch 2.13, ``TCPStore::activeOpLock_``), so a backend's rendezvous waiting on a dead peer would
    hold every other use of the job store — the next generation's arrival, the commit vote — for the whole timeout.
    The etcd store takes no such lock; its clone can be closed alone (:func:`_end_abandoned_connects`)."""
    return store.clone() if isinstance(store, dist.TCPStore | EtcdRendezvousStore) else store


class _Connecting:
    """A backend's construction running in a thread of its own (its rendezvous releases the GIL)."""

    def __init__(self, connect: Callable[[], ProcessGroup], client: dist.Store) -> None:
        self.done = threading.Event()
        self.group: ProcessGroup | None = None
        self.error: BaseException | None = None
        self.client = client  # the store client its rendezvous uses
        self._connect = connect
        threading.Thread(target=self._run, name="elan-connect", daemon=True).start()

    def _run(self) -> None:
        try:
            self.group = self._connect()
        except BaseException as error:  # handed to the waiting thread (or dropped with an abandoned connect)
            self.error = error
        finally:
            self.done.set()

    def result(self) -> ProcessGroup:
        if self.error is not None:
            raise self.error
        assert self.group is not None
        return self.group


def _connect_watching(connect: Callable[[], ProcessGroup], raise_if_failed: Callable[[], None],
                      client: dist.Store) -> ProcessGroup:
    """``connect()`` — gloo's rendezvous on ``client``, which waits for a missing peer for the whole collective
    timeout — in a thread, while this one watches for the generation's failure and raises it: a member that dies
    after it arrived but before it connected does not hold the others. An abandoned connect ends by its own timeout,
    or at exit (:func:`_end_abandoned_connects`); what it made is never freed (see :func:`_keep_forever`)."""
    connecting = _Connecting(connect, client)
    pause = ARRIVAL_POLL_MIN_S
    while not connecting.done.wait(pause):
        try:
            raise_if_failed()
        except BaseException:
            _abandoned_connects.append(connecting)
            _destroy_at_exit()  # ends it before the interpreter finalizes
            raise
        pause = min(ARRIVAL_POLL_MAX_S, pause * 2)
    return connecting.result()


def _keep_forever(generation: _Generation) -> None:
    """Never destroy a failed generation's group: its backend may still run a collective that waits on a dead peer,
    and gloo's destructor (closing the pairs of that collective, then joining its worker threads) throws
    ``gloo::IoException`` from a destructor — ``std::terminate`` — or blocks until the collective timeout. The group
    is kept referenced for the life of the process (an extra reference the interpreter never drops, so not even
    interpreter shutdown destroys it); its pending collective ends with an error when its peers exit — after our
    exit hook disarmed it (:func:`_disarm_all`) if that is after we exit."""
    _abandoned.append(generation)
    torch_compat.keep_alive_forever(generation.group)


def install_default_group(group: ElasticProcessGroup) -> None:
    """Make ``group`` torch's default process group (once per process), destroyed again at interpreter exit.

    ``init_process_group`` builds the default group through a registered backend factory; ours returns ``group``
    itself, so rank and world size passed here are placeholders (``group`` answers them live).
    """
    global _installing
    if dist.is_initialized():
        if dist.group.WORLD is not group:
            raise RuntimeError("another default process group exists; lightning_elan needs to own the default group")
        return
    with _install_lock:
        _register_backend()
        _installing = group
        try:
            dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=0, world_size=1, timeout=group.timeout)
        finally:
            _installing = None
        # callers branch on get_backend() (Lightning's _sync_ddp avoids ReduceOp.AVG on "gloo")
        torch_compat.report_backend_name(group, group.backend)
        _publish_generation(group)
    _destroy_at_exit()


def _destroy_at_exit() -> None:
    """torch asks for ``destroy_process_group`` before exit; left to interpreter finalization, a gloo group has
    aborted a finished worker ("terminate called without an active exception")."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_default_group)
        _exit_hook_registered = True


def uninstall_default_group(group: ElasticProcessGroup) -> None:
    """Destroy torch's default group if it is ``group`` (a standalone run ends; a later one installs its own)."""
    group.shutdown()
    group.keep_backends_for_life()
    if dist.is_initialized() and dist.group.WORLD is group:
        dist.destroy_process_group()


def _register_backend() -> None:
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    dist.Backend.register_backend(BACKEND_NAME, _create_from_registry, devices=devices)


def _create_from_registry(store: Any, rank: int, world_size: int, timeout: Any) -> ProcessGroup:
    if _installing is None:
        raise RuntimeError(f"the {BACKEND_NAME!r} backend is created by lightning_elan only")
    return _installing


def _destroy_default_group() -> None:
    _disarm_all()
    world = dist.group.WORLD if dist.is_initialized() else None
    if isinstance(world, ElasticProcessGroup):
        uninstall_default_group(world)


def _disarm_all() -> None:
    """Before the interpreter finalizes: no collective may call into Python when it ends later (abandoned generations
    end when their peers exit), and none may be doing so while the interpreter finalizes."""
    generations = list(_abandoned)
    world = dist.group.WORLD if dist.is_initialized() else None
    if isinstance(world, ElasticProcessGroup) and world._generation is not None:
        generations.append(world._generation)
    if isinstance(world, ElasticProcessGroup):
        generations.extend(world._sides)
    for generation in generations:
        generation.disarm(DISARM_WAIT_S)
    _await_released_callbacks(DISARM_WAIT_S)
    _end_abandoned_connects(DISARM_WAIT_S)


def _end_abandoned_connects(timeout_s: float) -> None:
    """Before the interpreter finalizes: an abandoned connect still polling the etcd store calls into Python from
    gloo's C++ rendezvous, and taking the GIL during finalization ends that thread with ``pthread_exit``, whose
    unwinding through C++ kills the process (etcd storm seed 9010: two survivors that had finished training died
    with SIGABRT, "terminate called without an active exception"). Closing its store client makes its rendezvous
    raise; the thread then returns while the interpreter is whole. (A ``TCPStore`` client waits in C++ alone.)"""
    pending = [connecting for connecting in _abandoned_connects
               if isinstance(connecting.client, EtcdRendezvousStore) and not connecting.done.is_set()]
    for connecting in pending:
        connecting.client.close()
    deadline = time.monotonic() + timeout_s
    for connecting in pending:
        connecting.done.wait(max(0.0, deadline - time.monotonic()))
