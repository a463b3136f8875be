"""A joiner receiving into memory of its own: which bytes go where (pure; the shared-memory transport filling a real
reader process's tensors is ``tests/engine/test_reception_processes.py``)."""

from __future__ import annotations

import datetime
import itertools
import multiprocessing as mp

import torch

from lightning_elan.replication.packing import arena_layout, make_layout, split_tensors
from lightning_elan.replication.reception import (
    LOCAL_ALIGN,
    SPARE_SLACK_BYTES,
    PrefaultedMemory,
    destinations_by_name,
    receive_pieces,
    tensor_nbytes,
    usable_destinations,
)

TIMEOUT = datetime.timedelta(seconds=60)
CTX = mp.get_context("spawn")
CPU = torch.device("cpu")


def state() -> list[torch.Tensor]:
    """Parameters first (float32, float64), then 'optimizer moments', a 0-d step, an empty and an int tensor."""
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(300, 7, generator=g),  # 0: own
        torch.randn(13, generator=g, dtype=torch.float64),  # 1: own
        torch.randn(41, generator=g),  # 2: offered with the wrong shape -> local
        torch.randn(300, 7, generator=g),  # 3: local (a moment)
        torch.randn(13, generator=g, dtype=torch.float64),  # 4: local
        torch.tensor(17.0),  # 5: local 0-d
        torch.empty(0, 3),  # 6: empty
        torch.randint(0, 1000, (9,), generator=g),  # 7: local int64
        torch.randn(5000, generator=g),  # 8: own, large
    ]


def own_tensors() -> dict[int, torch.Tensor]:
    return {0: torch.zeros(300, 7), 1: torch.zeros(13, dtype=torch.float64), 2: torch.zeros(40),
            8: torch.zeros(5000)}  # fmt: skip


# ------------------------------------------------------------------ pure


def test_pieces_follow_the_arena_and_pack_the_rest_aligned() -> None:
    tensors = state()
    layout = make_layout(tensors)
    places = arena_layout(layout)
    pieces, local = receive_pieces(layout, places, {0, 1, 8})
    assert [p.arena_offset for p in pieces] == sorted(p.arena_offset for p in pieces)
    assert {p.index for p in pieces} == {0, 1, 2, 3, 4, 5, 7, 8}  # the empty tensor has no bytes
    assert all(p.local_offset is None for p in pieces if p.index in {0, 1, 8})
    local_pieces = sorted((p for p in pieces if p.local_offset is not None), key=lambda p: p.local_offset)
    for before, after in itertools.pairwise(local_pieces):
        assert after.local_offset % LOCAL_ALIGN == 0
        assert after.local_offset >= before.local_offset + before.nbytes  # no overlap
    assert local == local_pieces[-1].local_offset + local_pieces[-1].nbytes
    assert sum(p.nbytes for p in pieces) == sum(t.numel() * t.element_size() for t in tensors)


def test_only_tensors_that_fit_exactly_are_received_into() -> None:
    tensors = state()
    layout = make_layout(tensors)
    offered = {**own_tensors(), 3: torch.zeros(7, 300).t(), 4: torch.zeros(13, dtype=torch.float32), 99: torch.ones(1)}
    usable = usable_destinations(layout, offered, lambda _: CPU)
    assert set(usable) == {0, 1, 8}  # 2: shape; 3: not contiguous; 4: dtype; 99: no such tensor
    assert usable_destinations(layout, offered, lambda _: torch.device("meta")) == {}  # bound elsewhere than the CPU


def test_destinations_by_name_match_a_state_dict_skeleton() -> None:
    model = torch.nn.Linear(3, 2)
    skeleton, _tensors = split_tensors({"model": model.state_dict(), "other": torch.ones(2)})
    own = torch.nn.Linear(3, 2).state_dict(keep_vars=True)
    got = destinations_by_name(skeleton["model"], own)
    assert {index: id(t) for index, t in got.items()} == {0: id(own["weight"]), 1: id(own["bias"])}
    assert destinations_by_name(None, own) == {} and destinations_by_name({"bias": 3}, own) == {}


def test_tensor_nbytes_counts_each_tensor_once() -> None:
    t = torch.zeros(10)
    assert tensor_nbytes({"a": t, "b": [t, torch.zeros(3, dtype=torch.float64)], "c": 1}) == 40 + 24


def test_prefaulted_memory_is_taken_once_and_only_if_it_fits() -> None:
    spare = PrefaultedMemory.fault_in(1000)
    assert spare.nbytes >= 1000
    assert spare.take(spare.nbytes + 1) is None  # too small: the transfer allocates instead
    spare = PrefaultedMemory.fault_in(1000)
    taken = spare.take(1000)
    assert taken is not None and taken.numel() == 1000 and taken.dtype == torch.uint8
    taken.fill_(7)  # writable
    assert spare.take(10) is None  # once


def test_prefaulted_memory_waits_for_its_size_and_gives_way_to_an_early_transfer() -> None:
    answers = [None, None, 4096]
    spare = PrefaultedMemory(lambda: answers.pop(0) if len(answers) > 1 else answers[0], poll_s=0.01)
    spare.wait()
    assert spare.nbytes == 4096 + SPARE_SLACK_BYTES
    assert spare.take(4096) is not None
    early = PrefaultedMemory(lambda: None, poll_s=0.01)
    assert early.take(10) is None  # the transfer came before any size: it allocates, nothing waits
    early.wait()  # and the poller has stopped
    assert early.nbytes is None
