"""Cluster environment whose rank and world size change with every generation."""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment
from typing_extensions import override

from lightning_elan.protocol.contract import ENV_AM_ADDRESS


class ElanEnvironment(ClusterEnvironment):
    """Rank and world size are set by :class:`ElanStrategy` when a generation forms; processes come from outside."""

    def __init__(self, rank: int = 0, world_size: int = 1, main_address: str = "127.0.0.1", main_port: int = 0) -> None:
        self._rank = rank
        self._world_size = world_size
        self._local_rank = 0
        self._node_rank = 0
        self._main_address = main_address
        self._main_port = main_port

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return self._main_address

    @property
    @override
    def main_port(self) -> int:
        return self._main_port

    @staticmethod
    @override
    def detect() -> bool:
        return ENV_AM_ADDRESS in os.environ

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        """Ignored: Lightning would set num_nodes × devices; the generation decides (see :meth:`assign`)."""

    @override
    def global_rank(self) -> int:
        return self._rank

    @override
    def set_global_rank(self, rank: int) -> None:
        """Ignored for the same reason as :meth:`set_world_size`."""

    @override
    def local_rank(self) -> int:
        return self._local_rank

    @override
    def node_rank(self) -> int:
        return self._node_rank

    def assign(self, rank: int, world_size: int, local_rank: int = 0, node_rank: int = 0) -> None:
        """Take the rank, world size and place on the hosts of a new generation."""
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._node_rank = node_rank


def host_placement(hosts: list[str], rank: int) -> tuple[int, int]:
    """``(local rank, node rank)`` of ``rank`` among the members on ``hosts`` (by rank): its order among the members on
    its host, and its host's order by each host's first member."""
    host = hosts[rank]
    return hosts[:rank].count(host), list(dict.fromkeys(hosts)).index(host)
