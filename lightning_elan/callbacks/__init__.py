"""Scaling callbacks: :class:`HybridScaling` (global batch at a resize) and :class:`ProgressiveLinearLR` (LR ramp).

    Trainer(strategy="elan", callbacks=[HybridScaling(policy="hybrid", max_global_batch=4096),
                                        ProgressiveLinearLR(ramp_steps=100)])

Integration points for the strategy
===================================

Both callbacks work in any Lightning run on their own (timing, logging, the ramp, checkpoint state); changing the
global batch is the strategy's job. ``ElanStrategy`` does what follows through
:class:`lightning_elan.strategy.scaling_link.ScalingLink`. At an adjustment ``n_old → n_new`` decided at a batch
boundary:

1. **Decide, on rank 0 only**, before anything is broadcast (``ElanStrategy._ask_master``)::

       scaling = next((c for c in trainer.callbacks if isinstance(c, HybridScaling)), None)
       decision = scaling.decide(n_old=trainer.world_size, n_new=plan.world_size,  # plan: AdjustmentPlan
                                 global_batch=self.data_position.global_batch)
       payload["scaling"] = decision.to_dict()          # JSON-able; or put it in the AM's plan

   Without a ``HybridScaling`` callback keep the global batch (strong scaling) and skip steps 2–3.

2. **Apply the new global batch, on every rank that stays or joins**, from the broadcast (or plan) payload, at the
   same step on all ranks (``ElanStrategy._adjust``)::

       decision = ScalingDecision.from_dict(payload["scaling"])
       self.data_position.global_batch = decision.global_batch

   Do it *before* the state snapshot sent to joiners, so the data state they receive already holds the new batch.
   ``decision.local_batch`` is the largest per-worker share (``ceil(G/n_new)``); ``local_share`` still splits ``G``.

3. **Start the LR ramp, on every rank**, also before the snapshot (callback states travel in the checkpoint dict, so
   joiners receive the ramp and the updated HybridScaling state)::

       scaling.apply(trainer, decision)    # records the decision and calls start_ramp(trainer.global_step,
                                           # decision.lr_scale) on every ProgressiveLinearLR

   which is the same as ``ProgressiveLinearLR.start_ramp(step=trainer.global_step, to_scale=decision.lr_scale)``.
   ``trainer.global_step`` at ``on_train_batch_end`` is the index of the next optimizer step: the ramp's T0, where the
   multiplier is still the old one; it reaches ``to_scale`` at T0 + ramp_steps. ``to_scale`` is absolute (relative to
   the user's unscaled LR): ``k_total`` or ``sqrt(k_total)`` with ``k_total = G_new / G_at_start``.

4. Optional: ``scaling.summary()`` (JSON-able) for ``elan status`` — send it from rank 0 with the coordinate request
   or a report; ``lightning_elan.scaling.format_summary(summary)`` gives the lines to print.
   Optional: ``scaling.record_allreduce_time(seconds)`` during a step replaces the estimated all-reduce time with a
   measured one (e.g. from a DDP communication hook).

Nothing here needs a collective: every worker times its own steps, and the decision is one rank-0 computation.
"""

from __future__ import annotations

from lightning_elan.callbacks.hybrid import HybridScaling
from lightning_elan.callbacks.lr_ramp import ProgressiveLinearLR
from lightning_elan.scaling.batch import ScalingDecision

__all__ = ["HybridScaling", "ProgressiveLinearLR", "ScalingDecision"]
