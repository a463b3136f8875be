"""Source choice without topologies: distinct stayers round-robin (``plan_replication``'s fallback)."""

from __future__ import annotations

import pytest

from lightning_elan.replication.sources import plan_replication


def choose_sources(stayers: list[str], leavers: list[str], joiners: list[str]) -> dict[str, str]:
    sources, transfers = plan_replication(stayers, leavers, joiners)
    assert transfers is None
    return sources


def test_joiners_get_distinct_stayers_round_robin_in_order() -> None:
    sources = choose_sources(["w0", "w1"], ["w2"], ["w3", "w4", "w5"])

    assert sources == {"w3": "w0", "w4": "w1", "w5": "w0"}


def test_duplicate_stayers_count_once() -> None:
    assert choose_sources(["w1", "w1", "w0"], [], ["w5", "w6"]) == {"w5": "w1", "w6": "w0"}


def test_leavers_are_sources_when_no_worker_stays() -> None:
    assert choose_sources([], ["w0", "w1"], ["w2", "w3", "w4"]) == {"w2": "w0", "w3": "w1", "w4": "w0"}


def test_no_joiners_need_no_source() -> None:
    assert choose_sources([], [], []) == {}


def test_joiners_without_any_source_are_refused() -> None:
    with pytest.raises(ValueError, match="no source"):
        choose_sources([], [], ["w3"])


def test_duplicate_joiners_are_refused() -> None:
    with pytest.raises(ValueError, match="distinct"):
        choose_sources(["w0"], [], ["w3", "w3"])
