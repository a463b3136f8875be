"""The torch.distributed surface user code calls works on the elastic default group in every generation.

Three real processes go through a grow, a shrink with an abort, and a rank change (``distributed_surface_worker``);
in each generation every member calls ``new_group`` (all ranks, a subset, gloo with Lightning's ten-thousand-day
timeout, ``use_local_synchronization``), ``new_subgroups``, ``barrier``, ``monitored_barrier``, the object
collectives, ``send``/``recv``, ``init_device_mesh`` and Lightning's own ``_InfiniteBarrier`` (what ``prepare_data``
runs in). Before the elastic group answered ``new_group`` itself, the first such call hung forever.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("distributed_surface_worker.py")
REPO = Path(__file__).resolve().parents[2]
MEMBERS = {0: [0, 1], 1: [0, 1, 2], 2: [2, 0]}  # generation -> process index at each rank


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> list[dict[int, dict]]:
    tmp = tmp_path_factory.mktemp("surface")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    outs = [tmp / f"p{index}.json" for index in range(3)]
    processes = [subprocess.Popen([sys.executable, str(WORKER), str(index), str(store.port), str(out)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for index, out in enumerate(outs)]
    try:
        for process in processes:
            output, _ = process.communicate(timeout=180)
            assert process.returncode == 0, output[-4000:]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return [{int(g): o for g, o in json.loads(out.read_text()).items()} for out in outs]


def each_member(seen: list[dict[int, dict]]):
    for generation, members in MEMBERS.items():
        for rank, index in enumerate(members):
            yield generation, rank, len(members), seen[index][generation]


@pytest.mark.integration
def test_rank_world_and_backend_are_the_generations(seen):
    for _generation, rank, world, observed in each_member(seen):
        assert (observed["rank"], observed["world"], observed["backend"]) == (rank, world, "gloo")


@pytest.mark.integration
def test_new_group_in_every_form(seen):
    for _generation, rank, world, observed in each_member(seen):
        groups = observed["groups"]
        assert groups["whole"] == world * (world + 1) / 2
        assert groups["gloo"] == world
        assert groups["mine"] == rank + 10  # new_subgroups(group_size=1): a group of its own
        assert (groups["whole_rank"], groups["whole_size"]) == (rank, world)
        assert groups["first_two"] == (2 if rank < 2 else -1)  # get_rank of a group it is not in: -1
        assert groups["local"] == (2 if rank in (0, world - 1) else None)


@pytest.mark.integration
def test_object_collectives(seen):
    for _generation, rank, world, observed in each_member(seen):
        objects = observed["objects"]
        assert objects["all_gather_object"] == list(range(world))
        assert objects["broadcast_object_list"] == f"from {world - 1}"
        assert objects["gather_object"] == ([["g", r] for r in range(world)] if rank == 0 else None)
        assert objects["scatter"] == f"to {rank}"


@pytest.mark.integration
def test_point_to_point_device_mesh_and_lightnings_infinite_barrier(seen):
    for _generation, rank, world, observed in each_member(seen):
        assert observed["p2p"] == (rank - 1) % world
        assert observed["mesh"] == world * (world + 1) / 2
        assert observed["infinite_barrier"] is True


@pytest.mark.integration
def test_a_group_from_an_earlier_generation_raises_naming_the_resize(seen):
    stale = [observed["stale"] for generation, _rank, _world, observed in each_member(seen)
             if "stale" in observed]
    assert len(stale) == 4  # processes 0 and 1 in generation 1, processes 2 and 0 in generation 2
    for message in stale:
        assert "resize" in message and "new_group" in message, message
