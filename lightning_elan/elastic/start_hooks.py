"""The results of the collectives the training's start hooks make, for the workers that join later.

The ``on_fit_start`` and ``on_train_start`` hooks of the callbacks and the LightningModule run on every process of a
fit, a joiner's too: it runs them after it received the training state, while the members train. What they compute
with a collective (statistics of the data reduced over the processes' shares, a value broadcast from rank 0) the
joiner cannot compute with the members, and computed alone it differs from theirs (a reduction of its share only):
state derived from it and not replicated (a plain attribute) would make it train otherwise. So rank 0 publishes the
result of every collective it completes in those hooks, named by the hook, its owner's place and the collective's
place in the hook; the joiner's same collective takes that result. One the members never made (the hook took another
branch on the joiner) runs alone, with a warning.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
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
        self._made = 0
        self._warned: set[str] = set()

    def entering(self, hook: str | None) -> None:
        """A start hook begins (``on_train_start/3``: its name and its owner's place), again when it runs again after
        a recovery; None: it returned."""
        self._hook, self._made = hook, 0

    def completed(self, result: Any, publisher: bool) -> Any:
        """A member completed a collective; in a start hook, the publisher (rank 0) publishes its result."""
        name = self._next_name()
        if name is not None and publisher:
            self._publish(RESULT_PREFIX + name, _to_bytes(result))
        return result

    def alone(self, result: Any, device: torch.device) -> Any:
        """A joiner's collective, made alone (``result``): in a start hook, the members' result of theirs instead."""
        name = self._next_name()
        if name is None:
            return result
        published = self._published(RESULT_PREFIX + name)
        if published is not None:
            return torch.load(io.BytesIO(published), map_location=device, weights_only=False)
        if name not in self._warned:
            self._warned.add(name)
            log.warning("collective %s of this joiner's start hook was not made by the job's members: it runs in this "
                        "process alone", name)
        return result

    def _next_name(self) -> str | None:
        if self._hook is None:
            return None
        self._made += 1
        return f"{self._hook}/{self._made - 1}"


def _to_bytes(result: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(result.detach() if isinstance(result, torch.Tensor) else result, buffer)
    return buffer.getvalue()
