"""An FSDP2 module and its optimizers sharded again, in place, over the members of a new generation (issue 24).

Every member of the default group takes part: the ``holders`` (the old mesh's ranks, in order) send the rows of their
shards that now belong elsewhere, the ``receivers`` (the new mesh's ranks, in order) receive the rows of their new
shards (``reshard.move_rows``: parameters and every optimizer state sharded like them), a joiner — a receiver that
holds nothing — having built the module on the meta device. FSDP2 is taken off the module (``torch_compat.
undo_fully_shard``) and applied again by the caller's ``shard_modules(model, mesh)`` (the same units, the same
options), the new shards are loaded with ``load_state_dict(assign=True)``, and each optimizer keeps its object (a
scheduler's reference stays good): its groups point at the new parameters, its sharded states are the moved rows, its
other states (Adam's ``step``) and its groups' hyperparameters are the first holder's.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_elan.replication.reshard import DEFAULT_CHUNK_BYTES, move_rows
from lightning_elan.torch_compat import forget_cut_forward, state_dict_key, undo_fully_shard

__all__ = [
    "ShardModules",
    "describe_optimizers",
    "held_shards",
    "is_fully_sharded",
    "register_sharded_parameters",
    "reshard_fsdp",
    "take_fsdp_off",
]

ShardModules = Callable[[nn.Module, DeviceMesh], None]
"""Applies ``fully_shard`` to the module's units and the module itself on the given mesh (the user's wrapping)."""

PARAM = "param"


def reshard_fsdp(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], shard_modules: ShardModules,
                 holders: Sequence[int], receivers: Sequence[int], mesh: DeviceMesh | None, group: Any | None = None,
                 skeleton: list[dict[str, Any]] | None = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 held: dict[str, dict[str, torch.Tensor]] | None = None) -> None:
    """Shard ``model`` and ``optimizers`` from the ``holders``' mesh onto ``mesh`` (None on a member that leaves).

    ``holders``/``receivers`` are ranks of ``group`` (default: the default group; else a process group, a c10d
    backend or a side group, see ``move_rows``). ``skeleton``: the optimizers as :func:`describe_optimizers` describes
    them on a holder (default: the first holder's, broadcast on the default group). ``held``: this holder's old rows
    (:func:`held_shards`) when the caller keeps them to start again from should the reshard be abandoned (a member's
    death); then they are only read. Without it each old shard is freed once its rows have gone. Rows move in pieces
    of at most ``chunk_bytes``, and each new parameter shard is loaded as soon as it is whole, so a member's memory
    grows by at most its new shard, one chunk and one parameter's shard (FSDP2 re-pads a short one). On an error the
    optimizers' groups point at the module's parameters again, their states empty (the caller's rows hold them)."""
    me = group.rank() if group is not None else dist.get_rank()
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    like = {name: torch.empty(p.shape, dtype=p.dtype, device="meta") for name, p in model.named_parameters()}
    aliases = tied_aliases(model)
    skeleton = skeleton if skeleton is not None else _skeleton(optimizers, names, holders[0])
    _check_same_module(skeleton, like)
    keep = held is not None
    olds = (held if keep else _held_shards(model, optimizers, names)) if me in holders else {}
    group_names = [_release(optimizer, names) for optimizer in optimizers]
    with _groups_restored_on_failure(model, optimizers, group_names):
        if is_fully_sharded(model):
            undo_fully_shard(model)
        gc.collect()  # FSDP2's states (reference cycles) go now: ``olds`` is then the only owner of the old shards
        if me in receivers:
            if mesh is None:
                raise ValueError("a receiver of the reshard needs the new mesh")
            shard_modules(model, mesh)  # on the meta parameters: allocates nothing
        moved = _move_all(model, like, skeleton, olds, keep, holders, receivers, mesh, group, chunk_bytes, aliases)
        if me not in receivers:
            return
        parameters = dict(model.named_parameters())
        for index, (optimizer, described) in enumerate(zip(optimizers, skeleton, strict=True)):
            _rebind(optimizer, described, group_names[index],
                    lambda name, key, index=index: moved[name][f"o{index}/{key}"], parameters)


def _move_all(model: nn.Module, like: dict[str, torch.Tensor], skeleton: list[dict[str, Any]],
              olds: dict[str, dict[str, torch.Tensor]], keep: bool, holders: Sequence[int], receivers: Sequence[int],
              mesh: DeviceMesh | None, group: Any | None, chunk_bytes: int,
              aliases: dict[str, list[str]]) -> dict[str, dict[str, DTensor]]:
    """Every tensor's rows to the new layout; a receiver loads each parameter once it is whole. Returns the moved
    optimizer states (``keep``: the old rows are left in ``olds``; else each is freed once sent)."""
    me = group.rank() if group is not None else dist.get_rank()
    moved: dict[str, dict[str, DTensor]] = {}
    for name, shape in like.items():
        rows_of = olds.get(name, {}) if keep else olds.pop(name, {})
        for kind in _sharded_kinds(skeleton, name):
            old = rows_of.get(kind) if keep else rows_of.pop(kind, None)
            rows = move_rows(old, shape.shape[0], holders, receivers, like=shape, group=group,
                             chunk_bytes=chunk_bytes)
            del old  # without ``keep``: the old shard freed here
            if rows is not None:
                moved.setdefault(name, {})[kind] = _as_shard(rows, mesh, shape)
        if me in receivers:
            _load_parameter(model, name, moved[name].pop(PARAM), aliases.get(name, ()))
    return moved


def tied_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each parameter registered under several names (tied weights) by its first name: its other names. The reshard
    moves it under its first name (``named_parameters`` lists it once) and registers the loaded shard under the others
    too; FSDP2's own ``_setattr_on_modules`` would do so only at the unit's next reshard."""
    first = {id(parameter): name for name, parameter in model.named_parameters()}
    aliases: dict[str, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if first[id(parameter)] != name:
            aliases.setdefault(first[id(parameter)], []).append(name)
    return aliases


def _tie(model: nn.Module, name: str, aliases: Sequence[str]) -> None:
    parameter = model.get_parameter(name)
    for alias in aliases:
        owner, _, attribute = alias.rpartition(".")
        setattr(model.get_submodule(owner), attribute, parameter)


def is_fully_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 is applied to ``model`` or any of its modules (a holder's; a reshard abandoned after it re-applied
    FSDP2; a joiner's units made in ``configure_model`` on its stand-in mesh)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(module, FSDPModule) for module in model.modules())


def register_sharded_parameters(model: nn.Module) -> None:
    """Every FSDP2 unit's sharded parameters registered on its module (``FSDPModule.reshard``; a no-op on a unit
    that is sharded already), a forward cut short included — the parameters the optimizers hold. A step cut by a
    member's death leaves gathered parameters registered: the root's after any forward (FSDP2 reshards the root only
    after the backward), and every unit's whose forward the death cut (the survivors wait in a later unit's
    all-gather)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            forget_cut_forward(module)
            module.reshard()


