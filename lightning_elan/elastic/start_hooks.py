"""The results of the collectives the training's start hooks make, for the workers that join later.

The ``on_fit_start`` and ``on_train_start`` hooks of the callbacks and the LightningModule run on every process of a
fit, a joiner's too: it runs them after it received the training state, while the members train. What they compute
with a collective (statistics of the data reduced over the processes' shares, a value broadcast from rank 0) the
joiner cannot compute with the members, and computed alone it differs from theirs (a reduction of its share only):
state derived from it and not replicated (a plain attribute) would make it train otherwise. So rank 0 publishes the
result of every collective it completes in those hooks, named by the hook, its owner's place and the collective's
place in the hook; the joiner's same collective takes that result. One the members never made (the hook took another
branch on the joiner) runs alone, with a warning.

A ``torch.distributed`` collective called there directly (not through the strategy) reaches the job's group: on a
joiner it would meet the members' next collective of their training batch, and both would hang. Those are counted
apart (``raw``): rank 0 publishes the tensors each one left, and the joiner's same call takes them without reaching
the group.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger(__name__)

__all__ = ["START_HOOKS", "StartHookResults"]

START_HOOKS = ("on_fit_start", "on_train_start")
"""The hooks a joiner runs after it received the state and before its first batch (the sanity check is skipped on a
restarting loop; the epoch's start hooks are skipped mid-epoch)."""
RESULT_PREFIX = "hook/"


class StartHookResults:
    """Counts the collectives of the start hook running now; publishes (rank 0) or takes (a joiner) their results.

    ``publish(name, value)`` stores a result in the job's store, ``published(name)`` reads one (None: not there).
    """

    def __init__(self, publish: Callable[[str, bytes], None], published: Callable[[str], bytes | None]) -> None:
        self._publish = publish
        self._published = published
        self._hook: str | None = None
        self._made: dict[str, int] = {}
        self._in_strategy_collective = False
        self._warned: set[str] = set()
        self.entering(None)

    def entering(self, hook: str | None) -> None:
        """A start hook begins (``on_train_start/3``: its name and its owner's place), again when it runs again after
        a recovery; None: it returned."""
        self._hook, self._made = hook, {"": 0, "raw/": 0}

    @contextmanager
    def strategy_collective(self) -> Iterator[None]:
        """A collective of the strategy runs (counted by :meth:`completed`): the group's calls it makes are not raw."""
        self._in_strategy_collective = True
        try:
            yield
        finally:
            self._in_strategy_collective = False

    def completed(self, result: Any, publisher: bool) -> Any:
        """A member completed a collective; in a start hook, the publisher (rank 0) publishes its result."""
        name = self._next_name("")
        if name is not None and publisher:
            self._publish(name, _to_bytes(result))
        return result

    def alone(self, result: Any, device: torch.device) -> Any:
        """A joiner's collective, made alone (``result``): in a start hook, the members' result of theirs instead."""
        name = self._next_name("")
        if name is None:
            return result
        published = self._take(name)
        return result if published is None else torch.load(io.BytesIO(published), map_location=device,
                                                               weights_only=False)

    @property
    def following_raw(self) -> bool:
        """Whether a ``torch.distributed`` call on the job's group now is one made directly in a start hook."""
        return self._hook is not None and not self._in_strategy_collective

    def raw_completed(self, outputs: list[torch.Tensor], publisher: bool) -> None:
        """A member's direct collective in a start hook completed, leaving ``outputs``; the publisher publishes them."""
        name = self._next_name("raw/")
        if name is not None and publisher:
            self._publish(name, _to_bytes([output.detach().cpu() for output in outputs]))

    def raw_taken(self, outputs: list[torch.Tensor], own: torch.Tensor | None = None) -> None:
        """A joiner's direct collective in a start hook: ``outputs`` take what the members' same call left. A gather's
        slots (``own``: this process's input) are as many as the joiner's world has: a slot the members' call did not
        have takes ``own``, as this rank's slot would."""
        name = self._next_name("raw/")
        published = self._take(name) if name is not None else None
        if published is None:
            return
        values = torch.load(io.BytesIO(published), weights_only=False)
        if len(values) != len(outputs):
            log.warning("collective %s of this joiner's start hook has %d outputs, the members' had %d: the members' "
                        "fill the first, this process's own input the others", name, len(outputs), len(values))
        for index, output in enumerate(outputs):
            if index < len(values) and values[index].shape == output.shape:
                output.copy_(values[index])
            elif own is not None and own.shape == output.shape:
                output.copy_(own)

    def _take(self, name: str) -> bytes | None:
        published = self._published(name)
        if published is None and name not in self._warned:
            self._warned.add(name)
            log.warning("collective %s of this joiner's start hook was not made by the job's members: it runs in this "
                        "process alone", name)
        return published

    def _next_name(self, kind: str) -> str | None:
        if self._hook is None:
            return None
        self._made[kind] += 1
        return f"{RESULT_PREFIX}{self._hook}/{kind}{self._made[kind] - 1}"


def _to_bytes(result: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(result.detach() if isinstance(result, torch.Tensor) else result, buffer)
    return buffer.getvalue()
