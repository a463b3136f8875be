"""``strategy="elan_fsdp"`` in one process (no ``elan run``): registered with both Lightning trees, the model sharded
by FSDP2 over a mesh of the generation's group (``self.device_mesh`` in ``configure_model``), the optimizer over the
sharded parameters, a checkpoint of plain full tensors; what is not supported yet is refused at the start of fit."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  (registers the strategies)
from lightning_elan.strategy.fsdp import ElanFSDPStrategy


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(_Block(), _Block(), nn.Linear(4, 1)).double()
        self.mesh_seen: object = None

    def configure_model(self) -> None:
        self.mesh_seen = self.device_mesh

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _data() -> DataLoader:
    x = torch.randn(16, 4, dtype=torch.float64)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def _trainer(strategy: object, tmp_path: Path, **options: object) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=tmp_path, **options)


def test_registered_with_both_lightning_trees() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert StrategyRegistry["elan_fsdp"]["strategy"] is ElanFSDPStrategy
    pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.strategies import StrategyRegistry as ClassicRegistry

    assert ClassicRegistry["elan_fsdp"]["strategy"].__module__ == "lightning_elan.pytorch_lightning.strategy.fsdp"


def test_trains_sharded_and_saves_a_full_checkpoint(tmp_path: Path) -> None:
    model = _Model()
    trainer = _trainer(ElanFSDPStrategy(shard_modules={_Block}), tmp_path)
    trainer.fit(model, _data())

    assert model.mesh_seen is trainer.strategy.device_mesh and model.mesh_seen.size() == 1
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())
    assert trainer.optimizers[0].param_groups[0]["params"][0] is next(model.parameters())
    trainer.save_checkpoint(tmp_path / "full.ckpt")
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert sorted(checkpoint["state_dict"]) == sorted(name for name, _ in model.named_parameters())
    assert all(type(value) is torch.Tensor for value in checkpoint["state_dict"].values())
    assert set(checkpoint["optimizer_states"][0]["state"]) == set(checkpoint["state_dict"])


def test_hsdp_over_a_world_smaller_than_its_group_is_fsdp(tmp_path: Path) -> None:
    """``hsdp_group_size=2`` in a 1-member world: no two replica groups, so FSDP over the one member (1-D mesh)."""
    model = _Model()
    trainer = _trainer(ElanFSDPStrategy(hsdp_group_size=2), tmp_path)
    trainer.fit(model, _data())

    assert model.mesh_seen.ndim == 1 and model.mesh_seen.size() == 1
    assert all(isinstance(parameter, DTensor) for parameter in model.parameters())


@pytest.mark.parametrize("size", [0, -2, 1.5, "2", True])
def test_an_invalid_hsdp_group_size_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match="hsdp_group_size must be a positive integer"):
        ElanFSDPStrategy(hsdp_group_size=size)  # type: ignore[arg-type]
