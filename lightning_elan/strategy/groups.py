"""Process groups per generation on one long-lived store."""

from __future__ import annotations

import atexit
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elan.strategy.identity import WorkerIdentity, split_host_port

log = logging.getLogger(__name__)


class GenerationGroups:
    """Forms the default process group of each generation from a ``PrefixStore`` of one store that outlives them."""

    def __init__(self, store: dist.Store, backend: str, timeout: timedelta, device: torch.device | None) -> None:
        self.store = store
        self.backend = backend
        self.timeout = timeout
        self.device = device
        self.generation: int | None = None
        self._leave_at_exit_registered = False

    @classmethod
    def connect(cls, identity: WorkerIdentity, backend: str, timeout: timedelta, device: torch.device | None):
        """Client of the launcher's TCPStore, or an in-process store for a standalone run."""
        if identity.standalone:
            return cls(dist.HashStore(), backend, timeout, device)
        host, port = split_host_port(identity.store_address or "")
        store = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
        return cls(store, backend, timeout, device)

    def form(self, generation: int, rank: int, world_size: int) -> float:
        """Leave the current group and join generation ``generation``; returns seconds spent."""
        start = time.perf_counter()
        self.leave()
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore(f"elan/gen{generation}/", self.store),
            rank=rank,
            world_size=world_size,
            timeout=self.timeout,
            device_id=self.device if self.device is not None and self.device.type != "cpu" else None,
        )
        self.generation = generation
        self._leave_at_exit()
        elapsed = time.perf_counter() - start
        log.debug("generation %d formed: rank %d of %d in %.1f ms", generation, rank, world_size, elapsed * 1e3)
        return elapsed

    def _leave_at_exit(self) -> None:
        """Destroy the group before the interpreter shuts down (members keep it after ``fit`` for a later ``validate``).

        torch asks for ``destroy_process_group`` before exit; left to interpreter finalization, a worker that had
        finished training once died at exit with "terminate called without an active exception" (SIGABRT) in CI.
        """
        if not self._leave_at_exit_registered:
            atexit.register(self.leave)
            self._leave_at_exit_registered = True

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.generation = None

    @property
    def active(self) -> bool:
        return self.generation is not None and dist.is_initialized()

    def replication_prefix(self, generation: int) -> str:
        """Store prefix of the transfers that form ``generation`` (one namespace per adjustment)."""
        return f"elan/gen{generation}/transfer"
