"""Store writes off the training thread: in order, never blocking the submitter, a failed one logged and dropped."""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from lightning_elan.elastic.state_size import STATE_NBYTES_KEY, StateSizeNotice
from lightning_elan.elastic.store_chores import StoreChores


def test_chores_run_in_submission_order_and_submit_never_waits_for_a_blocked_one():
    chores, release, done = StoreChores(), threading.Event(), []
    chores.submit("blocked", lambda: (release.wait(10), done.append("first")))
    started = time.monotonic()
    for name in ("second", "third"):
        chores.submit(name, lambda name=name: done.append(name))
    assert time.monotonic() - started < 1.0  # returned while the first chore is still blocked
    assert done == [] and chores.pending == 3
    release.set()
    assert chores.drain(10.0)
    assert done == ["first", "second", "third"] and chores.pending == 0


def test_drain_gives_up_on_a_store_that_does_not_answer_and_leaves_the_chore_queued():
    chores, release, done = StoreChores(), threading.Event(), []
    chores.submit("a store that does not answer", lambda: (release.wait(10), done.append("late")))
    assert not chores.drain(0.2)
    assert chores.pending == 1
    release.set()
    assert chores.drain(10.0) and done == ["late"]


def test_a_failed_chore_is_logged_and_the_next_one_runs(caplog):
    chores, done = StoreChores(), []

    def unavailable() -> None:
        raise dist.DistStoreError("etcd at 127.0.0.1:1 unavailable")

    with caplog.at_level(logging.WARNING, logger="lightning_elan.elastic.store_chores"):
        chores.submit("the state size a joiner receives", unavailable)
        chores.submit("next", lambda: done.append("next"))
        assert chores.drain(10.0)
    assert done == ["next"]
    assert "store write dropped (the state size a joiner receives): etcd at 127.0.0.1:1 unavailable" in caplog.text


def test_the_state_size_is_published_through_the_chores_once_per_generation_until_non_zero():
    store, chores, notice, sizes = dist.HashStore(), StoreChores(), StateSizeNotice(), iter([0, 0, 4096, 8192])
    notice.publish_if_due(store, lambda: next(sizes), chores)  # no optimizer state yet: 0 is published
    assert chores.drain(10.0) and store.get(STATE_NBYTES_KEY) == b"0"
    notice.publish_if_due(store, lambda: next(sizes), chores)  # still 0: nothing new to write
    notice.publish_if_due(store, lambda: next(sizes), chores)
    assert chores.drain(10.0) and store.get(STATE_NBYTES_KEY) == b"4096"
    notice.publish_if_due(store, lambda: next(sizes), chores)  # non-zero published: not measured again
    assert chores.drain(10.0) and store.get(STATE_NBYTES_KEY) == b"4096"
    notice.new_generation()
    notice.publish_if_due(store, lambda: next(sizes), chores)
    assert chores.drain(10.0) and store.get(STATE_NBYTES_KEY) == b"8192"
