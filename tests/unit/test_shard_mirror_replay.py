"""The shard mirror replays the committed optimizer steps on its copy exactly (``replication.shard_mirror``): one
process, a loopback group (the member is its own mirror holder), Adam with a changing learning rate."""

from __future__ import annotations

import torch
from torch import nn

from lightning_elan.replication.shard_mirror import PARAM, ShardMirror, mirrorable


class LoopbackWork:
    def wait(self) -> bool:
        return True


class LoopbackGroup:
    """A world of one: what rank 0 sends itself in an all-to-all is what it receives."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_counts: list[int],
                      input_counts: list[int], opts: object) -> LoopbackWork:
        assert output_counts == input_counts
        output.copy_(input)
        return LoopbackWork()


def test_the_mirror_follows_the_committed_steps_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    mirror, group = ShardMirror(), LoopbackGroup()
    for step in range(4):
        optimizer.zero_grad()
        model(torch.randn(5, 4, dtype=torch.float64)).pow(2).sum().backward()
        if not mirror.seeded:
            mirror.seed(model, [optimizer], group)
        mirror.exchange_gradients(model, group)
        optimizer.param_groups[0]["lr"] = 0.01 * (step + 1)  # a ramp: the step's own learning rate is replayed
        mirror.capture_hyperparameters([optimizer])
        optimizer.step()
        mirror.advance(0)
    rows = mirror.rows()
    for name, parameter in model.named_parameters():
        assert torch.equal(rows[name][PARAM], parameter.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(rows[name][f"o0/{key}"], optimizer.state[parameter][key])


def test_only_elementwise_optimizers_are_mirrored() -> None:
    parameter = nn.Parameter(torch.zeros(2))
    assert mirrorable([torch.optim.AdamW([parameter])]) is None
    assert "LBFGS" in (mirrorable([torch.optim.LBFGS([parameter])]) or "")


def test_steps_that_cannot_be_replayed_exactly_are_not_mirrored() -> None:
    from lightning_elan.elastic.fsdp_mirroring import unmirrored_because

    adam = [torch.optim.Adam([nn.Parameter(torch.zeros(2))])]
    assert unmirrored_because(adam, automatic=True) is None
    assert "manual optimization" in (unmirrored_because(adam, automatic=False) or "")
