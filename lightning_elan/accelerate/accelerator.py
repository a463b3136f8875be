"""ElasticAccelerator: Hugging Face Accelerate as a front-end of the elastic engine.

The membership protocol (join, agree, adjust, leave, replicate, data position) is
:class:`~lightning_elan.elastic.worker.ElasticWorker`'s. This module gives it what only the Accelerate loop knows:
the prepared models, optimizers, schedulers, scaler and registered objects as one in-memory state, the training
loader's batch boundaries (where an adjustment happens), and the place of this process in Accelerate's state
singletons. Every private Accelerate touch goes through :mod:`lightning_elan.accelerate.compat`.

What a resize refreshes (and why):

* ``PartialState``/``AcceleratorState``: ``num_processes``, ``process_index``, ``distributed_type`` — read live by
  ``accelerator.num_processes``, ``is_main_process``, ``gather``/``reduce``/``wait_for_everyone`` (which then use
  torch's default group: the engine's group, reconfigured in place).
* Nothing in the model: it is wrapped once in an :class:`~lightning_elan.elastic.ddp.ElasticDistributedDataParallel`
  whose gradient all-reduce follows the current generation, so the object ``prepare()`` returned keeps working.
* The training loader's iterator: rebuilt from the job's serial position (batches prefetched for the old world are
  dropped); evaluation loaders are cut for the new world when next iterated.
* Trackers: started on the new main process when rank 0 left.

A member's death during a pass over an evaluation loader is recovered from at once, in the collective that met it
(``gather_for_metrics``, ``gather``, ``reduce``, ``wait_for_everyone``): the survivors form the new generation, agree on
where the pass is, run the collective again among themselves and evaluate what the dead member had not given
(:mod:`~lightning_elan.accelerate.evaluation_recovery`), so the pass still gathers every sample once — also on a
survivor that became the main process within it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DDPCommunicationHookType, gather_object, recursively_apply
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_elan import torch_compat
from lightning_elan.accelerate import compat
from lightning_elan.accelerate.data import (
    ElasticEvaluationLoader,
    ElasticTrainLoader,
    EvaluationLoader,
    LeftTheJob,
    evaluation_unsupported,
    refuse_unsupported,
)
from lightning_elan.accelerate.evaluation_recovery import EvaluationRecovery, all_tensors, without_padding
from lightning_elan.accelerate.fsdp import FSDP2Sharding, LostShard, refuse_unsupported_fsdp, retry_calls
from lightning_elan.accelerate.local_sgd import LocalSGDSteps
from lightning_elan.accelerate.loop_end import LoopEnded, LoopEndWatch, announce_loop_end
from lightning_elan.accelerate.objects import CHECKPOINTED, ReplicatedObjects
from lightning_elan.accelerate.plugin import ElasticPlugin
from lightning_elan.accelerate.scaling import AccelerateScaling
from lightning_elan.accelerate.tracker_rows import TrackerRows
from lightning_elan.accelerate.wrappers import ElasticOptimizer, ElasticScheduler
from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.positions import LocalShare
from lightning_elan.elastic.applied_steps import AppliedSteps
from lightning_elan.elastic.ddp import ElasticDistributedDataParallel, freeze_as, frozen_parameters
from lightning_elan.elastic.etcd_rendezvous import open_rendezvous_store
from lightning_elan.elastic.gather import even_rows
from lightning_elan.elastic.live_reshard import ReshardGroup
from lightning_elan.elastic.pre_loop import PreLoopCollectives
from lightning_elan.elastic.pruning import prune_as
from lightning_elan.elastic.worker import ElasticWorker, NotAMember, generation_prefix
from lightning_elan.protocol.contract import WorkerEnvironment
from lightning_elan.replication.reception import destinations_by_name, tensor_nbytes
from lightning_elan.scaling.lr import ScaledParamGroups

log = logging.getLogger(__name__)

__all__ = ["ELAN_STATE_FILE", "ElasticAccelerator"]

ELAN_STATE_FILE = "elan_state.json"
"""What ``save_state`` adds to Accelerate's checkpoint folder: the job's data position and loop state (JSON)."""

EPOCH_LOOP_REQUIRED = (
    "ElasticAccelerator: iterate the training DataLoader inside `for epoch in accelerator.epochs(num_epochs):`, not "
    "`range(num_epochs)` or a loop of your own: a worker that joins the running job starts at the job's epoch and "
    "position, so its own range() would train epochs the other workers never train and the job would hang. Count "
    "optimizer steps with `accelerator.optimizer_steps` (or an object registered with `register_for_checkpointing`), "
    "not a local variable: a joiner's starts at 0. (A plain `python train.py` run, without `elan run`, may loop as "
    "it likes.)")

# a joiner warming up is no one's main process until its generation forms: rank 1 of the job's launch world (of 2 at
# least), so that a schedule sized with num_processes before prepare() (transformers' examples) is the members' one
_PROVISIONAL_RANK, _LEAST_PROVISIONAL_WORLD = 1, 2
_LEFT_RANK = -1


class ElasticAccelerator(Accelerator):
    """An ``accelerate.Accelerator`` whose job grows, shrinks and migrates while the loop trains.

    Use it like an ``Accelerator`` (every argument is passed on), prepare the training ``DataLoader`` first among the
    loaders (later ones are evaluation loaders), iterate epochs with :meth:`epochs`, and launch with ``elan run``.

    Args:
        elastic_plugin: the elastic options (:class:`~lightning_elan.accelerate.ElasticPlugin`).
        *args, **kwargs: ``Accelerator``'s own.
    """

    def __init__(self, *args: Any, elastic_plugin: ElasticPlugin | None = None, **kwargs: Any) -> None:
        _refuse_sharded_training(kwargs)
        plugin = elastic_plugin or ElasticPlugin()
        environment = WorkerEnvironment.from_env()
        self.elastic_plugin = plugin
        self.engine = ElasticWorker(environment, coordinate_every=plugin.coordinate_every,
                                    join_timeout_s=plugin.join_timeout_s, replication=plugin.replication,
                                    global_batch=plugin.global_batch_size, send_ahead=plugin.send_ahead)
        fsdp_plugin = kwargs.get("fsdp_plugin")
        self._sharding = None if fsdp_plugin is None else FSDP2Sharding(fsdp_plugin, self.engine.worker_id,
                                                                        hsdp_group_size=plugin.hsdp_group_size)
        if plugin.hsdp_group_size is not None and fsdp_plugin is None:
            raise ValueError("ElasticPlugin(hsdp_group_size=...) shards the model: pass an FSDP2 plugin too "
                             "(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))")
        self.engine.attach(self if self._sharding is None else _ShardedFrontEnd(self))
        self.optimizer_steps = 0
        self.elastic_scaling = AccelerateScaling(plugin, lambda: self.optimizer_steps)
        self.engine.register_scaling(self.elastic_scaling)
        self._train_loader: ElasticTrainLoader | None = None
        self._joined_running_job = False  # admitted in prepare(): holds the job's current state
        self._catching_up = False  # a joiner, until its first pass over the training loader: its code the members ran
        self._awaiting_first_batch = False  # a joiner before its first batch: its position is the job's
        self._loop_epoch: int | None = None  # the epoch `for epoch in accelerator.epochs(n)` is in (its body runs)
        self._between_passes = False  # a boundary where a pass over the training loader or an epoch starts
        self._epoch_loops = 0  # the epochs() loops entered
        self._loop_ran_out = False  # an epochs() loop ran to its end on a member: the job's training is over
        self._loop_left_after: tuple[int, int, bool] | None = None  # epochs() left early: (loop, optimizer steps,
        # after the last step's batch boundary)
        self._loop_end_announced = False
        self._loop_end_watch: LoopEndWatch | None = None  # a joiner: the job's loop may end before its own
        self._objects = ReplicatedObjects(lambda: compat.checkpointed_objects(self))
        self._position_at_open: dict[str, Any] | None = None  # the data position where the open step began
        self._tracker_args: dict[str, Any] | None = None
        self._tracker_rows = TrackerRows()  # the rows logged, written again by a new main process that lacks them
        self.engine.follow_logged_rows(self._write_tracker_rows_again)
        self._rows_at_open = 0  # the rows logged when the open step began (a discarded step's are forgotten)
        self._not_a_training_batch_warned = False
        self._saved_elsewhere: tuple[str, dict[str, Any]] | None = None  # the last save_state's directory and progress,
        # on a process that was not the main one (which writes the model, optimizers and elan_state.json)
        self._share: LocalShare | None = None
        self._batch_pending = False
        self._committed = False
        self._aborted = False  # a member died during this batch's step: the rest of it is a no-op, then redone
        self._recovery_due = False  # a member died after this batch's step was committed: it stands, then recover
        self._cut_after_commit = False  # ... in a later collective of the batch (a second model's backward)
        self._step_open = False  # micro-batches were taken since the last committed optimizer step
        self._step_attempted = False  # this batch called a synchronised optimizer step (applied or discarded)
        self._step_counter_at_open = 0  # Accelerate's micro-step counter when the open step began
        self.recoveries = 0  # member deaths this worker recovered from
        self._pre_loop = PreLoopCollectives(self._recover_before_the_loop, self.engine.earliest_position)
        self._between_batches: PreLoopCollectives | None = None  # collectives since the last batch (epoch's end)
        self._group_view: torch.distributed.ProcessGroup | None = None
        self._evaluations = EvaluationRecovery(self.engine, self, self._recover_at_once)
        self.local_sgd_steps_state = LocalSGDSteps()  # a LocalSGD's count of local steps: joiners continue it
        compat.guard_process_decorators()
        compat.watch_local_sgd()
        compat.route_state_barriers(self.wait_for_everyone)
        with compat.single_process_initialisation():
            super().__init__(*args, **kwargs)
        if self._sharding is not None:
            compat.keep_fsdp_plugin(self._sharding.plugin)
        device = self._elastic_device(environment, bool(kwargs.get("cpu", False)))
        self.engine.start("nccl" if device.type == "cuda" else "gloo", device, timedelta(seconds=300))
        self._refresh_membership()
        atexit.register(_close_at_exit, weakref.ref(self))

    @staticmethod
    def _elastic_device(environment: WorkerEnvironment, cpu: bool) -> torch.device:
        if cpu or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", environment.device_index or 0)

    # ------------------------------------------------------------------ what the user reads

    @property
    def has_left(self) -> bool:
        """This worker left the job (its loops end; it should exit 0)."""
        return self.engine.has_left

    @property
    def generation(self) -> int | None:
        return self.engine.generation

    @property
    def sample_weight(self) -> float:
        """Weight of this worker's current batch in the global mean (0 for a stand-in sample of an empty share)."""
        return 1.0 if self._share is None else self._share.loss_weight

    @property
    def step_discarded(self) -> bool:
        """A member died during the current batch's step: it is not applied (``optimizer.step()``,
        ``scheduler.step()`` do nothing) and its global batch is redone by the survivors from the next batch on."""
        return self._aborted

    @property
    def launch_world_size(self) -> int:
        """The job's world when it started: what a per-process ``batch_size`` and the LR schedule's steps per optimizer
        step mean. The engine's: a joiner receives its source's with its state, ``load_state`` sets the checkpoint's."""
        return self.engine.launch_world_size or 1

    @property
    def data_position(self) -> Any:
        """The job's data state ``(epoch, position, global batch)``; the engine is its only writer."""
        return self.engine.data

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """The epochs still to train, like ``range(num_epochs)`` but from the job's current epoch (a joiner starts at
        the replicated one, mid-epoch at the job's position; one that joined after the epoch's last batch starts with
        that epoch, its pass over the training loader empty, so it runs the code after the loop over the batches with
        the members). Each later epoch starts at its beginning, also when the loop over the previous one was left
        early (``break``). Ends on a worker that left the job."""
        epoch: int | None = None
        self._refuse_a_loop_after_the_training(num_epochs)
        self._epoch_loops += 1
        self._seed_shard_mirrors()
        self._pre_loop.loop_started()
        self.engine.training_loop_started()
        while not self.has_left:
            try:
                self._boundary_between_passes()  # a loop left early: its last batch ends first
            except LeftTheJob:
                break
            epoch = self._next_epoch(epoch)
            if epoch >= num_epochs:
                break
            self._loop_epoch = epoch
            try:
                yield epoch
            except GeneratorExit:  # the loop was left (break, return, an exception)
                steps = self.optimizer_steps + int(self._committed)
                self._loop_left_after = None if self.has_left else (self._epoch_loops, steps, not self._batch_pending)
                raise
            finally:
                self._loop_epoch = None
        self._loop_ran_out = not self.has_left
        self._training_over()

    def _seed_shard_mirrors(self) -> None:
        """Sharded, a launch member: the shard mirrors are seeded as the training loop starts (the last collective
        before it, recovered from as the others), so a death in the first step loses no step either."""
        if self._sharding is None or not self.engine.is_member:
            return
        sharding, model, optimizers = self._sharding, self._sharded_model(), self._torch_optimizers()
        self._pre_loop.run(lambda: sharding.seed_mirror(model, optimizers, self.engine.generation_group))

    def _refuse_a_loop_after_the_training(self, num_epochs: int) -> None:
        """An ``epochs()`` loop after one ran out: the job's training is over (its data position is at the end of the
        last epoch, the link to the AM closed), so this loop would train nothing (``epochs(n)`` continues the job's
        epochs) or train alone. A loop per fold or stage (Accelerate's ``cross_validation.py``: ``prepare()`` and
        ``range(num_epochs)`` per fold) cannot be made elastic: a joiner, running the script from its start, could
        not know which fold the job is in. Refused on every worker alike, with what to do instead."""
        if not self._loop_ran_out:
            return
        raise RuntimeError(
            f"accelerator.epochs({num_epochs}) after an earlier epochs() loop ran out: the job's training is over "
            f"(epochs() continues the job's epochs on one training DataLoader, the first prepared, so this loop would "
            f"train nothing). A training loop per fold or stage (cross-validation, a second training DataLoader) is "
            f"not supported in one elastic job: run each fold as its own `elan run` job, or train all stages in one "
            f"`for epoch in accelerator.epochs(total)` loop.")

    def _next_epoch(self, previous: int | None) -> int:
        data = self.engine.data
        if previous is None:  # a joiner is where the members are: in the job's epoch, complete or not
            return data.epoch + (1 if self.epoch_complete() and not self._awaiting_first_batch else 0)
        if self._train_loader is not None and data.epoch <= previous:
            self._train_loader.set_epoch(previous + 1)
        return previous + 1

    def register_for_elastic_state(self, *objects: Any) -> None:
        """Objects with ``state_dict``/``load_state_dict`` (an EMA, a metric) that joiners receive with the model
        (objects registered with ``register_for_checkpointing`` are received too; only those are checkpointed).
        Before or after ``prepare()``: a joiner loads the job's state of an object when it registers it."""
        self._objects.register_elastic(objects)

    @override
    def register_for_checkpointing(self, *objects: Any) -> None:
        """Accelerate's; a joiner that registers an object after ``prepare()`` loads the job's state of it then."""
        start = len(compat.checkpointed_objects(self))
        super().register_for_checkpointing(*objects)
        self._objects.registered(CHECKPOINTED, start)

    # ------------------------------------------------------------------ preparing

    @override
    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """Accelerate's ``prepare``; a new worker then waits here until it is admitted and holds the job's state.
        Called again with a training loader after the training loop failed before its first step (accelerate's
        ``find_executable_batch_size`` retrying at a smaller batch size), the new loader is the training loader."""
        if self._retrying_the_loop(args):
            self._forget_the_failed_loop()
        if self._sharding is not None and any(isinstance(arg, torch.nn.Module) for arg in args):
            for model in (arg for arg in args if isinstance(arg, torch.nn.Module)):
                retry_calls(model, self._call_in_evaluation)
            with self._sharding.preparing():  # Accelerate's FSDP2 preparation, on this generation's mesh
                result = super().prepare(*args, device_placement=device_placement)
        else:
            result = super().prepare(*args, device_placement=device_placement)
        if self._ready_to_join():
            self._join()
        return result

    def _ready_to_join(self) -> bool:
        """A new worker joins once its training loader (and, sharded, its model: the live reshard fills it) is
        prepared."""
        if self._train_loader is None or not self.engine.environment.joiner or self.engine.generation is not None:
            return False
        return self._sharding is None or bool(compat.prepared_models(self))

    def _retrying_the_loop(self, args: tuple[Any, ...]) -> bool:
        """A launch member's training loop (its first ``epochs()``) was left, by an error, before any step was applied,
        and a new ``DataLoader`` is being prepared: the loop is being retried (``find_executable_batch_size``)."""
        return (self._train_loader is not None and self._epoch_loops == 1 and self._loop_epoch is None
                and self.optimizer_steps == 0 and not self._committed and not self._joined_running_job
                and self.engine.is_member and any(isinstance(arg, DataLoader) for arg in args))

    def _forget_the_failed_loop(self) -> None:
        """The failed loop's batch is not taken (the position goes back to its step's first sample, the step's
        gradients go), its loader is no longer the training loader, and its global batch is the new loader's."""
        log.info("worker %s: the training loop failed before its first step and a new training DataLoader is "
                 "prepared: the loop starts again with it", self.engine.worker_id)
        data = self.engine.data
        if self._step_open:
            self._discard_open_step()
            if self._position_at_open is not None:
                data.load_state_dict(self._position_at_open)
        data.load_state_dict({**data.state_dict(), "global_batch": None, "steps_before": 0, "position_before": 0})
        self.elastic_scaling.forget_global_batch()
        loaders = compat.prepared_dataloaders(self)
        if self._train_loader in loaders:
            loaders.remove(self._train_loader)
        self._train_loader = self._position_at_open = self._share = self._loop_left_after = None
        self._batch_pending, self._epoch_loops = False, 0

    def _join(self) -> None:
        for model in compat.prepared_models(self):
            if isinstance(model, ElasticDistributedDataParallel):
                model.warm_up_alone()
        try:
            self.engine.join()
            self._joined_running_job = self._awaiting_first_batch = self._catching_up = True
            self._watch_loop_end()
        except NotAMember as reason:
            log.info("%s; leaving", reason)
            self._refresh_membership()

    def _watch_loop_end(self) -> None:
        """A joiner: stop with a clear error if the job's other members end their loop before this one does."""
        engine = self.engine
        if engine.environment.standalone or engine.group is None:
            return
        group = engine.group
        self._loop_end_watch = LoopEndWatch(
            lambda: open_rendezvous_store(engine.environment.store_address or "", engine.timeout),
            lambda: engine.generation,
            self._trains_past,
            lambda generation, error: group.fail(generation_prefix(generation), error))

    def _trains_past(self, loop: int, steps: int, after_boundary: bool) -> bool:
        """In the ``loop``-th ``epochs()`` loop past ``steps`` optimizer steps: at the batch boundary of that step or
        later when the members left inside its batch, with a batch taken after it when they left after its boundary
        (then the code after the loop over the batches, an evaluation and ``check_trigger()``, which they ran too
        before they left, may still be in its last collective here when they announce the loop's end)."""
        if self._loop_epoch is None or self._epoch_loops != loop:
            return False
        if self.optimizer_steps != steps:
            return self.optimizer_steps > steps
        return self._batch_pending or not after_boundary

    def _announce_loop_end(self) -> None:
        """A member that left its ``epochs()`` loop early goes on (a collective, a save, ``end_training``): joiners
        still training past its last step stop (see :mod:`~lightning_elan.accelerate.loop_end`)."""
        if self._loop_left_after is None or self._loop_end_announced or not self.engine.is_member:
            return
        self._loop_end_announced = True
        if not self.engine.environment.standalone and self.engine.group is not None:
            announce_loop_end(self.engine.group.store, self.engine.generation or 0, *self._loop_left_after)

    def _raise_if_loop_ended(self, cause: BaseException | None = None) -> None:
        """This joiner trains past the step the job's loop ended after: stop with the reason."""
        if isinstance(cause, LoopEnded):
            raise cause  # the engine raised the error the loop-end watch failed the collectives with
        error = None if self._loop_end_watch is None else self._loop_end_watch.error_if_past()
        if error is not None:
            raise error from cause

    @override
    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        if not isinstance(data_loader, DataLoader):
            return super().prepare_data_loader(data_loader, device_placement, slice_fn_for_dispatch)
        if self._train_loader is None:
            return self._prepare_train_loader(data_loader, device_placement)
        evaluation = self._evaluation_loader(data_loader, device_placement)
        compat.prepared_dataloaders(self).append(evaluation)
        return evaluation

    def _evaluation_loader(self, data_loader: DataLoader, device_placement: bool | None
                           ) -> ElasticEvaluationLoader | EvaluationLoader:
        unsupported = evaluation_unsupported(data_loader, self.even_batches, self.split_batches)
        if unsupported is None:
            placement = self.device_placement if device_placement is None else device_placement
            return ElasticEvaluationLoader(data_loader, self._evaluations, self.device if placement else None,
                                           self.non_blocking)
        log.info("evaluation DataLoader sharded by Accelerate (%s): a member's death during a pass loses its samples "
                 "of that pass", unsupported)
        return EvaluationLoader(data_loader, self._shard_for_evaluation, self._evaluations, unsupported)

    def _shard_for_evaluation(self, loader: DataLoader) -> Any:
        """Accelerate's shards of an evaluation loader for the world of now (at its first pass and after a resize)."""
        self._warn_if_shards_uneven(loader)
        return compat.shard_for_evaluation(self, loader)

    def _warn_if_shards_uneven(self, loader: DataLoader) -> None:
        """``even_batches=False``: Accelerate deals the batches round robin, so a world that does not divide them gives
        some processes one batch more, and a collective per batch (``gather_for_metrics``) there waits for ever."""
        if self.even_batches or self.split_batches or isinstance(loader.dataset, torch.utils.data.IterableDataset):
            return
        world = self.num_processes
        try:
            batches = len(loader)
        except TypeError:
            return
        if world < 2 or batches % world == 0:
            return
        shares = [len(range(rank, batches, world)) for rank in range(world)]
        log.warning("evaluation DataLoader with even_batches=False at %d processes: its %d batches are %s per process, "
                    "so a collective per batch (gather_for_metrics, gather, reduce) waits for ever on the processes "
                    "with more (then fails at the collective timeout); a resize gives the job such a world. Use "
                    "even_batches=True (Accelerate's default: the last batches are padded, gather_for_metrics drops "
                    "the padding), or collect the metrics locally and gather them once after the pass",
                    world, batches, shares)

    def _prepare_train_loader(self, data_loader: DataLoader, device_placement: bool | None) -> ElasticTrainLoader:
        refuse_unsupported(data_loader, self.dispatch_batches)
        data = self.engine.data
        if data.global_batch is None and self.engine.is_member:
            data.change_global_batch(self._launch_global_batch(data_loader))
        base = ElasticDataLoader(data_loader, data, self._world_view, self._epoch_order_seed())
        self.engine.follow_epoch_order(base.sampler.order)
        placement = self.device_placement if device_placement is None else device_placement
        self._train_loader = ElasticTrainLoader(base, self, self.device if placement else None, self.non_blocking)
        compat.prepared_dataloaders(self).append(self._train_loader)
        return self._train_loader

    def _launch_global_batch(self, data_loader: DataLoader) -> int:
        """The global batch the job starts with: the loader's ``batch_size`` per process, or with
        ``split_batches=True`` the loader's ``batch_size`` itself (Accelerate splits it over the processes)."""
        if self.split_batches:
            return data_loader.batch_size
        return data_loader.batch_size * self.launch_world_size

    def _epoch_order_seed(self) -> int:
        """Seed of a shuffled epoch order (the same on every worker): ``DataLoaderConfiguration(data_seed=…)`` —
        with ``use_seedable_sampler=True`` plain Accelerate then visits the same order (``randperm`` seeded with
        ``data_seed + epoch``) —, else ``$PL_GLOBAL_SEED`` as ``seed_everything`` sets it, else 0."""
        data_seed = getattr(self.dataloader_config, "data_seed", None)
        return int(data_seed) if data_seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))

    def _world_view(self) -> tuple[int, int]:
        return (self.engine.rank, self.engine.world_size) if self.engine.is_member else (0, 1)

    @override
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> torch.nn.Module:
        """Accelerate's placement, mixed precision and compilation, then one elastic DDP for the process's life."""
        prepared = super().prepare_model(model, device_placement, evaluation_mode=True)
        if evaluation_mode or isinstance(prepared, ElasticDistributedDataParallel):
            return prepared
        if not any(parameter.requires_grad for parameter in prepared.parameters()):
            return prepared
        ddp = ElasticDistributedDataParallel(prepared, self._current_group, **self._ddp_arguments())
        ddp.failure_in_forward = self._absorb_failure_in_forward
        compat.mark_prepared(ddp)
        compat.replace_prepared(compat.prepared_models(self), prepared, ddp)
        return ddp

    def _ddp_arguments(self) -> dict[str, Any]:
        handler = self.ddp_handler
        if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
            raise NotImplementedError("ElasticAccelerator all-reduces gradients with its own communication hook "
                                      "(on the current generation); a DDP comm hook cannot be combined with it")
        kwargs = handler.to_kwargs() if handler is not None else {}
        if self.device.type == "cuda":
            kwargs.setdefault("device_ids", [self.device.index])
        return kwargs

    def _current_group(self) -> torch.distributed.ProcessGroup | None:
        return self._group_view if self.engine.is_member else None

    @override
    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        if compat.is_prepared(optimizer):
            return super().prepare_optimizer(optimizer, device_placement)
        placement = self.device_placement if device_placement is None else device_placement
        prepared = ElasticOptimizer(optimizer, self, device_placement=placement, scaler=self.scaler)
        compat.prepared_optimizers(self).append(prepared)
        return prepared

    @override
    def prepare_scheduler(self, scheduler: Any) -> Any:
        if compat.is_prepared(scheduler):
            return super().prepare_scheduler(scheduler)
        optimizers = compat.prepared_optimizers(self)
        owner = next((o for o in optimizers if getattr(scheduler, "optimizer", None) is o.optimizer), optimizers)
        prepared = ElasticScheduler(scheduler, owner, self, step_with_optimizer=self.step_scheduler_with_optimizer,
                                    split_batches=self.split_batches)
        compat.prepared_schedulers(self).append(prepared)
        return prepared

    # ------------------------------------------------------------------ the training step (StepCommit: the wrappers')

    @override
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Accelerate's backward of the loss weighted by this worker's share of the global batch (a last global batch
        that does not divide by the world counts every sample once)."""
        self._absorb_tolerated_failure()  # a member died in the forward (FSDP2's all-gather)
        if self._aborted:
            return  # the step is discarded: its gradients would not be all-reduced anyway
        self._warn_if_not_a_training_batch()
        weight = self.sample_weight
        if weight != 1.0:
            loss = loss * weight
        self.engine.backward_started()
        timer = self.elastic_scaling.policy.timer
        timer.before_backward(time.perf_counter())
        try:
            super().backward(loss, **kwargs)
            self._absorb_tolerated_failure()  # FSDP2's reduce-scatter
        except Exception as error:  # a member died during the gradient all-reduce (anything else is re-raised)
            self._absorb_failure(error)
        timer.after_backward(time.perf_counter())

    def _warn_if_not_a_training_batch(self) -> None:
        """A backward in the training loop with no batch of the training loader taken: the loop trains on another
        loader (find_executable_batch_size's retry after steps were applied prepares a new one, which is then an
        evaluation loader), whose steps elan neither counts nor re-shards: say so, once."""
        if (self._batch_pending or self._loop_epoch is None or self._not_a_training_batch_warned
                or self.engine.environment.standalone):
            return
        self._not_a_training_batch_warned = True
        log.warning("worker %s: backward() of a batch that is not from the training DataLoader (the first one "
                    "prepared): elan counts, shards and redoes only that loader's batches, so these steps are not "
                    "elastic (accelerator.optimizer_steps stays %d, samples may be trained twice in an epoch). A new "
                    "training DataLoader is taken only when the training loop failed before its first step (a "
                    "find_executable_batch_size retry); after that, keep training on the loader prepared first",
                    self.engine.worker_id, self.optimizer_steps)

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> tuple[bool, ScaledParamGroups | None]:
        """Every synchronised optimizer step: commit it with every member (once per batch), scale it by the LR ramp.
        Returns whether to apply it (not when it is discarded) and the scaled param groups to restore after it."""
        self._step_attempted = True
        if not self._committed and not self._aborted:
            self._absorb_tolerated_failure()
        if not self._committed and not self._aborted:
            self._commit(optimizer)
        if self._aborted:
            return False, None
        if self._cut_after_commit:
            self._skip_step_after_cut()
            return False, None
        return True, self._lr_scaled(optimizer)

    def step_with_closure(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                          step: Callable[[Callable[[], Any]], None]) -> None:
        """A synchronised step whose closure the optimizer evaluates itself (``step(closure)``), perhaps several
        times with the parameters updated between (``torch.optim.LBFGS``): each evaluation's backward all-reduces the
        gradients, so the step runs first and is voted on once it returned; a member's death in any evaluation, or in
        the vote, puts the parameters and the optimizer state back as the step found them (kept before it began:
        ``LBFGS.step`` fills its state before its first evaluation), and the batch is redone. A step after the
        batch's commit (a second optimizer's) goes as one without a closure."""
        if self._committed or self._aborted:
            apply, scaled = self.before_optimizer_step(optimizer)
            if apply:
                self._run_scaled(lambda: step(closure), optimizer, scaled)
                self.after_optimizer_step()
            return
        self._refuse_a_closure_when_sharded()
        self._step_attempted = True
        kept = AppliedSteps()
        kept.before_update(optimizer)
        evaluate = self._until_discarded(closure, optimizer)
        self._run_scaled(lambda: step(evaluate), optimizer, self._lr_scaled(optimizer))
        if not self._aborted:
            self._commit(optimizer)
        if self._aborted:
            kept.undo()
            return
        self.after_optimizer_step()

    def _until_discarded(self, closure: Callable[[], Any], optimizer: torch.optim.Optimizer) -> Callable[[], Any]:
        """``closure``, until a member's death (met in an evaluation's backward) discarded the step: from then on an
        evaluation runs no forward on the failed generation (DDP's reducer, its reduction cut short, would fail the
        next forward's check: "unmarked_param_indices") and no user code; it leaves no gradients and gives the last
        loss, so the optimizer sees a zero gradient and ends its step (which is then undone)."""
        last: list[Any] = [None]

        def evaluate() -> Any:
            if self._aborted:
                optimizer.zero_grad(set_to_none=True)
                return torch.zeros(()) if last[0] is None else last[0]
            last[0] = closure()
            return last[0]

        return evaluate

    def _run_scaled(self, step: Callable[[], None], optimizer: torch.optim.Optimizer,
                    scaled: ScaledParamGroups | None) -> None:
        try:
            step()
        finally:
            if scaled is not None:
                scaled.restore(optimizer)

    def _refuse_a_closure_when_sharded(self) -> None:
        """Sharded, the shard mirror applies each committed step from its reduced gradients once: an optimizer that
        evaluates its closure in the step has no such gradients."""
        if self._sharding is not None:
            raise NotImplementedError("optimizer.step(closure) under FSDP2 with ElasticAccelerator: the shard mirrors "
                                      "apply a committed step from its gradients, which a closure evaluated inside "
                                      "the step does not leave; call backward before optimizer.step()")

    def _commit(self, optimizer: torch.optim.Optimizer) -> None:
        """The batch's commit vote (sharded, the reduced gradients go to the mirror holder first)."""
        try:
            self._mirror_gradients(optimizer)
            self.engine.commit_step(self.optimizer_steps)
        except Exception as error:  # the vote was aborted: a member died before every member committed
            self._absorb_failure(error)
        else:
            self._committed, self._step_open = True, False
            self._pre_loop.step_committed()
            self.elastic_scaling.policy.timer.optimizer_step()

    def _lr_scaled(self, optimizer: torch.optim.Optimizer) -> ScaledParamGroups | None:
        """The param groups scaled by the LR ramp for this step (None when it does not scale)."""
        scale = self.elastic_scaling.lr_scale_at(self.optimizer_steps)
        if scale == 1.0:
            return None
        scaled = ScaledParamGroups(optimizer, scale)
        if self._sharding is not None:  # the mirror took the step's hyperparameters before the vote, unscaled
            self._sharding.hyperparameters_changed(self._torch_optimizers())
        return scaled

    def _absorb_tolerated_failure(self) -> None:
        """Sharded: a collective of the model failed inside the user's calls (its forward, or a backward) and was
        tolerated there (see ``FSDP2Sharding.build_mesh``): the step is discarded now (or the error re-raised)."""
        failure = None if self._sharding is None else self._sharding.take_failure()
        if failure is not None:
            self._absorb_failure(failure)

    def _absorb_failure_in_forward(self, error: BaseException) -> bool:
        """The elastic DDP's buffer broadcast before a forward failed: in a training step a member's death discards
        the step (the forward goes on, its output unused; ``backward`` and the optimizer step do nothing), as FSDP2's
        all-gathers are tolerated there; in an evaluation pass the survivors recover at once and the forward goes on
        with this process's buffers (the next forward, the new generation's first, broadcasts on every survivor,
        those that had completed this broadcast included); anything else is raised in the user's forward."""
        if self._recovers_in_evaluation():
            self._raise_if_loop_ended(error)
            self._evaluations.recover(error)
            return True
        if not self._step_open or self._evaluations.evaluating or not self.engine.is_member:
            return False
        self._absorb_failure(error)
        return True

    def _mirror_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Sharded: this step's reduced gradients go to the mirror holder before the commit vote."""
        if self._sharding is not None and self.engine.is_member:
            self._sharding.before_vote(self._sharded_model(), self._torch_optimizers(), optimizer,
                                       self.engine.generation_group)

    def after_optimizer_step(self) -> None:
        """A committed step was applied: sharded, its mirror applies it too."""
        if self._sharding is not None:
            self._sharding.after_step()

    def _check_shards_recoverable(self) -> None:
        """Sharded: a member died; :class:`LostShard` when no mirror can restore its shard."""
        if self._sharding is not None:
            self._sharding.check_recoverable(self.engine.world_size, self._torch_optimizers())

    def _sharded_model(self) -> torch.nn.Module:
        return compat.prepared_models(self)[0]

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [optimizer.optimizer for optimizer in compat.prepared_optimizers(self)]

    def _absorb_failure(self, error: BaseException) -> None:
        """``error`` came out of a collective of the current step: once a member's death is confirmed the step is
        discarded — unless every member committed it already: it stands (its scheduler step and the loop's side
        effects too) — and the loop goes on to the next batch boundary, where the survivors recover; else
        re-raised (or :class:`LoopEnded`, on a joiner training past the step the job's loop ended after)."""
        self._raise_if_loop_ended(error)
        self.engine.confirm_peer_failure(error)
        self._check_shards_recoverable()
        if self._committed:
            if not self._recovery_due:
                log.warning("worker %s: a member of generation %s died after step %d was committed: it stands",
                            self.engine.worker_id, self.engine.generation, self.optimizer_steps + 1)
            self._recovery_due = self._cut_after_commit = True
            return
        if not self._aborted:
            log.warning("worker %s: a member of generation %s died; the step is discarded and redone",
                        self.engine.worker_id, self.engine.generation)
        self._aborted = True

    # ------------------------------------------------------------------ batch boundaries (BatchBoundaries: the loader)

    def start_iteration(self, loader: ElasticTrainLoader) -> None:
        """A new pass over the training loader: the last batch of a loop left early ends first; an epoch that is
        complete gives way to the next one, unless :meth:`epochs` is in it (then the pass is empty: a joiner after
        the epoch's last batch, a second pass in one epoch). Under `elan run`, only inside :meth:`epochs`."""
        self._boundary_between_passes()
        self._require_epoch_loop()
        self._catching_up = False
        self._between_batches = None
        data = self.engine.data
        if self.epoch_complete() and self._loop_epoch != data.epoch:
            loader.set_epoch(data.epoch + 1)

    def _boundary_between_passes(self) -> None:
        """The boundary of a batch whose loop was left early (``break``), run where the next pass or epoch starts:
        no adjustment there (the members are past the code after their loop over the batches; a joiner would start
        before it)."""
        self._between_passes = True
        try:
            self.batch_boundary()
        finally:
            self._between_passes = False

    def epoch_complete(self) -> bool:
        data = self.engine.data
        if self._train_loader is None or data.global_batch is None:
            return False
        return data.position >= self._train_loader.sampler.epoch_end()

    def _require_epoch_loop(self) -> None:
        """A pass over the training loader outside ``accelerator.epochs(n)`` is refused at once under `elan run`: a
        joiner's ``range(n)`` would train epochs the job's other members never train (they would hang)."""
        if self._loop_epoch is None and not self.engine.environment.standalone:
            raise RuntimeError(EPOCH_LOOP_REQUIRED)

    def take_global_batch(self, loader: ElasticTrainLoader) -> None:
        self._batch_pending = True  # first: the batch about to be taken trains past a step the job's loop ended after
        self._between_batches = None
        self._raise_if_loop_ended()
        data = self.engine.data
        opens_step = not self._step_open
        if opens_step:
            self._step_counter_at_open = self.step
            self._rows_at_open = self._tracker_rows.count
            self._position_at_open = data.state_dict()
        self._awaiting_first_batch = False
        self._share = self.engine.take_global_batch(loader.sampler.epoch_end(), opens_step=opens_step)
        self._batch_pending = self._step_open = True
        policy = self.elastic_scaling.policy
        policy.track_world_size(self.engine.world_size)
        policy.track_global_batch(data.global_batch)
        policy.timer.batch_start(time.perf_counter(), self._share.size, self.engine.world_size)

    def batch_boundary(self) -> None:
        """After the last batch's work (at the next batch or the end of the loop): report, coordinate, adjust — or,
        when a member died, recover (the discarded step's batches are redone next)."""
        if self.has_left:
            raise LeftTheJob
        trained, self._batch_pending = self._batch_pending, False
        stepped, self._step_attempted = self._step_attempted, False
        if trained:
            if self._committed:
                self.optimizer_steps += 1
            self._committed = False
            if not self._aborted:
                self._observe_step()
        if trained and self._inside_an_accumulation_window(stepped):
            return
        if self._aborted or self._recovery_due:
            self._recover()
        elif trained:
            try:
                self.engine.at_batch_boundary(self.optimizer_steps)
            except Exception as error:
                self._raise_if_loop_ended(error)
                raise

    def _inside_an_accumulation_window(self, stepped: bool) -> bool:
        """Between two micro-batches of an optimizer step: ``accumulate()``'s window (``sync_gradients`` off), or one
        accumulated by hand (Accelerate's guide "without ``accumulate()``": ``no_sync`` on all but every N-th batch of
        the user's own ``enumerate`` counter) — the batch took a step open and called no synchronised optimizer step.
        Nothing happens here: no coordination (a joiner admitted now would start its counter at 0 in the middle of the
        members' window: a synced backward against their ``no_sync`` one, a hang) and no recovery. A recovery here
        would re-yield the window's first batches to a loop that saw no skipped step: what it keeps per window (the
        samples of the step, a loss it sums over the micro-batches) would count them twice, and by hand its counter
        goes on, so every later window would be cut off the data (silently other steps than a static run's). A
        member's death is met in the window's gradient all-reduce or its commit; a death met earlier (a collective
        of the user's, a forward's buffer broadcast, or the watch) leaves the rest of the window discarded (backward
        and step are no-ops) and the survivors recover after the batch that calls the step, whose
        ``optimizer_step_was_skipped`` is True: the window's batches are redone from its first."""
        if not self._step_open or stepped or self._between_passes:
            return False
        if self._aborted:
            log.debug("worker %s: a member died inside an accumulation window: the survivors recover after the batch "
                      "that calls the step", self.engine.worker_id)
            self._forget_interrupted_ddp_iterations()  # the window's next forward would fail DDP's check
        return True

    def _recover(self) -> None:
        """Survivors of a member's death: the engine rewinds the data position to the open step's first batch,
        re-forms the job without the dead and serves survivors without state; the open step's gradients go."""
        self._aborted = self._recovery_due = False
        self.recoveries += 1
        self.engine.recover(self.optimizer_steps)
        self._pre_loop.catch_up()

    def _recover_before_the_loop(self, error: BaseException) -> None:
        """A collective before the training loop raised: recover if a member died (see ``elastic/pre_loop.py``);
        sharded, no step was mirrored yet: :class:`LostShard`."""
        self.engine.confirm_peer_failure(error)
        if self._sharding is not None and not self._sharding.mirrored:
            raise LostShard(f"worker {self.engine.worker_id}: a member of this FSDP2 job died before the training "
                            "loop, when no shard is mirrored yet; restart the job") from error
        self._check_shards_recoverable()
        log.warning("worker %s: a member died before the training loop; its collective runs again without it",
                    self.engine.worker_id)
        self.recoveries += 1
        self.engine.recover(self.optimizer_steps)

    def _observe_step(self) -> None:
        sample = self.elastic_scaling.policy.timer.batch_end(time.perf_counter())
        if sample is not None and self.sample_weight != 0.0:
            self.elastic_scaling.policy.observe(sample.local_batch, sample.world_size, sample.compute_s,
                                                sample.allreduce_s)

    def _training_over(self) -> None:
        """The loop is over (``epochs()`` ran out, or ``end_training``): the launcher is told this member's training
        ended, same-host joiners finish copying, the link to the AM closes (the group stays)."""
        if self._loop_end_watch is not None:
            self._loop_end_watch.close()
        if self._sharding is not None:
            self._sharding.settle()
        self.engine.training_ended(self.optimizer_steps)
        self.engine.close()

    # ------------------------------------------------------------------ FrontEnd: what the engine asks of Accelerate

    def training_state(self) -> dict[str, Any]:
        """Sharded: without the parameters and optimizer states (the live reshard moves them), with the optimizers'
        skeleton."""
        sharding = self._sharding
        return {
            "models": [self.unwrap_model(model).state_dict() if sharding is None else
                       sharding.unsharded_state(model) for model in compat.prepared_models(self)],
            "frozen": [frozen_parameters(self.unwrap_model(model)) for model in compat.prepared_models(self)],
            "optimizers": [optimizer.state_dict() if sharding is None else {}
                           for optimizer in compat.prepared_optimizers(self)],
            "fsdp_optimizers": None if sharding is None else
            sharding.describe(self._sharded_model(), self._torch_optimizers()),
            "schedulers": [scheduler.state_dict() for scheduler in compat.prepared_schedulers(self)],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "objects": self._objects.state_dict(),
            "local_sgd": self.local_sgd_steps_state.state_dict(),
            "loop": {**self._loop_state(), "trackers": self._tracker_args, "tracker_rows": self._tracker_rows.count,
                     "save_iteration": self.project_configuration.iteration},
        }

    def load_training_state(self, state: dict[str, Any]) -> None:
        for model, model_state, frozen in zip(compat.prepared_models(self), state["models"], state["frozen"],
                                              strict=True):
            self.unwrap_model(model).load_state_dict(model_state, strict=self._sharding is None)  # sharded: buffers
            freeze_as(self.unwrap_model(model), frozen)  # what the loop froze or unfroze since
        if self._sharding is not None:
            self._sharding.joined(state["fsdp_optimizers"])  # the states come by the live reshard
        else:
            for optimizer, optimizer_state in zip(compat.prepared_optimizers(self), state["optimizers"], strict=True):
                optimizer.load_state_dict(optimizer_state)
        for scheduler, scheduler_state in zip(compat.prepared_schedulers(self), state["schedulers"], strict=True):
            scheduler.load_state_dict(scheduler_state)
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self._objects.load_state_dict(state["objects"])
        self.local_sgd_steps_state.load_state_dict(state["local_sgd"])
        self._load_loop_state(state["loop"])
        self._mark_optimizers_stepped()
        self._pre_loop.joined()
        self._tracker_args = state["loop"].get("trackers")
        self._tracker_rows.count = int(state["loop"].get("tracker_rows", 0))
        self.project_configuration.iteration = int(state["loop"]["save_iteration"])  # automatic checkpoint names
        if self.is_main_process:
            self._start_trackers_here()

    def _mark_optimizers_stepped(self) -> None:
        """A joiner of a job that applied steps: its schedulers' optimizers count as stepped, so a scheduler stepped
        before this process's first ``optimizer.step()`` (a joiner admitted at an epoch's end, then a per-epoch
        scheduler) does not warn that the schedule's first value is skipped: it is not, the members stepped."""
        if self.optimizer_steps == 0:
            return
        for scheduler in compat.prepared_schedulers(self):
            optimizer = getattr(getattr(scheduler, "scheduler", scheduler), "optimizer", None)
            if isinstance(optimizer, torch.optim.Optimizer):
                torch_compat.mark_optimizer_stepped(optimizer)

    def receive_destinations(self, state: dict[str, Any]) -> dict[int, torch.Tensor]:
        """Each prepared model's own parameters and buffers take the source's, pruned as the source's are."""
        destinations: dict[int, torch.Tensor] = {}
        for model, skeleton in zip(compat.prepared_models(self), state["models"], strict=True):
            prune_as(self.unwrap_model(model), skeleton)
            destinations.update(destinations_by_name(skeleton, self.unwrap_model(model).state_dict(keep_vars=True)))
        return destinations

    def state_nbytes_beyond_model(self) -> int:
        if self._sharding is not None:
            return 0  # the optimizer states move in the live reshard
        return tensor_nbytes([getattr(optimizer, "optimizer", optimizer).state
                              for optimizer in compat.prepared_optimizers(self)])

    def state_nbytes(self) -> int:
        models = [self.unwrap_model(model) for model in compat.prepared_models(self)]
        if self._sharding is not None:  # what a source sends a joiner: the buffers
            return tensor_nbytes([list(model.buffers()) for model in models])
        return tensor_nbytes([[*model.parameters(), *model.buffers()] for model in models]) + \
            self.state_nbytes_beyond_model()

    def _loop_state(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps, "accelerate_step": self.step,
                "launch_world_size": self.launch_world_size, "scaling": self.elastic_scaling.state_dict()}

    def _load_loop_state(self, loop: dict[str, Any]) -> None:
        self.optimizer_steps = int(loop["optimizer_steps"])
        self.step = int(loop["accelerate_step"])
        self.engine.launch_world_size = int(loop["launch_world_size"])
        self.elastic_scaling.load_state_dict(loop["scaling"])

    def epoch_aggregates(self) -> dict[str, Any] | None:
        """None: an Accelerate loop has no epoch-end reduction of its own (what it gathers, it gathers per step)."""
        return None

    def absorb_epoch_aggregates(self, parts: list[dict[str, Any]]) -> None:
        """Never called: :meth:`epoch_aggregates` records nothing."""

    def shared_state(self) -> dict[str, Any]:
        return {}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        """Every member already holds what rank 0 would share (tracker arguments are recorded on every process)."""

    def adjustment_blocker(self) -> str | None:
        """Not while gradients accumulate, and not where a loop left early starts its next pass or epoch."""
        if not self.sync_gradients:
            return "gradients are being accumulated"
        return "a loop left early starts its next pass" if self._between_passes else None

    def before_resize(self) -> None:
        """Nothing to detach (the elastic DDP follows the generation by itself); in a recovery, the gradients of a
        step that was not committed are dropped (its batches are redone)."""
        if self._step_open:
            self._discard_open_step()
        elif self._cut_after_commit:
            self._discard_cut_iterations()

    def _skip_step_after_cut(self) -> None:
        """An optimizer step of a batch whose step was committed (by its first optimizer step) before a member died in
        a later collective of the batch: its gradients were not all-reduced with every member, so it is not applied."""
        log.warning("worker %s: a member died after step %d was committed (its first optimizer step), in a later "
                    "backward of the same batch: this later optimizer step is not applied (its gradients are not "
                    "the whole batch's); the job goes on, but this step differs from a static run's (two optimizers "
                    "stepped in one batch, a GAN: the first one's step stands)", self.engine.worker_id,
                    self.optimizer_steps + 1)

    def _discard_cut_iterations(self) -> None:
        """After a death in a backward that followed the batch's commit: no gradients, and each elastic DDP without
        the interrupted iteration (its reducer would fail the next forward: 'unmarked_param_indices')."""
        for optimizer in compat.prepared_optimizers(self):
            optimizer.optimizer.zero_grad(set_to_none=True)
        self._forget_interrupted_ddp_iterations()
        self._cut_after_commit = False

    def _forget_interrupted_ddp_iterations(self) -> None:
        """Each elastic DDP without the iteration a member's death cut short: its reducer would fail the next forward
        ('unmarked_param_indices': the previous reduction never finished). In a window accumulated by hand the
        death may cut a micro-batch's all-reduce (a ``no_sync`` around the backward only: DDP syncs by the forward's
        state) and the window's next forward comes before the recovery."""
        for model in compat.prepared_models(self):
            if isinstance(model, ElasticDistributedDataParallel):
                model.discard_iteration()

    def _discard_open_step(self) -> None:
        """Whatever phase the death cut short (a forward, a backward or its all-reduce, the vote), the redo starts
        clean: no gradients, each elastic DDP without the interrupted iteration, the scaler without the step's stage,
        Accelerate's micro-step counter where the step began (``sync_gradients`` follows from it). Optimizers and
        schedulers did not step: a discarded step is not applied."""
        for optimizer in compat.prepared_optimizers(self):
            optimizer.optimizer.zero_grad(set_to_none=True)
        self._forget_interrupted_ddp_iterations()
        if self._sharding is not None:
            self._sharding.discard_step(self._sharded_model())
        if self.scaler is not None:
            torch_compat.forget_scaler_step(self.scaler)
        self.step = self._step_counter_at_open
        self._step_open = False
        self._tracker_rows.forget_after(self._rows_at_open)

    def membership_changed(self, previous_rank: int | None) -> None:
        self._refresh_membership()
        if self.is_main_process and previous_rank not in (None, 0):
            self._start_trackers_here()
            self._complete_checkpoint_of_dead_main()

    def after_resize(self) -> None:
        if self._train_loader is not None:
            self._train_loader.rebuild()

    def _reshard_shards_live(self, reshard: ReshardGroup) -> None:
        """Sharded (``LiveResharding``, through :class:`_ShardedFrontEnd`; not a method named ``reshard_live``, which
        would make every accelerator a ``LiveResharding`` front-end): move this member's shards to their new holders;
        a leaver's model is left with empty CPU tensors (its shards went)."""
        assert self._sharding is not None
        model, receiving = self._sharded_model(), reshard.rank in reshard.receivers
        group = self.engine.generation_group if receiving else None  # a leaver is in no generation now
        self._sharding.reshard_live(reshard, model, self._torch_optimizers(), group)
        if not receiving:
            model.to_empty(device=self.device)

    def leave(self) -> Any:
        self._refresh_membership()
        self._finish_trackers()
        raise LeftTheJob

    def _in_an_open_step(self) -> bool:
        """A step is open and not committed: a failed collective of the sharded model is tolerated (kept for the
        step's end) rather than raised inside the user's forward or backward."""
        return self._step_open and not self._committed

    def _refresh_membership(self) -> None:
        """This process's place in the job, written into Accelerate's state singletons."""
        engine, device = self.engine, self.engine.device
        if engine.has_left:
            compat.set_process_state(False, device, None, 1, _LEFT_RANK, outside_the_job=True)
            if self._sharding is not None:
                self._sharding.forget_mesh()
        elif engine.is_member:
            self._group_view = engine.generation_group
            compat.set_process_state(True, device, engine.backend, engine.world_size, engine.rank,
                                     sharded=self._sharding is not None)
            if self._sharding is not None:
                tolerating = self._in_an_open_step
                self._sharding.build_mesh(engine.tolerant_generation_group(tolerating), device, engine.generation,
                                          lambda ranks: engine.generation_subgroup(ranks, tolerating))
        else:  # a joiner warming up: local collectives, not the main process
            world = max(self.launch_world_size, _LEAST_PROVISIONAL_WORLD)
            compat.set_process_state(False, device, None, world, _PROVISIONAL_RANK, outside_the_job=True)

    # ------------------------------------------------------------------ collectives in the loop

    @override
    def gather(self, tensor: Any) -> Any:
        """Accelerate's ``gather`` of tensors padded to equal first dimensions (an uneven share of a global batch:
        ``elastic/gather.py``); when a member just died in the loop, this worker's own values (the step is
        discarded). On a worker outside the job (it left, or it joined no generation), Accelerate's local one."""
        gather = super().gather
        if not self.engine.is_member:
            return gather(tensor)  # a single process for Accelerate (see _refresh_membership): nothing to even out
        return self._collective(lambda: gather(recursively_apply(even_rows, tensor)), tensor)

    @override
    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """Accelerate's ``reduce`` (it reduces a copy); when a member just died in the loop, this worker's own values
        (the step is discarded)."""
        reduce = super().reduce
        return self._collective(lambda: reduce(tensor, reduction, scale), tensor)

    @override
    def pad_across_processes(self, tensor: Any, dim: int = 0, pad_index: int = 0, pad_first: bool = False) -> Any:
        """Accelerate's (an all-gather of the sizes: one of the job's collectives, recovered from as ``gather``); when
        a member just died in the loop, this worker's tensor as it is."""
        pad = super().pad_across_processes
        return self._collective(lambda: pad(tensor, dim=dim, pad_index=pad_index, pad_first=pad_first), tensor)

    @override
    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        """Accelerate's; in a pass over an elastic evaluation loader, the rows dropped are the padding of the pass's
        current batch (the end of its last one, or, in the batch a member died in, the survivors' padding)."""
        evaluation = self._evaluations.evaluation
        if evaluation is None:
            return super().gather_for_metrics(input_data, use_gather_object)
        if use_gather_object or not all_tensors(input_data):
            own = input_data if isinstance(input_data, list) else [input_data]
            return without_padding(self._collective(lambda: gather_object(input_data), own), evaluation)
        return recursively_apply(lambda tensor: without_padding(tensor, evaluation), self.gather(input_data))

    @override
    def wait_for_everyone(self) -> None:
        """Accelerate's barrier (``main_process_first`` and ``PartialState().wait_for_everyone()`` come here too:
        ``compat.route_state_barriers``); when a member just died in the loop, it returns (the survivors recover at the
        next batch); before the loop, the survivors recover and meet in it again."""
        self.engine.wait_for_training_loop()  # a joiner before its admission (see the engine)
        self._collective(compat.state_barrier, None)

    def _collective(self, collective: Callable[[], Any], own: Any) -> Any:
        """Run one of the job's collectives, or return ``own`` (this worker's values) where there is no one to meet:

        * a joiner admitted in ``prepare()``, until its first pass over the training loader: the members made the
          collectives of the code between ``prepare()`` and that pass (after ``prepare()``, at the epoch's start)
          before they trained the batches it joins at (local, like Lightning's); a real one would pair with their
          gradient all-reduce. From that pass on (an empty one when it joined after the epoch's last batch) it is
          where the members are: the code after the loop over the batches meets them;
        * before :meth:`epochs`: a member's death is recovered from and the collective runs again
          (:class:`~lightning_elan.elastic.pre_loop.PreLoopCollectives`);
        * from :meth:`epochs` on: a member's death discards the step (see :meth:`_absorb_failure`), the survivors
          recover at the next batch boundary.
        """
        self._announce_loop_end()
        if self._catching_up:
            return own
        if self._pre_loop.before_loop and self.engine.is_member:
            return self._pre_loop_collective(collective)
        if self._outside_a_batch() or (self._after_the_loop() and not self._evaluations.evaluating):
            return self._collective_between_batches(collective)
        try:
            result = collective()
        except Exception as error:
            if not self._recovers_in_evaluation():
                self._absorb_failure(error)
                self._evaluations.warn_lost(self._step_open)
                return own
            self._raise_if_loop_ended(error)
            self._evaluations.recover(error)
            return self._collective(collective, own)  # again, among the survivors
        self._evaluations.collective_done()
        return result

    def _pre_loop_collective(self, collective: Callable[[], Any]) -> Any:
        """A collective before the training loop (run again after a recovery, see ``elastic/pre_loop.py``); in a pass
        over an evaluation loader, a recovery meanwhile gives the survivors what the dead had not evaluated."""
        generation = self.engine.generation
        result = self._pre_loop.run(collective)
        if self.engine.generation != generation:
            self._evaluations.recovered_before_the_loop(self._pre_loop.run)
        self._evaluations.collective_done()
        return result

    def _outside_a_batch(self) -> bool:
        """In the loop over the epochs, between two passes over the training loader (the code at an epoch's end or
        start: ``reduce`` of an epoch's loss, ``save_state``'s barrier), no batch taken and no step open, this process
        a member, outside an evaluation pass (whose own recovery evaluates what the dead had not)."""
        return (self._loop_epoch is not None and not self._batch_pending and not self._step_open
                and not self._aborted and not self._recovery_due and not self._evaluations.evaluating
                and self.engine.is_member)

    def _after_the_loop(self) -> bool:
        """This member's ``epochs()`` loop ran out: the script's code after it runs (a test pass, the final barrier
        and save), in which a member's death is recovered from at once, as between batches, with no joiner admitted
        (there is no training left to give one)."""
        return self._loop_ran_out and self._loop_epoch is None and self.engine.is_member and not self.has_left

    def _collective_between_batches(self, collective: Callable[[], Any]) -> Any:
        """A collective outside a training batch: a member's death in it is recovered from at once and it runs again
        among the survivors, as one before the training loop (no step to discard: the code after it meets the
        survivors, not this process's own values). The collectives since the last batch are kept in order, so a
        survivor that completed one the others had not runs it again with them (``elastic/pre_loop.py``)."""
        if self._between_batches is None:
            self._between_batches = PreLoopCollectives(self._recover_between_batches, self.engine.earliest_position)
        result = self._between_batches.run(collective)
        self._evaluations.collective_done()
        return result

    def _recover_between_batches(self, error: BaseException) -> None:
        """A collective outside a training batch raised: recover if a member died, else re-raise."""
        self._raise_if_loop_ended(error)
        self.engine.confirm_peer_failure(error)
        self._check_shards_recoverable()
        log.warning("worker %s: a member died in a collective %s; it runs again without it", self.engine.worker_id,
                    "after the training loop" if self._after_the_loop() else
                    "between training batches (the code at an epoch's end or start)")
        self._recover_now(self.optimizer_steps)

    def _recover_now(self, committed_step: int) -> None:
        """The survivors form the next generation at once (no batch boundary to wait for); after the training loop,
        as an evaluation outside it: the link to the AM opened again, no joiner admitted."""
        self.recoveries += 1
        if self._after_the_loop():
            self.engine.recover_evaluation(committed_step)
        else:
            self.engine.recover(committed_step)

    # ------------------------------------------------------------------ evaluation passes (evaluation_recovery.py)

    def _recovers_in_evaluation(self) -> bool:
        """Whether a failed collective is one of an evaluation pass the survivors go on with at once: in the loop over
        the epochs or after it ran out, no training step open (its batch would be redone), this process a member."""
        return (self._evaluations.evaluating and (self._loop_epoch is not None or self._after_the_loop())
                and not self._step_open and self.engine.is_member and not self._aborted)

    def _call_in_evaluation(self, call: Callable[[], Any]) -> Any:
        """A call of the sharded model (its forward: FSDP2's all-gathers): when a member dies in it during an
        evaluation pass, the survivors recover at once and call it again among themselves (the same inputs; the
        dead member's samples are re-cut into the pass). In a training step the failure is tolerated instead
        (``FSDP2Sharding.build_mesh``) and the step redone."""
        while True:
            try:
                return call()
            except Exception as error:
                if not self._recovers_in_evaluation():
                    raise
                self._raise_if_loop_ended(error)
                self._evaluations.recover(error)

    def _recover_at_once(self) -> None:
        """Survivors of a death inside an evaluation pass or a sharded ``save_state`` recover at once: a training step
        this batch committed stands (the pass, or the save, then goes on among them: :class:`EvaluationRecovery`,
        :meth:`_save_among_the_members`)."""
        self._recovery_due = False
        self._recover_now(self.optimizer_steps + int(self._committed))
        self._pre_loop.catch_up()

    # ------------------------------------------------------------------ trackers

    @override
    def init_trackers(self, project_name: str, config: dict | None = None, init_kwargs: dict | None = None) -> None:
        """Accelerate's (main process only); the arguments are kept on every process, so the trackers can start
        again on a new main process when rank 0 leaves."""
        self._tracker_args = {"project_name": project_name, "config": config, "init_kwargs": init_kwargs}
        super().init_trackers(project_name, config, init_kwargs)

    @override
    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """Accelerate's (the main process writes); every member keeps the row, numbered, and the main process marks
        it written, so that a new main process writes it again should this one die before it wrote it
        (``tracker_rows.py``). A row logged in a step a member's death cut short is not kept: the redo logs it."""
        row = None if self._aborted else self._tracker_rows.logged(values, step, log_kwargs)
        super().log(values, step, log_kwargs)
        if row is not None:
            self.engine.rows_closed(row)

    def _write_tracker_rows_again(self, row: int) -> bool:
        """The new main process after its predecessor's death: write the rows after the last one it marked, up to
        ``row`` (the last this process logged in the failed generation)."""
        self._start_trackers_here()
        written = self._tracker_rows.write_again(self.engine.rows_marked, row, super().log)
        if written:
            log.warning("worker %s: the main process died before it wrote %d tracker row%s: written by the new main "
                        "process", self.engine.worker_id, written, "" if written == 1 else "s")
        return written > 0

    def _start_trackers_here(self) -> None:
        if self._tracker_args is not None and not self.trackers:
            log.info("worker %s is the main process now: starting the trackers", self.engine.worker_id)
            super().init_trackers(**self._tracker_args)

    def _finish_trackers(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []

    @override
    def end_training(self) -> None:
        """Trackers finish and the elastic link closes; the job's group stays until the process exits."""
        self._announce_loop_end()
        self._training_over()
        self._finish_trackers()

    # ------------------------------------------------------------------ checkpoints

    @override
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any) -> Any:
        """Accelerate's checkpoint plus ``elan_state.json``: the data position and loop state, so ``load_state``
        continues at the right sample whatever the world size then. Nothing (None) on a worker that left the job."""
        if self._left_the_job("save_state"):
            return None
        self._announce_loop_end()
        data, loop = self._checkpoint_progress()
        save = super().save_state
        location = self._save_among_the_members(lambda: save(output_dir, safe_serialization, **kwargs))
        if location is None:
            return None
        if self.is_main_process:
            Path(location, ELAN_STATE_FILE).write_text(json.dumps({"data": data, "loop": loop}))
        self._saved_elsewhere = None if self.is_main_process else (str(location), loop)
        return location

    @override
    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict[str, Any]:
        """Accelerate's. Under FSDP2 every process gathers the full state (a collective): between batches or after the
        loop (the final save) a member's death in it is recovered from at once, the dead member's shard restored from
        its mirror, and the survivors gather again."""
        get = super().get_state_dict
        if self._sharding is None or not (self._outside_a_batch() or self._after_the_loop()):
            return get(model, unwrap)
        return self._save_among_the_members(lambda: get(model, unwrap))

    def _save_among_the_members(self, save: Callable[[], Any]) -> Any:
        """Run Accelerate's ``save_state``. Under FSDP2 it is a collective (DCP's gathers and writes, or the full
        state dict's): a member's death in it is recovered from at once, the dead member's shard restored from its
        mirror, and the save runs again among the survivors (before the loop and between batches as any collective
        there; in a batch whose step was applied, here) — unless a step is open: the death discards it like any
        collective of the step (None: nothing saved; the redo calls ``save_state`` again where it called it)."""
        if self._sharding is None:
            return save()
        if self._pre_loop.before_loop and self.engine.is_member:
            return self._pre_loop_collective(save)
        if self._outside_a_batch() or self._after_the_loop():
            return self._collective_between_batches(save)
        while True:
            try:
                return save()
            except Exception as error:
                if self._step_open or self._aborted or not self.engine.is_member:
                    self._absorb_failure(error)
                    return None
                self._raise_if_loop_ended(error)
                self.engine.confirm_peer_failure(error)
                self._check_shards_recoverable()
                log.warning("worker %s: a member died in save_state; the survivors recover and save again",
                            self.engine.worker_id)
                self._recover_at_once()

    def _complete_checkpoint_of_dead_main(self) -> None:
        """This process became the main one in a recovery: if the last ``save_state`` was made here as another process
        and the main process of then died before it wrote its part (``elan_state.json`` last), and no step was applied
        since, write the checkpoint again into its directory (its parameters, optimizers and position are those)."""
        saved, self._saved_elsewhere = self._saved_elsewhere, None
        if saved is None or Path(saved[0], ELAN_STATE_FILE).exists():
            return
        location, loop = saved
        if self._checkpoint_progress()[1]["optimizer_steps"] != loop["optimizer_steps"]:
            return
        log.warning("worker %s: the main process died before it wrote save_state's checkpoint %s; the new main "
                    "process writes it", self.engine.worker_id, location)
        configuration = self.project_configuration
        naming, iteration = configuration.automatic_checkpoint_naming, configuration.iteration
        configuration.automatic_checkpoint_naming = False  # its directory, and no barrier (this is a recovery)
        try:
            self.save_state(location)
        finally:
            configuration.automatic_checkpoint_naming, configuration.iteration = naming, iteration

    def _checkpoint_progress(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The data position and loop state a checkpoint saved now resumes from: those after the last applied step. A
        step committed in this batch counts (``save_state`` right after ``optimizer.step()``); the batches of a step
        not applied yet (before ``optimizer.step()``, or accumulating) are trained again."""
        loop = self._loop_state()
        if self._step_open and self._position_at_open is not None:
            loop["accelerate_step"] = self._step_counter_at_open
            return dict(self._position_at_open), loop
        loop["optimizer_steps"] = self.optimizer_steps + int(self._committed)
        return self.engine.data.state_dict(), loop

    @override
    def save_model(self, model: torch.nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        """Accelerate's; nothing on a worker that left the job."""
        if not self._left_the_job("save_model"):
            super().save_model(model, save_directory, *args, **kwargs)

    @override
    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """Accelerate's; nothing on a worker that left the job."""
        if not self._left_the_job("save"):
            super().save(obj, f, safe_serialization=safe_serialization)

    def _left_the_job(self, call: str) -> bool:
        """Whether this worker left the job: then ``call`` writes nothing (the job's files are its members')."""
        if self.has_left:
            log.info("worker %s left the job: %s() writes nothing (the job's members write its files)",
                     self.engine.worker_id, call)
        return self.has_left

    @override
    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs: Any) -> None:
        """Accelerate's ``load_state`` plus the data position. Skipped on a worker that joined the running job: it
        already holds the job's current state, and the usual ``if checkpoint exists: load_state(...)`` at the top of
        a script would put it back at an older step than its peers."""
        if self._joined_running_job:
            log.info("worker %s joined the running job with its current state: load_state(%s) skipped",
                     self.engine.worker_id, input_dir or "latest")
            return
        super().load_state(input_dir, load_kwargs, **kwargs)
        folder = compat.latest_checkpoint_dir(self) if input_dir is None else os.path.expanduser(input_dir)
        path = Path(folder, ELAN_STATE_FILE)
        if not path.exists():
            log.warning("%s has no %s (not saved by an ElasticAccelerator): the data position is not restored",
                        folder, ELAN_STATE_FILE)
            return
        state = json.loads(path.read_text())
        self.engine.data.load_state_dict(state["data"])
        self._load_loop_state(state["loop"])
        if self._train_loader is not None:
            self._train_loader.rebuild()

    @override
    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Any:
        """For the training loader: the epoch continues at global batch ``num_batches`` (a position, the same on
        every worker whatever the world size); other loaders as Accelerate does. Skipped on a worker that joined the
        running job, before its first batch: like ``load_state`` (the usual resume code), its position is the
        job's."""
        if dataloader is not self._train_loader or self._train_loader is None:
            return super().skip_first_batches(dataloader, num_batches)
        if self._awaiting_first_batch:
            log.info("worker %s joined the running job at its data position: skip_first_batches(%d) skipped",
                     self.engine.worker_id, num_batches)
            return self._train_loader
        data = self.engine.data
        if data.global_batch is None or num_batches < data.steps_before:
            raise ValueError(f"cannot skip to global batch {num_batches} of epoch {data.epoch}: "
                             f"{data.steps_before} batches were cut with an earlier global batch size")
        state = data.state_dict()
        position = data.position_before + (num_batches - data.steps_before) * data.global_batch
        state["position"] = min(position, self._train_loader.sampler.epoch_end())
        data.load_state_dict(state)
        self._train_loader.rebuild()
        return self._train_loader


_SHARDED_PLUGINS = ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin", "torch_tp_plugin",
                    "parallelism_config")
