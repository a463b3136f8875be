"""The registered objects a joiner receives: those of ``register_for_checkpointing`` (Accelerate's list) and of
``register_for_elastic_state``, matched by their position in each list, whenever each was registered.

A joiner receives the job's state inside ``prepare()``; an object the script registers after ``prepare()`` (Accelerate
allows it anywhere before ``save_state``) is not registered yet then. Its state is kept and loaded when the joiner
registers it: the source and the joiner run the same script, so the *i*-th object of a list is the same object on
both whatever the moment it was registered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["ReplicatedObjects"]

CHECKPOINTED, ELASTIC = "checkpointed", "elastic"
_SAME_AS_CHECKPOINTED = "<the state of an object registered for checkpointing too: in the checkpointed list>"
"""In the elastic list, for an object registered for checkpointing too (also a state already loaded, on a joiner)."""


class ReplicatedObjects:
    """The registered objects' states, by list and position; a joiner's states of objects it has not registered yet."""

    def __init__(self, checkpointed: Callable[[], list[Any]]) -> None:
        self._checkpointed = checkpointed
        self.elastic: list[Any] = []
        self._pending: dict[str, list[Any]] = {CHECKPOINTED: [], ELASTIC: []}

    def state_dict(self) -> dict[str, list[Any]]:
        """Each list's states in registration order (an object in both lists is sent once)."""
        checkpointed = self._checkpointed()
        elastic = [_SAME_AS_CHECKPOINTED if _contains(checkpointed, obj) else obj.state_dict() for obj in self.elastic]
        return {CHECKPOINTED: [obj.state_dict() for obj in checkpointed], ELASTIC: elastic}

    def load_state_dict(self, state: dict[str, list[Any]]) -> None:
        """A joiner: load the objects registered so far; keep the others' states for their registration."""
        self._pending = {CHECKPOINTED: list(state[CHECKPOINTED]), ELASTIC: list(state[ELASTIC])}
        self.registered(CHECKPOINTED, 0)
        self.registered(ELASTIC, 0)

    def register_elastic(self, objects: tuple[Any, ...]) -> None:
        """``register_for_elastic_state``: objects with ``state_dict``/``load_state_dict``."""
        for obj in objects:
            if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
                raise ValueError(f"{type(obj).__name__} has no state_dict/load_state_dict: it cannot be replicated")
        start = len(self.elastic)
        self.elastic.extend(objects)
        self.registered(ELASTIC, start)

    def registered(self, kind: str, start: int) -> None:
        """The objects of list ``kind`` from position ``start`` on were just registered: load their received state."""
        objects = self._checkpointed() if kind == CHECKPOINTED else self.elastic
        states = self._pending[kind]
        for position in range(start, min(len(objects), len(states))):
            state, states[position] = states[position], _SAME_AS_CHECKPOINTED  # each received state loads once
            if not _is_marker(state):
                objects[position].load_state_dict(state)


def _is_marker(state: Any) -> bool:
    return isinstance(state, str) and state == _SAME_AS_CHECKPOINTED


def _contains(objects: list[Any], obj: Any) -> bool:
    return any(item is obj for item in objects)
