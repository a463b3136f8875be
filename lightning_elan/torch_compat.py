"""Every touch of a private torch API, in one place, gated on the torch versions it was read from.

Read from torch 2.13's ``torch/distributed/distributed_c10d.py``, ``torch/csrc/distributed/c10d/`` (``ProcessGroup``,
``Backend``, ``ProcessGroupGloo``, ``ProcessGroupNCCL``, ``reducer.cpp``), ``torch/nn/parallel/distributed.py`` and
``torch/amp/grad_scaler.py``; the process-group ones are used since torch 2.3 (the package's lower bound). Each function
names the upstream behaviour it relies on. Importing this module refuses a torch outside :data:`SUPPORTED_TORCH`, as
``lightning_elan.compat`` refuses an untested Lightning: pyproject.toml declares the same range, so only an environment
that ignores the package's requirements meets the refusal.

A process group, upstream: a ``ProcessGroup`` holds one *backend* (``ProcessGroupGloo``, ``ProcessGroupNCCL``) per
device type and dispatches each collective to the backend of its tensors' device, or to its default backend.
``init_process_group``/``new_group`` assemble one in ``_new_process_group_helper`` with the private calls below; the
elastic process group assembles its own the same way, once per generation.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import Version

log = logging.getLogger(__name__)

__all__ = [
    "SUPPORTED_TORCH",
    "C10dBackend",
    "backend_of",
    "backward_alone",
    "check_torch_version",
    "forget_cut_forward",
    "forget_mesh_group",
    "forget_scaler_step",
    "forget_tensor_parallel_mesh",
    "is_dataloader_worker",
    "keep_alive_forever",
    "mark_optimizer_stepped",
    "mesh_of_group",
    "nccl_backend",
    "publish_default_group",
    "register_backend",
    "report_backend_name",
    "reset_reducer",
    "set_default_backend",
    "settle_bucket_layout",
    "stand_in_mesh",
    "start_sequence_numbers",
    "state_dict_key",
    "undo_fully_shard",
]

SUPPORTED_TORCH = ">=2.3,<2.14"
"""``torch`` versions whose private behaviour this module relies on (the upper bound: the newest minor CI tested,
constraints-ci.txt; pre-releases of 2.14 are outside it, as pip's ``<2.14`` excludes them)."""


def check_torch_version(installed: str) -> None:
    """Refuse a torch whose internals this module was not written against (fails at import, with the range)."""
    if not SpecifierSet(SUPPORTED_TORCH).contains(Version(installed), prereleases=True):
        raise ImportError(f"lightning_elan supports torch{SUPPORTED_TORCH}; found torch {installed}. Install a "
                          f"supported version (pip install 'torch{SUPPORTED_TORCH}').")


check_torch_version(str(torch.__version__))

C10dBackend = torch._C._distributed_c10d.Backend
"""The C++ base class of ``ProcessGroupGloo``/``ProcessGroupNCCL`` (``torch.distributed.Backend`` is the string enum of
backend names, a different class); a backend used on its own is an instance of it."""


# ---- assembling a process group (distributed_c10d._new_process_group_helper) ---------------------------------------


def set_default_backend(group: dist.ProcessGroup, kind: dist.ProcessGroup.BackendType) -> None:
    """The backend type ``group`` dispatches to when a collective's tensors do not pick one by device
    (``ProcessGroup::setDefaultBackend``; ``_new_process_group_helper`` sets it before registering the backends)."""
    group._set_default_backend(kind)


def register_backend(group: dist.ProcessGroup, device: str | torch.device, kind: dist.ProcessGroup.BackendType,
                     backend: Any) -> None:
    """``backend`` serves ``group``'s collectives on tensors of ``device``'s type (``ProcessGroup::setBackend``, what
    ``_new_process_group_helper`` calls once per device; C++ callers such as DDP's logging look backends up so)."""
    group._register_backend(torch.device(device), kind, backend)


def backend_of(group: dist.ProcessGroup, device: str) -> Any | None:
    """The backend ``group`` registered for ``device``'s type, or None (``ProcessGroup::getBackend`` raises a
    ``RuntimeError`` for a device type without one)."""
    try:
        return group._get_backend(torch.device(device))
    except RuntimeError:
        return None


def start_sequence_numbers(backend: Any) -> None:
    """Agree on the backend's first collective sequence number, as ``_new_process_group_helper`` does after building
    every backend (``Backend::setSequenceNumberForGroup``: gloo's rank 0 draws it and the others read it from the
    backend's store; NCCL counts from 0). A rendezvous on the store: every member calls it."""
    backend._set_sequence_number_for_group()


def nccl_backend(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    """An NCCL backend over ``store`` (not registered with torch's world), with ``Options`` as
    ``_new_process_group_helper`` makes its default ones: the normal-priority stream, and the collective timeout in the
    private field ``ProcessGroupNCCL.Options._timeout``."""
    if not dist.is_nccl_available():
        raise RuntimeError("torch.distributed was built without NCCL")
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


# ---- what torch records of the default group (distributed_c10d._world) ---------------------------------------------


def publish_default_group(group: dist.ProcessGroup, store: dist.Store, world_size: int) -> None:
    """Record ``group`` (the default group, if torch has it) as ranks ``0..world_size-1`` over ``store``.

    ``init_process_group`` records the default group in ``distributed_c10d._world``: ``pg_group_ranks[group]`` (read by
    ``get_process_group_ranks`` and so by ``new_subgroups``) and ``pg_map[group] = (backend name, store)`` (torch before
    2.13 builds ``new_group``'s backends on that store in ``_new_process_group_helper``; ``_get_default_store()`` hands
    it to libraries). A group torch has not recorded is left alone."""
    world = dist.distributed_c10d._world
    if group not in world.pg_map:
        return
    backend, _ = world.pg_map[group]
    world.pg_map[group] = (backend, store)
    world.pg_group_ranks[group] = {rank: rank for rank in range(world_size)}


def report_backend_name(group: dist.ProcessGroup, backend: str) -> None:
    """Make ``torch.distributed.get_backend(group)`` answer ``backend``: torch (2.3-2.13) answers it from
    ``distributed_c10d._world.pg_map[group][0]``, the name given to ``init_process_group``."""
    world = dist.distributed_c10d._world
    _, store = world.pg_map[group]
    world.pg_map[group] = (backend, store)


def keep_alive_forever(owned: object) -> None:
    """An extra reference to ``owned`` that nothing ever drops (``Py_IncRef`` through ``ctypes.pythonapi``): not even
    interpreter finalization frees it. For torch objects whose destruction is unsafe: a gloo backend's destructor joins
    its worker threads and closes their pairs (``ProcessGroupGloo::~ProcessGroupGloo``), which blocks or throws from
    a destructor while a collective still waits on a dead peer; a work or future freed by a backend's thread takes the
    GIL there."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(owned))


# ---- DDP's reducer (torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp) ----------------------


def settle_bucket_layout(reducer: Any) -> bool:
    """Buckets in parameter registration order from now on (returns whether they were laid out anew; DDP does not
    rebuild buckets with ``find_unused_parameters``, whose layout is its constructor's).

    ``Reducer._push_all_rebuilt_params`` / ``_rebuild_buckets`` (``push_rebuilt_params_for_all_indices``,
    ``rebuild_buckets``): DDP's join hook settles the bucket layout this way; ``rebuild_buckets`` first checks that the
    previous reduction finished (``ensure_prior_reduction_finished``) and lays the buckets out afresh (new flat gradient
    tensors, views re-pointed)."""
    reducer._push_all_rebuilt_params()
    return bool(reducer._rebuild_buckets())


def backward_alone(reducer: Any, parameters: list[torch.Tensor]) -> None:
    """One backward of zero gradients into ``parameters`` through the reducer, with no forward: it writes every
    gradient into its bucket, runs the communication hook on each bucket and copies the buckets back, as a real
    iteration does, and ends with the reducer finalized (as after any iteration).

    ``Reducer.prepare_for_backward`` (what DDP's forward calls after the module's forward, ``outputs`` empty without
    ``find_unused_parameters``): arms the autograd hooks and resets the per-iteration bucket counts; the hooks on each
    parameter's ``AccumulateGrad`` (``autograd_hook``) then mark it ready and ``finalize_backward`` runs as the
    engine's final callback."""
    reducer.prepare_for_backward([])
    torch.autograd.backward(parameters, grad_tensors=[torch.zeros_like(parameter) for parameter in parameters])


def rebuild_reducer(ddp: Any, parameters: list[torch.nn.Parameter], expect_sparse_gradient: list[bool]) -> None:
    """A new reducer for ``ddp`` over ``parameters`` (those that require a gradient now, in the caller's order).

    ``DistributedDataParallel._build_debug_param_to_name_mapping`` and ``_ddp_init_helper``
    (torch/nn/parallel/distributed.py): what DDP's constructor runs to make its reducer from the list
    ``_build_params_for_reducer`` gives (the buckets, the autograd hooks, the DDP logger); the old reducer, dropped,
    removes its autograd hooks (``Reducer::~Reducer`` → ``remove_autograd_hooks``). ``_comm_hooks`` lists the hooks of
    the reducer; the new one has none yet."""
    names = ddp._build_debug_param_to_name_mapping(parameters)
    ddp._ddp_init_helper(parameters, expect_sparse_gradient, names, ddp.static_graph)
    ddp._comm_hooks = []


def move_parameter(module: torch.nn.Module, name: str, position: int) -> None:
    """Put ``module``'s own parameter ``name`` at ``position`` among its own parameters (registration order).

    ``nn.Module._parameters`` (the dict ``register_parameter`` fills, in order; ``parameters()`` follows it): torch's
    pruning registers ``<name>_orig`` last, and an optimizer built afterwards would list the parameters in another order
    than one built before the pruning (its state is matched by position)."""
    parameters = module._parameters
    moved = parameters.pop(name)
    items = list(parameters.items())
    items.insert(position, (name, moved))
    parameters.clear()
    parameters.update(items)


def register_reducer_comm_hook(reducer: Any, state: object, hook: Any) -> None:
    """``hook`` on ``reducer`` (``torch.distributed._register_comm_hook``, what ``DistributedDataParallel.
    register_comm_hook`` calls after its checks)."""
    dist._register_comm_hook(reducer, state, hook)


def reset_reducer(reducer: Any) -> None:
    """Forget the reducer's interrupted iteration: the next forward starts as after a finished backward.

    ``Reducer._reset_state`` (``reset_state``): what ``DistributedDataParallel._update_process_group`` calls so a DDP
    can go on after a failed backward — ``require_finalize_``, ``expect_autograd_hooks_``, the first-hook flag and the
    division factor cleared, the unused-parameter map zeroed, and the buckets marked as not rebuilt. The per-iteration
    counters (ready parameters, pending buckets, next bucket) are reset by ``prepare_for_backward`` at the next
    forward."""
    reducer._reset_state()


# ---- DataLoader workers (torch/utils/data/dataloader.py, torch/utils/data/_utils/worker.py) --------------------------


def is_dataloader_worker(process: Any) -> bool:
    """Whether a ``multiprocessing`` process runs a DataLoader worker.

    Upstream: ``DataLoader``'s multiprocessing iterator starts each worker as
    ``multiprocessing_context.Process(target=torch.utils.data._utils.worker._worker_loop, ...)``, and
    ``multiprocessing``'s ``BaseProcess`` keeps the target in ``_target`` (current in the child while its after-fork
    callbacks run, before the target).
    """
    from torch.utils.data._utils import worker

    return getattr(process, "_target", None) is worker._worker_loop


# ---- the GradScaler (torch/amp/grad_scaler.py) ----------------------------------------------------------------------


def forget_scaler_step(scaler: Any) -> None:
    """A ``GradScaler`` forgets the stage of a step that was discarded (its scale and growth tracker stay).

    ``GradScaler._per_optimizer_states``: the stage (unscaled, stepped) and found-inf tensors of the step in progress,
    cleared by ``update()`` after a step; a step that is never applied must not leave them behind (``unscale_`` of the
    redone step would raise "unscale_() has already been called on this optimizer since the last update()")."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if states:
        states.clear()


# ---- FSDP2 (torch/distributed/fsdp/_fully_shard/, torch/distributed/_composable/contract.py) -------------------------

FULLY_SHARD_UNDONE_ON = ">=2.13,<2.14"
"""The torch versions whose FSDP2 internals :func:`undo_fully_shard` was read from and tested on."""


def mark_optimizer_stepped(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer`` as stepped for its LR schedulers: ``LRScheduler.__init__`` wraps ``optimizer.step`` so that a
    call sets ``optimizer._opt_called``, and ``LRScheduler.step`` warns "Detected call of `lr_scheduler.step()` before
    `optimizer.step()`" while its ``_step_count`` is 1 and that attribute is unset. A process that received the state
    of optimizers the job stepped (a joiner) has not called ``step`` itself."""
    optimizer._opt_called = True  # type: ignore[attr-defined]


def undo_fully_shard(model: torch.nn.Module) -> None:
    """Take FSDP2 off every module of ``model``, so that ``fully_shard`` can be applied again on another mesh; each
    sharded parameter becomes a meta tensor of its full shape (the caller loads the new local shards with
    ``load_state_dict(..., assign=True)``, FSDP2's own way to fill a module built on meta).

    What ``fully_shard`` left, and where: the forward pre- and post-hooks of ``FSDPState.init``
    (``_pre_forward_hook_handle``/``_post_forward_hook_handle``, on the state's first module); each
    ``FSDPParamGroup``'s state-dict hooks (``_register_state_dict_hooks``:
    ``_module_to_pre_save_state_dict_hook_handle``, ``_module_to_pre_load_state_dict_hook_handle``); each
    ``FSDPParam``'s ``_post_load_hook_handle`` (left behind, an old parameter re-pads a new shard to the old layout at
    ``load_state_dict``); the state ``contract`` keeps in the module's ``__dict__`` (``__composable_api_state_key_*``,
    ``__composable_api_registry_key_*``) and in ``_composable_state._module_state_mapping``; the ``FSDP<Class>``
    class ``_apply_to_module`` swapped in (bases ``(FSDPModule, Class)``); and the ``_is_fsdp_managed_module`` and
    ``_fsdp_use_orig_params`` flags."""
    if not SpecifierSet(FULLY_SHARD_UNDONE_ON).contains(Version(str(torch.__version__)), prereleases=True):
        raise NotImplementedError(f"resharding an FSDP2 module needs torch{FULLY_SHARD_UNDONE_ON}")
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    for module in model.modules():
        state = _get_module_fsdp_state(module)
        if state is None:
            continue
        if state._modules[0] is module:
            _remove_fsdp_hooks(state)
        _module_state_mapping.pop(module, None)
        for key in [key for key in module.__dict__ if key.startswith("__composable_api_")]:
            del module.__dict__[key]
        if isinstance(module, FSDPModule):
            module.__class__ = module.__class__.__bases__[1]
        for flag in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(flag, None)
    _parameters_to_meta(model)


def fully_shard_units(model: torch.nn.Module) -> list[tuple[list[torch.nn.Module], dict[str, Any]]]:
    """Every ``fully_shard`` unit of ``model`` — its modules (several for ``fully_shard([a, b])``) and the options it
    was called with — children before their parents, so that applying them in this order on another mesh makes the
    same units.

    Read back from each unit's ``FSDPState`` (``_fully_shard/_fsdp_state.py``): its modules (``_modules``), its
    ``_mp_policy``, whether ``reshard_after_forward`` was left to FSDP2 (``_auto_reshard_after_forward``, then None);
    from its first ``FSDPParamGroup`` (``_fsdp_param_group.py``, none when the unit manages no parameter) its
    ``offload_policy`` and ``post_forward_mesh_info`` (None: ``False``; the shard mesh's size: ``True``; another size:
    that int). A ``shard_placement_fn`` placing a parameter on another dimension than its rows is refused;
    ``ignored_params`` or ``dp_mesh_dims`` are not read back."""
    if not SpecifierSet(FULLY_SHARD_UNDONE_ON).contains(Version(str(torch.__version__)), prereleases=True):
        raise NotImplementedError(f"reading FSDP2 units back needs torch{FULLY_SHARD_UNDONE_ON}")
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    units, seen = [], set()
    for module in reversed(list(model.modules())):  # post-order enough: a child comes after its parent in modules()
        state = _get_module_fsdp_state(module)
        if state is None or id(state) in seen:
            continue
        seen.add(id(state))
        _refuse_placements_other_than_rows(state, model)
        units.append((list(state._modules), _fully_shard_options(state)))
    return units


def _refuse_placements_other_than_rows(state: Any, model: torch.nn.Module) -> None:
    """A live reshard moves rows (``Shard(0)``, each ``FSDPParam``'s ``fsdp_placement`` by default); a
    ``shard_placement_fn`` placing a parameter on another dimension is refused here, at setup, with its name."""
    for group in state._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            if fsdp_param.fsdp_placement.dim != 0:
                name = next((name for name, parameter in model.named_parameters()
                             if parameter is fsdp_param.sharded_param), "?")
                raise NotImplementedError(
                    f"parameter {name!r} is sharded on dimension {fsdp_param.fsdp_placement.dim} "
                    "(fully_shard's shard_placement_fn): an elastic job reshards parameters sharded on their rows "
                    "(Shard(0), fully_shard's default) only")


def _fully_shard_options(state: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"mp_policy": state._mp_policy}
    groups = state._fsdp_param_groups
    if groups:
        group = groups[0]
        options["offload_policy"] = group.offload_policy
        options["reshard_after_forward"] = _reshard_after_forward(group.post_forward_mesh_info, group.mesh_info)
    if state._auto_reshard_after_forward:
        options["reshard_after_forward"] = None
    return options


def _reshard_after_forward(after: Any, mesh_info: Any) -> bool | int:
    if after is None:
        return False
    return True if after.shard_mesh_size == mesh_info.shard_mesh_size else after.shard_mesh_size


def solo_mesh(device_type: str, name: str) -> Any:
    """A 1-D ``DeviceMesh`` of this process alone, on a gloo group of its own (an in-process store): a joiner's
    ``self.device_mesh`` in ``configure_model`` before it has a generation — the units made on it are made again on
    the job's mesh at its admission. Registered like :func:`mesh_of_group`."""
    store, kind = dist.HashStore(), dist.ProcessGroup.BackendType.GLOO
    group = dist.ProcessGroup(store, 0, 1)
    set_default_backend(group, kind)
    backend = dist.ProcessGroupGloo(store, 0, 1)
    for device in {"cpu", device_type}:
        register_backend(group, device, kind, backend)
    return mesh_of_group(group, device_type, name)


def stand_in_mesh(device_type: str, name: str, size: int) -> Any:
    """A joiner's ``self.device_mesh`` in ``configure_model`` before it has a generation: 1-D of ``size`` ranks (the
    job's launch world, over which the members ran theirs), this process at rank 0, so that code choosing what to build
    by the mesh's size (``if dp_mesh.size() > 1``) builds what the members built. Only its size and rank are real: its
    group (a ``ProcessGroup`` of that size over an in-process store) has no backend, and a collective on it raises
    "No backend type associated with device type". ``fully_shard`` of a module on the meta device makes its units
    without communicating; the units are made again on the job's mesh at its admission. One rank: :func:`solo_mesh`."""
    if size <= 1:
        return solo_mesh(device_type, name)
    return mesh_of_group(dist.ProcessGroup(dist.HashStore(), 0, size), device_type, name)


def forget_cut_forward(module: torch.nn.Module) -> None:
    """Before ``FSDPModule.reshard()`` of a unit whose forward an exception cut (a member's death in a later unit's
    all-gather): each ``FSDPParamGroup`` is still in ``TrainingState.FORWARD`` (``FSDPState._post_forward`` never ran),
    and ``FSDPParamGroup.reshard`` returns at once in that state for a group that does not reshard after the forward
    (the root's), leaving its gathered parameters registered; the group is set back to ``TrainingState.IDLE``."""
    if not SpecifierSet(FULLY_SHARD_UNDONE_ON).contains(Version(str(torch.__version__)), prereleases=True):
        raise NotImplementedError(f"resharding an FSDP2 module needs torch{FULLY_SHARD_UNDONE_ON}")
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    for group in module._get_fsdp_state()._fsdp_param_groups:  # type: ignore[operator]
        if group._training_state == TrainingState.FORWARD:
            group._training_state = TrainingState.IDLE


def _remove_fsdp_hooks(state: Any) -> None:
    state._pre_forward_hook_handle.remove()
    state._post_forward_hook_handle.remove()
    for group in state._fsdp_param_groups:
        for fsdp_param in group.fsdp_params:
            fsdp_param._post_load_hook_handle.remove()
        for handles in (group._module_to_pre_save_state_dict_hook_handle,
                        group._module_to_pre_load_state_dict_hook_handle):
            for handle in handles.values():
                handle.remove()


def _parameters_to_meta(model: torch.nn.Module) -> None:
    """Each sharded parameter replaced by a meta one of its full shape; a parameter shared by several modules (tied
    weights: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) by one, shared alike, so that ``fully_shard``
    again finds it shared."""
    from torch.distributed.tensor import DTensor

    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if isinstance(parameter, DTensor):
                if id(parameter) not in replaced:
                    meta = torch.empty(parameter.shape, dtype=parameter.dtype, device="meta")
                    replaced[id(parameter)] = torch.nn.Parameter(meta, requires_grad=parameter.requires_grad)
                setattr(module, name, replaced[id(parameter)])


# ---- activation checkpointing's wrapper (torch/distributed/algorithms/_checkpoint/checkpoint_wrapper.py) -------------


def checkpoint_activations(model: torch.nn.Module, classes: frozenset[type]) -> None:
    """Each instance of ``classes`` in ``model`` wrapped by ``checkpoint_wrapper`` (its activations recomputed in the
    backward), as Lightning ``FSDPStrategy``'s ``activation_checkpointing_policy`` does through torch's
    ``apply_activation_checkpointing``; one already wrapped is left as it is (a later fit, the user's own wrapping)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrapped = {id(module._checkpoint_wrapped_module) for module in model.modules()
               if isinstance(module, CheckpointWrapper)}
    def check(module: torch.nn.Module) -> bool:
        return isinstance(module, tuple(classes)) and id(module) not in wrapped

    apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=check)


def state_dict_key(parameter_name: str) -> str:
    """The ``state_dict`` key of the parameter ``named_parameters`` names so: a ``CheckpointWrapper`` (what
    ``checkpoint_wrapper(block)`` returns) keeps its module as ``_checkpoint_wrapped_module`` and its state-dict hooks
    drop that name from the keys (``_post_state_dict_hook``), and its load pre-hook puts it back
    (``_pre_load_state_dict_hook``): a name passed through ``load_state_dict`` unchanged gets it twice and matches no
    parameter."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return parameter_name.replace(_CHECKPOINT_PREFIX, "")


# ---- DeviceMesh over a group torch did not record (torch/distributed/device_mesh.py) --------------------------------


# Lightning's ModelParallelStrategy names its mesh's dimensions so (lightning/fabric/strategies/model_parallel.py,
# ``_setup_device_mesh``), and user code written for it slices them: ``self.device_mesh["data_parallel"]``.
DATA_PARALLEL, TENSOR_PARALLEL = "data_parallel", "tensor_parallel"


@functools.cache
def _elastic_mesh_type() -> type:
    """``DeviceMesh`` answering to ModelParallelStrategy's dimension names as well as its own (defined on first use:
    ``torch.distributed.device_mesh`` defines ``DeviceMesh`` only where distributed is available). torch.compile
    treats it as the ``DeviceMesh`` it is (``torch/_library/opaque_object.py`` resolves subclasses of opaque types)."""
    from torch.distributed.device_mesh import DeviceMesh

    class ElasticDeviceMesh(DeviceMesh):
        """A generation's mesh; ``mesh["data_parallel"]`` is the whole data-parallel mesh (itself: 1-D for FSDP, 2-D
        for HSDP), ``mesh["tensor_parallel"]`` a mesh of this rank alone (an elastic job has no tensor parallelism)."""

        def __getitem__(self, mesh_dim_names: str | tuple[str, ...]) -> Any:
            names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) else tuple(mesh_dim_names)
            if names == (DATA_PARALLEL,):
                return self
            if names == (TENSOR_PARALLEL,):
                return self._tensor_parallel_mesh()
            return super().__getitem__(mesh_dim_names)

        def __reduce_ex__(self, protocol: Any) -> Any:
            """Pickled (and deep-copied) as the plain ``DeviceMesh`` it is (its ``__getstate__``/``__setstate__``):
            a pickle holding it loads where lightning_elan is not installed."""
            state = self.__getstate__()
            state.pop("_elan_tensor_parallel", None)
            return object.__new__, (DeviceMesh,), state

        def _tensor_parallel_mesh(self) -> Any:
            if self.size() == 1:
                return self
            if getattr(self, "_elan_tensor_parallel", None) is None:
                name = f"{'_'.join(self.mesh_dim_names)}_{TENSOR_PARALLEL}"
                self._elan_tensor_parallel = solo_mesh(self.device_type, name)
            return self._elan_tensor_parallel

    return ElasticDeviceMesh


def forget_tensor_parallel_mesh(mesh: Any) -> None:
    """Drop the name of the one-rank mesh ``mesh["tensor_parallel"]`` made, if it made one (with its generation)."""
    solo = getattr(mesh, "_elan_tensor_parallel", None)
    if solo is not None:
        forget_mesh_group(solo.mesh_dim_names[0])
        mesh._elan_tensor_parallel = None


def mesh_of_group(group: dist.ProcessGroup, device_type: str, name: str) -> Any:
    """A 1-D ``DeviceMesh`` of ranks ``0..size-1`` whose collectives run on ``group``, registered as ``name``.

    ``DeviceMesh.from_group`` reads the group's ranks from ``distributed_c10d._world.pg_group_ranks`` and its name from
    ``ProcessGroup.group_name``: only groups torch's ``new_group``/``init_process_group`` made are recorded there, and
    an elastic generation's view is neither. This builds what ``from_group`` builds for a 1-D group
    (``DeviceMesh(..., _init_backend=False)``, ``_dim_group_names``, ``_pg_registry``), and registers the group by name
    in the C++ registry (``_register_process_group``) that DTensor's functional collectives resolve names through."""

    group._set_group_name(name)
    torch._C._distributed_c10d._register_process_group(name, group)
    # the group's rank: a joiner builds its mesh before torch has a default group; the dimension named after the group:
    # meshes of equal layout are equal (DeviceMesh.__eq__), and DTensor's sharding propagation cache would hand an op
    # on a later generation's mesh the output spec, with the group, of an earlier one
    ranks = torch.arange(group.size(), dtype=torch.int, device="cpu")  # on the CPU under a meta-device context too
    mesh = _elastic_mesh_type()(device_type, ranks, mesh_dim_names=(name,), _init_backend=False, _rank=group.rank())
    mesh._dim_group_names = [name]
    mesh._pg_registry[name] = group
    return mesh


def mesh_of_groups(groups: list[dist.ProcessGroup], shape: tuple[int, ...], device_type: str, names: list[str],
                   rank: int) -> Any:
    """A ``DeviceMesh`` of ranks ``0..n-1`` laid out as ``shape`` (row-major), whose dimension ``d`` runs its
    collectives on ``groups[d]`` (this rank's group of that dimension), registered as ``names[d]`` (an HSDP mesh:
    ``(replicas, shard group)``). What ``DeviceMesh.from_group`` builds for several groups, for groups torch did not
    record (see :func:`mesh_of_group`); ``rank``: this member's rank in the generation."""

    for group, name in zip(groups, names, strict=True):
        group._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, group)
    mesh = _elastic_mesh_type()(device_type, torch.arange(math.prod(shape), dtype=torch.int, device="cpu").view(shape),
                                mesh_dim_names=tuple(names), _init_backend=False, _rank=rank)
    mesh._dim_group_names = list(names)
    for group, name in zip(groups, names, strict=True):
        mesh._pg_registry[name] = group
    return mesh


def forget_mesh_group(name: str) -> None:
    """Drop a name :func:`mesh_of_group` registered (``_unregister_process_group``), once its generation is over."""
    torch._C._distributed_c10d._unregister_process_group(name)
