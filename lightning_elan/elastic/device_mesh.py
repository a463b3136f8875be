"""The ``DeviceMesh`` of one generation of a sharded job (issue 24): 1-D over the generation's group (FSDP), or 2-D
``(replicate, shard)`` over subgroups of it (HSDP), as both front-ends (``elan_fsdp``, Accelerate's FSDP2) build it.

Under HSDP with ``shards`` shards, the shard groups are runs of ``shards`` consecutive ranks and the replica groups
the ranks equal modulo ``shards`` (member ``p`` holds shard ``p % shards``: ``replication.shard_layout``). Every member
makes every subgroup, shard groups first, in the same order (``ElasticProcessGroup.new_group``'s rule); each is valid
in its generation only and failed with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lightning_elan import torch_compat

__all__ = ["GenerationMesh", "Subgroup", "generation_mesh"]

Subgroup = Callable[[list[int]], Any]
"""Makes a subgroup of the given ranks of the current generation (None on a member not in them)."""


@dataclass
class GenerationMesh:
    """A generation's mesh, the names it registered (forgotten with it) and the groups its dimensions run on."""

    mesh: Any
    names: list[str]
    groups: list[Any] = field(default_factory=list)

    def forget(self) -> None:
        """Unregister its names once the generation is over."""
        torch_compat.forget_tensor_parallel_mesh(self.mesh)
        for name in self.names:
            torch_compat.forget_mesh_group(name)


def generation_mesh(group: Any, shards: int, subgroup: Subgroup, device_type: str, name: str) -> GenerationMesh:
    """The mesh of a generation whose ``group`` (rank, size) holds ``shards`` shards: 1-D over ``group`` when each
    member holds one, else ``(replicate, shard)`` over this member's replica and shard subgroups."""
    world, rank = group.size(), group.rank()
    if shards == world:
        return GenerationMesh(torch_compat.mesh_of_group(group, device_type, name), [name], [group])
    made = [subgroup(list(range(first, first + shards))) for first in range(0, world, shards)]
    made += [subgroup(list(range(index, world, shards))) for index in range(shards)]
    shard_group, replica_group = [one for one in made if one is not None]
    names = [f"{name}_replicate", f"{name}_shard"]
    mesh = torch_compat.mesh_of_groups([replica_group, shard_group], (world // shards, shards), device_type, names,
                                       rank)
    return GenerationMesh(mesh, names, [replica_group, shard_group])
