"""The job's FSDP2 units read back from a module and made again on another mesh (``elan_fsdp``'s resizes keep the
units a user's ``configure_model`` made); in-process, on stand-in meshes of one process."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from lightning_elan import torch_compat
from lightning_elan.replication.fsdp_reshard import is_fully_sharded
from lightning_elan.strategy.fsdp import shard_again, shard_model, shard_units


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)


def meta_model() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 4), Block(), nn.Sequential(Block(), nn.Linear(4, 2)))


def mesh(name: str):
    return torch_compat.solo_mesh("cpu", name)


def units_of(model: nn.Module) -> list[str]:
    return sorted(name for name, module in model.named_modules() if isinstance(module, FSDPModule))


def test_a_users_units_and_options_are_read_back_children_first():
    model, made_on = meta_model(), mesh("units_read")
    fully_shard(model[2][0], mesh=made_on, reshard_after_forward=False)
    fully_shard([model[2][1], model[1]], mesh=made_on, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float64))
    fully_shard(model, mesh=made_on, reshard_after_forward=True)

    units = shard_units(model)

    assert [names for names, _ in units] == [["2.1", "1"], ["2.0"], [""]]
    grouped, alone, root = (options for _, options in units)
    assert grouped["mp_policy"].param_dtype == torch.float64 and grouped["reshard_after_forward"] is None
    assert alone["reshard_after_forward"] is False
    assert root["reshard_after_forward"] is True


def test_units_made_again_on_another_mesh_are_the_same_units_with_the_same_options():
    model, first = meta_model(), mesh("units_first")
    fully_shard(model[2][0], mesh=first, reshard_after_forward=False)
    fully_shard(model[1], mesh=first)
    fully_shard(model, mesh=first)
    units = shard_units(model)
    torch_compat.undo_fully_shard(model)
    assert not is_fully_sharded(model)

    second = mesh("units_second")
    shard_again(model, second, units)

    assert shard_units(model) == units
    assert all(parameter.device_mesh is second for parameter in model.parameters())


def test_shard_modules_are_added_outside_the_users_units_and_the_root_last():
    model, made_on = meta_model(), mesh("units_added")
    fully_shard(model[2], mesh=made_on)  # the user's unit holds one Block: that Block is not made a unit of its own

    shard_model(model, made_on, frozenset({Block}), {"reshard_after_forward": True})

    assert units_of(model) == ["", "1", "2"]


def test_is_fully_sharded_sees_a_unit_below_an_unsharded_root():
    model = meta_model()
    assert not is_fully_sharded(model)
    fully_shard(model[1], mesh=mesh("units_below"))
    assert is_fully_sharded(model) and not isinstance(model, FSDPModule)


def test_the_mesh_answers_to_model_parallel_strategys_dimension_names():
    """``self.device_mesh["data_parallel"]`` and ``["tensor_parallel"]`` as under ``ModelParallelStrategy``; its own
    name still slices; any other name is refused as torch refuses it."""
    solo = mesh("dimnames")
    try:
        assert solo["data_parallel"] is solo and solo[("data_parallel",)] is solo
        assert solo["tensor_parallel"].size() == 1
        assert solo["dimnames"] is solo
        with pytest.raises(KeyError, match="Invalid mesh_dim_names"):
            solo["pipeline_parallel"]
        unit = fully_shard(nn.Linear(2, 2).double(), mesh=solo["data_parallel"])
        assert isinstance(unit, FSDPModule) and unit.weight.device_mesh is solo
        unpickled = pickle.loads(pickle.dumps(unit.weight))  # as the plain DeviceMesh: loads without lightning_elan
        assert type(unpickled.device_mesh) is DeviceMesh and unpickled.device_mesh == solo
    finally:
        torch_compat.forget_tensor_parallel_mesh(solo)
        torch_compat.forget_mesh_group("dimnames")


def test_a_module_unlike_the_holders_is_refused_naming_what_differs():
    from lightning_elan.replication.fsdp_reshard import ModuleMismatch, _check_same_module

    skeleton = [{"states": {"a.weight": {"sharded": ["exp_avg"], "values": {}, "shape": [4, 2]},
                            "b.weight": {"sharded": ["exp_avg"], "values": {}, "shape": [3]}}}]
    like = {"a.weight": torch.empty(4, 2, device="meta"), "b.weight": torch.empty(3, device="meta")}
    _check_same_module(skeleton, like)
    with pytest.raises(ModuleMismatch, match=r"'b.weight' has the shape \[5\], the job's \[3\] \(1 differ"):
        _check_same_module(skeleton, {**like, "b.weight": torch.empty(5, device="meta")})
    with pytest.raises(ModuleMismatch, match=r"no parameter 'b.weight' \(of 1 the job trains\)"):
        _check_same_module(skeleton, {"a.weight": like["a.weight"], "c.weight": like["b.weight"]})
    assert issubclass(ModuleMismatch, TypeError)  # the process's own error: never waited on as a peer's death


def test_a_unit_sharded_on_another_dimension_than_its_rows_is_refused_by_name():
    from torch.distributed.tensor import Shard

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    solo = mesh("columns")
    try:
        fully_shard(model[0], mesh=solo, shard_placement_fn=lambda parameter: Shard(parameter.ndim - 1))
        fully_shard(model, mesh=solo)
        with pytest.raises(NotImplementedError, match=r"parameter '0.weight' is sharded on dimension 1"):
            torch_compat.fully_shard_units(model)
    finally:
        torch_compat.forget_mesh_group("columns")
