"""Every touch of a private torch API the engine makes, in one place (read from torch 2.13's
``torch/nn/parallel/distributed.py``, ``torch/csrc/distributed/c10d/reducer.cpp`` and ``torch/amp/grad_scaler.py``).

What the elastic DDP depends on, upstream:

* ``Reducer._push_all_rebuilt_params`` / ``_rebuild_buckets`` (``push_rebuilt_params_for_all_indices``,
  ``rebuild_buckets``): DDP's join hook settles the bucket layout this way; ``rebuild_buckets`` first checks that the
  previous reduction finished (``ensure_prior_reduction_finished``) and lays the buckets out afresh (new flat gradient
  tensors, views re-pointed).
* ``Reducer._reset_state`` (``reset_state``): what ``DistributedDataParallel._update_process_group`` calls so a DDP
  can go on after a failed backward — ``require_finalize_``, ``expect_autograd_hooks_``, the first-hook flag and the
  division factor cleared, the unused-parameter map zeroed, and the buckets marked as not rebuilt. The per-iteration
  counters (ready parameters, pending buckets, next bucket) are reset by ``prepare_for_backward`` at the next forward.
* ``GradScaler._per_optimizer_states``: the stage (unscaled, stepped) and found-inf tensors of the step in progress,
  cleared by ``update()`` after a step; a step that is never applied must not leave them behind (``unscale_`` of the
  redone step would raise "unscale_() has already been called on this optimizer since the last update()").
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["forget_scaler_step", "reset_reducer", "settle_bucket_layout"]


def settle_bucket_layout(reducer: Any) -> bool:
    """Buckets in parameter registration order from now on (returns whether they were laid out anew; DDP does not
    rebuild buckets with ``find_unused_parameters``, whose layout is its constructor's)."""
    reducer._push_all_rebuilt_params()
    return bool(reducer._rebuild_buckets())


def reset_reducer(reducer: Any) -> None:
    """Forget the reducer's interrupted iteration: the next forward starts as after a finished backward."""
    reducer._reset_state()


def forget_scaler_step(scaler: Any) -> None:
    """A ``GradScaler`` forgets the stage of a step that was discarded (its scale and growth tracker stay)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states:
        states.clear()
