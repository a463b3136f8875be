"""The evaluation pass in progress on a process of an ``ElasticAccelerator``, and what its survivors do when a member
dies inside it: recover in the collective that met the death, agree on where the pass is (one all-gather), and go on
with what the dead member had not evaluated (:mod:`~lightning_elan.accelerate.evaluation` plans it, purely). What
cannot be made whole is named in a warning. Also the rows ``gather_for_metrics`` keeps of a gathered batch of such a
pass (:func:`without_padding`).

The evaluation loaders (:mod:`~lightning_elan.accelerate.data`) tell :class:`EvaluationRecovery` their passes (it is
their :class:`~lightning_elan.accelerate.data.EvaluationHost`); the accelerator asks it, in each collective, what to do
with a failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import recursively_apply

from lightning_elan.accelerate.evaluation import EvaluationPass, Progress, same_place
from lightning_elan.elastic.worker import ElasticWorker

log = logging.getLogger(__name__)

__all__ = ["EvaluationRecovery", "all_tensors", "without_padding"]

Agreement = Callable[[], list[Progress]]
"""Every survivor's place in the pass, by rank in the new world."""


class EvaluationRecovery:
    """The pass over an evaluation loader in progress on this process (its loaders report it: ``EvaluationHost``),
    and its recovery when a member dies in one of its collectives.

    Args:
        engine: the worker's elastic engine (it confirms a member's death).
        accelerator: this process's place in the job (``process_index``, ``num_processes``, ``device``).
        recover: the accelerator's recovery, run once a death is confirmed: the survivors form the new generation.
    """

    def __init__(self, engine: ElasticWorker, accelerator: Accelerator, recover: Callable[[], None]) -> None:
        self._engine = engine
        self._accelerator = accelerator
        self._recover = recover
        self.evaluating = False  # a pass over an evaluation loader is in progress
        self.evaluation: EvaluationPass | None = None  # that pass, when the elastic evaluation loader makes it
        self._unsupported: str | None = None  # why the loader of that pass cannot be re-cut
        self._loss_warned = False  # the pass lost samples and said so

    # ------------------------------------------------------------------ EvaluationHost: what the loaders tell

    def evaluation_world(self) -> tuple[int, int]:
        """This process's rank and the world size a new pass is cut for."""
        return self._accelerator.process_index, self._accelerator.num_processes

    def evaluation_started(self, evaluation: EvaluationPass | None, unsupported: str | None = None) -> None:
        """A pass begins (``evaluation`` None: a loader Accelerate shards, ``unsupported`` says why)."""
        self.evaluating, self.evaluation, self._unsupported = True, evaluation, unsupported
        self._loss_warned = False

    def evaluation_ended(self, evaluation: EvaluationPass | None) -> None:
        """The pass is over (exhausted, or its loop left)."""
        if self.evaluating and self.evaluation is evaluation:
            self.evaluating, self.evaluation, self._unsupported = False, None, None

    # ------------------------------------------------------------------ what the accelerator's collectives tell

    def collective_done(self) -> None:
        """One of the job's collectives completed (the pass counts them within its current batch)."""
        if self.evaluation is not None:
            self.evaluation.collective_done()

    def warn_lost(self, step_open: bool) -> None:
        """A member died during an evaluation pass the survivors cannot go on with now (a training step is open, or
        the loop over the epochs is not running): its collectives return this process's own values until the pass
        ends, once said."""
        if self.evaluating and not self._loss_warned:
            self._loss_warned = True
            log.warning("worker %s: a member died during an evaluation pass made %s: the rest of the pass gathers this "
                        "process's values only (the dead member's and the other survivors' samples of it are missing)",
                        self._engine.worker_id, "while a training step is open" if step_open
                        else "outside the loop over the epochs")

    def recover(self, error: BaseException) -> None:
        """A member died during an evaluation pass: recover now (a training step this batch committed stands), then
        the survivors agree on where the pass is and go on with what the dead had not evaluated."""
        self._engine.confirm_peer_failure(error)
        log.warning("worker %s: a member of generation %s died during an evaluation pass; the survivors go on with "
                    "its samples", self._engine.worker_id, self._engine.generation)
        self._recover()
        self._go_on(self._agreed)

    def recovered_before_the_loop(self, run: Callable[[Agreement], list[Progress]]) -> None:
        """A collective before the training loop recovered from a death: in a pass, the survivors agree through
        ``run`` (the pre-loop journal's, which recovers and runs it again) and go on with the dead's samples."""
        if self.evaluating:
            self._go_on(lambda: run(self._agree))

    # ------------------------------------------------------------------ the survivors' agreement

    def _agreed(self) -> list[Progress]:
        """Every survivor's place in the pass; a death meanwhile is recovered from and they agree again."""
        while True:
            try:
                return self._agree()
            except Exception as error:
                self._engine.confirm_peer_failure(error)
                log.warning("worker %s: a member died while the survivors of an evaluation pass agreed",
                            self._engine.worker_id)
                self._recover()

    def _agree(self) -> list[Progress]:
        """Every member's place in the current evaluation pass, by rank (one all-gather of four integers)."""
        assert self.evaluation is not None
        mine = torch.tensor(self.evaluation.progress().to_list(), dtype=torch.int64, device=self._accelerator.device)
        places = [torch.empty_like(mine) for _ in range(self._accelerator.num_processes)]
        torch.distributed.all_gather(places, mine)
        return [Progress.from_list(place.tolist()) for place in places]

    def _go_on(self, agree: Agreement) -> None:
        """The pass goes on among the survivors (see :mod:`~lightning_elan.accelerate.evaluation`); what cannot be
        made whole is named in a warning."""
        evaluation = self.evaluation
        if evaluation is None:
            log.warning("worker %s: a member died during a pass over an evaluation DataLoader that cannot be cut again "
                        "(%s): its samples of the batch in flight and of the batches after it are not evaluated in "
                        "this pass (gather_for_metrics returns the survivors' only)", self._engine.worker_id,
                        self._unsupported)
            return
        survivors = agree()
        if not same_place(survivors):
            raise RuntimeError(f"worker {self._engine.worker_id}: a member died inside a collective of an evaluation "
                               f"pass that some survivors completed and others did not (plan, batch, collectives by "
                               f"rank: {[survivor.position() for survivor in survivors]}); the pass cannot go on")
        twice = evaluation.recovered(survivors, self._accelerator.process_index, self._accelerator.num_processes)
        if twice:
            log.warning("worker %s: a member died between two collectives of evaluation batch %d: its samples %s of "
                        "that batch are evaluated again by the survivors, and the first %d collective(s) of that "
                        "batch had gathered them already (they hold them twice)", self._engine.worker_id,
                        evaluation.batch, twice, evaluation.collectives)


def all_tensors(data: Any) -> bool:
    """Whether ``data`` holds tensors only (Accelerate's test in ``gather_for_metrics``)."""
    try:
        recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def without_padding(gathered: Any, evaluation: EvaluationPass) -> Any:
    """The rows of a gathered tensor (or list of objects) of the pass's current batch that are samples. A gather of
    something else than one row per sample is cut as Accelerate cuts it (its first rows) when the samples come first,
    else left as it is."""
    kept = evaluation.kept_rows()
    if kept is None or (isinstance(gathered, torch.Tensor) and gathered.dim() == 0):
        return gathered
    rows, samples = kept
    if samples == list(range(len(samples))):
        return gathered[: len(samples)]
    if len(gathered) != rows:
        return gathered
    if isinstance(gathered, torch.Tensor):
        return gathered[torch.tensor(samples, dtype=torch.long, device=gathered.device)]
    return [gathered[row] for row in samples]
