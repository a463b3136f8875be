"""Accelerate's ``LocalSGD`` in an elastic job: the count of local steps that decides when the models are averaged.

``LocalSGD`` (``accelerate/local_sgd.py``) counts ``step()`` calls in ``num_steps`` and, every ``local_sgd_steps`` of
them, runs ``wait_for_everyone`` and one ``reduce`` per parameter. That count lives in the user's ``LocalSGD`` object,
which a joiner builds itself, at 0: it would average at other steps than the members, whose collectives then wait for
it for ever. The members' count travels with the training state, and a joiner's first ``LocalSGD`` entered (the one
active where it joined: around the epoch loop or, as Accelerate's example has it, around each epoch's) starts from it.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["LocalSGDSteps"]

log = logging.getLogger(__name__)


class LocalSGDSteps:
    """The ``LocalSGD`` this worker is inside (entered, not exited), and a joiner's count for its first one."""

    def __init__(self) -> None:
        self._active: Any = None
        self._received: int | None = None

    def entered(self, local_sgd: Any) -> None:
        """A ``LocalSGD`` was entered: on a joiner, the first one continues the members' count."""
        self._active = local_sgd
        if self._received is not None:
            log.debug("LocalSGD continues the job's count of local steps: %d", self._received)
            local_sgd.num_steps, self._received = self._received, None

    def exited(self, local_sgd: Any) -> None:
        if self._active is local_sgd:
            self._active = None

    def state_dict(self) -> dict[str, int | None]:
        return {"num_steps": None if self._active is None else int(self._active.num_steps)}

    def load_state_dict(self, state: dict[str, int | None] | None) -> None:
        """A joiner: the count of the members' active ``LocalSGD`` (None: they were in none)."""
        self._received = None if state is None else state.get("num_steps")
