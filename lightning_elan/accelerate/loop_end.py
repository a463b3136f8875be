"""A worker that trains on after the job's other members ended their training loop: a clear error, not a hang.

A script that counts steps in a local variable and leaves its loops with ``break`` at a maximum (the
``completed_steps``/``max_train_steps`` of transformers' ``run_*_no_trainer.py``) ends its training later on a worker
that joined the running job (its count started at 0) than on the others. That worker would train on alone, its next
collective waiting for members that never come (the collective timeout, 300 s).

Instead: a member whose ``accelerator.epochs()`` loop was left early announces which of its ``epochs()`` loops that was
and the optimizer steps it applied, in the job's store, at its next call that shows it goes on after its loop (a
collective, ``save_state``, ``end_training``; a member that crashed out of its loop announces nothing, and the job
recovers from its death as usual). A joiner watches for that announcement (:class:`LoopEndWatch`); once it is in that
same loop past that step, its collectives are released and it stops with :class:`LoopEnded`, which says what the loop
must count with. (The loops are counted so that a script with two ``epochs()`` loops, the first left with ``break``,
does not stop a joiner in its second.)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch.distributed as dist

__all__ = ["LoopEndWatch", "LoopEnded", "announce_loop_end", "loop_ended_key"]

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.2
"""How often a joiner looks for the announcement (it only matters once it trains past the job's last step)."""


def loop_ended_key(generation: int) -> str:
    """The rendezvous-store key saying which ``epochs()`` loop a member of ``generation`` left early, after how many
    optimizer steps (``"LOOP:STEPS"``)."""
    return f"elan/accelerate/loop_ended/gen{generation}"


class LoopEnded(RuntimeError):
    """This worker trains past the step at which the job's other members ended their training loop."""

    def __init__(self, steps: int) -> None:
        super().__init__(
            f"the job's other workers ended their training loop after {steps} optimizer steps while this worker, which "
            "joined the running job, trains on: the loop counts its steps or epochs itself, and a joiner's count "
            "starts at 0. Count optimizer steps with `accelerator.optimizer_steps` (a joiner receives it) or an object "
            "registered with `accelerator.register_for_checkpointing`, and iterate epochs with "
            "`for epoch in accelerator.epochs(num_epochs)`")
        self.steps = steps


def announce_loop_end(store: dist.Store, generation: int, loop: int, steps: int, after_boundary: bool) -> None:
    """A member left its ``loop``-th ``epochs()`` loop early after ``steps`` optimizer steps, and goes on: say so to the
    joiners. ``after_boundary``: it left after the batch boundary of its last step (in the code after the loop over the
    batches: ``check_trigger()`` after an evaluation), not inside that batch (``break`` after ``optimizer.step()``)."""
    log.info("training loop %d of generation %d ended after %d optimizer steps", loop, generation, steps)
    store.set(loop_ended_key(generation), f"{loop}:{steps}:{int(after_boundary)}")


class LoopEndWatch:
    """A joiner's thread: polls the store for its generation's announcement; once ``trains_past(loop, steps,
    after_boundary)``, calls ``release(generation, LoopEnded(steps))`` (which fails the collectives of that generation)
    once."""

    def __init__(self, open_store: Callable[[], dist.Store], generation: Callable[[], int | None],
                 trains_past: Callable[[int, int, bool], bool], release: Callable[[int, LoopEnded], None]) -> None:
        self._open_store = open_store
        self._generation = generation
        self._trains_past = trains_past
        self._release = release
        self.ended_after: tuple[int, int, bool] | None = None  # (loop, steps, after_boundary), once announced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elan-loop-end-watch", daemon=True)
        self._thread.start()

    def error_if_past(self) -> LoopEnded | None:
        """The error to stop with when the job's loop ended and this worker trains past it, else None."""
        ended = self.ended_after
        return LoopEnded(ended[1]) if ended is not None and self._trains_past(*ended) else None

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        try:
            store = self._open_store()
        except Exception as error:  # without the store, a joiner past the job's end waits out its collective
            log.warning("loop-end watch cannot reach the store: %s", error)
            return
        while not self._stop.wait(WATCH_INTERVAL_S):
            generation = self._generation()
            if generation is None:
                continue
            if self.ended_after is None:
                self.ended_after = _announced(store, generation)
            error = self.error_if_past()
            if error is not None:
                log.error("%s", error)
                self._release(generation, error)
                return


def _announced(store: dist.Store, generation: int) -> tuple[int, int, bool] | None:
    key = loop_ended_key(generation)
    try:
        if not store.check([key]):
            return None
        loop, steps, after_boundary = store.get(key).decode().split(":")
    except Exception:  # a store that does not answer now: look again later
        return None
    return int(loop), int(steps), after_boundary == "1"
