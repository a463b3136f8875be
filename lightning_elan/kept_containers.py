"""The plain containers a user's hooks fill, put back as they were when work that is redone began.

Lightning's own idiom since 2.0 keeps a step's outputs in a list on the LightningModule and reduces it at the epoch's
end (``self.validation_step_outputs.append(loss)`` in ``validation_step``, ``torch.stack(...)`` and ``.clear()`` in
``on_validation_epoch_end``; the same for training and test steps). Work a member's death cuts is redone on the
survivors — a training step, a validation run — and its hooks run again, so the attempt that was abandoned would stay
in such a list: a validation of 18 samples counted 30. A restart from a checkpoint (Lightning's own answer to a
failure) starts with the lists the constructor made; a survivor gets back the ones it had when the redone work began.

:class:`KeptContainers` records, for each chosen attribute that holds a ``list``, ``dict``, ``set`` or ``deque``, that
object and a shallow copy of its contents, and does so for the containers nested in a short one (a dict of lists per
dataloader; at most :data:`MAX_SCANNED` elements, so that a list of every step's outputs costs one copy, not a look
into each of them) down to :data:`MAX_DEPTH`; :meth:`KeptContainers.restore` puts each container's contents back in
place (references the user keeps stay valid) and each attribute back to its container (a hook that assigned a new
list). What the elements are is not looked into: a tensor changed in place stays changed (buffers are put back
elsewhere).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MAX_DEPTH", "MAX_SCANNED", "KeptContainers"]

MAX_DEPTH = 3
"""How deep nested containers are kept (``self.outputs[dataloader_idx]`` is depth 2)."""
MAX_SCANNED = 32
"""The most elements a container may hold for the containers among them to be kept too."""

_CONTAINERS = (list, dict, set, collections.deque)


class KeptContainers:
    """The containers among ``owners``' attributes (those ``keep(owner, name)`` accepts), as they are now."""

    def __init__(self, owners: Iterable[object], keep: Callable[[object, str], bool]) -> None:
        self._attributes: list[tuple[object, str, Any]] = []
        self._contents: dict[int, tuple[Any, Any]] = {}  # id -> (the container, a shallow copy of its contents)
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if isinstance(value, _CONTAINERS) and keep(owner, name):
                    self._attributes.append((owner, name, value))
                    self._record(value, 1)

    def __len__(self) -> int:
        return len(self._contents)

    def _record(self, container: Any, depth: int) -> None:
        if id(container) in self._contents:
            return
        contents = dict(container) if isinstance(container, dict) else list(container)
        self._contents[id(container)] = (container, contents)
        if depth >= MAX_DEPTH or len(contents) > MAX_SCANNED:
            return
        for value in contents.values() if isinstance(contents, dict) else contents:
            if isinstance(value, _CONTAINERS):
                self._record(value, depth + 1)

    def restore(self) -> None:
        """Every kept container holds what it held when kept; every kept attribute names its container again."""
        for container, contents in self._contents.values():
            _refill(container, contents)
        for owner, name, container in self._attributes:
            if vars(owner).get(name) is not container:
                setattr(owner, name, container)


def _refill(container: Any, contents: Any) -> None:
    if isinstance(container, dict):
        container.clear()
        container.update(contents)
    elif isinstance(container, list):
        container[:] = contents
    elif isinstance(container, set):
        container.clear()
        container.update(contents)
    else:  # a deque (its maxlen kept)
        container.clear()
        container.extend(contents)
