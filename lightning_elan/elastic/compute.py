"""A member's compute time per optimizer step, measured on the training thread from two timestamps per batch.

Compute is the forward pass: from the moment the engine hands out a batch (``take_global_batch``) to the moment the
front-end starts its backward pass, less the time spent waiting in collectives meanwhile (a metric logged with
``sync_dist=True`` in ``training_step`` waits for the slowest rank). It is the part of a step no peer can delay:
under DDP the backward pass also holds the all-reduce and the wait for the slowest rank, so a straggler makes every
rank's backward slow but only its own forward. The mean over the steps since the last report goes to the AM every
``every_s`` seconds (off the training thread), where the straggler detector and ``elan profile`` read it. Pure.
"""

from __future__ import annotations

STATS_EVERY_S = 1.0
"""A member sends its compute time to the AM at most this often."""


class ComputeMeter:
    """Accumulates forward time per optimizer step; :meth:`take_due` hands out the mean once per interval."""

    def __init__(self, every_s: float = STATS_EVERY_S) -> None:
        self.every_s = every_s
        self._batch_started: float | None = None
        self._blocked_at_start = 0.0
        self._forward = 0.0  # the step in flight (its micro-batches so far)
        self._total, self._steps = 0.0, 0
        self._last_step: int | None = None
        self._sent_at: float | None = None

    def batch_started(self, now: float, blocked_s: float = 0.0) -> None:
        """A batch is handed out at ``now``; ``blocked_s``: the process's time in collective waits so far."""
        self._batch_started, self._blocked_at_start = now, blocked_s

    def backward_started(self, now: float, blocked_s: float = 0.0) -> None:
        """The front-end starts the backward pass of the batch handed out last (a second call is ignored)."""
        if self._batch_started is not None:
            waited = max(0.0, blocked_s - self._blocked_at_start)
            self._forward += max(0.0, now - self._batch_started - waited)
            self._batch_started = None

    def step_done(self, step: int) -> None:
        """A batch ended with ``step`` optimizer steps done: a step is complete when ``step`` moved on."""
        if self._last_step is not None and step > self._last_step and self._forward > 0:
            self._total += self._forward
            self._steps += 1
        if self._last_step is None or step != self._last_step:
            self._forward = 0.0
        self._last_step = step

    def reset(self) -> None:
        """A new generation: a step that spans the change is not measured."""
        self._batch_started, self._forward, self._total, self._steps, self._last_step = None, 0.0, 0.0, 0, None

    def take_due(self, now: float) -> tuple[int, float] | None:
        """``(steps, mean compute seconds)`` when a report is due and a step was measured, else None."""
        if self._sent_at is None:
            self._sent_at = now
        if self._steps == 0 or now - self._sent_at < self.every_s:
            return None
        measured = (self._steps, self._total / self._steps)
        self._total, self._steps, self._sent_at = 0.0, 0, now
        return measured
