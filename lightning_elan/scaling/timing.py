"""Split a training step's wall time into compute and all-reduce from local timestamps only (pure, no sync).

Lightning's hooks give, per batch: start (``on_train_batch_start``), ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step`` and end (``on_train_batch_end``). Forward time is pure local compute. Backward time under
DDP also holds the all-reduce that backward could not hide (DDP waits for its buckets before backward returns) and
any wait for slower ranks. The approximation (documented, deliberately simple):

* backward compute ≈ ``backward_ratio × forward``, where the ratio is learned on steps without communication (world
  size 1, or micro-batches inside gradient accumulation, where DDP skips the all-reduce) and defaults to 2 (the usual
  "backward costs two forwards");
* all-reduce = backward time − that estimate (≥ 0), or a measured value handed in with :meth:`StepTimer.allreduce`
  (e.g. from a DDP communication hook);
* compute = the whole step − all-reduce (forward, backward, optimizer step, other hooks).
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_elan.scaling.throughput import RunningMean


@dataclass(frozen=True)
class StepSample:
    """One measured step, ready for :meth:`ThroughputModel.observe_step`."""

    local_batch: int
    world_size: int
    compute_s: float
    allreduce_s: float


class StepTimer:
    """Timestamps of the batch in flight; :meth:`batch_end` turns them into a :class:`StepSample` (or ``None``)."""

    def __init__(self, backward_ratio: float = 2.0, window: int = 50) -> None:
        if backward_ratio < 0:
            raise ValueError(f"backward_ratio must be >= 0, got {backward_ratio}")
        self.window = window
        self.ratio = RunningMean(0, backward_ratio)
        self._reset()

    def _reset(self) -> None:
        self._start: float | None = None
        self._backward_start: float | None = None
        self._backward_end: float | None = None
        self._stepped = False
        self._allreduce: float | None = None
        self._local_batch = 0
        self._world_size = 1

    @property
    def backward_ratio(self) -> float:
        return self.ratio.mean

    def batch_start(self, now: float, local_batch: int, world_size: int) -> None:
        self._reset()
        self._start, self._local_batch, self._world_size = now, local_batch, world_size

    def before_backward(self, now: float) -> None:
        if self._backward_start is None:
            self._backward_start = now

    def after_backward(self, now: float) -> None:
        self._backward_end = now

    def optimizer_step(self) -> None:
        self._stepped = True

    def allreduce(self, seconds: float) -> None:
        """A measured all-reduce time for this step (replaces the estimate)."""
        self._allreduce = (self._allreduce or 0.0) + max(0.0, seconds)

    def batch_end(self, now: float) -> StepSample | None:
        """The sample of the batch that just ended; ``None`` when it did not complete a synchronised step."""
        start, backward_start, backward_end = self._start, self._backward_start, self._backward_end
        self._start = None
        if start is None or backward_start is None or backward_end is None:
            return None
        forward, backward = backward_start - start, max(0.0, backward_end - backward_start)
        synced = self._stepped and self._world_size > 1
        if not synced and forward > 0:
            self.ratio.add(backward / forward, self.window)
        if not self._stepped:
            return None  # a micro-batch of gradient accumulation: no optimizer step to model
        total = max(0.0, now - start)
        allreduce = self._allreduce_estimate(forward, backward) if synced else 0.0
        return StepSample(self._local_batch, self._world_size, max(0.0, total - allreduce), allreduce)

    def _allreduce_estimate(self, forward: float, backward: float) -> float:
        if self._allreduce is not None:
            return min(self._allreduce, backward)
        return max(0.0, backward - self.backward_ratio * forward)
