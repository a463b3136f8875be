"""ElanStrategy: Lightning's DDP strategy as a front-end of the elastic engine.

The membership protocol (join, agree, adjust, leave, replicate, data position) is
:class:`~lightning_elan.elastic.worker.ElasticWorker`'s. This module gives it what only Lightning knows — the
in-memory checkpoint, the DDP wrapper, the training loader, loggers, the end of ``fit`` — and every private Lightning
touch goes through :mod:`lightning_elan.compat`.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_elan import compat, sharded_checkpoint, torch_compat
from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.positions import LocalShare
from lightning_elan.data.sampler import DataPosition
from lightning_elan.elastic.applied_steps import AppliedSteps, ClosureReevaluations
from lightning_elan.elastic.ddp import ElasticDistributedDataParallel, freeze_as, frozen_parameters
from lightning_elan.elastic.error_origin import may_be_a_peers_death
from lightning_elan.elastic.frontend import ScalingParticipant
from lightning_elan.elastic.gather import even_rows
from lightning_elan.elastic.host_mutex import HostMutex
from lightning_elan.elastic.pre_loop import PreLoopCollectives
from lightning_elan.elastic.pruning import prune_as, pruned_tensors, without_pruned
from lightning_elan.elastic.rng import LoaderRNG
from lightning_elan.elastic.start_hooks import START_HOOKS, StartHookResults
from lightning_elan.elastic.worker import ElasticWorker, NotAMember, engine_of_process
from lightning_elan.protocol.contract import DEFAULT_JOIN_TIMEOUT_S, WorkerEnvironment
from lightning_elan.replication.reception import destinations_by_name, tensor_nbytes
from lightning_elan.strategy.environment import ElanEnvironment, host_placement

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry

log = logging.getLogger(__name__)

# a joiner warming up is no one's rank 0 (loggers and checkpoints stay quiet) until its generation forms
_PROVISIONAL_RANK, _PROVISIONAL_WORLD = 1, 2
_LEFT_RANK = -1
_LEFT_RANK_ZERO_ONLY = 1  # a leaver's rank for Lightning's rank_zero_only: not 0, and above it


class ElanStrategy(DDPStrategy):
    """Elastic DDP: survivors keep training while workers join, leave or migrate at batch boundaries.

    Args:
        coordinate_every: steps between two questions to the application master (default: ``elan run``'s
            ``--coordinate-every``, else 10).
        global_batch_size: samples per optimizer step over all workers; default: the DataLoader's ``batch_size``
            times the initial world size. Kept fixed under resizes (strong scaling).
        join_timeout_s: how long a new worker waits for its adjustment before giving up.
        replication: ``"auto"`` (default: each joiner copies from its nearest worker over CUDA IPC, shared memory or
            the network, as the application master plans from every worker's topology) or ``"collective"`` (always a
            broadcast on a transfer group). Default: ``$ELAN_REPLICATION``, else ``"auto"``.
        send_ahead: when this worker makes its shared-memory send segment (the state's size of ``/dev/shm``) before
            an adjustment, so that its first write is not in the pause: ``"joiners"`` (while a request's new workers
            warm up; CPU workers), ``"always"`` (kept for the whole run) or ``"off"``. Default: ``$ELAN_SEND_AHEAD``,
            else ``"joiners"``.
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and from there to DDP).
    """

    strategy_name = "elan"
    recovers_evaluations = True
    """A member's death during ``trainer.validate/test/predict`` outside ``fit`` is recovered from (the pass runs
    again among the survivors); a sharded subclass, whose shards the survivors would have to rebuild, says no."""

    def __init__(
        self,
        coordinate_every: int | None = None,
        global_batch_size: int | None = None,
        join_timeout_s: float = DEFAULT_JOIN_TIMEOUT_S,
        replication: str | None = None,
        send_ahead: str | None = None,
        **kwargs: Any,
    ) -> None:
        environment = WorkerEnvironment.from_env()
        kwargs.setdefault("timeout", timedelta(seconds=300))
        super().__init__(cluster_environment=ElanEnvironment(), **kwargs)
        # a later Trainer of the process takes the engine of the job's first: it owns torch's default group
        self.engine = engine_of_process() or ElasticWorker(
            environment, coordinate_every=coordinate_every, join_timeout_s=join_timeout_s, replication=replication,
            global_batch=global_batch_size, send_ahead=send_ahead,
        )
        self.engine.attach(self)
        compat.end_the_script_after_a_leavers_fit()
        self._collectives_local = False
        self._training_fit = False  # from setup to teardown of a fit that trains (not Tuner.lr_find's)
        self._fits_before = 0  # the training fits this process ended as a member before the current call began
        self._evaluation_limits: dict[str, int | float] = {}  # the user's limit_*_batches
        self._evaluation_limits_warned: set[str] = set()
        self._current_share: LocalShare | None = None
        self._applied_steps = AppliedSteps()  # manual optimization: the batch's steps, until it stands
        self._reevaluations = ClosureReevaluations()  # optimizers that evaluate the closure again in a step
        self._loader_rng = LoaderRNG()  # the random state the data-loader hooks were called with
        self._ddp: ElasticDistributedDataParallel | None = None
        self._group_view: torch.distributed.ProcessGroup | None = None
        self._pre_loop = PreLoopCollectives(self._recover_in_a_kept_collective, self.engine.earliest_position)
        self._start_hooks = StartHookResults(self.engine.publish_start_result, self.engine.published_start_result)
        self._sync_environment()

    # ------------------------------------------------------------------ registration and environment

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("elan", cls, description="Elastic DDP: grow, shrink and migrate while training")

    @override
    def _configure_launcher(self) -> None:
        """No launcher: `elan run`, `elan worker` or the user start the processes (``DDPStrategy``'s own hook)."""

    @property
    @override
    def root_device(self) -> torch.device:
        """The worker's device: ``elan run``'s device index, not the local rank (DDP's choice; the members on a host
        change while a process keeps its device)."""
        assert self.parallel_devices is not None
        device = self.parallel_devices[0]
        index = self.engine.environment.device_index
        if device.type == "cuda" and index is not None:
            return torch.device("cuda", index)
        return device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def set_world_ranks(self) -> None:
        """Lightning's rank-zero gate follows the global rank; a worker that left (rank -1) is not rank 0 for it
        either: ``rank_zero_experiment`` creates a logger's experiment unless the rank is above 0, and a leaver's CSV
        writer would delete the job's ``metrics.csv``."""
        rank = self.global_rank if self.global_rank >= 0 else _LEFT_RANK_ZERO_ONLY
        rank_zero_only.rank = utils_rank_zero_only.rank = rank

    @property
    def coordinate_every(self) -> int:
        return self.engine.coordinate_every

    @property
    def replication(self) -> str:
        return self.engine.replication

    @property
    def generation(self) -> int | None:
        return self.engine.generation

    @property
    def data_position(self) -> DataPosition:
        """The job's data state ``(epoch, position, global batch)``; the engine is its only writer."""
        return self.engine.data

    @property
    def has_left(self) -> bool:
        return self.engine.has_left

    def register_scaling(self, participant: ScalingParticipant) -> None:
        """``HybridScaling`` registers here: it decides the global batch at every resize."""
        self.engine.register_scaling(participant)

    @override
    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        self._fits_before = self.engine.training_fits
        if trainer is not None:
            compat.disable_distributed_sampler(trainer)
            _install_coordinator(trainer, self)
            compat.follow_fit_loop_restores(trainer, self._fit_loop_restored)
            compat.route_lr_find()
            compat.prepare_data_as_the_job(trainer, lambda: self.engine.has_left, self._preparing_data_in_turn)
            if not self.engine.environment.standalone:  # SIGTERM = leave the job (elastic/termination.py)
                compat.keep_sigterm_handler(trainer, lambda: self.engine.sigterm_handler)
                compat.drop_sigterm_broadcast(trainer)
        self._warn_of_unlaunched_devices()
        super().setup_environment()
        if trainer is not None and self._recovering_evaluation(trainer):
            compat.redo_evaluations_cut_by_a_death(trainer, self._recover_evaluation, self._evaluation_pass_done)
        if trainer is not None and self.recovers_evaluations:
            compat.redo_saves_cut_by_a_death(trainer, self._recover_evaluation)

    def _recovering_evaluation(self, trainer: pl.Trainer) -> bool:
        """``trainer.validate/test/predict`` outside ``fit`` on a member of the job: a member's death in it is
        recovered from (before its first collective, the ``log_dir`` broadcast of Lightning's profiler setup)."""
        return self.recovers_evaluations and trainer.state.fn in _EVALUATION_CALLS and self.engine.is_member

    def _warn_of_unlaunched_devices(self) -> None:
        """``Trainer(devices=N)`` outside ``elan run``: one process trains (``elan run --nproc N`` starts N; there is
        no launcher of our own, see :meth:`_configure_launcher`)."""
        processes = len(self.parallel_devices or []) * self.num_nodes
        if self.engine.environment.standalone and processes > 1:
            log.warning("strategy=\"elan\" with %d devices outside `elan run` trains in this one process: start the "
                        "job with `elan run --nproc %d -- python %s` for %d workers", processes, processes,
                        " ".join(sys.argv) or "SCRIPT", processes)

    @override
    def setup_distributed(self) -> None:
        """Connect to the job; a later fit/validate of the process (this Trainer's or another's) keeps its
        generation."""
        reset_seed()
        backend, timeout = compat.collective_settings(self)
        if not self.engine.is_member:
            self.engine.start(backend, self.root_device, timeout)
            self._collectives_local = not self.engine.is_member  # a joiner warming up
            self.engine.alone_until_admitted()
        self._group_view = self.engine.generation_group if self.engine.is_member else None
        self._sync_environment()

    def _preparing_data_in_turn(self) -> HostMutex:
        """Held while this process runs the user's ``prepare_data``: one process of the job per host at a time (a
        joiner is local rank 0 of its own world, and ran it while a member's local rank 0 did)."""
        return HostMutex(f"{self.engine.environment.job}/prepare_data", what="prepare_data")

    def _sync_environment(self) -> None:
        """The cluster environment's rank, world size and place on the hosts from the engine (provisional for a
        joiner, -1 once left)."""
        local_rank, node_rank = 0, 0
        if self.engine.has_left:
            rank, world_size = _LEFT_RANK, 0
        elif self.engine.is_member:
            rank, world_size = self.engine.rank, self.engine.world_size
            local_rank, node_rank = host_placement(self.engine.hosts, rank)
        elif self.engine.environment.joiner:
            # local rank 0 of node 0: it runs prepare_data, as it cannot wait for the members' (its barrier is its own)
            rank, world_size = _PROVISIONAL_RANK, _PROVISIONAL_WORLD
        else:
            rank, world_size = max(self.engine.environment.rank, 0), max(self.engine.environment.world_size, 1)
        self.cluster_environment.assign(rank, world_size, local_rank, node_rank)
        self.set_world_ranks()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """A worker that left the job during ``fit`` evaluates nothing afterwards (see :meth:`_setup_as_leaver`); a
        joiner's ``validate``/``test``/``predict`` before its ``fit`` runs alone (see :meth:`_setup_alone`)."""
        if trainer.state.fn == TrainerFn.FITTING:
            self._setup_fit(trainer)
            super().setup(trainer)
        elif self.engine.has_left:
            self._setup_as_leaver(trainer)
        elif not self.engine.is_member:
            self._setup_alone(trainer)
        elif self.recovers_evaluations:
            self._again_after_a_death(lambda: super(ElanStrategy, self).setup(trainer))  # DDP's state broadcast
        else:
            super().setup(trainer)

    def _setup_fit(self, trainer: pl.Trainer) -> None:
        """A fit after this worker left the job is skipped (one info line); a member's training fit after its first
        (a script that trains in stages) starts its data afresh (``ElasticWorker.start_later_fit``)."""
        self._training_fit = not compat.tuning(trainer)
        compat.around_dataloader_requests(trainer, self._loader_rng.call)
        compat.no_checkpoint_selected_after_leaving(trainer, lambda: self.engine.has_left)
        compat.no_throughput_setup_after_leaving(trainer, lambda: self.engine.has_left)
        compat.follow_start_hooks(trainer, START_HOOKS, self._start_hooks.entering)
        if self.engine.group is not None:  # torch.distributed called directly in those hooks
            self.engine.group.follow_start_hooks(self._start_hooks, lambda: self._collectives_local)
        if self.engine.has_left:
            log.info("worker %s left the job: this fit is skipped here (the job's workers train)",
                     self.engine.worker_id)
            raise compat.LeaveFit
        if self._training_fit and self.engine.is_member and self.engine.training_fits:
            self.engine.start_later_fit(trainer.fit_loop.epoch_progress.current.processed)
        if self.engine.is_member:
            self._share_logger_versions(trainer)

    def _share_logger_versions(self, trainer: pl.Trainer) -> None:
        """Every member takes rank 0's logger versions before anything is logged, so a member that becomes rank 0
        after rank 0's death continues each logger in its version directory (it had resolved the first logger's only:
        a second ``CSVLogger`` of the new rank 0 opened ``version_1`` beside the rows rank 0 wrote in ``version_0``).
        Each rank gives its own resolution: a broadcast run again after rank 0's death takes the new rank 0's."""
        compat.set_logger_versions(trainer, self.broadcast(compat.resolved_logger_versions(trainer)))

    def _setup_alone(self, trainer: pl.Trainer) -> None:
        """The model set up as DDP's ``setup`` does for an evaluation, without the state sync that needs the job.

        A joiner runs the user's script from its top: an evaluation before ``fit`` (a baseline ``trainer.validate``)
        is one the members ran when the job started. The joiner runs it alone, on the whole of its data, while it warms
        up (its collectives stay in the process), so the script gets the results it expects."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.setup_precision_plugin()

    def _setup_as_leaver(self, trainer: pl.Trainer) -> None:
        """``validate``/``test``/``predict`` after this worker left: skipped, with one info line. Its model stopped
        training when it left, so its results would be a stale model's; the job's final workers evaluate."""
        self._setup_alone(trainer)
        stage = _LIMIT_OF_STAGE.get(trainer.state.fn)
        if stage is not None:
            setattr(trainer, stage, 0)  # Lightning's own skip: the loop runs no hook and loads no data
        log.info("worker %s left the job during fit: trainer.%s is skipped here (the job's workers evaluate)",
                 self.engine.worker_id, trainer.state.fn.value)

    # ------------------------------------------------------------------ DDP on the elastic group

    @override
    def configure_ddp(self) -> None:
        """A joiner builds its elastic DDP while it warms up (it needs no group), then waits for its adjustment (in the
        fit that trains: ``Tuner.lr_find``'s fit is over before the members train, see :meth:`run_lr_find`)."""
        super().configure_ddp()
        if not self.engine.is_member and self._training_fit:
            self._join()

    @override
    def _setup_model(self, model: torch.nn.Module) -> DistributedDataParallel:
        """One elastic DDP for the life of the process: its gradient all-reduce follows the current generation, so a
        resize rebuilds nothing (no bucket reallocation, no shape verification). The launch generation starts like DDP
        (rank 0's weights broadcast); every later one was formed by a replication, so all members hold the same
        weights."""
        if self._ddp is None or self._ddp.module is not model:
            kwargs = dict(self._ddp_kwargs)
            for unsupported in ("process_group", "static_graph"):
                if kwargs.pop(unsupported, None):
                    raise ValueError(f"ElanStrategy does not support DDP's {unsupported!r}: the elastic DDP chooses "
                                     "its group at every generation and settles its buckets at construction")
            self._ddp = ElasticDistributedDataParallel(model, self._current_group,
                                                       device_ids=self.determine_ddp_device_ids(), **kwargs)
            if self.engine.in_launch_generation:  # a member's death in it is recovered (elastic/pre_loop.py)
                self._pre_loop.run(self._ddp.broadcast_module_state)
        return self._ddp

    def _current_group(self) -> torch.distributed.ProcessGroup | None:
        return self._group_view if self.engine.is_member else None

    def _join(self) -> None:
        """A joiner, warmed up (model on its device): wait for the adjustment and take the state from the source."""
        if self._ddp is not None:
            self._ddp.warm_up_alone()
        try:
            self.engine.join()
        except NotAMember as reason:
            log.info("%s; leaving", reason)
            self._sync_environment()
            raise compat.LeaveFit from None

    # ------------------------------------------------------------------ FrontEnd: what the engine asks of Lightning

    @property
    def max_epochs(self) -> int | None:
        """The trainer's ``max_epochs`` (the engine's estimate of the samples left, for the utility autoscaler)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        epochs = getattr(trainer, "max_epochs", None)
        return epochs if isinstance(epochs, int) and epochs >= 0 else None

    def training_state(self) -> dict[str, Any]:
        trainer = self.lightning_module.trainer
        return {"checkpoint": compat.dump_training_state(trainer), "logger_versions": compat.logger_versions(trainer),
                "callback_metrics": compat.callback_metrics(trainer),
                "checkpoint_saves": compat.checkpoint_saves(trainer),
                "accumulate_grad_batches": trainer.accumulate_grad_batches, "loader_rng": self._loader_rng.recorded,
                "frozen": frozen_parameters(self.lightning_module), "pruned": pruned_tensors(self.lightning_module)}

    def load_training_state(self, state: dict[str, Any]) -> None:
        self._pre_loop.joined()
        trainer, checkpoint = self.lightning_module.trainer, state["checkpoint"]
        compat.call_on_load_checkpoint(trainer, checkpoint)
        module_state = without_pruned(checkpoint["state_dict"], state["pruned"]) if state["pruned"] else \
            checkpoint["state_dict"]
        self.lightning_module.load_state_dict(module_state, strict=self.lightning_module.strict_loading)
        freeze_as(self.lightning_module, state["frozen"])  # what a callback unfroze since (BackboneFinetuning)
        compat.set_logger_versions(trainer, state["logger_versions"])
        if self.global_rank == 0:  # every old member left (a whole migration): this joiner writes the logs on
            compat.adopt_loggers(trainer)
        compat.align_checkpoint_dirs(trainer, checkpoint.get("callbacks", {}))
        compat.stage_training_state(trainer, checkpoint)
        compat.set_checkpoint_saves(trainer, state.get("checkpoint_saves", {}))
        compat.set_callback_metrics(trainer, state["callback_metrics"])
        compat.run_the_joined_epoch_as_the_members(trainer, state["accumulate_grad_batches"])
        self._loader_rng.inherit(state["loader_rng"])

    def receive_destinations(self, state: dict[str, Any]) -> dict[int, Tensor]:
        """The module's own parameters and buffers (``keep_vars``: the tensors themselves) take the source's, pruned
        as the source's are."""
        prune_as(self.lightning_module, state["pruned"])
        own = self.lightning_module.state_dict(keep_vars=True)
        return {**destinations_by_name(state["checkpoint"].get("state_dict"), own),
                **destinations_by_name(state["pruned"], own)}

    def state_nbytes_beyond_model(self) -> int:
        return tensor_nbytes([optimizer.state for optimizer in self.optimizers])

    def state_nbytes(self) -> int:
        module = self.lightning_module
        return tensor_nbytes([*module.parameters(), *module.buffers()]) + self.state_nbytes_beyond_model()

    def epoch_aggregates(self) -> dict[str, Any] | None:
        return compat.epoch_aggregates(self.lightning_module.trainer)

    def absorb_epoch_aggregates(self, parts: list[dict[str, Any]]) -> None:
        compat.absorb_epoch_aggregates(self.lightning_module.trainer, parts)

    def shared_state(self) -> dict[str, Any]:
        return {"logger_versions": compat.logger_versions(self.lightning_module.trainer)}

    def adopt_shared_state(self, state: dict[str, Any]) -> None:
        compat.set_logger_versions(self.lightning_module.trainer, state["logger_versions"])

    def adjustment_blocker(self) -> str | None:
        return compat.adjustment_blocker(self.lightning_module.trainer)

    def before_resize(self) -> None:
        """The elastic DDP stays (it follows the generation); Lightning's ``configure_ddp`` expects the bare module."""
        self.model = self.lightning_module

    def membership_changed(self, previous_rank: int | None) -> None:
        """A member that became rank 0 continues the old rank 0's loggers; a joiner does so once it has their versions
        (:meth:`load_training_state`): built before, its logger would open a version of its own."""
        self._group_view = self.engine.generation_group if self.engine.is_member else None
        self._sync_environment()
        if self.global_rank == 0 and previous_rank is not None and previous_rank != 0:
            compat.adopt_loggers(self.lightning_module.trainer)

    def after_resize(self) -> None:
        """Stayers after a resize: DDP on the new group, data from the same serial position, eval shards rebuilt. A
        recovery before Lightning set the model up leaves DDP to its ``setup``, which builds it on the new group."""
        trainer = self.lightning_module.trainer
        if trainer.state.fn != TrainerFn.FITTING or not compat.inside_a_call(trainer):
            compat.move_progress_bar(trainer, loop_started=False)  # validate/test/predict: its pass runs again on
            return  # the new shards; between calls (a save after fit) nothing trains any more
        if self._ddp is not None:
            self.configure_ddp()
        loader = self._elastic_train_loader()
        if loader is not None:
            loader.rebuild()
        compat.refetch_prefetched_batch(trainer)
        if loader is not None:
            compat.refresh_epoch_length(trainer)  # the global batch may have changed: the epoch has a new length
        self._reshard_evaluation(trainer)
        compat.move_progress_bar(trainer, loop_started=not self._pre_loop.before_loop)
        compat.move_throughput_monitors(trainer, loop_started=not self._pre_loop.before_loop)
        compat.move_profiler(trainer)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """An error ended ``trainer.validate/test/predict`` (outside ``fit``) or a training fit after the first: when a
        member died meanwhile, say so in one error line. A death during an evaluation's pass is recovered from (the
        pass runs again among the survivors: ``compat.redo_evaluations_cut_by_a_death``), and so is one in Lightning's
        barriers and broadcast around it (they run again); one met in another collective around the pass (a user's
        ``all_gather`` in a ``setup`` hook) is not, and the survivors' error is gloo's ("Connection reset by peer"),
        which does not name the death. Only a process's first training fit is elastic: a death in a later one fails
        the job wherever the survivors meet it (a barrier of its loaders' setup, a hook's reduction)."""
        super().on_exception(exception)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not self.engine.is_member:
            return
        fitting = trainer.state.fn == TrainerFn.FITTING
        if (fitting and not self._in_a_later_fit(trainer)) or not self._a_members_death(exception):
            return  # the first fit recovers from deaths itself: no wait here for the AM's notice
        if not fitting:
            log.error("worker %s: a member of the job died during trainer.%s, in a collective outside its pass over "
                      "the data that elan does not run again; this %s stops here with the error below",
                      self.engine.worker_id, trainer.state.fn.value, trainer.state.fn.value)
        else:
            log.error("worker %s is past the job's elastic fit: a member of the job died during a training fit after "
                      "the script's first, which cannot recover from a member's death (only a process's first "
                      "training fit is elastic); this fit stops here with the error below", self.engine.worker_id)

    def _in_a_later_fit(self, trainer: pl.Trainer) -> bool:
        """A training fit after one this process ended as a member, from its setup hooks on (``start_later_fit``)."""
        return bool(self._fits_before) and not compat.tuning(trainer)

    def _a_members_death(self, exception: BaseException) -> bool:
        """Whether ``exception`` may be a collective's error for a member's death, and the AM told of one."""
        maybe_a_death = self.world_size > 1 and may_be_a_peers_death(exception)
        return maybe_a_death and self.engine.peer_failure_within(_DEATH_NOTICE_S)

    def leave(self) -> NoReturn:
        raise compat.LeaveFit

    def fit_returned(self) -> None:
        """``trainer.fit`` returned (``compat.end_the_script_after_a_leavers_fit``): a worker that left the job during
        it ends its script here, exit 0, as if the job had been launched at its final size. Its fit finished cleanly
        (teardown done, loggers finalised as a non-member); the code after ``fit`` (a ``trainer.test``, a reload of the
        best checkpoint, a result file) would see its state as it was when it left, so it runs on the job's members
        only. The user's ``finally:`` blocks and ``atexit`` hooks still run (``SystemExit``), and the launcher counts
        the exit 0 as the leave it waited for."""
        if not self.engine.has_left:
            return
        log.info("worker %s left the job during fit: its script ends here, after trainer.fit (the code after fit runs "
                 "on the job's workers)", self.engine.worker_id)
        raise SystemExit(0)

    # ------------------------------------------------------------------ data: elastic training loader

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return self._shard_for_evaluation(trainer, dataloader)
        if isinstance(dataloader, DataLoader) and _has_iterable_dataset(dataloader):
            raise NotImplementedError("ElanStrategy's training DataLoader needs a map-style dataset (exactly once per "
                                      "epoch is kept by sample index); an IterableDataset is not supported yet")
        if not isinstance(dataloader, DataLoader):
            log.warning("%s is not a map-style DataLoader: it is not made elastic", type(dataloader).__name__)
            return dataloader
        if dataloader.batch_size is None:
            raise NotImplementedError(
                f"ElanStrategy's training DataLoader needs a batch_size: it cuts each global batch from the epoch's "
                f"order of samples, and a batch_sampler ({type(dataloader.batch_sampler).__name__}) makes the batches "
                "itself; build the loader with sampler=... and batch_size=... instead")
        if self.data_position.global_batch is None:
            self.data_position.change_global_batch(dataloader.batch_size * self._launch_world_size())
        seed = int(os.getenv("PL_GLOBAL_SEED", 0))
        loader = ElasticDataLoader(dataloader, self.data_position, self._world_view, seed)
        self.engine.follow_epoch_order(loader.sampler.order)
        return loader

    def _fit_loop_restored(self, epoch: int, with_loader_state: bool) -> None:
        """Lightning restored its fit loop from a state that holds no position of the training data (the LR finder's,
        saved before the loop): like Lightning's fresh loader, the data starts ``epoch`` from its first sample. A state
        with a position (a checkpoint saved in the loop, a joiner's) loads it through ``ElasticDataLoader``."""
        if not with_loader_state:
            self.data_position.start_epoch(epoch)

    def run_lr_find(self, lr_find: Callable[..., Any], trainer: pl.Trainer, model: pl.LightningModule,
                    **options: Any) -> Any:
        """The LR finder's range test (``Tuner.lr_find``, a ``LearningRateFinder``): the launch members run it before
        their training loop and rank 0 publishes what it found; a joiner, which cannot run it with them, takes that
        (its ``update_attr`` applied), so the script sees the members' result. Nothing else changes: no adjustment
        lands in a range test (Lightning runs it with its own callbacks only), and its data does not count."""
        name = self.engine.next_start_result_name("lr_find")
        if self.engine.environment.joiner:
            found = json.loads(self.engine.start_result(name))
            return compat.lr_finder_from_results(trainer, model, found, options)
        finder = lr_find(trainer, model, **options)
        if self.is_global_zero:
            self.engine.publish_start_result(name, json.dumps(compat.lr_find_results(finder)))
        return finder

    def _launch_world_size(self) -> int:
        """The job's world when it started (``elan run --nproc``): the global batch a user's per-process
        ``batch_size`` means, also when a member died before the loop and the world is smaller already, and for a
        joiner (started with no world of its own), in a later fit too: its source's."""
        return self.engine.launch_world_size or self.world_size

    def _world_view(self) -> tuple[int, int]:
        return self.global_rank, self.world_size

    def _reshard_evaluation(self, trainer: pl.Trainer) -> None:
        """The validation loaders are requested again at the next validation, for the new shards: with the random
        state of their last request (a static run would not have called the hook again)."""
        compat.reset_evaluation_dataloaders(trainer)
        self._loader_rng.replay(compat.VALIDATION_LOADER_HOOK)

    def _shard_for_evaluation(self, trainer: pl.Trainer, dataloader: object) -> object:
        self._keep_evaluation_limit_global(trainer)
        if (
            not compat.user_wants_distributed_sampler(trainer)
            or self.world_size < 2
            or not self.engine.is_member  # a joiner before its fit evaluates alone (see _setup_alone)
            or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader.sampler, DistributedSampler)
            or _has_iterable_dataset(dataloader)
            or trainer.state.stage == RunningStage.PREDICTING
        ):
            return dataloader
        sampler = compat.evaluation_sampler(dataloader, self.world_size, self.global_rank)
        self._warn_of_repeated_evaluation_samples(trainer, sampler)
        return compat.with_sampler(dataloader, sampler, trainer.state.stage)

    def _warn_of_repeated_evaluation_samples(self, trainer: pl.Trainer, sampler: DistributedSampler) -> None:
        """``DistributedSampler`` gives every process as many samples by repeating the first ones where the world does
        not divide the dataset (DDP does the same). Where the launch world divided it, the static run evaluated each
        sample once: at this world size the job's evaluation metrics (a ``sync_dist`` mean, a torchmetrics state) take
        the repeated samples in too and differ from the static run's. Said once per stage and world size."""
        total, samples = sampler.total_size, len(sampler.dataset)  # type: ignore[arg-type]
        launch = self._launch_world_size()
        key = f"{trainer.state.stage}@{self.world_size}"
        limit = getattr(trainer, f"limit_{trainer.state.stage.dataloader_prefix}_batches", None)
        whole = isinstance(limit, float) and limit == 1.0  # a limit may stop before the repeated samples
        if total == samples or samples % launch != 0 or not whole or self.global_rank != 0:
            return
        if key in self._evaluation_limits_warned:
            return
        self._evaluation_limits_warned.add(key)
        log.warning("evaluation (%s) at %d workers: %d samples do not divide among them, so each process "
                    "evaluates %d and %d samples are evaluated twice (DistributedSampler's padding, as under DDP); "
                    "the job's %d launch workers evaluated each once, so %s metrics at this size differ from a "
                    "static run's",
                    trainer.state.stage.value, self.world_size, samples, sampler.num_samples, total - samples, launch,
                    trainer.state.stage.dataloader_prefix)

    def _keep_evaluation_limit_global(self, trainer: pl.Trainer) -> None:
        """An int ``limit_val_batches``/``limit_test_batches`` counts batches per process: the static run of the launch
        world evaluates ``limit × launch world`` batches, the first samples of the dataset (each process's shard
        interleaves it). At another world the per-process limit is set so the job evaluates as many, the same samples
        (rounded up where the world does not divide them: a warning says so); a fraction scales with the shard."""
        stage = trainer.state.stage
        if stage not in _EVALUATION_LIMITED or not self.engine.is_member:
            return
        name = f"limit_{stage.dataloader_prefix}_batches"
        limit = self._evaluation_limits.setdefault(name, getattr(trainer, name))
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            return
        if not compat.user_wants_distributed_sampler(trainer):
            return  # the user's own sampler shards: their limit is theirs
        total = limit * self._launch_world_size()
        per_process = -(-total // self.world_size)
        if per_process * self.world_size != total and name not in self._evaluation_limits_warned:
            self._evaluation_limits_warned.add(name)
            log.warning("%s=%d per process at %d workers is %d batches; at %d workers each evaluates %d (%d in all)",
                        name, limit, self._launch_world_size(), total, self.world_size, per_process,
                        per_process * self.world_size)
        setattr(trainer, name, per_process)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._pre_loop.batch_started()
        if self._collectives_local:
            # a joiner's start-up is over; its validation loaders were set up without the group: set them up again
            # at the next validation, together with the stayers who reset theirs at the adjustment
            self._collectives_local = False
            self._reshard_evaluation(self.lightning_module.trainer)
        loader = self._elastic_train_loader()
        if loader is not None:
            opens = compat.opens_optimizer_step(self.lightning_module.trainer, batch_idx)
            self._current_share = self.engine.take_global_batch(loader.sampler.epoch_end(), opens_step=opens)
        else:
            self._current_share = None

    def _elastic_train_loader(self) -> ElasticDataLoader | None:
        loaders = compat.train_dataloaders(self.lightning_module.trainer)
        return next((loader for loader in loaders if isinstance(loader, ElasticDataLoader)), None)

    @property
    def sample_weight(self) -> float:
        """Weight of this rank's current batch in the global mean (0 for a stand-in sample)."""
        return 1.0 if self._current_share is None else self._current_share.loss_weight

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        self.engine.backward_started()
        weight = self.sample_weight
        if weight != 1.0:
            closure_loss = closure_loss * weight
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ batch boundaries (from the callback)

    def on_epoch_start(self, trainer: pl.Trainer) -> None:
        """An epoch after a change of the global batch has a different length than the one Lightning measured."""
        if self._elastic_train_loader() is not None:
            compat.refresh_epoch_length(trainer)

    def on_batch_end(self, trainer: pl.Trainer) -> None:
        """A batch boundary once the optimizer step is over: inside an accumulation window a member's death is
        noticed by the window's next collective, which rewinds the whole window (``compat.redo_interrupted_batches``);
        a boundary there would recover without the loop going back."""
        if not compat.accumulating(trainer):
            self.engine.at_batch_boundary(trainer.global_step, after_recovery=self._pre_loop.catch_up)

    # ------------------------------------------------------------------ worker failures

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The optimizer applies a step only when every member committed it; an aborted vote raises before the update,
        so nothing is applied. The vote comes after everything Lightning runs before the update — the closure
        (``training_step``, backward, the gradient all-reduce), the ``on_before_optimizer_step`` hooks and gradient
        clipping (``compat.after_the_closure``) — so a member's death in any of them, a user's collective in a hook
        (``self.log(..., sync_dist=True)`` of a gradient norm) or FSDP2's clipping norm included, is a death before
        the vote: the step is redone. (Before, the vote followed the backward: a survivor that met the death in a
        hook's collective had voted, so the step counted as done, and it never applied the update: one step lost.)

        A precision plugin of the user's whose ``optimizer_step`` runs the closure itself and never calls
        ``_after_closure`` (so no hook or clipping runs either) gets the vote right before the update (the optimizer's
        step pre-hook), or after its step when it applied none.

        An optimizer that evaluates the closure again inside its step (``torch.optim.LBFGS``, or one seen doing so
        in an earlier step) updates the parameters between its evaluations, each voted on: the batch stays open
        until the step returns, with the parameters and optimizer state it began with kept (before the step begins:
        ``LBFGS.step`` fills its state before it evaluates the closure), so a member's death in any evaluation undoes
        the step and the batch is redone whole (as a batch of manual optimization)."""
        manual = not self.lightning_module.automatic_optimization
        torch_optimizer = _torch_optimizer(optimizer)
        held_open = manual or self._reevaluations.expected(torch_optimizer)
        evaluations, unvoted = 0, False

        def vote() -> None:
            nonlocal unvoted
            unvoted = False
            self._before_the_vote(torch_optimizer)
            self.engine.commit_step(self.lightning_module.trainer.global_step, closes_batch=not held_open)
            self._pre_loop.step_committed()
            if not held_open:
                self._pre_loop.batch_stood()

        def counted_closure() -> Any:
            nonlocal evaluations, unvoted
            evaluations += 1
            output = closure()
            unvoted = True  # voted by ``_after_closure``, or else before the update (a precision plugin's own step)
            return output

        def vote_before_the_update(*_: Any) -> None:
            if unvoted:
                vote()

        if held_open:  # kept before the step begins: ``LBFGS.step`` fills its state before its first closure
            self._applied_steps.before_update(torch_optimizer)
        with compat.after_the_closure(self.precision_plugin, vote):
            before_update = torch_optimizer.register_step_pre_hook(vote_before_the_update)
            try:
                output = super().optimizer_step(optimizer, counted_closure, model, **kwargs)
            finally:
                before_update.remove()
        if unvoted:  # the plugin ran the closure and did not update (a step it skips): voted on all the same
            vote()
        if not manual:
            self._reevaluations.seen(torch_optimizer, evaluations)
            if held_open:
                self._batch_stands(self.lightning_module.trainer.global_step + 1)
        return output

    def _before_the_vote(self, optimizer: torch.optim.Optimizer) -> None:
        """What a step does once its gradients are final, before its commit vote (nothing here)."""

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Manual optimization: the batch's optimizer steps are all inside ``training_step``; once it returns the
        batch stands (a death from here on is recovered from without a redo)."""
        try:
            output = super().training_step(*args, **kwargs)
        finally:
            self._undo_an_interrupted_redirection()
        if not self.lightning_module.automatic_optimization:
            self._batch_stands(self.lightning_module.trainer.global_step)
        return output

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().validation_step(*args, **kwargs)
        finally:
            self._undo_an_interrupted_redirection()

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().test_step(*args, **kwargs)
        finally:
            self._undo_an_interrupted_redirection()

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().predict_step(*args, **kwargs)
        finally:
            self._undo_an_interrupted_redirection()

    def _undo_an_interrupted_redirection(self) -> None:
        """A member's death in DDP's forward before it reached the LightningModule (the buffers' broadcast of a model
        with buffers: BatchNorm's statistics, a transformers model's ``position_ids``) leaves Lightning's forward
        redirection in place: the redone step's ``self(x)`` would call ``training_step(x)``."""
        module = self.lightning_module
        if module is not None:
            compat.undo_an_interrupted_forward_redirection(module)

    def _batch_stands(self, step: int) -> None:
        """A batch held open over several optimizer steps (manual optimization, an optimizer that evaluates the
        closure again) is over with ``step`` steps applied: a death from here on is recovered from without a redo."""
        self._applied_steps.batch_stands()
        self.engine.batch_trained(step)
        self._pre_loop.batch_stood()

    def recover_from(self, error: BaseException, rollback: Callable[[], None] | None) -> bool:
        """An error escaped a training batch (``rollback`` given) or its validation (None): if a member died, roll
        the batch back when its step was not committed (it is redone) and recover; anything else is re-raised.
        Returns whether the batch was discarded."""
        if self.engine.has_left or isinstance(error, (compat.LeaveFit, StopIteration)):
            raise error  # a leaver's way out, the end of the data: Lightning's own control flow
        self.engine.confirm_peer_failure(error)
        discarded = rollback is not None and self.engine.step_uncommitted
        if discarded:
            rollback()
            self._discard_interrupted_step()
        self.engine.recover(self.lightning_module.trainer.global_step)
        self._pre_loop.catch_up()
        return discarded

    def _recover_in_a_kept_collective(self, error: BaseException) -> None:
        """A collective before the training loop or between two batches raised: recover if a member died (see
        ``elastic/pre_loop.py``)."""
        self.engine.confirm_peer_failure(error)
        where = "before the training loop" if self._pre_loop.before_loop else "outside a training batch"
        log.warning("worker %s: a member died %s; its collective runs again without it", self.engine.worker_id, where)
        self.engine.recover(self.lightning_module.trainer.global_step)

    def _recover_evaluation(self, error: BaseException) -> None:
        """An error escaped a pass of ``trainer.validate/test/predict`` outside ``fit``: if a member died, the
        survivors form the next generation (the pass then runs again among them); anything else is re-raised."""
        if self.engine.has_left or self._alone() or isinstance(error, (compat.LeaveFit, StopIteration)):
            raise error
        self.engine.confirm_peer_failure(error)
        log.warning("worker %s: a member died during trainer.%s; the survivors run it again without it",
                    self.engine.worker_id, self.lightning_module.trainer.state.fn.value)
        self.engine.recover_evaluation(self.lightning_module.trainer.global_step)

    def _evaluation_pass_done(self) -> None:
        """Every member finished the pass of ``trainer.validate/test/predict``, or a member died in it (raises)."""
        if self.engine.is_member and not self._alone():
            self.engine.agree_evaluation_pass()

    def fit_started(self) -> None:
        """The fit's ``on_fit_start``: the model set up, a checkpoint it resumes from restored, the sanity check
        next (a sharded strategy seeds its mirrors here)."""

    def training_loop_started(self) -> None:
        """The fit loop's ``on_train_start``: from here a member's death redoes the interrupted batch."""
        self._refuse_several_train_loaders()
        self._pre_loop.loop_started()
        self.engine.training_loop_started()

    def _refuse_several_train_loaders(self) -> None:
        """One data position serves one training loader: several (a dict or list, which Lightning combines) would
        share it, and each epoch would end early with samples never trained."""
        loaders = compat.train_dataloaders(self.lightning_module.trainer)
        if len(loaders) > 1:
            raise NotImplementedError(
                f"ElanStrategy trains on one training DataLoader (exactly once per epoch is kept for one dataset); "
                f"got {len(loaders)}, which Lightning combines: combine their datasets into one Dataset, or train "
                f"them with strategy='ddp'")

    def _discard_interrupted_step(self) -> None:
        """Whatever phase the death cut short (forward, backward, all-reduce, vote), the redo starts clean: the elastic
        DDP forgets the iteration (gradients, the reducer's pending reduction), a mixed-precision scaler the step's
        stage, the LightningModule a ``toggle_optimizer`` the step did not undo. The optimizer and schedulers did not
        step: the vote comes before the update (manual optimization: the batch's steps applied before the death are
        undone)."""
        if self._ddp is not None:
            self._ddp.discard_iteration()
        self._applied_steps.undo()
        compat.undo_toggled_optimizer(self.lightning_module)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            torch_compat.forget_scaler_step(scaler)

    # ------------------------------------------------------------------ collectives: local while a joiner starts up

    def _alone(self) -> bool:
        """Collectives stay in this process: a joiner starting up, or a worker that left the job."""
        return self._collectives_local or self.engine.has_left

    def _collective(self, collective: Callable[[], Any], again_after_a_death: bool = False, kept: bool = True) -> Any:
        """A collective of the strategy: one before the training loop or between two training batches is recovered
        inside itself (``_pre_loop``), one of a validation run in the loop by running the validation again
        (``compat.redo_validation_cut_by_a_death``); one of ``trainer.validate/test/predict`` outside ``fit`` is not
        kept either: a death in its pass runs the whole pass again among the survivors
        (``compat.redo_evaluations_cut_by_a_death``), and one around the pass that can run again with the same inputs
        (``again_after_a_death``: Lightning's barriers before the setup hooks, its ``log_dir`` broadcast) runs again
        in the survivors' generation. ``kept=False``: in the loop, a death in it runs the hook that made it again
        (``Trainer.save_checkpoint``'s barrier: the file may not be written; a reduction of the epoch's aggregates)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or trainer.state.fn not in _EVALUATION_CALLS:
            if not self._pre_loop.before_loop and (not kept or (trainer is not None and trainer.validating)):
                return collective()
            return self._pre_loop.run(collective)
        if again_after_a_death and self._recovering_evaluation(trainer) and not compat.evaluation_pass_running(trainer):
            return self._again_after_a_death(collective)
        return collective()

    def _again_after_a_death(self, call: Callable[[], Any]) -> Any:
        """``call`` (one that can run again: a barrier, the evaluation's setup) in ``trainer.validate/test/predict``:
        when a member died in it, again in the survivors' generation."""
        while True:
            try:
                return call()
            except Exception as error:
                self._recover_evaluation(error)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._alone():
            barrier = super().barrier
            kept = not compat.ends_a_checkpoint_save(*args, **kwargs)
            self._member_collective(lambda: barrier(*args, **kwargs), again_after_a_death=True, kept=kept,
                                    published=False)

    def _result_alone(self, result: Any) -> Any:
        """A collective in this process alone; a joiner's in a start hook takes the members' result of theirs."""
        return result if self.engine.has_left else self._start_hooks.alone(result, self.root_device)

    def _member_collective(self, collective: Callable[[], Any], again_after_a_death: bool = False, kept: bool = True,
                           published: bool = True) -> Any:
        """A member's collective (see :meth:`_collective`); rank 0 publishes its result where it was made in a start
        hook (``published``: a barrier has none)."""
        with self._start_hooks.strategy_collective():
            result = self._collective(collective, again_after_a_death, kept)
        return self._start_hooks.completed(result, publisher=self.global_rank == 0) if published else result

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._alone():
            return self._result_alone(obj)
        broadcast = super().broadcast
        return self._member_collective(lambda: broadcast(obj, src), again_after_a_death=True)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduction works in place: a reduction run again (see :meth:`barrier`) starts from the input.
        Between two training batches a death in one runs its hook again instead (not kept): the epoch's ``sync_dist``
        aggregates are reduced from the values of the moment, which the heir of the dead member's part changes."""
        if self._alone():
            return self._result_alone(tensor)
        reduce, given = super().reduce, _copied(tensor)
        return self._member_collective(lambda: reduce(_copied(given), group, reduce_op), kept=False)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Lightning's stack of one tensor per process; tensors whose first dimension differs (an uneven share of a
        global batch, a joiner's fewer outputs of its first epoch) are padded to equal first (``elastic/gather.py``)."""
        if self._alone():
            return self._result_alone(tensor.unsqueeze(0))
        all_gather = super().all_gather
        return self._member_collective(lambda: all_gather(even_rows(tensor, group), group, sync_grads))

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """A file as Lightning loads it, or a sharded directory (``ModelParallelStrategy``'s, ``FSDPStrategy``'s,
        ``elan_fsdp``'s): its model state read whole, its optimizer states read once the optimizers exist."""
        metadata_name = compat.sharded_checkpoint_metadata_name()
        if not sharded_checkpoint.is_sharded_checkpoint(checkpoint_path, metadata_name):
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(checkpoint_path)
        checkpoint = torch.load(path / metadata_name, map_location="cpu", weights_only=weights_only)
        checkpoint["state_dict"] = sharded_checkpoint.load_model_state(path, self.lightning_module.state_dict())
        optimizers = sharded_checkpoint.optimizer_keys(path)
        if optimizers:
            checkpoint["optimizer_states"] = [sharded_checkpoint.ShardedOptimizerState(path, key) for key in optimizers]
        return checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Optimizer states as Lightning loads them, or read from a sharded checkpoint now that the optimizers exist."""
        if not self._load_sharded_optimizer_states(checkpoint):
            super().load_optimizer_state_dict(checkpoint)

    def _load_sharded_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Read each optimizer's state from the sharded checkpoint it stands for; False when it holds the states."""
        states = checkpoint["optimizer_states"]
        if not any(isinstance(state, sharded_checkpoint.ShardedOptimizerState) for state in states):
            return False
        if len(states) != len(self.optimizers):
            raise RuntimeError(f"the checkpoint holds the states of {len(states)} optimizers, but "
                               f"configure_optimizers returned {len(self.optimizers)}: resume with as many optimizers")
        for optimizer, state in zip(self.optimizers, states, strict=True):
            state.load_into(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))
        return True

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A worker that left the job saves nothing (its model stopped training when it left): one info line."""
        if self.engine.has_left:
            log.info("worker %s left the job: no checkpoint saved to %s", self.engine.worker_id, filepath)
            return
        super().save_checkpoint(checkpoint, filepath, storage_options)

    # ------------------------------------------------------------------ teardown

    @override
    def on_train_end(self) -> None:
        """The fit loop ran to its end, its ``on_train_end`` hooks included (the strategy's hook comes after the
        callbacks' and the LightningModule's, whose collectives are kept until here; not reached when it raised)."""
        self._training_loop_ended = True
        self._pre_loop.loop_ended()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        if getattr(self, "_training_loop_ended", False):
            self._training_loop_ended = False
            self.engine.training_ended(self.lightning_module.trainer.global_step)
        if self.engine.has_left or (self._training_fit and self.engine.is_member):
            self.engine.close()  # training is over: an evaluation or LR range test before it keeps the AM link
        self._training_fit = False
        super().teardown()
        self._sync_environment()
        if self.engine.environment.standalone:
            self.engine.shutdown()  # a later Trainer in this process starts a group of its own


class _ElanCoordinator(Callback):
    """Gives the strategy every epoch start and, after the last hook of every training batch, the batch's end
    (strategies get neither hook; callbacks' ``on_train_batch_end`` runs before the LightningModule's)."""

    def __init__(self, strategy: ElanStrategy) -> None:
        self._strategy = strategy

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compat.call_after_each_trained_batch(trainer, self._batch_over)
        compat.redo_interrupted_batches(trainer, self._strategy.recover_from)
        engine = self._strategy.engine
        engine.follow_logged_rows(compat.keep_logged_rows(trainer, engine.rows_closed))
        compat.redo_start_hooks_cut_by_a_death(trainer, self._strategy.recover_from)
        compat.redo_end_hooks_cut_by_a_death(trainer, self._strategy.recover_from)
        compat.redo_validation_cut_by_a_death(trainer, self._strategy.recover_from)
        self._strategy.fit_started()

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.on_epoch_start(trainer)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.training_loop_started()

    def _batch_over(self) -> None:
        self._strategy.on_batch_end(self._strategy.lightning_module.trainer)


def _install_coordinator(trainer: pl.Trainer, strategy: ElanStrategy) -> None:
    if not any(isinstance(callback, _ElanCoordinator) for callback in trainer.callbacks):
        trainer.callbacks.append(_ElanCoordinator(strategy))


_DEATH_NOTICE_S = 10.0
"""How long an evaluation's collective error waits for the AM's notice of a member's death before it is taken as
the process's own."""
_EVALUATION_CALLS = (TrainerFn.VALIDATING, TrainerFn.TESTING, TrainerFn.PREDICTING)
_EVALUATION_LIMITED = (RunningStage.SANITY_CHECKING, RunningStage.VALIDATING, RunningStage.TESTING)
_LIMIT_OF_STAGE = {TrainerFn.VALIDATING: "limit_val_batches", TrainerFn.TESTING: "limit_test_batches",
                   TrainerFn.PREDICTING: "limit_predict_batches"}


def _has_iterable_dataset(dataloader: DataLoader) -> bool:
    return isinstance(dataloader.dataset, torch.utils.data.IterableDataset)


def register_elan_strategy() -> None:
    """Make ``Trainer(strategy="elan")`` resolve (Lightning has no entry point for strategies)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "elan" not in StrategyRegistry:
        ElanStrategy.register_strategies(StrategyRegistry)


register_elan_strategy()
# "elan_fsdp" beside "elan": the FSDP module registers itself as it is imported (when this module was a script's first
# import, it imported Lightning itself, and Lightning's import could not register the two: lightning_elan/__init__)
importlib.import_module(f"{__package__}.fsdp")


def _copied(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (``_optimizer``), or itself."""
    return getattr(optimizer, "_optimizer", optimizer)
