"""FSDP2 under the elastic accelerator (issue 24 item 4):
``ElasticAccelerator(fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))``.

Accelerate's own FSDP2 preparation runs (``fsdp2_prepare_model``: its auto-wrap policy's units, the embedding and tail
units, the root, mixed precision), but every ``fully_shard`` it makes is recorded and given the current generation's
mesh (``DeviceMesh`` over the engine's generation group) instead of torch's default one; a joiner, which has no mesh
before it is admitted, only records them. The recorded calls are the model's wrapping: a resize takes FSDP2 off the
model and applies the same calls again on the new generation's mesh, while every parameter's and optimizer state's
rows move from their old holders to their new ones (``replication.fsdp_reshard``, as ``elan_fsdp`` does), so a joiner
receives only its shard. Each member's shard is mirrored by the next one (``elastic.fsdp_mirroring``): a SIGKILLed
member's rows come from its mirror and the interrupted step is redone.

A member's death inside the model's forward during an evaluation pass (FSDP2's all-gather: no training step to discard
and redo) is recovered from inside the user's call: the model's class gets a ``__call__`` that, when a call fails so,
lets the accelerator recover (the dead member's shard from its mirror, the pass re-cut) and calls the forward again
among the survivors (:func:`retry_calls`).

What Accelerate refuses or does differently on a CPU is in ``accelerate/compat.py`` (``AcceleratorState`` drops the
plugin there; the members' state says ``FSDP`` so ``is_fsdp2``, ``save_state`` and ``load_state`` take the FSDP2 paths).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_elan.accelerate import compat
from lightning_elan.elastic.device_mesh import GenerationMesh, Subgroup, generation_mesh
from lightning_elan.elastic.fsdp_mirroring import LostShard, StepMirroring, unmirrored_because
from lightning_elan.replication import shard_layout
from lightning_elan.replication.fsdp_reshard import describe_optimizers, register_sharded_parameters

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch.distributed.device_mesh import DeviceMesh

    from lightning_elan.elastic.live_reshard import ReshardGroup

log = logging.getLogger(__name__)

__all__ = ["FSDP2Sharding", "LostShard", "refuse_unsupported_fsdp", "retry_calls"]

CallRetry = Callable[[Callable[[], Any]], Any]
"""Runs a model call (a thunk), recovering from a member's death in it and running it again, or re-raising."""

DEFAULT_RESHARD_CHUNK_BYTES = 64 << 20
"""The largest message of the live reshard at a resize (the fixed buffer beside a member's new shard)."""

_REFUSED_OPTIONS = {
    "cpu_ram_efficient_loading": "rank 0 would broadcast the weights at prepare(), which a joiner does not run with "
                                 "the members",
    "cpu_offload": "the live reshard and the shard mirror are not built for FSDP2's offloaded shards (a GPU job's "
                   "parameters kept in pinned CPU memory)",
}


def refuse_unsupported_fsdp(plugin: Any) -> None:
    """FSDP1 and the FSDP2 options the elastic job cannot keep across a resize are refused, saying why."""
    if getattr(plugin, "fsdp_version", 1) != 2:
        raise NotImplementedError(
            "ElasticAccelerator shards with FSDP2 only: pass FullyShardedDataParallelPlugin(fsdp_version=2, ...) "
            "(FSDP1's flat parameters cannot be resharded live; fsdp_version=1 is not elastic)")
    for option, why in _REFUSED_OPTIONS.items():
        value = getattr(plugin, option, None)
        if value and not _is_default_offload(value):
            raise NotImplementedError(f"ElasticAccelerator with FSDP2: {option} is not supported ({why})")


