"""What an Accelerate user's loop may do under the elastic accelerator, without a job: registered objects matched by
position whenever registered."""

from __future__ import annotations

import pytest

from lightning_elan.accelerate.objects import CHECKPOINTED, ReplicatedObjects


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _source(checkpointed: list[Counter], elastic: list[Counter]) -> dict:
    objects = ReplicatedObjects(lambda: checkpointed)
    objects.register_elastic(tuple(elastic))
    return objects.state_dict()


def test_a_joiner_loads_an_object_it_registers_after_receiving_the_state():
    """Registered after ``prepare()`` (where a joiner receives the state): loaded at registration, once."""
    ema, progress = Counter(7), Counter(12)
    state = _source([progress], [ema])
    checkpointed: list[Counter] = []
    joiner = ReplicatedObjects(lambda: checkpointed)
    mine_ema = Counter()
    joiner.register_elastic((mine_ema,))  # before prepare()
    joiner.load_state_dict(state)
    assert mine_ema.n == 7
    mine_progress = Counter()
    checkpointed.append(mine_progress)  # register_for_checkpointing after prepare()
    joiner.registered(CHECKPOINTED, 0)
    assert mine_progress.n == 12
    mine_progress.n = 13
    joiner.registered(CHECKPOINTED, 0)  # a received state loads once
    assert mine_progress.n == 13


def test_an_object_in_both_lists_is_sent_once_and_loaded_whichever_list_the_joiner_registers_it_in_first():
    shared = Counter(5)
    state = _source([shared], [shared])
    assert state["elastic"][0] != {"n": 5}, "sent in the checkpointed list only"
    checkpointed: list[Counter] = []
    joiner = ReplicatedObjects(lambda: checkpointed)
    mine = Counter()
    joiner.register_elastic((mine,))  # elastic before prepare(), checkpointing after
    joiner.load_state_dict(state)
    assert mine.n == 0
    checkpointed.append(mine)
    joiner.registered(CHECKPOINTED, 0)
    assert mine.n == 5


def test_objects_beyond_the_received_state_keep_their_own():
    joiner = ReplicatedObjects(lambda: [])
    joiner.load_state_dict(_source([], [Counter(3)]))
    first, extra = Counter(), Counter(9)
    joiner.register_elastic((first, extra))
    assert (first.n, extra.n) == (3, 9)


def test_an_object_without_state_dict_is_refused_with_its_type():
    with pytest.raises(ValueError, match="int has no state_dict"):
        ReplicatedObjects(lambda: []).register_elastic((3,))
