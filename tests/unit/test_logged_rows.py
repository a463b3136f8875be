"""The logger rows of the last step that stood: rank 0 marks them written, and the new rank 0 of a recovery writes
them again only when the dead rank 0 had not (``elastic/logged_rows.py``)."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from lightning_elan.elastic.logged_rows import LoggedRows, rows_key


class _Loggers:
    """What a front-end's re-send wrote, by window; it keeps the rows of ``kept`` only."""

    def __init__(self, kept: int) -> None:
        self.kept, self.sent = kept, []

    def resend(self, window: int) -> bool:
        if window != self.kept:
            return False
        self.sent.append(window)
        return True


def _survivor(store: dist.Store, generation: int, window: int) -> tuple[LoggedRows, _Loggers]:
    rows, loggers = LoggedRows(), _Loggers(window)
    rows.follow(loggers.resend)
    rows.closed(store, generation, rank=1, window=window)  # rank 1 of the failed generation: it marks nothing
    return rows, loggers


def test_rank_0_marks_the_windows_it_wrote_and_the_others_do_not() -> None:
    store = dist.HashStore()
    LoggedRows().closed(store, 3, rank=1, window=7)
    assert not store.check([rows_key(3)])
    LoggedRows().closed(store, 3, rank=0, window=7)
    assert store.get(rows_key(3)) == b"7"


@pytest.mark.parametrize("marked", [None, 6], ids=["no-mark", "an-earlier-window"])
def test_the_new_rank_0_writes_rows_the_dead_rank_0_had_not(marked: int | None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    if marked is not None:
        store.set(rows_key(3), str(marked))
    rows, loggers = _survivor(store, 3, 7)
    rows.check(store, 3)
    with caplog.at_level(logging.WARNING):
        rows.resend_if_due(store, 4, rank=0)
    assert loggers.sent == [7]
    assert store.get(rows_key(4)) == b"7", "marked in the new generation: its own failure does not write them again"
    assert "the new rank 0 wrote them" in caplog.text
    rows.check(store, 4)
    rows.resend_if_due(store, 5, rank=0)
    assert loggers.sent == [7]


def test_rows_rank_0_wrote_are_not_written_again() -> None:
    store = dist.HashStore()
    store.set(rows_key(3), "7")
    rows, loggers = _survivor(store, 3, 7)
    rows.check(store, 3)
    rows.resend_if_due(store, 4, rank=0)
    assert loggers.sent == []


def test_rows_closed_in_an_earlier_generation_are_not_written_again() -> None:
    """Closed in generation 3, whose rank 0 wrote them (or its heir did): generation 4 failed before a window closed."""
    store = dist.HashStore()
    rows, loggers = _survivor(store, 3, 7)
    rows.check(store, 4)
    rows.resend_if_due(store, 5, rank=0)
    assert loggers.sent == []


def test_only_the_new_rank_0_writes() -> None:
    store = dist.HashStore()
    rows, loggers = _survivor(store, 3, 7)
    rows.check(store, 3)
    rows.resend_if_due(store, 4, rank=1)
    assert loggers.sent == [] and not store.check([rows_key(4)])


def test_a_vote_store_gone_with_rank_0_writes_nothing_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    class GoneStore(dist.HashStore):
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("Connection reset by peer")

    rows, loggers = _survivor(dist.HashStore(), 3, 7)
    with caplog.at_level(logging.WARNING):
        rows.check(GoneStore(), 3)
    rows.resend_if_due(dist.HashStore(), 4, rank=0)
    assert loggers.sent == []
    assert "could not tell whether rank 0 wrote the logger rows" in caplog.text