def _is_default_offload(value: Any) -> bool:
    """FSDP2's ``OffloadPolicy()`` (no offload) is what the plugin holds when ``cpu_offload`` is off."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return isinstance(value, OffloadPolicy) and not isinstance(value, CPUOffloadPolicy)


@dataclass
class _Wrapping:
    """The ``fully_shard`` calls Accelerate made, in order (units first, the root last), without their mesh."""

    calls: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)

    def record(self, modules: Any, options: dict[str, Any]) -> None:
        self.calls.append((modules, {key: value for key, value in options.items() if key != "mesh"}))

    def apply(self, mesh: DeviceMesh) -> None:
        from torch.distributed.fsdp import fully_shard

        for modules, options in self.calls:
            fully_shard(modules, mesh=mesh, **options)


class FSDP2Sharding:
    """One process's FSDP2 state across the generations of an elastic Accelerate job: the wrapping, the mesh, the
    live reshard and the shard mirror."""

    def __init__(self, plugin: Any, worker_id: str, chunk_bytes: int = DEFAULT_RESHARD_CHUNK_BYTES,
                 hsdp_group_size: int | None = None) -> None:
        refuse_unsupported_fsdp(plugin)
        self.plugin = plugin
        self.chunk_bytes = chunk_bytes
        self.hsdp_group_size = hsdp_group_size
        self._wrapping = _Wrapping()
        self._mesh: DeviceMesh | None = None
        self._generation_mesh: GenerationMesh | None = None
        self._mirroring = StepMirroring(worker_id)
        self._joined_optimizers: list[dict[str, Any]] | None = None  # a joiner: its source's optimizer skeleton

    # ------------------------------------------------------------------ the mesh and the wrapping

    @property
    def mesh(self) -> DeviceMesh | None:
        """The current generation's mesh: 1-D, or ``(replicate, shard)`` under HSDP (None outside the job)."""
        return self._mesh

    def shard_count(self, world: int) -> int:
        """How many shards a generation of ``world`` members has (``replication.shard_layout.shard_count``)."""
        return shard_layout.shard_count(world, self.hsdp_group_size)

    def build_mesh(self, group: Any, device: torch.device, generation: int | None, subgroup: Subgroup) -> None:
        """A mesh over the generation's group (the elastic view: fixed size, abortable collectives; a
        ``TolerantGenerationGroup``, so a member's death in the model's forward or backward, inside the user's calls,
        is kept for :meth:`take_failure` instead of raised there); under HSDP over its shard and replica subgroups
        (``subgroup`` makes them, tolerant alike)."""
        self.forget_mesh()
        shards = self.shard_count(group.size())
        self._mirroring.replicated = shards < group.size()
        self._generation_mesh = generation_mesh(group, shards, subgroup, device.type,
                                                f"elan_accelerate_fsdp_gen{generation}")
        self._mesh = self._generation_mesh.mesh

    def take_failure(self) -> BaseException | None:
        """A collective of the model that failed, tolerated, since the last call (None: none), on any group of the
        mesh (each one's failure is taken)."""
        groups = [] if self._generation_mesh is None else self._generation_mesh.groups
        failures = [group.take_failure() for group in groups]
        return next((failure for failure in failures if failure is not None), None)

    def forget_mesh(self) -> None:
        if self._generation_mesh is not None:
            self._generation_mesh.forget()
        self._mesh = self._generation_mesh = None

    @contextmanager
    def preparing(self) -> Iterator[None]:
        """Around Accelerate's ``prepare`` of the model: its ``fully_shard`` calls recorded, and applied on this
        generation's mesh on a member; a joiner (outside the job, no mesh yet) only records them, its state saying
        ``FSDP`` meanwhile so that ``prepare`` takes Accelerate's FSDP2 path (it shards at its live reshard)."""
        wrapping, mesh = self._wrapping, self._mesh

        def recording(original: Callable[..., Any]) -> Callable[..., Any]:
            def fully_shard(modules: Any, **options: Any) -> Any:
                wrapping.record(modules, options)
                return modules if mesh is None else original(modules, **{**options, "mesh": mesh})
            return fully_shard

        with compat.fully_shard_replaced(recording):
            if mesh is None:
                with compat.preparing_as_fsdp2():
                    yield
            else:
                yield

    def shard(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """Apply the recorded wrapping on ``mesh`` (``replication.fsdp_reshard.ShardModules``)."""
        self._wrapping.apply(mesh)

    # ------------------------------------------------------------------ a joiner's state

    @staticmethod
    def unsharded_state(model: nn.Module) -> dict[str, Any]:
        """What a source sends a joiner of the model: the buffers (FSDP2 keeps them whole), no parameter."""
        return {name: value for name, value in model.state_dict().items() if not isinstance(value, DTensor)}

    def describe(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
        """The optimizers' skeleton a joiner receives (hyperparameters, the states that are not sharded; the old
        layout's while an abandoned reshard left the shards there)."""
        return self._mirroring.describe(model, optimizers)

    def joined(self, skeleton: list[dict[str, Any]]) -> None:
        self._joined_optimizers = skeleton

    # ------------------------------------------------------------------ a resize

    @staticmethod
    def discard_step(model: nn.Module) -> None:
        """A step cut by a member's death: every FSDP2 unit's sharded parameters registered again (a forward whose
        backward never ran leaves the root's gathered parameters on the module: FSDP2 reshards the root only after
        the backward), so the reshard finds the parameters the optimizers hold."""
        register_sharded_parameters(model)

    def reshard_live(self, reshard: ReshardGroup, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                     group: Any) -> None:
        """Move this member's shards to their new holders (after a death: a dead member's from its mirror); a
        receiver ends sharded over the new generation's mesh with its mirror seeded, a leaver holds nothing."""
        holding = reshard.rank in reshard.holders
        if holding:  # an evaluation's forward (no backward follows) left the root's gathered parameters registered
            register_sharded_parameters(model)
        skeleton = describe_optimizers(model, optimizers) if holding else self._joined_optimizers
        assert skeleton is not None, "a joiner reshards with its source's optimizer skeleton"
        self._mirroring.move(reshard, model, optimizers, self.shard, self._mesh, skeleton, self.chunk_bytes, group,
                             self.unmirrored(optimizers))
        self._joined_optimizers = None

    # ------------------------------------------------------------------ the mirror around a step

    def unmirrored(self, optimizers: Sequence[torch.optim.Optimizer]) -> str | None:
        """Why the steps cannot be mirrored (None: they can)."""
        if len(optimizers) > 1:
            return "more than one optimizer: a batch's later optimizer steps follow its commit vote"
        return unmirrored_because(optimizers, automatic=True)

    def before_vote(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], optimizer: Any,
                    group: Any) -> None:
        """After the backward (and any gradient clipping), before the commit vote: the gradients to the mirror."""
        index = list(optimizers).index(optimizer) if optimizer in optimizers else 0
        self._mirroring.before_vote(model, optimizers, index, group, self.unmirrored(optimizers))

    def seed_mirror(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], group: Any) -> None:
        """As the launch generation's training loop starts: every member's shard copied into its mirror holder, so a
        death in the first step is covered too (a later generation's mirrors are seeded by its reshard: no-op)."""
        self._mirroring.seed(model, optimizers, group, self.unmirrored(optimizers))

    @property
    def mirrored(self) -> bool:
        """Whether a member's death now loses no shard: its mirror is seeded in the current generation, or (HSDP)
        every shard has replicas."""
        return self._mirroring.covers_a_death

    def hyperparameters_changed(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The LR ramp scaled the step's learning rate after the commit vote: the mirror replays it with that."""
        self._mirroring.hyperparameters_changed(optimizers)

    def after_step(self) -> None:
        """The committed step was applied here: apply it to the mirror too."""
        self._mirroring.after_step()

    def check_recoverable(self, world_size: int, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Before a recovery: :class:`LostShard` when no mirror can restore a dead member's shard."""
        self._mirroring.check_recoverable(world_size, self.unmirrored(optimizers))

    def settle(self) -> None:
        """Wait for the mirror's replay of the last step."""
        self._mirroring.settle()


def retry_calls(model: nn.Module, retry: CallRetry) -> None:
    """Every later call of ``model`` goes through ``retry``. Its class becomes a subclass of the same name whose
    ``__call__`` does so, put *under* FSDP2's ``FSDP<Class>`` (applied after this, and taken off and applied again at
    each resize by ``torch_compat.undo_fully_shard``, which keeps the class below it): an instance attribute cannot
    replace ``__call__``, and FSDP2's hooks (the all-gathers) run inside ``nn.Module.__call__``."""
    cls = type(model)
    if getattr(cls, "_elan_retries_calls", False):
        model.__dict__["_elan_call_retry"] = retry
        return

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = super(retrying, self).__call__
        retry_of = self.__dict__.get("_elan_call_retry")
        return call(*args, **kwargs) if retry_of is None else retry_of(lambda: call(*args, **kwargs))

    retrying = type(cls.__name__, (cls,), {"__call__": __call__, "_elan_retries_calls": True,
                                           "__module__": cls.__module__, "__qualname__": cls.__qualname__})
    model.__class__ = retrying
    model.__dict__["_elan_call_retry"] = retry
