"""Local and node rank of a generation's members from their hosts (what ``prepare_data`` and ``trainer.local_rank``
go by)."""

from __future__ import annotations

import lightning.pytorch  # noqa: F401  (first: importing Lightning registers the strategy, which imports the environment)

from lightning_elan.strategy.environment import ElanEnvironment, host_placement


def test_one_host_gives_local_ranks_in_rank_order_on_node_zero() -> None:
    hosts = ["a", "a", "a"]
    assert [host_placement(hosts, rank) for rank in range(3)] == [(0, 0), (1, 0), (2, 0)]


def test_hosts_are_numbered_by_their_first_member() -> None:
    hosts = ["b", "a", "b", "c", "a"]
    assert [host_placement(hosts, rank) for rank in range(5)] == [(0, 0), (0, 1), (1, 0), (0, 2), (1, 1)]


def test_the_environment_reports_what_it_was_assigned() -> None:
    environment = ElanEnvironment()
    environment.assign(3, 4, local_rank=1, node_rank=1)
    assert (environment.global_rank(), environment.world_size()) == (3, 4)
    assert (environment.local_rank(), environment.node_rank()) == (1, 1)