@contextmanager
def _groups_restored_on_failure(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                                group_names: list[list[str]]) -> Iterator[None]:
    """On an error (a member's death abandons the reshard) each optimizer's groups point at the module's parameters
    again, by name, so that a later reshard (the recovery) can release and rebind them; their states stay empty."""
    try:
        yield
    except BaseException:
        parameters = dict(model.named_parameters())
        for optimizer, names in zip(optimizers, group_names, strict=True):
            for group, param_names in zip(optimizer.param_groups, names, strict=True):
                group["params"] = [parameters[name] for name in param_names]
            optimizer.state.clear()
        raise


def take_fsdp_off(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """FSDP2 taken off ``model`` (its parameters become meta tensors of their full shape), each optimizer's groups
    pointing at the new parameters (a joiner again after a death abandoned the reshard that had sharded it)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    undo_fully_shard(model)
    parameters = dict(model.named_parameters())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [parameters[names[id(parameter)]] for parameter in group["params"]]


def held_shards(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, dict[str, torch.Tensor]]:
    """This holder's local rows of every parameter and optimizer state sharded like it (``reshard_fsdp``'s ``held``)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return _held_shards(model, optimizers, names)


def _release(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> list[list[str]]:
    """Drop ``optimizer``'s references to the old parameters and states (their shards can then be freed as they go);
    the names of each group's parameters, for :func:`_rebind`."""
    group_names = [[names[id(parameter)] for parameter in group["params"]] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["params"] = []
    optimizer.state.clear()
    return group_names


def _as_shard(rows: torch.Tensor, mesh: DeviceMesh | None, like: torch.Tensor) -> DTensor:
    """This receiver's rows as its shard of ``mesh`` (a 2-D HSDP mesh: replicated over its first dimension, as
    ``fully_shard`` places a parameter on it)."""
    placements = [*[Replicate()] * (mesh.ndim - 1), Shard(0)] if mesh is not None else [Shard(0)]
    return DTensor.from_local(rows, mesh, placements, shape=like.shape, stride=like.stride(), run_check=False)


def _load_parameter(model: nn.Module, name: str, shard: DTensor, aliases: Sequence[str]) -> None:
    """Load one new parameter shard into the re-sharded ``model`` (FSDP2's post-load hook re-pads a short shard; the
    unpadded rows are freed when this returns), and register it under its tied ``aliases`` too
    (:func:`tied_aliases`)."""
    key = state_dict_key(name)  # under activation checkpointing's wrapper the key is not the name
    if model.load_state_dict({key: nn.Parameter(shard)}, assign=True, strict=False).unexpected_keys:
        raise RuntimeError(f"the live reshard could not load parameter {name!r} (state-dict key {key!r})")
    _tie(model, name, aliases)


def _held_shards(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
                 names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
    """This holder's local rows: each parameter's, and each optimizer state sharded like it (``o<i>/<key>``)."""
    held = {name: {PARAM: parameter.to_local().detach()} for name, parameter in model.named_parameters()}
    for index, optimizer in enumerate(optimizers):
        for parameter, state in optimizer.state.items():
            for key, value in state.items():
                if isinstance(value, DTensor):
                    held[names[id(parameter)]][f"o{index}/{key}"] = value.to_local()
    return held


def _skeleton(optimizers: Sequence[torch.optim.Optimizer], names: dict[int, str], source: int) -> list[dict[str, Any]]:
    """The first holder's description of each optimizer (the same on every member): each group's hyperparameters,
    and per parameter its sharded state keys and its other state values."""
    described: list[Any] = [None]
    if dist.get_rank() == source:
        described[0] = [_describe(optimizer, names) for optimizer in optimizers]
    dist.broadcast_object_list(described, src=source)
    return described[0]


class ModuleMismatch(TypeError):
    """This worker's module lacks parameters the job's members train, or has them in other shapes: it cannot take a
    shard of them (a ``TypeError``: the process's own error, taken at once, never waited on as a peer's death)."""


def _check_same_module(skeleton: list[dict[str, Any]], parameters: dict[str, torch.Tensor]) -> None:
    """Refuse, before any row moves, a module without the parameters, of the shapes, the holders' optimizers hold
    states for."""
    described = {name: state for one in skeleton for name, state in one["states"].items()}
    absent = sorted(name for name in described if name not in parameters)
    unlike = sorted(name for name, state in described.items()
                    if name in parameters and list(parameters[name].shape) != state["shape"])
    if unlike:
        name = unlike[0]
        raise ModuleMismatch(
            f"this worker's parameter {name!r} has the shape {list(parameters[name].shape)}, the job's "
            f"{described[name]['shape']} ({len(unlike)} differ): every worker must build the same module")
    if absent:
        raise ModuleMismatch(
            f"this worker's module has no parameter {absent[0]!r} (of {len(absent)} the job trains): every worker "
            "must build the same module (under Lightning a joiner runs configure_model before it joins, on a "
            "stand-in self.device_mesh of the job's launch size)")


def describe_optimizers(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> list[dict[str, Any]]:
    """This holder's description of ``optimizers`` for :func:`reshard_fsdp`'s ``skeleton`` (picklable, small)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [_describe(optimizer, names) for optimizer in optimizers]


def _describe(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, Any]:
    states = {}
    for parameter, state in optimizer.state.items():
        sharded = [key for key, value in state.items() if isinstance(value, DTensor)]
        values = {key: value for key, value in state.items() if not isinstance(value, DTensor)}
        states[names[id(parameter)]] = {"sharded": sharded, "values": values, "shape": list(parameter.shape)}
    groups = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    return {"groups": groups, "states": states}


def _sharded_kinds(skeleton: list[dict[str, Any]], name: str) -> list[str]:
    kinds = [PARAM]
    for index, described in enumerate(skeleton):
        kinds += [f"o{index}/{key}" for key in described["states"].get(name, {}).get("sharded", [])]
    return kinds


def _rebind(optimizer: torch.optim.Optimizer, described: dict[str, Any], group_names: list[list[str]],
            sharded: Callable[[str, str], DTensor], parameters: dict[str, nn.Parameter]) -> None:
    """Point ``optimizer``'s groups at the new parameters (``group_names``: each group's, by name), with the moved
    states and the first holder's hyperparameters and other states."""
    for group, hyper, param_names in zip(optimizer.param_groups, described["groups"], group_names, strict=True):
        group.update(hyper)
        group["params"] = [parameters[name] for name in param_names]
    optimizer.state.clear()
    for name, state in described["states"].items():
        optimizer.state[parameters[name]] = {**state["values"], **{key: sharded(name, key) for key in state["sharded"]}}
