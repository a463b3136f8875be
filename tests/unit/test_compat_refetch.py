"""``compat.refetch_prefetched_batch`` on Lightning's own ``_PrefetchDataFetcher`` (a loader without a length: the
fetcher keeps a batch ahead, which a resize must replace)."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch  # noqa: F401  (first: importing Lightning registers the strategy, which imports compat)
from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher

from lightning_elan import compat


class _Stream:
    """An iterable without a length whose batches follow a switchable source (the old world's, then the new's)."""

    def __init__(self) -> None:
        self.world = "old"
        self.served = 0

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> str:
        if self.served == 4:
            raise StopIteration
        self.served += 1
        return f"{self.world}-{self.served}"


def _trainer_with(fetcher: _PrefetchDataFetcher) -> SimpleNamespace:
    return SimpleNamespace(fit_loop=SimpleNamespace(_data_fetcher=fetcher))


def test_the_prefetched_batch_is_replaced_by_one_of_the_new_world() -> None:
    stream = _Stream()
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(stream)
    iterator = iter(fetcher)
    assert next(iterator) == "old-1"  # "old-2" is kept ahead
    stream.world = "new"
    compat.refetch_prefetched_batch(_trainer_with(fetcher))
    assert [next(iterator), next(iterator)] == ["new-3", "new-4"]  # (iter() again would restart the fetcher)
    assert fetcher.done


def test_an_exhausted_source_leaves_the_fetcher_done() -> None:
    stream = _Stream()
    fetcher = _PrefetchDataFetcher()
    fetcher.setup(stream)
    iterator = iter(fetcher)
    assert [next(iterator) for _ in range(3)] == ["old-1", "old-2", "old-3"]  # "old-4" kept ahead
    stream.served = 4
    compat.refetch_prefetched_batch(_trainer_with(fetcher))
    assert fetcher.done
    assert not fetcher.batches
