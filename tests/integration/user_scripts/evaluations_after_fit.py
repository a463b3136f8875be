"""An ordinary user's Lightning script that trains, then calls ``trainer.validate``, ``trainer.test`` and
``trainer.predict`` (or only evaluates, ``--no-fit``), writing what each call returned. It knows nothing of
lightning_elan's internals; only ``strategy="elan"`` (or ``"elan_fsdp"``). float64 throughout.

python evaluations_after_fit.py OUT [--no-fit] [--hold CALL:BATCH:RANK] [--strategy elan|elan_fsdp] [--own-units]

``--own-units`` (with ``elan_fsdp``): ``configure_model`` shards each Linear and the module with FSDP2's
``fully_shard`` over ``self.device_mesh``, as Lightning's FSDP2 guide does (once: the hook runs for every call).

After ``fit`` the trainer saves ``OUT/final.ckpt``.
Rank 0 writes ``OUT/results.json`` after each call (the metrics ``validate``/``test`` returned, the world size it ran
on); every process writes the predictions it returned, with their sample indices, to ``OUT/predictions/rank-<r>.pt``.

``--hold`` (test scaffolding): the process of rank RANK, at batch BATCH of the call CALL (validate, test or predict;
``after-validate:0``: between ``validate`` and ``test``; ``save:0``: in ``on_save_checkpoint`` of the save after
``fit``, after the model's state was gathered), writes ``OUT/held.json`` (its pid) and waits there to be
killed by the test, unless ``OUT/hold-released`` exists (the test writes it before the kill, so the pass run again
does not hold).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import lightning_elan  # noqa: F401  (registers strategy="elan")

# every size divides among 3 and 2 processes: no evaluation sample is padded in, at either world size
TRAIN, VALIDATE, TEST, PREDICT = 96, 48, 60, 36


class Points(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(size, 3, generator=generator, dtype=torch.float64) * 4 - 2
        self.y = (self.x[:, :1] * self.x[:, 1:2] - self.x[:, 2:]).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Model(pl.LightningModule):
    def __init__(self, out: Path, hold: tuple[str, int, int] | None, own_units: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).double()
        self.out, self.hold, self.own_units = out, hold, own_units

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if not self.own_units or isinstance(self, FSDPModule):
            return
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=self.device_mesh)
        fully_shard(self, mesh=self.device_mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def hold_if_due(self, call: str, batch_idx: int) -> None:
        if self.hold != (call, batch_idx, self.global_rank) or (self.out / "hold-released").exists():
            return
        marker = self.out / "held.json"
        marker.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid(), "call": call, "rank": self.global_rank}))
        marker.with_suffix(".tmp").replace(marker)
        time.sleep(300)
        os._exit(3)  # never killed: the test did not do its part

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self.trainer.sanity_checking and self.trainer.state.fn == "validate":
            self.hold_if_due("validate", batch_idx)
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.hold_if_due("test", batch_idx)
        _, x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)
        self.log("test_max_error", (self(x) - y).abs().max(), sync_dist=True, reduce_fx="max")

    def predict_step(self, batch: Any, batch_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.hold_if_due("predict", batch_idx)
        index, x, _ = batch
        return index, self(x)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.hold_if_due("save", 0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def write_results(trainer: pl.Trainer, out: Path, results: dict[str, Any]) -> None:
    if trainer.global_rank == 0:
        (out / "results.json").write_text(json.dumps({**results, "world_size": trainer.world_size}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-fit", action="store_true")
    parser.add_argument("--hold", type=lambda text: (text.split(":")[0], *map(int, text.split(":")[1:])))
    parser.add_argument("--strategy", default="elan", choices=["elan", "elan_fsdp"])
    parser.add_argument("--own-units", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(3)
    trainer = pl.Trainer(strategy=args.strategy, accelerator="cpu", max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Model(args.out, args.hold, args.own_units)
    results: dict[str, Any] = {}
    if not args.no_fit:
        trainer.fit(model, DataLoader(Points(TRAIN, 0), batch_size=6, shuffle=True))
        trainer.save_checkpoint(args.out / "final.ckpt")
    results["validate"] = trainer.validate(model, DataLoader(Points(VALIDATE, 1), batch_size=4))
    write_results(trainer, args.out, results)
    model.hold_if_due("after-validate", 0)
    results["test"] = trainer.test(model, DataLoader(Points(TEST, 2), batch_size=5))
    write_results(trainer, args.out, results)
    predictions = trainer.predict(model, DataLoader(Points(PREDICT, 3), batch_size=3))
    (args.out / "predictions").mkdir(exist_ok=True)
    torch.save({"index": torch.cat([index for index, _ in predictions]),
                "prediction": torch.cat([value for _, value in predictions])},
               args.out / "predictions" / f"rank-{trainer.global_rank}.pt")
    results["predict_world_size"] = trainer.world_size
    write_results(trainer, args.out, results)


if __name__ == "__main__":
    main()
