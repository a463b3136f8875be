"""The results of the start hooks' collectives: rank 0 publishes them by hook and place, a joiner takes them."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_elan.elastic.start_hooks import StartHookResults


@pytest.fixture
def store() -> dict[str, bytes]:
    return {}


def results(store: dict[str, bytes]) -> StartHookResults:
    return StartHookResults(store.__setitem__, store.get)


def test_a_joiner_takes_the_members_results_of_the_same_hook_in_order(store):
    rank0, rank1, joiner = results(store), results(store), results(store)
    for member, publisher in ((rank0, True), (rank1, False)):
        member.entering("on_train_start/2")
        member.completed(torch.tensor([6.0, 14.0]), publisher)
        member.completed("run-7", publisher)
        member.entering(None)
    joiner.entering("on_train_start/2")
    taken = [joiner.alone(torch.tensor([1.0, 1.0]), torch.device("cpu")), joiner.alone("mine", torch.device("cpu"))]
    joiner.entering(None)
    assert taken[0].tolist() == [6.0, 14.0] and taken[1] == "run-7"
    assert sorted(store) == ["hook/on_train_start/2/0", "hook/on_train_start/2/1"]  # rank 1 published nothing


def test_collectives_outside_the_start_hooks_are_neither_published_nor_taken(store):
    member, joiner = results(store), results(store)
    assert member.completed(torch.ones(1), True).item() == 1.0
    assert joiner.alone("mine", torch.device("cpu")) == "mine"
    assert store == {}


def test_a_hook_run_again_after_a_recovery_counts_its_collectives_afresh(store):
    member, joiner = results(store), results(store)
    member.entering("on_train_start/0")
    member.completed(torch.tensor(1.0), True)  # the first run: its second collective met the death
    member.entering("on_train_start/0")  # the retry
    member.completed(torch.tensor(2.0), True)
    member.completed(torch.tensor(3.0), True)
    joiner.entering("on_train_start/0")
    assert [joiner.alone(torch.tensor(0.0), torch.device("cpu")).item() for _ in range(2)] == [2.0, 3.0]


def test_a_collective_the_members_never_made_runs_alone_with_one_warning(store, caplog):
    joiner = results(store)
    joiner.entering("on_fit_start/1")
    with caplog.at_level(logging.WARNING, logger="lightning_elan.elastic.start_hooks"):
        assert joiner.alone("mine", torch.device("cpu")) == "mine"
    assert "on_fit_start/1/0" in caplog.text and "alone" in caplog.text


def test_a_direct_call_in_a_start_hook_is_counted_apart_from_the_strategys(store):
    """A member's ``torch.distributed.all_reduce`` in ``on_train_start`` leaves tensors rank 0 publishes; the group's
    calls a strategy collective makes are not direct ones; the joiner's direct call takes the tensors."""
    member, joiner = results(store), results(store)
    member.entering("on_train_start/1")
    with member.strategy_collective():
        assert not member.following_raw
    member.completed(torch.tensor(5.0), True)
    assert member.following_raw
    member.raw_completed([torch.tensor([1.0, 2.0]), torch.tensor(3.0)], publisher=True)
    joiner.entering("on_train_start/1")
    outputs = [torch.zeros(2), torch.zeros(())]
    joiner.raw_taken(outputs)
    assert outputs[0].tolist() == [1.0, 2.0] and outputs[1].item() == 3.0
    assert joiner.alone(torch.tensor(0.0), torch.device("cpu")).item() == 5.0
    joiner.entering(None)
    assert not joiner.following_raw


def test_a_direct_call_the_members_never_made_leaves_the_joiners_tensors(store, caplog):
    joiner = results(store)
    joiner.entering("on_fit_start/0")
    outputs = [torch.full((2,), 7.0)]
    with caplog.at_level(logging.WARNING, logger="lightning_elan.elastic.start_hooks"):
        joiner.raw_taken(outputs)
    assert outputs[0].tolist() == [7.0, 7.0] and "on_fit_start/0/raw/0" in caplog.text


def test_a_gather_with_more_slots_than_the_members_had_takes_the_joiners_own_input_in_the_others(store, caplog):
    """The members gathered at 2 workers; the joiner's ``all_gather`` (as ``all_gather_object`` builds it) has a slot
    per process of its world of 3: the first two take the members' values, its own slot its own input."""
    member, joiner = results(store), results(store)
    member.entering("on_fit_start/4")
    member.raw_completed([torch.tensor([1.0]), torch.tensor([2.0])], publisher=True)
    joiner.entering("on_fit_start/4")
    slots = [torch.zeros(1) for _ in range(3)]
    with caplog.at_level(logging.WARNING, logger="lightning_elan.elastic.start_hooks"):
        joiner.raw_taken(slots, own=torch.tensor([9.0]))
    assert [slot.item() for slot in slots] == [1.0, 2.0, 9.0]
    assert "3 outputs, the members' had 2" in caplog.text
