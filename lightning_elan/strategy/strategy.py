"""ElanStrategy: DDP whose membership changes at batch boundaries while ``fit`` runs."""

from __future__ import annotations

import logging
import os
import random
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler
from typing_extensions import override

from lightning_elan import compat
from lightning_elan.data.loader import ElasticDataLoader
from lightning_elan.data.positions import LocalShare, global_batch_size_at, local_share
from lightning_elan.data.sampler import DataPosition
from lightning_elan.replication.exchange import OutgoingReplication, ReplicationContext, receive_replica, send_replica
from lightning_elan.replication.packing import join_tensors, split_tensors
from lightning_elan.replication.topology import detect as detect_topology
from lightning_elan.strategy.am_link import AMLink
from lightning_elan.strategy.environment import ElanEnvironment
from lightning_elan.strategy.groups import GenerationGroups
from lightning_elan.strategy.identity import WorkerIdentity
from lightning_elan.strategy.scaling_link import ScalingLink
from lightning_elan.strategy.timeline import StepTimeline

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry

log = logging.getLogger(__name__)

# what rank 0 broadcasts at a coordination point
_NO_CHANGE, _ADJUST, _DEFERRED = 0, 1, 2
# a joiner warming up is no one's rank 0 (loggers and checkpoints stay quiet) until its generation forms
_PROVISIONAL_RANK, _PROVISIONAL_WORLD = 1, 2
_LEFT_RANK = -1
_REPLICATION_MODES = ("auto", "collective")


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
        **kwargs: passed to :class:`~lightning.pytorch.strategies.DDPStrategy` (and from there to DDP).
    """

    strategy_name = "elan"

    def __init__(
        self,
        coordinate_every: int | None = None,
        global_batch_size: int | None = None,
        join_timeout_s: float = 1800.0,
        replication: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.identity = WorkerIdentity.from_env()
        environment = ElanEnvironment(rank=max(self.identity.rank, 0), world_size=max(self.identity.world_size, 1))
        kwargs.setdefault("timeout", timedelta(seconds=300))
        super().__init__(cluster_environment=environment, **kwargs)
        self.coordinate_every = coordinate_every or self.identity.coordinate_every
        if self.coordinate_every < 1:
            raise ValueError(f"coordinate_every must be >= 1, got {self.coordinate_every}")
        self.data_position = DataPosition(global_batch=global_batch_size)
        self.join_timeout_s = join_timeout_s
        self.replication = replication or os.environ.get("ELAN_REPLICATION", "auto")
        if self.replication not in _REPLICATION_MODES:
            raise ValueError(f"replication must be one of {_REPLICATION_MODES}, got {self.replication!r}")
        self._outgoing: OutgoingReplication | None = None
        self.has_left = False
        self._groups: GenerationGroups | None = None
        self._am: AMLink | None = None
        self._collectives_local = False
        self._joined = not self.identity.joiner
        self._current_share: LocalShare | None = None
        self._deferred = False
        self._timeline = StepTimeline()
        self._pending_report: dict[str, Any] | None = None
        self._retired_model: Any = None
        self._scaling = ScalingLink()

    # ------------------------------------------------------------------ registration and environment

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("elan", cls, description="Elastic DDP: grow, shrink and migrate while training")

    @override
    def _configure_launcher(self) -> None:
        self._launcher = None  # `elan run` (or the user) starts the processes

    @property
    @override
    def root_device(self) -> torch.device:
        device = super().root_device
        if device.type == "cuda" and self.identity.device_index is not None:
            return torch.device("cuda", self.identity.device_index)
        return device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @override
    def set_world_ranks(self) -> None:
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    @property
    def generation(self) -> int | None:
        return None if self._groups is None else self._groups.generation

    @override
    def setup_environment(self) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            compat.disable_distributed_sampler(trainer)
        super().setup_environment()

    @override
    def setup_distributed(self) -> None:
        if self._groups is not None and self._groups.active:
            return  # a second fit/validate in the same process keeps its generation
        reset_seed()
        self._process_group_backend = self._get_process_group_backend()
        self._groups = GenerationGroups.connect(
            self.identity, self._process_group_backend, self._timeout, self.root_device
        )
        if not self.identity.standalone:
            self._am = AMLink(self.identity)
        if self.identity.joiner and not self._joined:
            self._collectives_local = True
            self.cluster_environment.assign(_PROVISIONAL_RANK, _PROVISIONAL_WORLD)
        else:
            self._groups.form(self.identity.generation, self.identity.rank, self.identity.world_size)
            self.cluster_environment.assign(self.identity.rank, self.identity.world_size)
            if self._am is not None:
                self._am.register(str(self.root_device), self._topology())
        self.set_world_ranks()

    # ------------------------------------------------------------------ setup: joiners receive their state here

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self._install_coordinator(trainer)
            self.setup_optimizers(trainer)
            if not self._joined:
                self._join(trainer)
            self.configure_ddp()
        else:
            _sync_module_states(self.model)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:
        # generation 0 starts like DDP (rank 0's weights broadcast); every later generation was formed by a
        # replication, so all members already hold the same weights and DDP's construction has no collective
        self._ddp_kwargs["init_sync"] = self.generation == 0
        super().configure_ddp()

    def _install_coordinator(self, trainer: pl.Trainer) -> None:
        if not any(isinstance(callback, _ElanCoordinator) for callback in trainer.callbacks):
            trainer.callbacks.append(_ElanCoordinator(self))

    def _join(self, trainer: pl.Trainer) -> None:
        """A joiner, warmed up: report ready, wait for the adjustment, enter the generation, take the state."""
        assert self._am is not None
        self._am.register(str(self.root_device), self._topology())
        reply = self._am.wait_plan(self.join_timeout_s)
        if reply.get("status") != "plan":
            log.info("worker %s is not needed (%s); leaving", self.identity.worker_id, reply.get("reason"))
            self._mark_left()
            raise compat.LeaveFit
        plan = reply["plan"]
        phases = _PhaseClock()
        self._enter_generation(plan)
        phases.mark("group")
        checkpoint, elan_state, received = self._receive_training_state(plan)
        phases.mark("receive")
        self._apply_training_state(trainer, checkpoint, elan_state)
        phases.mark("restore")
        log.info("worker %s joined generation %d after %s", self.identity.worker_id, plan["generation"], phases)
        self._joined = True
        self._pending_report = {"role": "joiner", "generation": plan["generation"], "bytes_received": received}
        self._timeline.adjustment_started()

    def _topology(self) -> dict[str, Any] | None:
        """Where this worker lives, for the AM's replication planner (None: sources chosen without topology)."""
        if self.replication == "collective":
            return None
        try:
            return detect_topology(self.root_device).to_dict()
        except Exception as error:  # a probe we did not foresee: replicate over the collective rather than fail
            log.warning("topology detection failed (%s): this worker's transfers go over the collective", error)
            return None

    def _replication_context(self, plan: dict[str, Any]) -> ReplicationContext:
        assert self._groups is not None
        prefix = self._groups.replication_prefix(plan["generation"])
        return ReplicationContext(self._groups.store, prefix, self._process_group_backend, self._timeout,
                                  self.root_device)

    def _receive_training_state(self, plan: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], int]:
        me = self.identity.worker_id
        cpu_state, tensors, received, transport = receive_replica(
            self._replication_context(plan), plan, me, self._device_for
        )
        log.info("worker %s received %.1f MB of state from %s over %s", me, received / 1e6, plan["sources"][me],
                 transport)
        return join_tensors(cpu_state["checkpoint"], tensors), cpu_state["elan"], received

    def _apply_training_state(self, trainer: pl.Trainer, checkpoint: dict[str, Any], elan: dict[str, Any]) -> None:
        compat.call_on_load_checkpoint(trainer, checkpoint)
        self.lightning_module.load_state_dict(checkpoint["state_dict"], strict=self.lightning_module.strict_loading)
        self.data_position.load_state_dict(elan["data"])
        _set_rng_state(elan["rng"])
        compat.set_logger_versions(trainer, elan["logger_versions"])
        compat.align_checkpoint_dirs(trainer, checkpoint.get("callbacks", {}))
        compat.stage_training_state(trainer, checkpoint)
        # a configure_optimizers that read `estimated_stepping_batches` built the loader before the state arrived
        trainer.fit_loop._combined_loader = None

    def _device_for(self, device_type: str) -> torch.device:
        return torch.device("cpu") if device_type == "cpu" else self.root_device

    # ------------------------------------------------------------------ data: elastic training loader

    @override
    def process_dataloader(self, dataloader: object) -> object:
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return self._shard_for_evaluation(trainer, dataloader)
        if not isinstance(dataloader, DataLoader) or _has_iterable_dataset(dataloader):
            log.warning("%s is not a map-style DataLoader: it is not made elastic", type(dataloader).__name__)
            return dataloader
        if self.data_position.global_batch is None:
            self.data_position.global_batch = dataloader.batch_size * self.world_size
        seed = int(os.getenv("PL_GLOBAL_SEED", 0))
        return ElasticDataLoader(dataloader, self.data_position, self._world_view, seed)

    def _world_view(self) -> tuple[int, int]:
        return self.global_rank, self.world_size

    def _shard_for_evaluation(self, trainer: pl.Trainer, dataloader: object) -> object:
        user_wants_sampler = getattr(trainer._accelerator_connector, "_elan_user_distributed_sampler", True)
        if (
            not user_wants_sampler
            or self.world_size < 2
            or not isinstance(dataloader, DataLoader)
            or isinstance(dataloader.sampler, DistributedSampler)
            or _has_iterable_dataset(dataloader)
            or trainer.state.stage == RunningStage.PREDICTING
        ):
            return dataloader
        from lightning.pytorch.utilities.data import _update_dataloader

        sampler = DistributedSampler(dataloader.dataset, num_replicas=self.world_size, rank=self.global_rank,
                                     shuffle=False)
        return _update_dataloader(dataloader, sampler, mode=trainer.state.stage)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._collectives_local:
            # a joiner's start-up is over; its validation loaders were set up without the group: set them up again
            # at the next validation, together with the stayers who reset theirs at the adjustment
            self._collectives_local = False
            compat.reset_evaluation_dataloaders(self.lightning_module.trainer)
        self._current_share = self._take_global_batch()

    def _take_global_batch(self) -> LocalShare | None:
        """Advance the serial position by one global batch; return this rank's share of it."""
        loader = self._elastic_train_loader()
        if loader is None:
            return None
        end, data = loader.sampler.epoch_end(), self.data_position
        assert data.global_batch is not None
        size = global_batch_size_at(end, data.position, data.global_batch)
        share = local_share(data.position, size, self.world_size, self.global_rank)
        data.position = min(end, data.position + data.global_batch)
        return share

    def _elastic_train_loader(self) -> ElasticDataLoader | None:
        loaders = compat.train_dataloaders(self.lightning_module.trainer)
        return next((loader for loader in loaders if isinstance(loader, ElasticDataLoader)), None)

    @property
    def sample_weight(self) -> float:
        """Weight of this rank's current batch in the global mean (0 for a stand-in sample)."""
        return 1.0 if self._current_share is None else self._current_share.loss_weight

    @override
    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        weight = self.sample_weight
        if weight != 1.0:
            closure_loss = closure_loss * weight
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    # ------------------------------------------------------------------ coordination at batch boundaries

    def on_epoch_start(self, trainer: pl.Trainer) -> None:
        """Called by the coordinator callback when an epoch starts: an epoch after a change of the global batch has
        a different length than the epoch Lightning measured at setup."""
        if self._elastic_train_loader() is not None:
            compat.refresh_epoch_length(trainer)

    def on_batch_end(self, trainer: pl.Trainer) -> None:
        """Called by the coordinator callback after every training batch."""
        self._finish_outgoing()
        pause = self._timeline.step_ended()
        if pause is not None and self._pending_report is not None:
            self._send_report(pause)
        if self._am is None or not (self._deferred or trainer.global_step % self.coordinate_every == 0):
            return
        code, plan = self._agree_on_decision(trainer)
        self._deferred = code == _DEFERRED
        if code == _ADJUST:
            self._adjust(trainer, plan)

    def _agree_on_decision(self, trainer: pl.Trainer) -> tuple[int, dict[str, Any] | None]:
        code, payload = _NO_CHANGE, None
        if self.global_rank == 0:
            code, payload = self._ask_master(trainer)
        flag = torch.tensor([code], dtype=torch.int32, device=self.root_device)
        dist.broadcast(flag, src=0)
        code = int(flag.item())
        if code != _ADJUST:
            return code, None
        box = [payload]
        dist.broadcast_object_list(box, src=0, device=self.root_device if self.root_device.type != "cpu" else None)
        return code, box[0]

    def _ask_master(self, trainer: pl.Trainer) -> tuple[int, dict[str, Any] | None]:
        assert self._am is not None
        blocker = compat.adjustment_blocker(trainer)
        if blocker is not None:
            log.debug("no adjustment after step %d: %s", trainer.global_step, blocker)
            return _DEFERRED, None
        body = {
            "generation": self.generation,
            "step": trainer.global_step,
            "epoch": self.data_position.epoch,
            "position": self.data_position.position,
            "global_batch": self.data_position.global_batch,
        }
        summary = self._scaling.summary_if_due(trainer)
        if summary is not None:
            body["scaling"] = summary
        reply = self._am.coordinate(body)
        if reply.get("decision") != "adjust":
            return _NO_CHANGE, None
        plan = reply["plan"]
        scaling = self._scaling.decide(trainer, plan, self.data_position.global_batch)
        return _ADJUST, {"plan": plan, "logger_versions": compat.logger_versions(trainer), "scaling": scaling}

    def _adjust(self, trainer: pl.Trainer, decision: dict[str, Any]) -> None:
        """Old members at a decided adjustment: stayers re-form and rewire, sources send state, leavers leave."""
        plan, me = decision["plan"], self.identity.worker_id
        started = time.perf_counter()
        self._timeline.adjustment_started()
        compat.set_logger_versions(trainer, decision["logger_versions"])
        # before the snapshot: joiners receive the new data position and the started LR ramp
        self._scaling.apply(trainer, self.data_position, decision.get("scaling"))
        joiners = _joiners_of(plan, me)
        phases = _PhaseClock()
        snapshot = self._snapshot(trainer) if joiners else None
        phases.mark("snapshot")
        old_model = self.model
        assert self._groups is not None
        self._groups.leave()
        staying = me in plan["members"]
        if staying:
            self._enter_generation(plan)
        phases.mark("group")
        sent = self._send_training_state(plan, snapshot, joiners) if snapshot is not None else 0
        phases.mark("send")
        _remove_ddp_hooks(old_model)
        self._retire(old_model)
        self.model = self.lightning_module
        if not staying:
            self._leave(plan, sent, time.perf_counter() - started)
        self._rewire(trainer)
        phases.mark("rewire")
        log.info("worker %s in generation %d after %s", me, plan["generation"], phases)
        self._pending_report = {
            "role": "stayer", "generation": plan["generation"], "bytes_sent": sent,
            "adjust_s": time.perf_counter() - started,
        }

    def _snapshot(self, trainer: pl.Trainer) -> tuple[dict[str, Any], list[Tensor]]:
        skeleton, tensors = split_tensors(compat.dump_training_state(trainer))
        elan = {
            "data": self.data_position.state_dict(),
            "rng": _get_rng_state(),
            "logger_versions": compat.logger_versions(trainer),
        }
        return {"checkpoint": skeleton, "elan": elan}, tensors

    def _send_training_state(self, plan: dict[str, Any], snapshot: tuple, joiners: list[str]) -> int:
        cpu_state, tensors = snapshot
        outgoing = send_replica(self._replication_context(plan), plan, self.identity.worker_id, cpu_state, tensors)
        routes = "; ".join(f"{transport}: {', '.join(names)}" for transport, names in outgoing.joiners.items())
        log.info("worker %s sent %.1f MB of state (%s)", self.identity.worker_id, outgoing.bytes_sent / 1e6, routes)
        self._outgoing = outgoing
        return outgoing.bytes_sent

    def _finish_outgoing(self) -> None:
        """Same-host joiners copy while this source trains on; before its next adjustment (or exit) they are done."""
        if self._outgoing is not None:
            outgoing, self._outgoing = self._outgoing, None
            outgoing.finish(self._timeout)

    def _retire(self, old_model: Any) -> None:
        """Keep the previous generation's DDP wrapper alive until the next adjustment.

        Freeing it right after its process group was destroyed can deadlock: its reducer's destructor waits for gloo's
        worker thread, which needs the GIL the freeing thread holds. One generation later no work of it is pending.
        """
        self._retired_model = old_model

    def _enter_generation(self, plan: dict[str, Any]) -> None:
        assert self._groups is not None
        rank, world_size = plan["members"].index(self.identity.worker_id), len(plan["members"])
        self._groups.form(plan["generation"], rank, world_size)
        was_rank_zero = self.global_rank == 0
        self.cluster_environment.assign(rank, world_size)
        self.set_world_ranks()
        if rank == 0 and not was_rank_zero:
            compat.adopt_loggers(self.lightning_module.trainer)

    def _rewire(self, trainer: pl.Trainer) -> None:
        """Stayers after a resize: DDP on the new group, data from the same serial position, eval shards rebuilt."""
        self.configure_ddp()
        loader = self._elastic_train_loader()
        if loader is not None:
            loader.rebuild()
        compat.refetch_prefetched_batch(trainer)
        if loader is not None:
            compat.refresh_epoch_length(trainer)  # the global batch may have changed: the epoch has a new length
        compat.reset_evaluation_dataloaders(trainer)
        compat.move_progress_bar(trainer)

    def _leave(self, plan: dict[str, Any], sent: int, elapsed: float) -> None:
        assert self._am is not None
        self._finish_outgoing()
        log.info("worker %s leaves the job at generation %d", self.identity.worker_id, plan["generation"])
        self._am.report(
            {"role": "leaver", "generation": plan["generation"], "bytes_sent": sent, "pause_s": elapsed}, wait=True
        )
        self.has_left = True
        raise compat.LeaveFit

    def _mark_left(self) -> None:
        self.has_left = True

    def _send_report(self, pause: float) -> None:
        assert self._am is not None and self._pending_report is not None
        report = {**self._pending_report, "pause_s": pause}
        report.update(self._scaling.report_fields(self.lightning_module.trainer, self.data_position))
        if report["role"] == "joiner":
            report["startup_s"] = time.time() - self.identity.spawn_time
        self._am.report(report)
        self._pending_report = None

    # ------------------------------------------------------------------ collectives: local while a joiner starts up

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._collectives_local:
            super().barrier(*args, **kwargs)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj if self._collectives_local else super().broadcast(obj, src)

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        return tensor if self._collectives_local else super().reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        if self._collectives_local:
            return tensor.unsqueeze(0)
        return super().all_gather(tensor, group, sync_grads)

    # ------------------------------------------------------------------ teardown

    @override
    def teardown(self) -> None:
        self._finish_outgoing()
        super().teardown()
        if self.has_left:
            self.cluster_environment.assign(_LEFT_RANK, 0)
            self.set_world_ranks()
        if self._am is not None:
            self._am.close()
            self._am = None
        if self.identity.standalone and self._groups is not None:
            self._groups.leave()


