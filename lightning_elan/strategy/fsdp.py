"""ElanFSDPStrategy: the elastic strategy with the model sharded by FSDP2 over the current generation (issue 24).

Everything but the model wrapper is :class:`~lightning_elan.strategy.strategy.ElanStrategy`'s (the engine, the
elastic data loader, strong scaling's loss weights, the step vote). Instead of the elastic DDP, ``fully_shard`` is
applied to the units named by ``shard_modules`` and then to the LightningModule, over a 1-D ``DeviceMesh`` of the
generation's group; Lightning builds the optimizers after the wrap (as for its ``ModelParallelStrategy``), so they
hold the sharded parameters. FSDP2 averages the gradients over the mesh as DDP does, so the loss weights stay right.
A checkpoint is, by default (``state_dict_type="full"``, Lightning's ``FSDPStrategy`` default), a full state dict
gathered by every member and written by rank 0; with ``state_dict_type="sharded"`` a directory of DCP shards written by
every member (``ModelParallelStrategy``'s layout, :mod:`lightning_elan.sharded_checkpoint`). Either loads at any world
size, in ``"elan"``/``"elan_fsdp"`` jobs and in Lightning's ``ModelParallelStrategy``; both strategies load a directory
Lightning's sharded strategies wrote.

A resize reshards live (:class:`~lightning_elan.elastic.live_reshard.LiveResharding`): the old members (stayers and
leavers) and the joiners move the rows of every parameter and optimizer state from their old holders to their new
ones (``replication.fsdp_reshard.reshard_fsdp``), so a joiner receives only its shard; the rest of its state (loops,
data position, RNG, callbacks, schedulers) comes from its source as an ``"elan"`` joiner's does, without the model and
optimizer tensors.

A member's death loses no step (``elastic.fsdp_mirroring``): each member's shard is mirrored in the next one's
host memory, kept at the state after the last committed step (the reduced gradients go to the mirror before the step's
commit vote, and the mirror holder applies the committed update itself); the survivors form a new generation, the dead
member's rows come from its mirror holder and move with everyone's to the new layout (and to a ``--replace-failed``
joiner), and the interrupted step is redone as under ``"elan"``. A shard that died with its mirror, or a death no mirror
covers, stops the job with :class:`LostShard`, naming what was lost.

HSDP (``hsdp_group_size=k``): a generation whose size is a multiple of ``k`` with two or more replica groups shards
within groups of ``k`` consecutive ranks and replicates across them (a 2-D mesh over abortable subgroups of the
generation); its shards need no mirror, a dead member's is taken from a living replica. Any other size is FSDP over all
members. The live reshard moves between the layouts (``shard_count``; docs/architecture.md, *HSDP layouts*).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_elan import compat, sharded_checkpoint, torch_compat
from lightning_elan.elastic.device_mesh import GenerationMesh, generation_mesh
from lightning_elan.elastic.fsdp_mirroring import LostShard, StepMirroring, unmirrored_because
from lightning_elan.elastic.live_reshard import ReshardGroup
from lightning_elan.fsdp_options import read_fsdp_strategy_options
from lightning_elan.replication import shard_layout
from lightning_elan.replication.fsdp_reshard import (
    describe_optimizers,
    is_fully_sharded,
    register_sharded_parameters,
    take_fsdp_off,
)
from lightning_elan.replication.reception import tensor_nbytes
from lightning_elan.strategy.strategy import ElanStrategy

if TYPE_CHECKING:
    from collections.abc import Callable

    import lightning.pytorch as pl
    from lightning.fabric.strategies import _StrategyRegistry
    from torch.distributed.device_mesh import DeviceMesh

log = logging.getLogger(__name__)

__all__ = ["ElanFSDPStrategy", "LostShard", "register_elan_fsdp_strategy"]

LIVE_RESHARD_KEY = "elan_fsdp_live_reshard"
"""In a joiner's checkpoint: its model and optimizer states come by the live reshard, not in the checkpoint."""
ShardUnits = list[tuple[list[str], dict[str, Any]]]
"""The job's ``fully_shard`` units, children first: each unit's module names (several for ``fully_shard([a, b])``)
and the options it was made with — the user's own from ``configure_model`` and the strategy's."""


