"""A transformers model fine-tuned in Lightning, as Lightning's "Finetune Transformers Models" tutorial writes it.

    python glue_transformer.py OUT [--gradient-checkpointing]

``GLUEDataModule``: ``prepare_data`` writes a made-up tokenized corpus once (``OUT/data/glue.pt``; the tutorial
downloads and tokenizes there), ``setup(stage)`` loads it into a training split and two validation splits
("matched" and "mismatched", as MNLI has), batches are dicts padded per batch by a ``collate_fn``.
``GLUETransformer``: ``BertForSequenceClassification`` built from a small ``BertConfig`` (nothing downloaded; float64,
dropout 0), ``self.save_hyperparameters()``, the loss from the model's own ``labels=``, the validation outputs kept in
a list per dataloader and reduced in ``on_validation_epoch_end`` (``dataloader_idx``), AdamW with the tutorial's
no-decay groups and ``get_linear_schedule_with_warmup`` over ``trainer.estimated_stepping_batches``, stepped every
batch. ``--gradient-checkpointing``: ``model.gradient_checkpointing_enable()``. Logs to ``OUT/logs/glue/version_0``;
Lightning's default ``ModelCheckpoint`` (the last epoch).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification, get_linear_schedule_with_warmup

import lightning_elan  # noqa: F401  (registers strategy="elan")

VOCABULARY, NUM_LABELS = 40, 3
SPLITS = {"train": 96, "validation_matched": 18, "validation_mismatched": 12}


class Tokenized(Dataset):
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, **self.rows[index]}


def pad(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The tutorial's tokenizer pads each batch to its longest row."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    return {"index": torch.tensor([row["index"] for row in rows]), "input_ids": ids, "attention_mask": mask,
            "labels": torch.tensor([row["label"] for row in rows])}


class GLUEDataModule(pl.LightningDataModule):
    eval_splits = ("validation_matched", "validation_mismatched")

    def __init__(self, data_dir: Path, train_batch_size: int = 6, eval_batch_size: int = 4) -> None:
        super().__init__()
        self.data_dir, self.train_batch_size, self.eval_batch_size = data_dir, train_batch_size, eval_batch_size
        self.dataset: dict[str, Tokenized] = {}

    def prepare_data(self) -> None:
        path = self.data_dir / "glue.pt"
        if path.exists():
            return
        generator = torch.Generator().manual_seed(3)
        corpus = {}
        for split, size in SPLITS.items():
            rows = []
            for _ in range(size):
                length = int(torch.randint(5, 14, (), generator=generator))
                ids = (torch.randint(1, VOCABULARY, (length,), generator=generator)).tolist()
                rows.append({"input_ids": ids, "label": sum(ids[:3]) % NUM_LABELS})
            corpus[split] = rows
        self.data_dir.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        torch.save(corpus, partial)
        partial.rename(path)

    def setup(self, stage: str) -> None:
        corpus = torch.load(self.data_dir / "glue.pt")
        self.dataset = {split: Tokenized(rows) for split, rows in corpus.items()}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset["train"], batch_size=self.train_batch_size, shuffle=True, collate_fn=pad)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(self.dataset[split], batch_size=self.eval_batch_size, collate_fn=pad)
                for split in self.eval_splits]


class GLUETransformer(pl.LightningModule):
    def __init__(self, learning_rate: float = 2e-3, warmup_steps: int = 3, weight_decay: float = 0.01,
                 gradient_checkpointing: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = BertConfig(vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=48, max_position_embeddings=32, num_labels=NUM_LABELS,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.model = BertForSequenceClassification(config).double()
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.outputs: dict[int, list[dict[str, torch.Tensor]]] = {}

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.model(**inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self(**{key: value for key, value in batch.items() if key != "index"}).loss
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        outputs = self(**{key: value for key, value in batch.items() if key != "index"})
        self.outputs.setdefault(dataloader_idx, []).append(
            {"loss_sum": outputs.loss * len(batch["labels"]), "count": torch.tensor(float(len(batch["labels"]))),
             "correct": (outputs.logits.argmax(-1) == batch["labels"]).sum().double()})

    def on_validation_epoch_end(self) -> None:
        for index, outputs in sorted(self.outputs.items()):
            split = GLUEDataModule.eval_splits[index].removeprefix("validation_")
            totals = {key: torch.stack([output[key] for output in outputs]).sum() for key in outputs[0]}
            totals = {key: self.trainer.strategy.reduce(value.double(), reduce_op="sum")
                      for key, value in totals.items()}
            self.log_dict({f"val_loss_{split}": totals["loss_sum"] / totals["count"],
                           f"val_acc_{split}": totals["correct"] / totals["count"],
                           f"val_seen_{split}": totals["count"]}, add_dataloader_idx=False)
        self.outputs.clear()

    def configure_optimizers(self) -> dict[str, Any]:
        no_decay = ["bias", "LayerNorm.weight"]
        groups = [
            {"params": [p for n, p in self.model.named_parameters() if not any(nd in n for nd in no_decay)],
             "weight_decay": self.hparams.weight_decay},
            {"params": [p for n, p in self.model.named_parameters() if any(nd in n for nd in no_decay)],
             "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.learning_rate)
        scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=self.hparams.warmup_steps,
                                                    num_training_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}


def main(out: Path, gradient_checkpointing: bool) -> None:
    pl.seed_everything(42)
    data = GLUEDataModule(out / "data")
    model = GLUETransformer(gradient_checkpointing=gradient_checkpointing)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=3, log_every_n_steps=1,
                         enable_progress_bar=False, default_root_dir=out, logger=CSVLogger(out / "logs", name="glue"))
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--gradient-checkpointing" in sys.argv[2:])
