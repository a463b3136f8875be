"""The engine's live-reshard hook (``elastic/live_reshard.py``): a front-end that opts in gets one group of the old
members (old rank order) and the joiners, with the holders' and receivers' ranks in shard order; one that does not
(the ``"elan"`` DDP strategy) is never called and no group is formed."""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from lightning_elan.elastic.live_reshard import LiveResharding, ReshardGroup, reshard_live
from lightning_elan.protocol.contract import AdjustmentPlan


class _Sharded:
    """Records its reshard group and sums one tensor over it (the group works)."""

    def __init__(self) -> None:
        self.reshard: ReshardGroup | None = None
        self.total = torch.zeros(1)

    def reshard_live(self, reshard: ReshardGroup) -> None:
        self.reshard = reshard
        self.total = torch.tensor([float(reshard.rank + 1)])
        reshard.group.allreduce([self.total]).wait()


def _plan() -> AdjustmentPlan:
    """w0 leaves and w2 joins (a migration): w0, w1 hold the shards, w1, w2 receive them."""
    return AdjustmentPlan("r1", "migrate", 4, 3, 9, members=["w1", "w2"], previous_members=["w0", "w1"],
                          joiners=["w2"], leavers=["w0"], sources={"w2": "w1"}, hosts={})


def test_old_members_then_joiners_form_the_reshard_group() -> None:
    store, plan = dist.HashStore(), _plan()
    frontends = {worker: _Sharded() for worker in ("w0", "w1", "w2")}
    threads = [threading.Thread(target=reshard_live, args=(frontends[worker], plan, worker, store, "gloo",
                                                           timedelta(seconds=30))) for worker in frontends]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert isinstance(frontends["w0"], LiveResharding)
    assert [frontends[worker].reshard.rank for worker in ("w0", "w1", "w2")] == [0, 1, 2]
    assert all(frontend.reshard.holders == [0, 1] and frontend.reshard.receivers == [1, 2]
               for frontend in frontends.values())
    assert all(frontend.total.item() == 6.0 for frontend in frontends.values())


def test_a_front_end_that_does_not_opt_in_forms_no_group() -> None:
    store = dist.HashStore()
    reshard_live(object(), _plan(), "w1", store, "gloo", timedelta(seconds=1))
    assert store.num_keys() == 0
