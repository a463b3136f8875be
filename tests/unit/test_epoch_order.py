"""A user sampler's epoch order, carried to a joiner with the data position (``EpochOrder.state_dict``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler, WeightedRandomSampler

from lightning_elan.data.sampler import EpochOrder


def weighted(seed: int = 17) -> WeightedRandomSampler:
    return WeightedRandomSampler(torch.linspace(0.1, 1.0, 40).tolist(), num_samples=40, replacement=False,
                                 generator=torch.Generator().manual_seed(seed))


def test_a_joiner_visits_the_epochs_of_a_user_sampler_with_its_own_generator_as_the_members_do() -> None:
    member = EpochOrder.from_sampler(weighted(), 40, seed=0)
    orders = [list(member.indices(epoch)) for epoch in range(3)]
    joiner = EpochOrder.from_sampler(weighted(), 40, seed=0)
    joiner.indices(0)  # a joiner may touch its own order while it warms up

    joiner.load_state_dict(member.state_dict())

    assert joiner.indices(2) == orders[2]
    assert joiner.indices(3) == member.indices(3)
    assert sorted(orders[2]) == list(range(40)) and orders[2] != orders[1]


def test_a_joiner_without_the_state_would_draw_another_order() -> None:
    member = EpochOrder.from_sampler(weighted(), 40, seed=0)
    for epoch in range(3):
        member.indices(epoch)

    assert EpochOrder.from_sampler(weighted(), 40, seed=0).indices(3) != member.indices(3)


def test_a_seeded_order_needs_no_state() -> None:
    order = EpochOrder(40, shuffle=True, seed=5)
    order.indices(1)

    assert order.state_dict() is None
    order.load_state_dict(None)
    assert order.indices(1) == EpochOrder(40, shuffle=True, seed=5).indices(1)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_distributed_sampler_gives_the_global_order_its_ranks_visit_together(shuffle: bool) -> None:
    """The batches a static 2-process DDP job trains, rank 0's share and rank 1's side by side, in the order
    lightning_elan visits the epoch (before: each process took its own rank's share as the order and shared it
    again — a quarter of the data each on 2 workers)."""
    dataset = list(range(40))
    ranks = [DistributedSampler(dataset, num_replicas=2, rank=rank, shuffle=shuffle, seed=3) for rank in (0, 1)]
    order = EpochOrder.from_sampler(ranks[0], len(dataset), seed=0)
    for epoch in range(3):
        for sampler in ranks:
            sampler.set_epoch(epoch)
        interleaved = [index for pair in zip(*(list(sampler) for sampler in ranks), strict=True) for index in pair]
        assert order.indices(epoch) == interleaved


def test_a_distributed_sampler_with_its_own_iter_is_refused_with_what_to_do() -> None:
    class Bucketing(DistributedSampler):
        def __iter__(self):
            return iter(sorted(super().__iter__()))

    with pytest.raises(ValueError, match="Bucketing is a DistributedSampler with its own __iter__"):
        EpochOrder.from_sampler(Bucketing(list(range(8)), num_replicas=2, rank=0), 8, seed=0)
