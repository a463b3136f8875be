"""What ``strategy="elan"`` refuses at the start of ``fit``, with one clear error (standalone: no ``elan run``)."""

from __future__ import annotations

from collections.abc import Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import lightning_elan  # noqa: F401  (registers strategy="elan")


class _Stream(IterableDataset):
    """64 samples, streamed."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(torch.randn(64, 3))


class _Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(3, 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.net(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_iterable_dataset_training_loader_is_refused_at_start() -> None:
    """Exactly once needs sample indices: refused before the first batch, not at the first resize."""
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(NotImplementedError, match="IterableDataset"):
        trainer.fit(_Model(), DataLoader(_Stream(), batch_size=8))


def test_a_training_loader_with_a_batch_sampler_is_refused_with_what_to_do() -> None:
    """``DataLoader(batch_sampler=...)`` has no ``batch_size``: a sentence naming the sampler and the way that works,
    not a ``TypeError`` from inside the strategy (probe round 4)."""
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(range(64)), batch_size=8,
                                            drop_last=False)
    with pytest.raises(NotImplementedError, match=r"batch_sampler \(BatchSampler\).*sampler=\.\.\. and batch_size="):
        trainer.fit(_Model(), DataLoader(_Points(64), batch_sampler=batches))


class _Points(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.x = torch.randn(size, 3)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.x[index]


class _TwoSourceModel(_Model):
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(batch["a"]).pow(2).mean() + self.net(batch["b"]).pow(2).mean()


def test_several_training_loaders_are_refused_at_start() -> None:
    """A dict of loaders (Lightning's CombinedLoader) would share one data position and end each epoch early."""
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    loaders = {"a": DataLoader(_Points(64), batch_size=8), "b": DataLoader(_Points(32), batch_size=4)}
    with pytest.raises(NotImplementedError, match=r"one training DataLoader.*got 2"):
        trainer.fit(_TwoSourceModel(), loaders)


@pytest.mark.parametrize("devices", [1, 2])
def test_devices_outside_elan_run_warn_that_one_process_trains(devices: int, caplog: pytest.LogCaptureFixture) -> None:
    """``Trainer(strategy="elan", devices=2)`` run as ``python train.py`` trains one process (no launcher of its own):
    it says so and how to start the workers, instead of training alone in silence."""
    trainer = pl.Trainer(strategy="elan", accelerator="cpu", devices=devices, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with caplog.at_level("WARNING", logger="lightning_elan"):
        trainer.fit(_Model(), DataLoader(_Points(16), batch_size=8))
    warned = [record.getMessage() for record in caplog.records if "outside `elan run`" in record.getMessage()]
    assert trainer.global_step == 2
    if devices == 1:
        assert warned == []
    else:
        assert len(warned) == 1 and "elan run --nproc 2 -- python" in warned[0], warned