_SHARDED_ENVIRONMENT = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")


def _refuse_sharded_training(kwargs: dict[str, Any]) -> None:
    """Elastic training here is data parallel (every worker holds the whole model) or sharded with FSDP2 (an
    ``fsdp_plugin`` with ``fsdp_version=2``); the other sharded engines are refused, FSDP1 with the reason."""
    fsdp = kwargs.get("fsdp_plugin")
    if fsdp is not None:
        refuse_unsupported_fsdp(fsdp)
    given = [name for name in _SHARDED_PLUGINS if name != "fsdp_plugin" and kwargs.get(name) is not None]
    given += [name for name in _SHARDED_ENVIRONMENT if os.environ.get(name, "false").lower() == "true"
              and not (name == "ACCELERATE_USE_FSDP" and fsdp is not None)]
    if given:
        raise NotImplementedError(f"ElasticAccelerator supports data-parallel training (DDP) and FSDP2 (an "
                                  f"fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)) only, not "
                                  f"{', '.join(given)} (FSDP configured through the environment, DeepSpeed, "
                                  "Megatron-LM and tensor parallelism are not elastic yet)")


class _ShardedFrontEnd:
    """The engine's front-end for an FSDP2 job: the accelerator itself (every ``FrontEnd`` call goes to it), and
    ``LiveResharding``, so every old member and joiner moves the shards at a resize (a data-parallel job's front-end
    is the accelerator alone: its resizes build no reshard group)."""

    def __init__(self, accelerator: ElasticAccelerator) -> None:
        self._accelerator = accelerator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def reshard_live(self, reshard: ReshardGroup) -> None:
        self._accelerator._reshard_shards_live(reshard)

    def shard_count(self, world: int) -> int:
        """The live reshard's layouts: HSDP's shards when ``ElasticPlugin.hsdp_group_size`` divides the world."""
        assert self._accelerator._sharding is not None
        return self._accelerator._sharding.shard_count(world)


def _close_at_exit(reference: weakref.ref[ElasticAccelerator]) -> None:
    accelerator = reference()
    if accelerator is not None:
        accelerator._training_over()
