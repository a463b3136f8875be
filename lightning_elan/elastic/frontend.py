"""What a training framework gives the elastic engine: the interface every front-end implements.

The engine (:class:`~lightning_elan.elastic.worker.ElasticWorker`) runs the membership protocol; a front-end (the
Lightning strategy, the Accelerate accelerator) knows how to dump and load its training state, rebuild its data
iterator, re-wrap its model, and end its training loop. Nothing here imports a framework.

Besides implementing :class:`FrontEnd`, a front-end drives the engine's failure handling: it calls
``ElasticWorker.commit_step(committed_step)`` (the optimizer steps applied so far) after a step's gradients were
all-reduced and before the optimizer applies them (an aborted commit raises, and the step must not be applied), and
when an error escapes a training step it calls ``confirm_peer_failure(error)`` (which re-raises anything that is not a
member's death), rolls its own loop back when ``step_uncommitted`` says the step was not committed, then
``recover(committed_step)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping

    import torch

    from lightning_elan.scaling.batch import ScalingDecision

__all__ = ["FrontEnd", "ScalingParticipant"]


@runtime_checkable
class FrontEnd(Protocol):
    """The framework side of one worker, called by the engine on the training thread at batch boundaries."""

    def training_state(self) -> dict[str, Any]:
        """The framework's whole training state, in memory (tensors anywhere inside; no file)."""

    def load_training_state(self, state: dict[str, Any]) -> None:
        """A joiner: restore what :meth:`training_state` returned on its source."""

    def receive_destinations(self, state: dict[str, Any]) -> Mapping[int, torch.Tensor]:
        """A joiner: tensors of its own the source's state may be received into (its parameters and buffers), keyed by
        the index of the source's tensor; ``state`` is the source's :meth:`training_state` with a
        :class:`~lightning_elan.replication.packing.TensorRef` in place of each tensor. Loading then copies nothing
        for them (a tensor copied onto itself)."""

    def state_nbytes_beyond_model(self) -> int:
        """Bytes of the training state's tensors a joiner has no tensor of its own for yet (optimizer moments...)."""

    def state_nbytes(self) -> int:
        """Bytes of the whole training state's tensors (model and beyond), counted without dumping the state: no user
        hook runs. A source makes its send segment this large ahead of an adjustment."""

    def epoch_aggregates(self) -> dict[str, Any] | None:
        """What this worker accumulated so far in the epoch for values reduced over the members at its end (tensors,
        lists of tensors), keyed alike on every worker; None or empty when there is nothing."""

    def absorb_epoch_aggregates(self, parts: list[dict[str, Any]]) -> None:
        """Add other workers' :meth:`epoch_aggregates` (members that left or died) to this worker's own."""

    def shared_state(self) -> dict[str, Any]:
        """Rank 0's small framework state every member adopts at an adjustment (e.g. logger versions)."""

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Adopt rank 0's :meth:`shared_state` (every old member, at an adjustment)."""

    def adjustment_blocker(self) -> str | None:
        """Why the job cannot change size at this batch boundary (gradients accumulating, epoch end, ...), or None."""

    def before_resize(self) -> None:
        """Stop using the current generation (e.g. detach the model from its DDP wrapper)."""

    def membership_changed(self, previous_rank: int | None) -> None:
        """This worker's rank or world size changed (read them from the engine); ``previous_rank`` is None for a
        joiner that was in no generation."""

    def after_resize(self) -> None:
        """A stayer after a resize: re-wrap the model on the new group, rebuild the data iterator from the position."""

    def leave(self) -> NoReturn:
        """End the training loop normally on a worker that left the job (the engine marked it as left)."""


class ScalingParticipant(Protocol):
    """Whoever decides the global batch at a resize (``HybridScaling``), registered with the engine."""

    @property
    def last_decision(self) -> ScalingDecision | None:
        """The decision applied last, reported to the application master."""

    def decide_resize(self, n_old: int, n_new: int, global_batch: int) -> ScalingDecision:
        """Rank 0: the global batch (and LR scale) for a resize ``n_old → n_new``."""

    def apply_resize(self, decision: ScalingDecision) -> None:
        """Every old member, before the state snapshot: act on the decision (e.g. start the LR ramp)."""

    def summary(self) -> dict[str, Any]:
        """JSON-able scaling summary for ``elan status``."""
