"""``lightning_elan.sharded_checkpoint`` in one process (no process group: DCP reads and writes alone): a directory in
Lightning ``FSDPStrategy``'s layout (the model under ``"model"``) and ``ModelParallelStrategy``'s (``"state_dict"``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_elan import sharded_checkpoint

META = "meta.pt"


def trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 3, dtype=torch.float64)).sum().backward()
        optimizer.step()
    return model, optimizer


def write(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, model_key: str) -> None:
    from torch.distributed.checkpoint import save
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    path.mkdir()
    save({model_key: model.state_dict(), "optimizer_0": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=path)
    torch.save({"global_step": 2}, path / META)


@pytest.mark.parametrize("model_key", ["state_dict", "model"])
def test_a_lightning_sharded_directory_loads_whole(tmp_path: Path, model_key: str) -> None:
    model, optimizer = trained()
    write(tmp_path / "ckpt", model, optimizer, model_key)
    fresh = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)

    assert sharded_checkpoint.is_sharded_checkpoint(tmp_path / "ckpt", META)
    assert not sharded_checkpoint.is_sharded_checkpoint(tmp_path / "ckpt" / META, META)
    assert sharded_checkpoint.model_key(tmp_path / "ckpt") == model_key
    assert sharded_checkpoint.optimizer_keys(tmp_path / "ckpt") == ["optimizer_0"]
    state = sharded_checkpoint.load_model_state(tmp_path / "ckpt", fresh.state_dict())
    fresh.load_state_dict(state)
    sharded_checkpoint.ShardedOptimizerState(tmp_path / "ckpt", "optimizer_0").load_into(fresh, fresh_optimizer)

    for name, value in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
    for mine, theirs in zip(fresh.parameters(), model.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_optimizer.state[mine][key], optimizer.state[theirs][key]), key


def test_a_directory_without_a_model_is_refused_by_name(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import save

    save({"weights": {"w": torch.ones(2)}}, checkpoint_id=tmp_path)
    with pytest.raises(ValueError, match="holds no model state"):
        sharded_checkpoint.model_key(tmp_path)


def test_a_module_on_the_meta_device_reads_nothing(tmp_path: Path) -> None:
    model, optimizer = trained()
    write(tmp_path / "ckpt", model, optimizer, "state_dict")
    with torch.device("meta"):
        template = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).state_dict()

    state = sharded_checkpoint.load_model_state(tmp_path / "ckpt", template)

    assert all(value.is_meta for value in state.values())


def test_shard_like_cuts_plain_tensors_where_the_template_holds_dtensors() -> None:
    """One process, a mesh of one: the cut is the whole tensor; values without a DTensor template pass as they are."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        template = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]), "step": torch.tensor(0.0)}
        full = {"w": torch.arange(8.0).reshape(4, 2), "step": torch.tensor(3.0), "lr": 0.1}

        cut = sharded_checkpoint.shard_like(full, template)

        assert isinstance(cut["w"], DTensor) and torch.equal(cut["w"].full_tensor(), full["w"])
        assert cut["step"] is full["step"] and cut["lr"] == 0.1
        assert sharded_checkpoint.shard_like(cut, template)["w"] is cut["w"]
    finally:
        dist.destroy_process_group()
