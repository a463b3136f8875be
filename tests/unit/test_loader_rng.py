"""``LoaderRNG``: a data-loader hook called again by an elastic job (a joiner's first call, a member's after a resize)
draws what its recorded call drew, and leaves the generators where they were."""

from __future__ import annotations

import random

import numpy as np
import torch

from lightning_elan.elastic.rng import LoaderRNG, rng_state, set_rng_state


def _dataset() -> list[float]:
    """What a user's ``train_dataloader`` draws from the global generators (torch, NumPy, Python)."""
    return [*torch.randn(3).tolist(), float(np.random.rand()), random.random()]


def test_a_joiner_builds_the_members_data_and_keeps_the_state_it_inherited() -> None:
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    member = LoaderRNG()
    members_data = member.call("train_dataloader", _dataset)
    torch.randn(100), np.random.rand(7), random.random()  # the members train on
    inherited = rng_state()  # what the joiner takes from its source
    joiner = LoaderRNG()
    joiner.inherit(member.recorded)
    set_rng_state(inherited)
    assert joiner.call("train_dataloader", _dataset) == members_data
    assert torch.equal(torch.get_rng_state(), inherited["torch"])
    assert random.getstate() == inherited["python"]
    assert joiner.call("train_dataloader", _dataset) != members_data  # a later call (a reload) draws afresh


def test_a_replayed_hook_repeats_its_last_call_and_an_unknown_one_is_recorded() -> None:
    torch.manual_seed(1)
    loaders = LoaderRNG()
    first = loaders.call("val_dataloader", _dataset)
    loaders.replay("val_dataloader")
    loaders.replay("test_dataloader")  # never called: nothing to repeat
    assert loaders.call("val_dataloader", _dataset) == first
    assert loaders.call("val_dataloader", _dataset) != first
    loaders.call("test_dataloader", _dataset)
    assert "test_dataloader" in loaders.recorded
