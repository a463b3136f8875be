"""The random number generators a joiner inherits from its source (torch, CUDA, Python, NumPy)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


class LoaderRNG:
    """The random state each data-loader hook was called with, so that every call builds the data a static job has.

    A hook that draws from the global generators (Lightning's ``BoringModel`` makes ``RandomDataset(32, 64)`` in
    ``train_dataloader``) builds the same data on every process of a static job: they were seeded alike and drew alike
    until then. Two calls in an elastic job would not: a joiner calls the hooks after it took its source's *current*
    state, and every member calls the validation hook again after a resize (for the new shards). So each call is
    recorded with the state it began with (the latest call counts: a loader reloaded every epoch), a joiner inherits
    the records, and a call that repeats one (the joiner's first of each hook, a member's after a resize) runs with the
    recorded state; the generators then go back to where they were."""

    def __init__(self) -> None:
        self.recorded: dict[str, dict[str, Any]] = {}
        self._replays: set[str] = set()

    def inherit(self, recorded: dict[str, dict[str, Any]]) -> None:
        """A joiner: the members' records, each replayed at this process's next call of its hook."""
        self.recorded.update(recorded)
        self._replays.update(recorded)

    def replay(self, hook: str) -> None:
        """The next call of ``hook`` repeats its last one (when there was one)."""
        if hook in self.recorded:
            self._replays.add(hook)

    def call(self, hook: str, build: Any) -> Any:
        """Run ``build()``, the data-loader hook ``hook``, with the random state it must see."""
        if hook not in self._replays:
            self.recorded[hook] = rng_state()
            return build()
        self._replays.discard(hook)
        current = rng_state()
        set_rng_state(self.recorded[hook])
        try:
            return build()
        finally:
            set_rng_state(current)
