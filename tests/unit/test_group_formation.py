"""Forming a generation when a member never arrives: the failure reported for it releases the others at once."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_elan.elastic.error_origin import is_a_collective_timeout
from lightning_elan.elastic.process_group import ElasticProcessGroup


class Died(RuntimeError):
    pass


@pytest.fixture
def group():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield ElasticProcessGroup(store, "gloo", timedelta(seconds=600), torch.device("cpu"))


def test_a_failure_of_the_generation_being_formed_ends_the_wait(group):
    failure = Died("rank 1 died before it arrived")
    reported = threading.Timer(0.3, lambda: group.fail("gen/7/", failure))
    reported.start()
    started = time.monotonic()
    with pytest.raises(Died):
        group.configure("gen/7/", 0, 2)  # rank 1 never comes: gloo alone would wait out the 600 s timeout
    waited = time.monotonic() - started
    assert 0.3 <= waited < 5, waited
    assert group.prefix is None  # not a member of the generation it could not form


def test_a_member_that_never_arrives_and_is_not_reported_times_the_wait_out_as_a_stall() -> None:
    """Nobody reports rank 1 (frozen: it never exits): the wait ends at the collective timeout, in an error that reads
    as a collective timeout, so the member asks the AM to fail the generation (``stalled``)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = ElasticProcessGroup(store, "gloo", timedelta(seconds=0.5), torch.device("cpu"))
    with pytest.raises(dist.DistStoreError, match=r"timed out after .*'arrived/1'.* did not arrive") as raised:
        group.configure("gen/9/", 0, 2)
    assert is_a_collective_timeout(raised.value) and group.prefix is None


def test_a_failure_of_another_generation_does_not(group):
    group.fail("gen/7/", Died("an older generation"))
    group.configure("gen/8/", 0, 1)
    tensor = torch.ones(1)
    group.allreduce([tensor]).wait()
    assert group.prefix == "gen/8/" and tensor.item() == 1.0


def test_a_process_that_left_its_generation_makes_its_collectives_alone(group):
    """A leaver's group: out of its generation (shut down at the adjustment), its later collectives — a teardown
    hook's barrier, a gather — would fail on a group it no longer has; once alone they complete in this process."""
    group.configure("gen/3/", 0, 1)
    group.shutdown()
    with pytest.raises(RuntimeError, match="not part of any generation"):
        group.barrier()
    group.go_alone()
    group.barrier().wait()
    gathered = [torch.zeros(2)]
    group.allgather([gathered], [torch.tensor([1.0, 2.0])], dist.distributed_c10d.AllgatherOptions()).wait()
    tensor = torch.full((2,), 3.0)
    group.allreduce([tensor]).wait()
    assert (group.rank(), group.size(), group.prefix) == (0, 1, "alone/")
    assert gathered[0].tolist() == [1.0, 2.0] and tensor.tolist() == [3.0, 3.0]
