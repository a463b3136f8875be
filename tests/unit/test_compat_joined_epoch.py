"""``compat._warn_of_skipped_epoch_start_hooks``: a joiner names the user's ``on_train_epoch_start`` hooks it did not
run (the LightningModule's, a user callback's), and not Lightning's own callbacks'."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, GradientAccumulationScheduler, LearningRateMonitor

from lightning_elan import compat


class Annealed(pl.LightningModule):
    def on_train_epoch_start(self) -> None:
        self.beta = self.current_epoch / 10


class Curriculum(Callback):
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass


class Quiet(Callback):
    pass


def _joiner(module: pl.LightningModule, callbacks: list[Callback]) -> SimpleNamespace:
    return SimpleNamespace(lightning_module=module, callbacks=callbacks, current_epoch=3)


def test_the_users_hooks_are_named(caplog: pytest.LogCaptureFixture) -> None:
    callbacks = [Curriculum(), Quiet(), LearningRateMonitor(), GradientAccumulationScheduler({1: 2})]
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        compat._warn_of_skipped_epoch_start_hooks(_joiner(Annealed(), callbacks))
    [record] = caplog.records
    assert "middle of epoch 3" in record.message
    assert "on_train_epoch_start of Annealed, Curriculum;" in record.message


def test_nothing_is_said_when_only_lightnings_own_hooks_were_skipped(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=compat.__name__):
        compat._warn_of_skipped_epoch_start_hooks(_joiner(pl.LightningModule(), [LearningRateMonitor(), Quiet()]))
    assert not caplog.records
