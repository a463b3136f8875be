"""One pass over an evaluation DataLoader, as an elastic job makes it: which samples each process evaluates, which
rows of a gathered batch are padding, and what is left to evaluate when a member dies in the middle of the pass.

A pass evaluates the loader's samples in its order. A *plan* cuts the samples still to evaluate into global batches of
``batch_size`` per process, as Accelerate shards an evaluation loader (``even_batches``): in global batch ``b`` process
``r`` takes the samples ``[b·G + r·B, b·G + (r+1)·B)`` (``G = world·B``), so a gather lists them in the loader's order;
the last global batch is padded (each process to ``B`` rows, repeating samples from the plan's start) and
``gather_for_metrics`` drops the padding. The first plan is the whole loader at the world of the moment.

When a member dies during a batch's collective, the survivors recover in a new generation and run the collective again
among themselves: it gathers their parts of the batch. The dead member's part of that batch, and every later batch of
the plan, are left to evaluate: the next batch starts a new plan of them for the new world. So every sample is gathered
exactly once in the pass, on every survivor — also on one that becomes the main process: it gathered everything that
was gathered before the death. A death between two collectives of one batch cannot be made whole (the dead member's
part is in the first ones, not in the others): its part is evaluated again and a warning names it.

Pure logic: no process group, no DataLoader.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

__all__ = ["EvaluationPass", "EvaluationPlan", "Progress", "same_place"]


@dataclass(frozen=True)
class EvaluationPlan:
    """The samples still to evaluate (indices, in the loader's order) cut into global batches for ``world`` processes
    of ``batch_size`` samples each."""

    samples: tuple[int, ...]
    world: int
    batch_size: int

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size

    def __len__(self) -> int:
        """Batches per process (the same on every process)."""
        return math.ceil(len(self.samples) / self.global_batch)

    def contributions(self, batch: int) -> list[list[int]]:
        """The samples (no padding) each process of the world evaluates in global batch ``batch``, by rank."""
        start = batch * self.global_batch
        return [list(self.samples[start + rank * self.batch_size : start + (rank + 1) * self.batch_size])
                for rank in range(self.world)]

    def indices(self, batch: int, rank: int) -> list[int]:
        """What process ``rank`` loads for global batch ``batch``: its samples, padded to ``batch_size`` when the
        world has several processes (as Accelerate's ``even_batches``; a single process is not padded)."""
        samples = self.contributions(batch)[rank]
        missing = self.batch_size - len(samples)
        if self.world == 1 or missing == 0:
            return samples
        return samples + list(itertools.islice(itertools.cycle(self.samples), missing))

    def rows_per_process(self, batch: int) -> int:
        """Rows each process gives a gather of a per-sample value in global batch ``batch``."""
        return self.batch_size if self.world > 1 else len(self.contributions(batch)[0])

    def after(self, batch: int) -> tuple[int, ...]:
        """The samples of the global batches after ``batch`` (all of them for ``batch`` -1)."""
        return self.samples[(batch + 1) * self.global_batch :]


@dataclass(frozen=True)
class Progress:
    """Where a survivor was in the pass when a member died: ``rank`` in the world the current batch was cut for,
    ``plan`` (how many plans the pass made before the current one), ``batch`` in that plan, ``collectives`` it
    completed in that batch."""

    rank: int
    plan: int
    batch: int
    collectives: int

    def to_list(self) -> list[int]:
        return [self.rank, self.plan, self.batch, self.collectives]

    @classmethod
    def from_list(cls, values: list[int]) -> Progress:
        return cls(*(int(value) for value in values))

    def position(self) -> tuple[int, int, int]:
        return self.plan, self.batch, self.collectives


class EvaluationPass:
    """The state of one pass over an evaluation loader on this process (see the module docstring)."""

    def __init__(self, samples: tuple[int, ...], world: int, rank: int, batch_size: int) -> None:
        self.plan = EvaluationPlan(samples, world, batch_size)
        self.rank = rank  # in the world the current batch was cut for
        self.plans = 0  # plans made before the current one
        self.batch = -1  # the current batch of the plan
        self.collectives = 0  # completed in the current batch
        self.contributors: list[list[int]] = []  # the current batch's samples, by rank of the world gathering it
        self._rows = 0  # rows per process in a gather of the current batch
        self._left: tuple[int, ...] | None = None  # after a recovery: what the next plan evaluates
        self._world_after: tuple[int, int] | None = None  # after a recovery: (rank, world) of the next plan

    def next_batch(self) -> list[int] | None:
        """Take the next batch: the indices this process loads, None when the pass is over. After a recovery the
        next batch is the first of a new plan."""
        if self._left is not None and self._world_after is not None:
            (self.rank, world), samples = self._world_after, self._left
            self.plan = EvaluationPlan(samples, world, self.plan.batch_size)
            self.plans, self.batch, self._left, self._world_after = self.plans + 1, -1, None, None
        self.batch += 1
        self.collectives = 0
        if self.batch >= len(self.plan):
            self.contributors = []
            return None
        self.contributors = self.plan.contributions(self.batch)
        self._rows = self.plan.rows_per_process(self.batch)
        return self.plan.indices(self.batch, self.rank)

    @property
    def replanned(self) -> bool:
        """Whether the current batch is the first of a plan made after a recovery."""
        return self.plans > 0 and self.batch == 0

    @property
    def is_last_batch(self) -> bool:
        return self.batch == len(self.plan) - 1

    def collective_done(self) -> None:
        self.collectives += 1

    def progress(self) -> Progress:
        return Progress(self.rank, self.plans, self.batch, self.collectives)

    def recovered(self, survivors: list[Progress], rank: int, world: int) -> list[int]:
        """A member died: ``survivors`` say, by their rank in the new world, where each was (the same place on every
        survivor: :func:`same_place` checked it). The current batch is now gathered by the survivors, in the order of
        their new ranks; what the dead had not given, and every later batch, is left for the next plan. Returns the
        dead members' samples of the current batch that earlier collectives of it gathered already (evaluated
        again: the caller warns)."""
        old_ranks = [survivor.rank for survivor in survivors]
        dead = [samples for old_rank, samples in enumerate(self.contributors) if old_rank not in old_ranks]
        lost = [sample for samples in dead for sample in samples]
        after = self._left if self._left is not None else self.plan.after(self.batch)
        self._left = tuple(lost) + after
        self._world_after = (rank, world)
        self.contributors = [self.contributors[old_rank] for old_rank in old_ranks]
        self.rank = rank
        return lost if self.collectives > 0 else []

    def kept_rows(self) -> tuple[int, list[int]] | None:
        """The rows of a gather of the current batch that are samples (not padding), and the rows it has; None when
        every row is a sample."""
        total = self._rows * len(self.contributors)
        kept = [process * self._rows + row for process, samples in enumerate(self.contributors)
                for row in range(len(samples))]
        return None if len(kept) == total else (total, kept)


def same_place(survivors: list[Progress]) -> bool:
    """Whether every survivor was in the same collective of the same batch when the member died."""
    return len({survivor.position() for survivor in survivors}) == 1