class _ElanCoordinator(Callback):
    """Gives the strategy the end of every training batch (strategies get no ``on_train_batch_end``)."""

    def __init__(self, strategy: ElanStrategy) -> None:
        self._strategy = strategy

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._strategy.on_epoch_start(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._strategy.on_batch_end(trainer)


class _PhaseClock:
    """Milliseconds spent in each named phase, for the adjustment log line."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self._phases: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._phases.append((phase, (now - self._last) * 1e3))
        self._last = now

    def __str__(self) -> str:
        return ", ".join(f"{phase} {ms:.1f} ms" for phase, ms in self._phases)


def _joiners_of(plan: dict[str, Any], source: str) -> list[str]:
    return [joiner for joiner in plan["joiners"] if plan["sources"][joiner] == source]


def _remove_ddp_hooks(model: Any) -> None:
    if isinstance(model, DistributedDataParallel):
        model._remove_autograd_hooks()


def _has_iterable_dataset(dataloader: DataLoader) -> bool:
    return isinstance(dataloader.dataset, torch.utils.data.IterableDataset)


def _get_rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def register_elan_strategy() -> None:
    """Make ``Trainer(strategy="elan")`` resolve (Lightning has no entry point for strategies)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "elan" not in StrategyRegistry:
        ElanStrategy.register_strategies(StrategyRegistry)


register_elan_strategy()
