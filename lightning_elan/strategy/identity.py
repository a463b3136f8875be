"""Who this worker is, read once from the environment the launcher sets (pure)."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_COORDINATE_EVERY = 10


@dataclass(frozen=True)
class WorkerIdentity:
    """The launcher's description of this process; ``standalone`` when no ``elan run`` started it."""

    job: str
    worker_id: str
    role: str  # "member", "joiner" or "standalone"
    am_address: str | None
    store_address: str | None
    generation: int
    rank: int
    world_size: int
    coordinate_every: int
    spawn_time: float
    device_index: int | None

    @property
    def standalone(self) -> bool:
        return self.role == "standalone"

    @property
    def joiner(self) -> bool:
        return self.role == "joiner"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerIdentity:
        env = os.environ if env is None else env
        if "ELAN_AM_ADDRESS" not in env:
            return cls.standalone_process(int(env.get("ELAN_COORDINATE_EVERY", DEFAULT_COORDINATE_EVERY)))
        role = env.get("ELAN_ROLE", "member")
        if role not in ("member", "joiner"):
            raise ValueError(f"ELAN_ROLE must be 'member' or 'joiner', got {role!r}")
        device = env.get("ELAN_DEVICE_INDEX")
        return cls(
            job=env["ELAN_JOB"],
            worker_id=env["ELAN_WORKER_ID"],
            role=role,
            am_address=env["ELAN_AM_ADDRESS"],
            store_address=env["ELAN_STORE_ADDRESS"],
            generation=int(env.get("ELAN_GENERATION", -1)),
            rank=int(env.get("ELAN_RANK", -1)),
            world_size=int(env.get("ELAN_WORLD_SIZE", 0)),
            coordinate_every=int(env.get("ELAN_COORDINATE_EVERY", DEFAULT_COORDINATE_EVERY)),
            spawn_time=float(env.get("ELAN_SPAWN_TIME", time.time())),
            device_index=None if device in (None, "") else int(device),
        )

    @classmethod
    def standalone_process(cls, coordinate_every: int = DEFAULT_COORDINATE_EVERY) -> WorkerIdentity:
        return cls("standalone", "w0", "standalone", None, None, 0, 0, 1, coordinate_every, time.time(), None)


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
