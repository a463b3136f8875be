"""An ordinary user's sharded training script: a float64 MLP trained with Adam, checkpointed every epoch, resumable.

python fsdp_checkpoint_user.py OUT --strategy S --batch-size B --max-epochs E [--resume CKPT] [--devices N] [--classic]

``S``: ``elan_fsdp`` (a full checkpoint, the default), ``elan_fsdp_sharded`` (``ElanFSDPStrategy(state_dict_type=
"sharded")``), ``elan``, ``model_parallel`` (Lightning's own ``ModelParallelStrategy`` over ``--devices`` CPU
processes; the model is sharded with ``fully_shard`` in ``configure_model``, as Lightning's guide does) or
``model_parallel_full`` (the same with ``save_distributed_checkpoint=False``). Each process appends the samples of every
batch it trains to ``OUT/trained-<pid>.jsonl``; ``OUT/checkpoints`` gets one checkpoint per epoch, ``OUT/top`` the best
by ``train_loss`` of the checkpoints every 3 steps and ``last.ckpt``, ``OUT/steps`` every one of those. At the end the
script saves ``OUT/final.ckpt`` with ``trainer.save_checkpoint``. ``--classic``: the ``pytorch_lightning`` package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan" and "elan_fsdp")

if "--classic" in sys.argv:
    import pytorch_lightning as pl
    from lightning_elan.pytorch_lightning.strategy.fsdp import ElanFSDPStrategy
    from pytorch_lightning.callbacks import Callback, ModelCheckpoint
    from pytorch_lightning.strategies import ModelParallelStrategy
else:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_elan.strategy.fsdp import ElanFSDPStrategy

SAMPLES, FEATURES, WIDTH = 96, 6, 16


class Indexed(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, FEATURES, generator=generator, dtype=torch.float64)
        self.y = torch.sin(self.x.sum(dim=1, keepdim=True))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


class MLP(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                                 nn.Linear(WIDTH, 1)).double()

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


class RecordTrained(Callback):
    def __init__(self, out: Path) -> None:
        self.path = out / f"trained-{os.getpid()}.jsonl"

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with self.path.open("a") as file:
            file.write(json.dumps({"epoch": trainer.current_epoch, "step": trainer.global_step,
                                   "samples": batch[0].tolist()}) + "\n")


def strategy_of(name: str, devices: int):
    if name == "elan_fsdp_sharded":
        return ElanFSDPStrategy(state_dict_type="sharded")
    if name == "elan_hsdp_sharded":  # HSDP whenever the job has 4 (or 6, 8...) members
        return ElanFSDPStrategy(state_dict_type="sharded", hsdp_group_size=2)
    if name.startswith("model_parallel"):  # model_parallel_full: its checkpoints one file
        return ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1,
                                     save_distributed_checkpoint=name != "model_parallel_full")
    return name


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--strategy", default="elan_fsdp")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--max-epochs", type=int, required=True)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--classic", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(1)
    plain = args.strategy.startswith("model_parallel")
    trainer = pl.Trainer(
        strategy=strategy_of(args.strategy, args.devices), accelerator="cpu", max_epochs=args.max_epochs,
        logger=False, enable_progress_bar=False, enable_model_summary=False, **({"devices": args.devices} if plain
                                                                                else {}),
        callbacks=[RecordTrained(args.out), ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1),
                   ModelCheckpoint(dirpath=args.out / "top", monitor="train_loss", save_top_k=1, save_last=True,
                                   every_n_train_steps=3, filename="{step}"),
                   ModelCheckpoint(dirpath=args.out / "steps", every_n_train_steps=3, save_top_k=-1,
                                   filename="{step}")],
    )
    trainer.fit(MLP(), DataLoader(Indexed(), batch_size=args.batch_size, shuffle=True), ckpt_path=args.resume)
    if not getattr(trainer.strategy, "has_left", False):  # a worker that left the job has no model to save
        trainer.save_checkpoint(args.out / "final.ckpt")


if __name__ == "__main__":
    main()
