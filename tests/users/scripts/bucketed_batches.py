"""Variable-length sequences batched by length: the DataLoader gets its own ``batch_sampler``.

    python bucketed_batches.py OUT

``LengthBuckets`` (a ``torch.utils.data.Sampler`` of index lists) shuffles the sequences, sorts each chunk of 24 by
length and cuts it into batches of 6, so each batch pads little; ``collate`` pads a batch to its longest sequence.
A GRU reads the sequences and regresses their mean. Float64; ``OUT/logs/buckets/version_0`` holds the losses.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, Dataset, Sampler

import lightning_elan  # noqa: F401  (registers strategy="elan")


class Sequences(Dataset):
    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(3, 13, (size,), generator=generator)
        self.items = [torch.randn(int(n), 1, generator=generator, dtype=torch.float64) for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor]:
        return index, self.items[index]


class LengthBuckets(Sampler[list[int]]):
    def __init__(self, lengths: list[int], batch_size: int, chunk: int, seed: int) -> None:
        self.lengths, self.batch_size, self.chunk, self.seed, self.epoch = lengths, batch_size, chunk, seed, 0

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        self.epoch += 1
        order = torch.randperm(len(self.lengths), generator=generator).tolist()
        for start in range(0, len(order), self.chunk):
            chunk = sorted(order[start:start + self.chunk], key=lambda i: self.lengths[i])
            yield from (chunk[i:i + self.batch_size] for i in range(0, len(chunk), self.batch_size))

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)


def collate(items: list[tuple[int, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    indices = torch.tensor([index for index, _ in items])
    lengths = torch.tensor([len(sequence) for _, sequence in items])
    padded = torch.nn.utils.rnn.pad_sequence([sequence for _, sequence in items], batch_first=True)
    return indices, padded, lengths


class Reader(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.GRU(1, 8, batch_first=True).double()
        self.head = torch.nn.Linear(8, 1).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, padded, lengths = batch
        packed = torch.nn.utils.rnn.pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=False)
        _, hidden = self.rnn(packed)
        target = padded.sum(1) / lengths.unsqueeze(1)
        loss = torch.nn.functional.mse_loss(self.head(hidden[-1]), target)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def main(out: Path) -> None:
    pl.seed_everything(43)
    data = Sequences(96, 0)
    buckets = LengthBuckets([len(sequence) for _, sequence in data], batch_size=6, chunk=24, seed=5)
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=2, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                         logger=CSVLogger(out / "logs", name="buckets"))
    trainer.fit(Reader(), DataLoader(data, batch_sampler=buckets, collate_fn=collate))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
