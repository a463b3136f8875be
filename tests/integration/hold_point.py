"""Test-only, inside a worker: hold at a named phase of one step while the test SIGKILLs the victim from outside.

``--hold-at WORKER:STEP:PHASE`` (both probes): at that step every member that reaches PHASE writes
``OUT/held-<worker>`` (its pid) and holds there — the victim ``WORKER`` until the test kills it with a real SIGKILL,
every other member until its engine has the failure notice (a member of its generation died) — and then goes on. So the
death lands exactly while the survivors are in PHASE, whatever the timing of the machine. In ``allreduce`` only the
victim holds (in its backward, before its gradient all-reduce): the others mark and go on into the all-reduce, where
they wait for the victim's gradients until it dies. Before the kill the test writes ``OUT/hold-released``: the step is
held once (neither its redo nor a replacement hold again). Standard library only: the probes import it as a sibling
module.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PHASES = ("forward", "backward", "allreduce", "vote", "optimizer", "batch_end")
"""``forward``: the step's forward is done (``training_step`` / the loss computed), its backward not started;
``backward``: in the backward pass, some gradients computed, no all-reduce started; ``allreduce``: the survivors wait
in the gradient all-reduce; ``vote``: gradients all-reduced, the commit vote not cast; ``optimizer``: every member
committed the step (the vote follows the hooks before the update and any gradient clipping), this one applied it (the
optimizer's step post-hook); ``batch_end``: the step is applied, the batch-end hooks run."""
METRIC = "metric"
"""Lightning probe only: in ``training_step``, before its metric is synced over the job (``self.log(sync_dist=True)``):
the failure surfaces inside the forward, between DDP's pre- and post-forward."""
LIGHTNING_PHASES = ("data", "validation", "checkpoint", "epoch_end")
"""Lightning probe only. ``data``: the batch is fetched and the step not started, the DataLoader's worker processes
alive (``--num-workers``); ``validation``: in ``validation_step`` of the validation that follows step STEP, before its
metric is synced over the job (``--val``); ``checkpoint``: ``ModelCheckpoint`` saving after step STEP, in the
module's ``on_save_checkpoint`` (``--full-lightning``); ``epoch_end``: the module's ``on_train_epoch_end`` of the epoch
that ended with step STEP (its ``sync_dist`` aggregates are synced next)."""
RELEASED = "hold-released"
HOLD_LIMIT_S = 120.0  # a hold that outlives this is a broken test: the worker fails loudly instead of hanging the job


@dataclass(frozen=True)
class HoldPoint:
    """Where the members hold (see the module docstring); an empty one never holds."""

    out: Path
    worker: str | None = None
    step: int = -1
    phase: str = ""

    @classmethod
    def parse(cls, out: Path, text: str | None) -> HoldPoint:
        if not text:
            return cls(out)
        worker, step, phase = text.split(":")
        if phase not in (METRIC, *PHASES, *LIGHTNING_PHASES):
            raise ValueError(f"unknown hold phase {phase!r} (one of {', '.join((METRIC, *PHASES, *LIGHTNING_PHASES))})")
        return cls(out, worker, int(step), phase)

    def due(self, phase: str, step: int) -> bool:
        """This process is at the hold's phase and step, and the hold was not released yet."""
        return (self.worker is not None and phase == self.phase and step == self.step
                and not (self.out / RELEASED).exists())

    def hold(self, me: str, failed: Callable[[], bool]) -> None:
        """Mark this member as arrived; the victim then waits to be killed, the others for the failure notice."""
        self.mark(me)
        if me == self.worker:
            time.sleep(HOLD_LIMIT_S)
            os._exit(3)  # never killed: the test did not do its part
        wait_for(failed, f"{me}: no failure notice while held in {self.phase}")

    def mark(self, me: str) -> None:
        marker = self.out / f"held-{me}.json"
        partial = marker.with_suffix(".tmp")
        partial.write_text(json.dumps({"worker": me, "pid": os.getpid(), "phase": self.phase, "at": time.time()}))
        partial.replace(marker)


def wait_for(condition: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(message)
        time.sleep(0.01)
