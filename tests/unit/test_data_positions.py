from collections import Counter

import pytest
from torch.utils.data import DataLoader

from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.positions import global_batch_size_at, local_share, steps_in_epoch
from lightning_elan.data.sampler import DataPosition


@pytest.mark.parametrize(
    ("samples", "batch", "drop_last", "steps"), [(100, 12, False, 9), (100, 12, True, 8), (12, 12, False, 1)]
)
def test_steps_in_epoch(samples, batch, drop_last, steps):
    assert steps_in_epoch(samples, batch, drop_last) == steps


def test_local_shares_tile_the_global_batch_with_uneven_sizes():
    shares = [local_share(24, 12, 5, rank) for rank in range(5)]
    assert [share.size for share in shares] == [3, 3, 2, 2, 2]
    assert [(share.start, share.stop) for share in shares] == [(24, 27), (27, 30), (30, 32), (32, 34), (34, 36)]
    # n * b_r / G summed over ranks is n: the weighted DDP mean is the global-batch mean
    assert sum(share.loss_weight for share in shares) == pytest.approx(5)


def test_batch_smaller_than_world_gives_zero_weight_shares():
    shares = [local_share(96, 4, 5, rank) for rank in range(5)]
    assert [share.size for share in shares] == [1, 1, 1, 1, 0]
    assert shares[4].loss_weight == 0.0
    assert global_batch_size_at(100, 96, 12) == 4


def _epoch_with_resizes(shuffle: bool, worlds: list[int]) -> Counter:
    """Consume one epoch, changing the world size at every step; count every index any rank takes."""
    data = DataPosition(global_batch=12)
    loaders = {}
    seen: Counter = Counter()
    user_loader = DataLoader(list(range(100)), batch_size=6, shuffle=shuffle)
    step = 0
    while data.position < 100:
        size = worlds[step % len(worlds)]
        batch_start = data.position
        for rank in range(size):
            if (rank, size) not in loaders:
                loaders[rank, size] = ElasticDataLoader(user_loader, data, lambda r=rank, s=size: (r, s), 0)
            loader = loaders[rank, size]
            batch = next(iter(loader))
            share = local_share(batch_start, global_batch_size_at(100, batch_start, 12), size, rank)
            if share.size:
                seen.update(batch.tolist())
        data.position = min(100, data.position + 12)
        step += 1
    return seen


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_once_per_epoch_across_resizes(shuffle):
    seen = _epoch_with_resizes(shuffle, [2, 3, 5, 1, 4])
    assert sorted(seen) == list(range(100))
    assert set(seen.values()) == {1}


def test_shuffle_false_keeps_dataset_order_and_shuffle_matches_distributed_sampler_permutation():
    import torch

    data = DataPosition(global_batch=4)
    ordered = ElasticDataLoader(DataLoader(list(range(10)), batch_size=2), data, lambda: (0, 1), 0)
    assert next(iter(ordered)).tolist() == [0, 1, 2, 3]
    shuffled = ElasticDataLoader(DataLoader(list(range(10)), batch_size=2, shuffle=True), data, lambda: (0, 1), 3)
    expected = torch.randperm(10, generator=torch.Generator().manual_seed(3)).tolist()[:4]
    assert next(iter(shuffled)).tolist() == expected


def test_set_epoch_resets_position_only_for_a_new_epoch():
    data = DataPosition(epoch=1, position=24, global_batch=12)
    loader = ElasticDataLoader(DataLoader(list(range(100)), batch_size=6), data, lambda: (0, 1), 0)
    loader.sampler.set_epoch(1)
    assert data.position == 24
    loader.sampler.set_epoch(2)
    assert (data.epoch, data.position) == (2, 0)


def test_rebuild_restarts_from_the_current_position_with_the_new_world():
    data = DataPosition(global_batch=4)
    world = [0, 2]
    loader = ElasticDataLoader(DataLoader(list(range(20)), batch_size=2), data, lambda: tuple(world), 0)
    iterator = iter(loader)
    assert next(iterator).tolist() == [0, 1]
    next(iterator)  # prefetched for the old world, dropped by the rebuild
    data.position = 4
    world[:] = [1, 4]
    loader.rebuild()
    assert next(iterator).tolist() == [5]
    assert len(loader) == 5
    assert loader.state_dict() == {
        "epoch": 0, "position": 4, "global_batch": 4, "steps_before": 0, "position_before": 0
    }
