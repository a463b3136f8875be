"""Lightning's guide to FSDP2 (``ModelParallelStrategy``), its ``LanguageModel`` as the guide writes it, trained with
``strategy="elan_fsdp"`` instead: the demo ``Transformer`` built on the meta device in ``configure_model``, each
encoder and decoder layer sharded with ``fully_shard(layer, mesh=self.device_mesh)``, then the whole model; the
parameters materialised by the strategy (``reset_parameters``), as ``ModelParallelStrategy`` does. Adam; the demo's
``WikiText2`` (``./data/wikitext-2.txt``, made up by the test); float64 and no dropout, so a run at any world size
trains the same model. The user's additions: ``self.log`` of the loss (``sync_dist``) and of a torchmetrics
``SumMetric`` and ``MinMetric`` made in ``__init__`` (the samples trained in the epoch, the smallest batch a process
trained).

    python fsdp_guide_lm.py OUT [--epochs 3] [--units layers|model] [--after-fit] [--accumulate K] [--clip C]

``--accumulate K``/``--clip C``: ``Trainer(accumulate_grad_batches=K, gradient_clip_val=C)``. ``--sharded-checkpoints``:
``ElanFSDPStrategy(state_dict_type="sharded")`` (each checkpoint a directory of DCP shards, written by every member).
``--units model``: only the whole model is made a unit (the guide's smallest form); ``--units policies``:
``configure_model`` makes no unit, and the strategy gets Lightning ``FSDPStrategy``'s arguments as its FSDP guide passes
them (``ElanFSDPStrategy(auto_wrap_policy=layers, activation_checkpointing_policy=layers,
sharding_strategy="SHARD_GRAD_OP")``). After ``fit`` each process writes the names of its FSDP2 units and activation
checkpoint wrappers to ``OUT/structure-<pid>.json``. ``OUT/checkpoints`` gets a
checkpoint every 4 steps (the two lowest ``train_loss`` and ``last.ckpt``), ``OUT/logs`` a ``CSVLogger``'s rows, and
at the end ``OUT/final.ckpt`` (``trainer.save_checkpoint``). ``--after-fit``: then ``trainer.validate`` and
``trainer.predict`` over the first 24 samples in order (rank 0 writes the validation loss to ``OUT/validated.json``, and
each process its predictions to ``OUT/predicted-<pid>.pt``), and a second ``Trainer`` fits one more epoch from
``OUT/final.ckpt`` and saves ``OUT/final2.ckpt``. ``--validate-only``: a job that only evaluates, ``trainer.validate``
of the new model over the first 24 samples (each process writes its results to ``OUT/validated-<pid>.json``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos import Transformer, WikiText2
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import DataLoader, Subset

import lightning_elan  # noqa: F401  (registers strategy="elan_fsdp")
from lightning_elan import ElanFSDPStrategy


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size: int, units: str) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.units = units
        self.model = None
        self.samples_seen = torchmetrics.SumMetric()
        self.smallest_batch = torchmetrics.MinMetric()

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            model = Transformer(vocab_size=self.vocab_size, nlayers=2, nhid=64, ninp=32, nhead=4, dropout=0.0)
        if self.units == "policies":  # the strategy makes the units (and checkpoints their activations)
            self.model = model
            return
        if self.units == "layers":
            for module in model.modules():
                if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
                    fully_shard(module, mesh=self.device_mesh)
        fully_shard(model, mesh=self.device_mesh)
        self.model = model

    def training_step(self, batch):
        input, target = batch
        output = self.model(input, target)
        loss = F.nll_loss(output, target.view(-1))
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        self.samples_seen.update(torch.tensor(float(len(input))))
        self.log("samples_seen", self.samples_seen, on_step=False, on_epoch=True)
        self.smallest_batch.update(torch.tensor(float(len(input))))
        self.log("smallest_batch", self.smallest_batch, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch):
        input, target = batch
        self.log("val_loss", F.nll_loss(self.model(input, target), target.view(-1)), sync_dist=True)

    def predict_step(self, batch):
        input, target = batch
        return self.model(input, target).argmax(-1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--units", choices=["layers", "model", "policies"], default="layers")
    parser.add_argument("--after-fit", action="store_true")
    parser.add_argument("--validate-only", action="store_true", help="trainer.validate of the new model, no fit")
    parser.add_argument("--accumulate", type=int, default=1, help="Trainer(accumulate_grad_batches=...)")
    parser.add_argument("--clip", type=float, default=None, help="Trainer(gradient_clip_val=...)")
    parser.add_argument("--sharded-checkpoints", action="store_true", help='state_dict_type="sharded"')
    args = parser.parse_args()

    torch.set_default_dtype(torch.float64)
    L.seed_everything(42)
    dataset = WikiText2(data_dir=Path("data"))
    train_dataloader = DataLoader(dataset, batch_size=6, shuffle=True)
    model = LanguageModel(dataset.vocab_size, args.units)
    checkpoint = ModelCheckpoint(dirpath=args.out / "checkpoints", every_n_train_steps=4, save_top_k=2,
                                 monitor="train_loss", save_last=True)
    state_dict_type = "sharded" if args.sharded_checkpoints else "full"
    strategy = ElanFSDPStrategy(state_dict_type=state_dict_type) if args.sharded_checkpoints else "elan_fsdp"
    if args.units == "policies":  # Lightning FSDPStrategy's arguments, as its guide passes them
        layers = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
        strategy = ElanFSDPStrategy(auto_wrap_policy=layers, activation_checkpointing_policy=layers,
                                    sharding_strategy="SHARD_GRAD_OP", state_dict_type=state_dict_type)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=args.epochs,
                        accumulate_grad_batches=args.accumulate, gradient_clip_val=args.clip,
                        callbacks=[checkpoint], logger=CSVLogger(args.out / "logs", name="lm"), log_every_n_steps=1,
                        enable_progress_bar=False)
    if args.validate_only:
        validated = trainer.validate(model, DataLoader(Subset(dataset, range(24)), batch_size=6))
        (args.out / f"validated-{os.getpid()}.json").write_text(json.dumps(validated))
        return
    trainer.fit(model, train_dataloader)
    trainer.save_checkpoint(args.out / "final.ckpt")
    (args.out / f"structure-{os.getpid()}.json").write_text(json.dumps({  # what the model is made of now
        "units": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
        "checkpointed": [name for name, module in model.named_modules() if isinstance(module, CheckpointWrapper)]}))
    if args.after_fit:
        after_fit(trainer, model, dataset, args)


def after_fit(trainer: L.Trainer, model: LanguageModel, dataset: WikiText2, args: argparse.Namespace) -> None:
    first = DataLoader(Subset(dataset, range(24)), batch_size=6)
    validated = trainer.validate(model, first)
    if trainer.is_global_zero:
        (args.out / "validated.json").write_text(json.dumps(validated))
    predictions = trainer.predict(model, first)
    torch.save(predictions, args.out / f"predicted-{os.getpid()}.pt")
    again = L.Trainer(accelerator="cpu", devices=1, strategy="elan_fsdp", max_epochs=args.epochs + 1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False)
    again.fit(model, DataLoader(dataset, batch_size=6, shuffle=True), ckpt_path=args.out / "final.ckpt")
    again.save_checkpoint(args.out / "final2.ckpt")


if __name__ == "__main__":
    main()