_STRATEGIES_MADE = itertools.count()
"""Numbers the strategies of this process: a script that trains in stages makes one per ``Trainer``, each in the same
generation (a mesh name is registered with torch for the process's life: "A process group is already registered")."""


class ElanFSDPStrategy(ElanStrategy):
    """Elastic FSDP2: every parameter and optimizer state sharded over the current workers.

    Args:
        shard_modules: module classes whose instances each become a ``fully_shard`` unit (then the whole model is one);
            default: the whole model is one unit.
        reshard_after_forward: FSDP2's option of the same name (free the gathered parameters after the forward).
        mp_policy: an FSDP2 ``MixedPrecisionPolicy``, passed to every ``fully_shard``.
        hsdp_group_size: HSDP: shard within groups of this many consecutive ranks, replicate across the groups (a
            2-D mesh ``(replicate, shard)``); a member's death is then covered by its shard's replicas, no mirror.
            A world that is not a multiple of it, or no larger, is sharded over all its members (FSDP, mirrored);
            the live reshard moves between the two layouts.
        reshard_chunk_mb: the largest message of the live reshard at a resize, in MB (the fixed buffer beside a
            member's new shard: its memory grows by at most its new shard, one chunk and one parameter's shard).
        state_dict_type: Lightning ``FSDPStrategy``'s knob: ``"full"`` (default) gathers the whole state and rank 0
            writes one file; ``"sharded"`` has every member write its shards into a directory (no gather; DCP
            reshards it on load).
        **kwargs: passed to :class:`~lightning_elan.strategy.strategy.ElanStrategy`; and Lightning ``FSDPStrategy``'s
            ``auto_wrap_policy`` (a set of module classes, as ``shard_modules``), ``activation_checkpointing_policy``
            (a set of module classes: each instance wrapped by ``checkpoint_wrapper`` before it is sharded) and
            ``sharding_strategy`` (``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``: ``reshard_after_forward=False``), so that
            ``FSDPStrategy(...)`` becomes ``ElanFSDPStrategy(...)`` with the same arguments
            (:mod:`lightning_elan.fsdp_options`); any other option is refused, saying what to pass instead.
    """

    strategy_name = "elan_fsdp"

    def __init__(self, shard_modules: Iterable[type[nn.Module]] | None = None, reshard_after_forward: bool = True,
                 mp_policy: Any | None = None, hsdp_group_size: int | None = None, reshard_chunk_mb: float = 64,
                 state_dict_type: Literal["full", "sharded"] = "full", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        lightning_options = read_fsdp_strategy_options(self._ddp_kwargs)  # nothing is left for DDP
        if shard_modules is not None and lightning_options.shard_modules:
            raise ValueError("ElanFSDPStrategy: pass shard_modules or auto_wrap_policy, not both")
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}")
        self.state_dict_type = state_dict_type
        self.shard_modules = frozenset(shard_modules or ()) | lightning_options.shard_modules
        self.checkpointed_modules = lightning_options.checkpointed_modules
        self.reshard_after_forward = reshard_after_forward
        if lightning_options.reshard_after_forward is not None:
            self.reshard_after_forward = lightning_options.reshard_after_forward
        self.mp_policy = mp_policy
        if hsdp_group_size is not None and (type(hsdp_group_size) is not int or hsdp_group_size < 1):
            raise ValueError(f"hsdp_group_size must be a positive integer (or None for FSDP), got {hsdp_group_size!r}")
        self.hsdp_group_size = hsdp_group_size
        if reshard_chunk_mb <= 0:
            raise ValueError(f"reshard_chunk_mb must be positive, got {reshard_chunk_mb}")
        self.reshard_chunk_bytes = max(1, int(reshard_chunk_mb * (1 << 20)))
        self._device_mesh: DeviceMesh | None = None
        self._generation_mesh: GenerationMesh | None = None
        self._snapshotting = False  # a source dumps a joiner's state: no model or optimizer tensors in it
        self._joined_optimizers: list[dict[str, Any]] | None = None  # a joiner: its source's optimizer skeleton
        self._units: ShardUnits | None = None  # made again on each new mesh (a joiner: its source's)
        self._number = next(_STRATEGIES_MADE)  # in its meshes' names: a later Trainer's strategy registers its own

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register("elan_fsdp", cls, description="Elastic FSDP2: the model sharded over the workers")

    @property
    def device_mesh(self) -> DeviceMesh:
        """The current generation's mesh (what ``LightningModule.device_mesh`` reads in ``configure_model``): 1-D, or
        ``(replicate, shard)`` under HSDP."""
        if self._device_mesh is None:
            raise RuntimeError("the device mesh of strategy='elan_fsdp' exists once the worker is in the job")
        return self._device_mesh

    # ------------------------------------------------------------------ environment and mesh

    @override
    def setup_environment(self) -> None:
        """Connect to the job, then build the generation's mesh."""
        super().setup_environment()
        if self.engine.is_member:
            self._build_mesh()  # a joiner's comes with its generation (membership_changed)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """A joiner sets up unsharded (no mesh yet; its optimizers over its own parameters), then joins: the live
        reshard shards its module and rebinds its optimizers (Lightning restores loops and schedulers after this). A
        member's ``validate``/``test``/``predict`` after its fit, or of units its ``configure_model`` made (a job that
        only evaluates), keeps the shards as they are: DDP's evaluation setup would broadcast rank 0's module state,
        which over DTensor parameters fails ("Sharding propagation failed for aten.view.default", "Cannot flatten
        unevenly sharded tensor")."""
        if trainer.state.fn != TrainerFn.FITTING and self.engine.is_member and is_fully_sharded(self.lightning_module):
            self._setup_alone(trainer)  # the device and precision set up, no state sync: the shards are the job's
            return
        if self.checkpointed_modules and trainer.state.fn == TrainerFn.FITTING:
            torch_compat.checkpoint_activations(self.lightning_module, self.checkpointed_modules)  # joiners alike
        super().setup(trainer)
        if self._training_fit and not self.engine.is_member and not self.engine.has_left:
            _materialize_meta_buffers(self.lightning_module, self.root_device)
            self._join()

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """A joiner's ``configure_model`` builds on the meta device (its shards arrive in the live reshard), with a
        stand-in ``self.device_mesh`` of the job's launch size (the members' in theirs): the units it makes there are
        made again on the job's mesh."""
        if self._joiner_fitting():
            with self._stand_in_mesh(), torch.device("meta"):  # the mesh built on the CPU
                yield
        else:
            with super().model_sharded_context():
                yield

    @contextmanager
    def _stand_in_mesh(self) -> Generator[None, None, None]:
        module, name = self.lightning_module, f"elan_fsdp_joiner_{self.engine.worker_id}"
        size = self.engine.launch_world_size or 1  # the members ran configure_model over the launch world
        module._device_mesh = torch_compat.stand_in_mesh(self.root_device.type, name, size)
        try:
            yield
        finally:
            torch_compat.forget_tensor_parallel_mesh(module._device_mesh)
            module._device_mesh = None
            torch_compat.forget_mesh_group(name)

    @override
    def model_to_device(self) -> None:
        """A module built on the meta device in ``configure_model`` (as for Lightning's ``ModelParallelStrategy``): a
        joiner's stays there until the live reshard assigns its shards; a member's training module is materialised once
        sharded (:meth:`_setup_model`: each member allocates and initialises its shards only), any other now."""
        if _has_meta_tensors(self.lightning_module):
            if self._joiner_fitting() or self._shards_before_materialising():
                return
            compat.materialize_meta_module(self.model, self.root_device)
        super().model_to_device()

    def _shards_before_materialising(self) -> bool:
        trainer = self.lightning_module.trainer
        return trainer.state.fn == TrainerFn.FITTING and self.engine.is_member and self._device_mesh is not None

    def _joiner_fitting(self) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        return fitting and self.engine.environment.joiner and not self.engine.is_member and not self.engine.has_left

    def shard_count(self, world: int) -> int:
        """How many shards a generation of ``world`` members has (the live reshard's layouts): ``hsdp_group_size``
        when it divides the world into replica groups, else one per member."""
        return shard_layout.shard_count(world, self.hsdp_group_size)

    def _build_mesh(self) -> None:
        """A mesh over the generation's group (the elastic view: fixed size, abortable collectives); under HSDP, over
        its shard and replica subgroups (abortable with it)."""
        self._forget_mesh()
        group = self.engine.generation_group
        shards = self.shard_count(group.size())
        self._mirroring.replicated = shards < group.size()
        self._generation_mesh = generation_mesh(group, shards, self.engine.generation_subgroup, self.root_device.type,
                                                f"elan_fsdp{self._number}_gen{self.engine.generation}")
        self._device_mesh = self._generation_mesh.mesh
        if self.lightning_module is not None:
            self.lightning_module._device_mesh = self._device_mesh

    def _forget_mesh(self) -> None:
        if self._generation_mesh is not None:
            self._generation_mesh.forget()
            self._generation_mesh = None

    # ------------------------------------------------------------------ FSDP2 instead of the elastic DDP

    @override
    def configure_ddp(self) -> None:
        """The model sharded over the mesh (Lightning builds the optimizers after this, over the sharded parameters)."""
        assert self.model is not None
        self.model = self._setup_model(self.model)

    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:
        """Sharded over the mesh — the units the user's ``configure_model`` made kept, the ``shard_modules`` outside
        them and the LightningModule added — and the units recorded for every later mesh; a joiner's stays whole until
        the live reshard (it has no mesh yet)."""
        if self._device_mesh is None:
            return model
        if not _root_is_sharded(model):
            shard_model(model, self._device_mesh, self.shard_modules, self._fully_shard_options())
        if _has_meta_tensors(model):
            compat.materialize_meta_module(model, self.root_device)
        if self._units is None:
            self._units = shard_units(model)
        return model

    def _shard(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """``model`` (FSDP2 taken off) sharded on ``mesh`` in the job's units."""
        if self._units is None:
            shard_model(model, mesh, self.shard_modules, self._fully_shard_options())
        else:
            shard_again(model, mesh, self._units)

    def _fully_shard_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        return options

    @override
    def _register_ddp_hooks(self) -> None:
        """No DDP communication hooks: FSDP2 does its own reduce-scatter."""

    # ------------------------------------------------------------------ a step runs inside the root unit's call

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._through_the_root_unit():
            return super().training_step(*args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._through_the_root_unit():
            return super().validation_step(*args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._through_the_root_unit():
            return super().test_step(*args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._through_the_root_unit():
            return super().predict_step(*args, **kwargs)

    @contextmanager
    def _through_the_root_unit(self) -> Generator[None, None, None]:
        """While a step runs, ``self.model`` is a caller of the sharded LightningModule, so Lightning's forward
        redirection (``Strategy.training_step`` & co. when the model is not the LightningModule, as under DDP) runs the
        step inside the module's ``__call__``: FSDP2's forward hooks gather the root unit's parameters for the whole
        step and set up the backward's reduce-scatter. Called directly, a step that uses a submodule (``self.net(x)``,
        not ``self(x)``) found the parameters sharded (``aten.addmm.default got mixed torch.Tensor and DTensor``).
        FSDP2 never reshards the root unit after its forward, so a ``self(x)`` inside the step (a nested call) leaves
        them gathered too. A step cut before its forward ran (a member's death in the root unit's all-gather) leaves
        the redirection's patched ``forward`` behind: it is undone, so the redone step's ``self(x)`` is the forward."""
        sharded = self.model
        if sharded is None or not _root_is_sharded(sharded):
            yield
            return
        self.model = _RootUnitCall(sharded)
        try:
            yield
        finally:
            self.model = sharded
            compat.undo_an_interrupted_forward_redirection(sharded)

    # ------------------------------------------------------------------ a resize: the live reshard

    @override
    def membership_changed(self, previous_rank: int | None) -> None:
        """A stayer or joiner in a new generation: the mesh is the new generation's (the live reshard follows)."""
        super().membership_changed(previous_rank)
        if self.engine.is_member:
            self._build_mesh()

    @override
    def training_state(self) -> dict[str, Any]:
        """A joiner's state without the parameters and optimizer states (they come by the live reshard; gathering them
        would be a collective on the source alone): the module's buffers, the optimizers' skeleton (hyperparameters,
        Adam's step) and everything else an ``"elan"`` joiner gets."""
        self._snapshotting = True
        try:
            state = super().training_state()
        finally:
            self._snapshotting = False
        state["checkpoint"][LIVE_RESHARD_KEY] = True
        state["fsdp_optimizers"] = self._mirroring.describe(self.lightning_module, self._torch_optimizers())
        state["fsdp_units"] = self._units
        return state

    @override
    def load_training_state(self, state: dict[str, Any]) -> None:
        """As an ``"elan"`` joiner, but the model state of the checkpoint (buffers only) is not loaded strictly."""
        self._joined_optimizers, self._units = state["fsdp_optimizers"], state["fsdp_units"]
        module = self.lightning_module
        if is_fully_sharded(module):  # units of configure_model on the stand-in mesh; or a joiner again (a death
            take_fsdp_off(module, self._torch_optimizers())  # abandoned the live reshard that had sharded it)
        strict = module.strict_loading
        module.strict_loading = False
        try:
            super().load_training_state(state)
        finally:
            module.strict_loading = strict

    def reshard_live(self, reshard: ReshardGroup) -> None:
        """Move this member's shards to their new holders over ``reshard``'s group (``LiveResharding``); after a death,
        a dead member's from its mirror. Nothing moves in a job that only evaluates: its members hold the whole
        module (Lightning shards it for a fit only)."""
        if self._holds_the_whole_model():
            return
        receiving, holding = reshard.rank in reshard.receivers, reshard.rank in reshard.holders
        if holding:  # a step or an evaluation cut by a death left gathered parameters registered
            register_sharded_parameters(self.lightning_module)
        skeleton = describe_optimizers(self.lightning_module, self._torch_optimizers()) if holding else \
            self._joined_optimizers
        try:
            self._mirroring.move(reshard, self.lightning_module, self._torch_optimizers(), self._shard,
                                 self.device_mesh if receiving else None, skeleton, self.reshard_chunk_bytes,
                                 self.engine.generation_group if receiving else None, self._unmirrored())
        finally:  # a leaver (its reshard done or abandoned): meta tensors in its module; teardown moves it to the CPU
            if not receiving and _has_meta_tensors(self.lightning_module):
                _materialize(self.lightning_module, self._torch_optimizers(), self.root_device)
        self._joined_optimizers = None

    def _torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return [_torch_optimizer(optimizer) for optimizer in self.optimizers]

    @override
    def state_nbytes(self) -> int:
        """What a source sends a joiner: the buffers, no parameter or optimizer state (they move in the reshard)."""
        return tensor_nbytes(list(self.lightning_module.buffers()))

    @override
    def state_nbytes_beyond_model(self) -> int:
        return 0

    # ------------------------------------------------------------------ a member's death: its shard from its mirror

    @cached_property
    def _mirroring(self) -> StepMirroring:
        return StepMirroring(self.engine.worker_id)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """The committed step advances the mirror after the update (its gradients went to the mirror holder before
        the vote, :meth:`_before_the_vote`)."""
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._mirroring.after_step()
        return output

    @override
    def _before_the_vote(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's final gradients — after ``on_before_optimizer_step`` and gradient clipping — to the mirror
        holder, so that it replays the update the members apply."""
        index = self._torch_optimizers().index(optimizer)
        self._mirroring.before_vote(self.lightning_module, self._torch_optimizers(), index,
                                    self.engine.generation_group, self._unmirrored())

    @override
    def recover_from(self, error: BaseException, rollback: Callable[[], None] | None) -> bool:
        """A member died: recover as ``"elan"`` does when a mirror covers it (the reshard restores its shard), else stop
        with :class:`LostShard`; anything else is re-raised as before."""
        if self.engine.has_left or isinstance(error, (compat.LeaveFit, StopIteration)):
            raise error
        self.engine.confirm_peer_failure(error)
        try:
            self._mirroring.check_recoverable(self.engine.world_size, self._unmirrored())
        except LostShard as lost:
            raise lost from error
        return super().recover_from(error, rollback)

    @override
    def on_validation_start(self) -> None:
        self._mirror_for_evaluation()
        super().on_validation_start()

    @override
    def on_test_start(self) -> None:
        self._mirror_for_evaluation()
        super().on_test_start()

    @override
    def on_predict_start(self) -> None:
        self._mirror_for_evaluation()
        super().on_predict_start()

    def _mirror_for_evaluation(self) -> None:
        """A job that only evaluates FSDP2 units its ``configure_model`` made: each member's shard is mirrored as the
        pass starts (a collective, inside the pass: a death in it is recovered from as one in the pass), so that a
        death in the pass loses no shard. A no-op where the mirrors are seeded (after a fit, after the first pass, in
        the generation a recovery formed), in a fit, and where every member holds the whole module."""
        module = self.lightning_module
        if module.trainer.state.fn == TrainerFn.FITTING or not self.engine.is_member or \
                self._holds_the_whole_model():
            return
        self._mirroring.seed(module, self._torch_optimizers(), self.engine.generation_group, self._unmirrored())

    @override
    def _recover_evaluation(self, error: BaseException) -> None:
        """A member died in ``trainer.validate/test/predict`` (after ``fit``, or without one): as in a step, its shard
        comes from its mirror (kept at the state after the last committed step: an evaluation changes none; in a job
        that only evaluates its own units, seeded as the pass started) or a replica in the recovery's reshard, then
        the pass runs again among the survivors; :class:`LostShard` when none covers it (a death in the first pass's
        seed of the mirrors, or a single member). A job that only evaluates otherwise holds the whole module on every
        member: the pass runs again."""
        if not (self.engine.has_left or self._alone() or isinstance(error, (compat.LeaveFit, StopIteration))):
            self.engine.confirm_peer_failure(error)
            if self._holds_the_whole_model():
                super()._recover_evaluation(error)  # no shard to lose: the pass runs again among the survivors
                return
            if not self._mirroring.covers_a_death:
                why = self._unmirrored() or "it died before the shards were mirrored, as the first pass started"
                raise LostShard(f"worker {self.engine.worker_id}: a member of this strategy='elan_fsdp' job died in "
                                f"trainer.{self.lightning_module.trainer.state.fn.value} and its shard cannot be "
                                f"rebuilt ({why}); restart the job") from error
            self._mirroring.check_recoverable(self.engine.world_size, self._unmirrored())
        super()._recover_evaluation(error)

    def _holds_the_whole_model(self) -> bool:
        """An evaluation without a fit: Lightning's setup shards (``_setup_model``) for a fit only, so every member
        holds the whole module, as under ``"elan"`` (a joiner joins a fit only)."""
        module = self.lightning_module
        return module.trainer.state.fn != TrainerFn.FITTING and not is_fully_sharded(module)

    def _unmirrored(self) -> str | None:
        return unmirrored_because(self._torch_optimizers(), self.lightning_module.automatic_optimization)

    @override
    def fit_started(self) -> None:
        """The launch generation's mirrors are seeded as the fit starts (a checkpoint it resumes from is restored by
        then), so a death in the sanity check, or in any hook or collective before the first step, is covered as one
        in a step is; a resize's or recovery's generation has its mirrors already (seeded at the end of its reshard:
        this is a no-op there). The seed is a collective before the loop, recovered from as the others are."""
        self._seed_mirrors()

    @override
    def training_loop_started(self) -> None:
        """The mirrors seeded (a no-op after :meth:`fit_started`: the sanity check changes no state)."""
        self._seed_mirrors()
        super().training_loop_started()

    def _seed_mirrors(self) -> None:
        self._pre_loop.run(lambda: self._mirroring.seed(self.lightning_module, self._torch_optimizers(),
                                                        self.engine.generation_group, self._unmirrored()))

    @override
    def _recover_before_the_loop(self, error: BaseException) -> None:
        """A death once the mirrors were seeded (in their seed, or in a collective after it) is recovered from as in
        the loop; before, no shard is mirrored yet: the job stops with :class:`LostShard`."""
        self.engine.confirm_peer_failure(error)
        if self._mirroring.covers_a_death:
            super()._recover_before_the_loop(error)
            return
        raise LostShard(f"worker {self.engine.worker_id}: a member of this strategy='elan_fsdp' job died before the "
                        "training loop, when no shard is mirrored yet; restart the job") from error

    # ------------------------------------------------------------------ checkpoints: full on rank 0, or sharded

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full model state, gathered by every member (a collective) onto the CPU; or this member's shards."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        if self._snapshotting:  # a joiner's state: the buffers (FSDP2 keeps them whole), no parameter
            return {name: value for name, value in self.lightning_module.state_dict().items()
                    if not isinstance(value, DTensor)}
        return get_model_state_dict(self.lightning_module, options=self._state_options())

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer's full state keyed by parameter name (``get_optimizer_state_dict``; a collective); or this
        member's shards of it."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if self._snapshotting:
            return {}
        return get_optimizer_state_dict(self.lightning_module, _torch_optimizer(optimizer),
                                        options=self._state_options())

    def _state_options(self) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=self.state_dict_type == "full", cpu_offload=True)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``"sharded"``: every member writes its shards into the directory ``filepath`` (``ModelParallelStrategy``'s
        layout; DCP's collectives on the default group, which is the current generation's); ``"full"``: rank 0 writes
        the file (a sharded directory there is replaced, as Lightning does)."""
        if self.engine.has_left or self.state_dict_type == "full":
            self._remove_sharded_directory(filepath)
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError("ElanFSDPStrategy(state_dict_type='sharded').save_checkpoint(..., storage_options=...) is "
                            "not supported: the shards are written by torch.distributed.checkpoint, not CheckpointIO")
        sharded_checkpoint.save_sharded(checkpoint, Path(self.broadcast(str(filepath))),
                                        compat.sharded_checkpoint_metadata_name(), None, self.is_global_zero,
                                        lambda: self.barrier("elan_fsdp sharded save"))

    def _remove_sharded_directory(self, filepath: Any) -> None:
        if self.is_global_zero and not self.engine.has_left and \
                sharded_checkpoint.is_sharded_checkpoint(filepath, compat.sharded_checkpoint_metadata_name()):
            import shutil

            shutil.rmtree(filepath)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """A full state loaded before the model is sharded (Lightning restores the model before ``setup``) or cut
        into the shards locally (``sharded_checkpoint.shard_like``) and loaded with ``set_model_state_dict``."""
        if not _root_is_sharded(self.lightning_module):
            super().load_model_state_dict(checkpoint, strict=strict)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

        module = self.lightning_module
        state = sharded_checkpoint.shard_like(dict(checkpoint["state_dict"]), get_model_state_dict(module))
        set_model_state_dict(module, state, options=StateDictOptions(strict=strict))

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's full state (as :meth:`optimizer_state` wrote it, or keyed by position) cut into its shards
        locally (``set_optimizer_state_dict``'s own full-state path scatters from rank 0 over a group torch must have
        registered, which an elastic generation's is not); a sharded checkpoint's read shard by shard; a joiner's came
        by the live reshard."""
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        if checkpoint.get(LIVE_RESHARD_KEY) or self._load_sharded_optimizer_states(checkpoint):
            return
        module = self.lightning_module
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
            torch_optimizer = _torch_optimizer(optimizer)
            shards = sharded_checkpoint.shard_like(_keyed_by_name(state, module),
                                                   get_optimizer_state_dict(module, torch_optimizer))
            set_optimizer_state_dict(module, torch_optimizer, shards)

    @override
    def teardown(self) -> None:
        self._mirroring.settle()
        module = self.lightning_module
        unfilled = module is not None and _has_meta_tensors(module)
        with compat.module_kept_off_the_cpu(module) if unfilled else nullcontext():
            super().teardown()
        if self.engine.has_left or not self.engine.is_member:
            self._forget_mesh()


class _RootUnitCall:
    """Calls the sharded LightningModule through ``nn.Module.__call__`` (its FSDP2 hooks); ``self.model`` while a step
    runs (see ``ElanFSDPStrategy._through_the_root_unit``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def shard_model(model: nn.Module, mesh: DeviceMesh, unit_classes: frozenset[type[nn.Module]],
                options: dict[str, Any]) -> None:
    """``fully_shard`` on every instance of ``unit_classes`` (innermost first) outside the units ``model`` already has
    (the user's, made in ``configure_model``), then on ``model``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    within = {id(inner) for unit in model.modules() if isinstance(unit, FSDPModule) for inner in unit.modules()}
    units = [module for module in model.modules()
             if module is not model and isinstance(module, tuple(unit_classes)) and id(module) not in within]
    for unit in reversed(units):  # children before their parents
        fully_shard(unit, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    log.debug("FSDP2 over %d ranks: %d units of shard_modules and the root", mesh.size(), len(units))


def shard_units(model: nn.Module) -> ShardUnits:
    """``model``'s ``fully_shard`` units by module name, with their options (children first)."""
    names = {id(module): name for name, module in model.named_modules()}
    return [([names[id(module)] for module in modules], options)
            for modules, options in torch_compat.fully_shard_units(model)]


def shard_again(model: nn.Module, mesh: DeviceMesh, units: ShardUnits) -> None:
    """``fully_shard`` each of ``units`` again on ``mesh``, in order, with its options."""
    from torch.distributed.fsdp import fully_shard

    for names, options in units:
        modules = [model.get_submodule(name) for name in names]
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh, **options)


def _has_meta_tensors(model: nn.Module) -> bool:
    return any(tensor.is_meta for tensor in [*model.parameters(), *model.buffers()])


def _materialize(model: nn.Module, optimizers: list[torch.optim.Optimizer], device: torch.device) -> None:
    """A leaver's module (meta tensors once its shards went) given memory for its teardown; the optimizers' groups
    point at its new parameters (after an abandoned reshard the recovery's reshard still finds them by name)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    model.to_empty(device=device)
    parameters = dict(model.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [parameters[names[id(parameter)]] for parameter in group["params"]]


def _materialize_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """A joiner's buffers built on the meta device get memory (their values come with the source's state); one that
    is not in the state dict (non-persistent) cannot be received: a warning names it."""
    persistent = set(model.state_dict(keep_vars=True))
    for module_name, module in model.named_modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is None or not buffer.is_meta:
                continue
            module._buffers[name] = torch.empty_like(buffer, device=device)
            qualified = f"{module_name}.{name}" if module_name else name
            if qualified not in persistent:
                log.warning("strategy='elan_fsdp': the non-persistent buffer %s was built on the meta device on this "
                            "joiner and is not received with the state: its values are uninitialised", qualified)


def _root_is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 is applied to ``model`` itself (its root unit), not only to some of its modules (see
    ``replication.fsdp_reshard.is_fully_sharded``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _keyed_by_name(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
    """An optimizer state keyed by parameter position (a plain optimizer's, ``ModelParallelStrategy``'s full file)
    rekeyed by parameter name, as Lightning's ``_rekey_optimizer_state_if_needed`` does; one keyed by name as it is."""
    from torch.distributed.fsdp import FullyShardedDataParallel, OptimStateKeyType

    if state.get("state") and isinstance(next(iter(state["state"])), int):
        return FullyShardedDataParallel.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_NAME, module)
    return state


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (``_optimizer``), or itself."""
    return getattr(optimizer, "_optimizer", optimizer)


def register_elan_fsdp_strategy() -> None:
    """Make ``Trainer(strategy="elan_fsdp")`` resolve."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "elan_fsdp" not in StrategyRegistry:
        ElanFSDPStrategy.register_strategies(StrategyRegistry)


register_elan_fsdp_strategy()  # when this module was imported first: Lightning's import could not register it
