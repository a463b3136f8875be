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
parameter check — must be given :attr:`ElasticProcessGroup.current`, the generation's own group.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

__all__ = ["ElasticProcessGroup", "install_default_group", "uninstall_default_group"]

BACKEND_NAME = "elan"
"""The name the group is registered under with ``torch.distributed.Backend``."""

_install_lock = threading.Lock()
_installing: ElasticProcessGroup | None = None
_exit_hook_registered = False


class ElasticProcessGroup(ProcessGroup):
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
        self._rank = 0
        self._size = 1
        self._current: ProcessGroup | None = None

    # ------------------------------------------------------------------ membership

    def configure(self, prefix: str, rank: int, world_size: int) -> float:
        """Leave the current generation and join the one whose rendezvous is under ``prefix``; returns seconds."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a world of size {world_size}")
        started = time.perf_counter()
        self.shutdown()
        group_store = dist.PrefixStore(prefix, self.store)
        self._current = self._create(group_store, rank, world_size)
        self.prefix, self._rank, self._size = prefix, rank, world_size
        elapsed = time.perf_counter() - started
        log.debug("process group %s: rank %d of %d in %.1f ms", prefix, rank, world_size, elapsed * 1e3)
        return elapsed

    def shutdown(self) -> None:
        """Let go of the current generation's backend (its pending work is complete: we are at a batch boundary)."""
        current, self._current = self._current, None
        if current is not None:
            self._release(current, abort=False)

    def abort(self) -> None:
        """Tear a broken generation down without waiting for its peers (NCCL: ``ncclCommAbort``)."""
        current, self._current = self._current, None
        if current is not None:
            self._release(current, abort=True)

    def _create(self, store: dist.Store, rank: int, world_size: int) -> ProcessGroup:
        group = ProcessGroup(store, rank, world_size)
        gloo = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        gloo._set_sequence_number_for_group()
        devices = [(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)]
        default = ProcessGroup.BackendType.GLOO
        if self.backend == "nccl":
            devices.append((torch.device("cuda"), ProcessGroup.BackendType.NCCL, self._nccl(store, rank, world_size)))
            default = ProcessGroup.BackendType.NCCL
        elif torch.cuda.is_available():
            devices.append((torch.device("cuda"), ProcessGroup.BackendType.GLOO, gloo))
        group._set_default_backend(default)
        self._set_default_backend(default)
        for device, kind, backend in devices:
            group._register_backend(device, kind, backend)
            # DDP's construction logging and object collectives look the backend up on this (outer) object
            self._register_backend(device, kind, backend)
        return group

    def _nccl(self, store: dist.Store, rank: int, world_size: int) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        backend = dist.ProcessGroupNCCL(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        return backend

    @staticmethod
    def _release(group: ProcessGroup, abort: bool) -> None:
        for device in ("cuda", "cpu"):
            try:
                backend = group._get_backend(torch.device(device))
            except RuntimeError:
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
    def current(self) -> ProcessGroup:
        if self._current is None:
            raise RuntimeError("the elastic process group is not part of any generation (not configured)")
        return self._current

    # ------------------------------------------------------------------ collectives: forwarded to the generation

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        return self.current.allreduce(tensors, opts) if opts is not None else self.current.allreduce(tensors)

    def allreduce_coalesced(self, tensors: Any, opts: Any) -> Any:
        return self.current.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors: Any, opts: Any = None) -> Any:
        return self.current.broadcast(tensors, opts) if opts is not None else self.current.broadcast(tensors)

    def barrier(self, opts: Any = None) -> Any:
        return self.current.barrier(opts) if opts is not None else self.current.barrier()

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        return self.current.allgather(output_tensors, input_tensors, opts)

    def _allgather_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self.current._allgather_base(output, input, opts)

    def allgather_coalesced(self, output_lists: Any, input_list: Any, opts: Any = None) -> Any:
        return self.current.allgather_coalesced(output_lists, input_list, opts)

    def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        return self.current.allgather_into_tensor_coalesced(outputs, inputs, opts)

    def gather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        return self.current.gather(output_tensors, input_tensors, opts)

    def scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        return self.current.scatter(output_tensors, input_tensors, opts)

    def reduce(self, tensors: Any, opts: Any = None) -> Any:
        return self.current.reduce(tensors, opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        return self.current.reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(self, output: Any, input: Any, opts: Any = None) -> Any:
        return self.current._reduce_scatter_base(output, input, opts)

    def alltoall_base(self, output: Any, input: Any, output_splits: Any, input_splits: Any, opts: Any = None) -> Any:
        return self.current.alltoall_base(output, input, output_splits, input_splits, opts)

    def send(self, tensors: Any, dst_rank: int, tag: int = 0) -> Any:
        return self.current.send(tensors, dst_rank, tag)

    def recv(self, tensors: Any, src_rank: int, tag: int = 0) -> Any:
        return self.current.recv(tensors, src_rank, tag)

    def __repr__(self) -> str:
        return f"ElasticProcessGroup({self.backend}, {self.prefix!r}, rank {self._rank} of {self._size})"


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
        _report_backend_as(group, group.backend)
    _destroy_at_exit()


def _destroy_at_exit() -> None:
    """torch asks for ``destroy_process_group`` before exit; left to interpreter finalization, a gloo group has
    aborted a finished worker ("terminate called without an active exception")."""
    global _exit_hook_registered
    if not _exit_hook_registered:
        atexit.register(_destroy_default_group)
        _exit_hook_registered = True


def _report_backend_as(group: ElasticProcessGroup, backend: str) -> None:
    """Make ``torch.distributed.get_backend()`` answer ``backend`` instead of our registration name.

    torch (2.3-2.13) answers it from ``distributed_c10d._world.pg_map[group][0]``, the name given to
    ``init_process_group``; callers branch on it (Lightning's ``_sync_ddp`` avoids ``ReduceOp.AVG`` on "gloo").
    """
    world = dist.distributed_c10d._world
    _, store = world.pg_map[group]
    world.pg_map[group] = (backend, store)


def uninstall_default_group(group: ElasticProcessGroup) -> None:
    """Destroy torch's default group if it is ``group`` (a standalone run ends; a later one installs its own)."""
    group.shutdown()
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
    world = dist.group.WORLD if dist.is_initialized() else None
    if isinstance(world, ElasticProcessGroup):
        uninstall_default_group(world)
