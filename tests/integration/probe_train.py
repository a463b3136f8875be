"""A plain Lightning training script used by the integration tests (run through `elan run`).

It records, per worker: the dataset indices it trained on (per epoch), a bitwise digest of its parameters and optimizer
state at every step, the LR the optimizer used and the global batch at every step, when validation ran, and, on the
worker that ends as rank 0, the final parameters. ``--scaling POLICY`` adds ``HybridScaling`` and
``ProgressiveLinearLR``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset

import lightning_elan
from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR


class IndexedDataset(Dataset):
    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, 8, generator=generator, dtype=torch.float64)
        self.y = (self.x @ torch.linspace(-1, 1, 8, dtype=torch.float64)).unsqueeze(1) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        return index, self.x[index], self.y[index]


class ProbeModel(pl.LightningModule):
    def __init__(self, out_dir: Path, step_sleep: float = 0.0) -> None:
        super().__init__()
        self.step_sleep = step_sleep
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        self.out_dir = out_dir
        self.consumed: dict[int, list[int]] = {}
        self.digests: list[list] = []
        self.steps: list[list] = []  # [global_step, epoch, world_size, global_batch, lr used by the optimizer]
        self.validations: list[list[int]] = []  # [epoch, global_step] of every validation run (not sanity checks)

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        if getattr(self.trainer.strategy, "sample_weight", 1.0) > 0:
            self.consumed.setdefault(self.current_epoch, []).extend(index.tolist())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def on_train_batch_start(self, batch, batch_idx):
        trainer = self.trainer
        self.digests.append([trainer.global_step, trainer.world_size, trainer.global_rank, state_digest(self)])

    def on_before_optimizer_step(self, optimizer):
        # after the callbacks' hook: ProgressiveLinearLR has scaled the LR for this step
        trainer = self.trainer
        global_batch = getattr(getattr(trainer.strategy, "data_position", None), "global_batch", None)
        lr = optimizer.param_groups[0]["lr"]
        self.steps.append([trainer.global_step, trainer.current_epoch, trainer.world_size, global_batch, lr])

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validations.append([self.trainer.current_epoch, self.trainer.global_step])

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def state_digest(model: ProbeModel) -> str:
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(tensor.detach().cpu().numpy().tobytes())
    optimizer = model.trainer.optimizers[0]
    for state in optimizer.state.values():
        for key in sorted(state):
            digest.update(state[key].detach().cpu().numpy().tobytes())
    digest.update(repr([group["lr"] for group in optimizer.param_groups]).encode())
    return digest.hexdigest()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s: %(message)s")
    logging.getLogger("lightning_elan").setLevel(os.environ.get("ELAN_PROBE_LOG", "INFO"))
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--no-shuffle", action="store_true")
    parser.add_argument("--val", action="store_true")
    parser.add_argument("--strategy", default="elan", help="'elan', or a Lightning strategy for comparison runs")
    parser.add_argument("--devices", default="auto")
    parser.add_argument("--accelerator", default="cpu", help="'gpu' for the CUDA runs of tests/gpu")
    parser.add_argument("--backend", default=None, help="process group backend of the elan strategy (e.g. gloo)")
    parser.add_argument("--full-lightning", action="store_true", help="CSV logger, ModelCheckpoint, progress bar")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (slows a job down)")
    parser.add_argument("--scaling", choices=["strong", "weak", "hybrid"], help="add HybridScaling with this policy")
    parser.add_argument("--ramp-steps", type=int, default=4, help="ProgressiveLinearLR ramp (with --scaling)")
    parser.add_argument("--profile", type=Path, help="ThroughputModel JSON for HybridScaling (not learned further)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    pl.seed_everything(7)
    model = ProbeModel(args.out, args.step_sleep)
    dataset = IndexedDataset(args.samples)
    loader_kwargs = {"num_workers": args.num_workers, "persistent_workers": args.num_workers > 0}
    train = DataLoader(dataset, batch_size=args.batch_size, shuffle=not args.no_shuffle, **loader_kwargs)
    val = DataLoader(IndexedDataset(30), batch_size=5) if args.val else None
    strategy = args.strategy
    if strategy == "elan" and (args.global_batch or args.backend):
        strategy = lightning_elan.ElanStrategy(global_batch_size=args.global_batch, process_group_backend=args.backend)
    full = args.full_lightning
    callbacks = [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)] if full else []
    if args.scaling:
        profile = None if args.profile is None else str(args.profile)
        scaling = HybridScaling(policy=args.scaling, profile=profile, learn=profile is None)
        callbacks += [scaling, ProgressiveLinearLR(ramp_steps=args.ramp_steps)]
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=int(args.devices) if args.devices.isdigit() else args.devices,
        max_epochs=args.epochs,
        default_root_dir=args.out,
        logger=CSVLogger(args.out / "logs", flush_logs_every_n_steps=1) if full else False,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=full,
        enable_progress_bar=full,
        enable_model_summary=False,
        limit_val_batches=1.0 if args.val else 0,
        num_sanity_val_steps=2 if args.val else 0,
    )
    trainer.fit(model, train, val)

    worker = os.environ.get("ELAN_WORKER_ID", "w0")
    record = {
        "worker": worker,
        "left": getattr(trainer.strategy, "has_left", False),
        "global_step": trainer.global_step,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "consumed": model.consumed,
        "digests": model.digests,
        "steps": model.steps,
        "validations": model.validations,
    }
    (args.out / f"record-{worker}.json").write_text(json.dumps(record))
    if not record["left"] and trainer.global_rank == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.out / "final.pt")
    if args.strategy != "elan" and torch.distributed.is_initialized():
        # a plain Lightning comparison run: rank 0 hosts the store, so no rank may exit while another still uses it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
