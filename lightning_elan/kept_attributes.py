"""The plain attributes a user's hooks change, put back as they were when work that is redone began.

Lightning's own idiom since 2.0 keeps a step's outputs in a list on the LightningModule and reduces it at the epoch's
end (``self.validation_step_outputs.append(loss)`` in ``validation_step``, ``torch.stack(...)`` and ``.clear()`` in
``on_validation_epoch_end``; the same for training and test steps), and users count what they train in attributes of
their own (``self.batches_seen += 1`` in ``training_step``, a callback's ``self.in_epoch += 1``, a running loss in a
tensor attribute updated in place), often steering the training by them. Work a member's death cuts is redone on the
survivors — a training step, a validation run — and its hooks run again, so the attempt that was abandoned would stay
counted: a validation of 18 samples counted 30, an epoch of 8 batches counted 9. A restart from a checkpoint
(Lightning's own answer to a failure) starts with what the constructor made; a survivor gets back what it had when the
redone work began.

:class:`KeptAttributes` records, for each chosen attribute,

* one that holds a ``list``, ``dict``, ``set`` or ``deque``: that object and a shallow copy of its contents, and does so
  for the containers nested in a short one (a dict of lists per dataloader; at most :data:`MAX_SCANNED` elements, so
  that a list of every step's outputs costs one copy, not a look into each of them) down to :data:`MAX_DEPTH`;
* one that holds an immutable value (a number, a string, ``None``, a tuple): the value;
* one that holds a tensor (not a ``Parameter``: the module's parameters and buffers are put back elsewhere): that
  tensor, and a copy of its contents when it has at most :data:`MAX_TENSOR_ELEMENTS` elements, needs no gradient and
  is a plain strided tensor (a counter or a running loss; a large cache is left alone).

:meth:`KeptAttributes.restore` puts each container's contents back in place (references the user keeps stay valid), a
kept tensor's contents back in place when it changed, and each attribute back to the object it held (a hook that
assigned a new list, a number, a new tensor). What a container's elements are is not looked into: a tensor in a list
changed in place stays changed. An attribute the redone work added is left.
"""

from __future__ import annotations

import collections
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["MAX_DEPTH", "MAX_SCANNED", "MAX_TENSOR_ELEMENTS", "KeptAttributes"]

MAX_DEPTH = 3
"""How deep nested containers are kept (``self.outputs[dataloader_idx]`` is depth 2)."""
MAX_SCANNED = 32
"""The most elements a container may hold for the containers among them to be kept too."""
MAX_TENSOR_ELEMENTS = 4096
"""The most elements a tensor attribute may hold for its contents to be kept (a counter, a running statistic)."""

_CONTAINERS = (list, dict, set, collections.deque)
_IMMUTABLE = (numbers.Number, str, bytes, tuple, frozenset, type(None))


class KeptAttributes:
    """The containers, immutable values and tensors among ``owners``' attributes (those ``keep(owner, name)``
    accepts), as they are now."""

    def __init__(self, owners: Iterable[object], keep: Callable[[object, str], bool]) -> None:
        self._attributes: list[tuple[object, str, Any]] = []
        self._contents: dict[int, tuple[Any, Any]] = {}  # id -> (the container, a shallow copy of its contents)
        self._tensors: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (the tensor, its version, a copy)
        for owner in owners:
            for name, value in list(vars(owner).items()):
                if _kept_kind(value) and keep(owner, name):
                    self._attributes.append((owner, name, value))
                    self._record(value)

    def __len__(self) -> int:
        """How many containers and tensors' contents are kept."""
        return len(self._contents) + len(self._tensors)

    def _record(self, value: Any) -> None:
        if isinstance(value, _CONTAINERS):
            self._record_container(value, 1)
        elif isinstance(value, torch.Tensor) and _small_plain_tensor(value):
            self._tensors.append((value, value._version, value.detach().clone()))

    def _record_container(self, container: Any, depth: int) -> None:
        if id(container) in self._contents:
            return
        contents = dict(container) if isinstance(container, dict) else list(container)
        self._contents[id(container)] = (container, contents)
        if depth >= MAX_DEPTH or len(contents) > MAX_SCANNED:
            return
        for value in contents.values() if isinstance(contents, dict) else contents:
            if isinstance(value, _CONTAINERS):
                self._record_container(value, depth + 1)

    def restore(self) -> None:
        """Every kept container and tensor holds what it held when kept; every kept attribute names its object again."""
        for container, contents in self._contents.values():
            _refill(container, contents)
        with torch.no_grad():
            for tensor, version, copy in self._tensors:
                if tensor._version != version:  # changed in place since (torch counts in-place writes)
                    tensor.copy_(copy)
        for owner, name, value in self._attributes:
            if vars(owner).get(name) is not value:
                setattr(owner, name, value)


def _kept_kind(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not isinstance(value, torch.nn.Parameter)
    return isinstance(value, (*_CONTAINERS, *_IMMUTABLE))


def _small_plain_tensor(tensor: torch.Tensor) -> bool:
    return (tensor.layout == torch.strided and not tensor.requires_grad and not tensor.is_inference()
            and tensor.numel() <= MAX_TENSOR_ELEMENTS)


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
