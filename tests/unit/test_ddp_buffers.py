"""When ``ElasticDistributedDataParallel`` broadcasts buffers: where DDP would, and at the first forward of a
generation, whatever mode Lightning left the wrapper in — members and a joiner decide alike (or they hang)."""

from __future__ import annotations

from typing import Any

import torch

from lightning_elan.elastic.ddp import ElasticDistributedDataParallel


class _Work:
    """A finished collective."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        future.set_result(self.tensors)
        return future


class _FakeGeneration:
    """A two-process generation that counts buffer broadcasts (its collectives change nothing)."""

    def __init__(self) -> None:
        self.generation = object()
        self.broadcasts = 0

    def size(self) -> int:
        return 2

    def broadcast(self, tensors: list[torch.Tensor], options: Any) -> _Work:
        self.broadcasts += 1
        return _Work(tensors)

    def allreduce(self, tensors: list[torch.Tensor], options: Any) -> _Work:
        return _Work(tensors)


def _wrapper(current: dict[str, _FakeGeneration]) -> ElasticDistributedDataParallel:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    return ElasticDistributedDataParallel(model, lambda: current["group"])  # type: ignore[arg-type,return-value]


def _broadcast_in_forward(ddp: ElasticDistributedDataParallel, group: _FakeGeneration, grad: bool = True) -> bool:
    before = group.broadcasts
    with torch.set_grad_enabled(grad):
        output = ddp(torch.randn(6, 4)).sum()
    if grad:
        output.backward()
    return group.broadcasts > before


def test_members_after_a_validation_and_a_joiner_both_broadcast_at_the_generation_first_forward() -> None:
    old, new = _FakeGeneration(), _FakeGeneration()
    member_group = {"group": old}
    member = _wrapper(member_group)
    assert _broadcast_in_forward(member, old)
    member.eval()  # what Lightning's evaluation loops leave: the wrapper in eval mode, the module back in train mode
    with torch.no_grad():
        member.module.eval()
        _broadcast_in_forward(member, old, grad=False)
        member.module.train()
    member_group["group"] = new  # a grow
    joiner = _wrapper({"group": new})

    assert _broadcast_in_forward(member, new)
    assert new.broadcasts == len(list(member.module.buffers()))
    assert _broadcast_in_forward(joiner, new)
    assert new.broadcasts == 2 * len(list(member.module.buffers()))


def test_within_a_generation_buffers_are_broadcast_where_ddp_would() -> None:
    group = _FakeGeneration()
    ddp = _wrapper({"group": group})
    ddp.eval()  # the wrapper's mode plays no part, as in DDP
    assert _broadcast_in_forward(ddp, group)
    assert _broadcast_in_forward(ddp, group)
    assert _broadcast_in_forward(ddp, group, grad=False)  # the previous forward synchronised gradients
    assert not _broadcast_in_forward(ddp, group)  # the previous one ran without grad: DDP skips
    with ddp.no_sync():
        assert _broadcast_in_forward(ddp, group)
    assert not _broadcast_in_forward(ddp, group)  # after a no_sync forward: DDP skips
