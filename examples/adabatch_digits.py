"""The Elan AdaBatch experiment (paper §VI-B) in miniature, on scikit-learn's digits (shipped with the package).

AdaBatch trains with a small batch first and doubles it at intervals; Elan doubles the workers with it (weak scaling)
and ramps the LR ×2 over a few steps at each doubling (progressive linear scaling), expecting the accuracy of the
static run. Here: an MLP, global batch 32 → 64 → 128 at 1/3 and 2/3 of the epochs.

    pip install -e ".[examples]"
    python examples/adabatch_digits.py            # static baseline and AdaBatch in one process; accuracies + PNG

One process runs both the static baseline (batch 32 throughout) and AdaBatch without elasticity (the same batch and
LR schedule on one worker), prints the final test accuracies and writes ``adabatch_digits.png`` (LR actually used per
step, test accuracy per epoch).

The elastic run (``--elastic``) is the same AdaBatch schedule driven by worker changes — 1 → 2 → 4 workers, the global
batch following by ``HybridScaling(policy="weak")`` and the LR by ``ProgressiveLinearLR``::

    elan run --nproc 1 --job adabatch --schedule "450:to=2,680:to=4" -- python examples/adabatch_digits.py --elastic

(45 steps per epoch at batch 32, 23 at 64: epochs 10 and 20 start at steps 450 and 680; the adjustments land one
step later, because the last batch of an epoch is followed by validation, so the global batch changes one batch into
the epoch.) Rank 0 writes ``adabatch_digits_elastic.png`` and ``.json`` at the end.

``--with-elastic`` runs the comparison and that ``elan run`` job, and prints the elastic run's final accuracy next to
the static run of the same seed (0).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_elan  # noqa: F401  registers strategy="elan"
from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR

log = logging.getLogger("adabatch_digits")


@dataclass(frozen=True)
class Config:
    epochs: int = 30
    batch: int = 32
    lr: float = 0.05
    ramp_steps: int = 20
    seeds: int = 3
    out: Path = Path(".")

    @property
    def doubling_epochs(self) -> tuple[int, int]:
        return self.epochs // 3, 2 * self.epochs // 3


# ---------------------------------------------------------------------- data and model


def digits_splits(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """1,437 training and 360 test images of 8×8 digits, standardised with the training statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    std[std == 0] = 1.0  # pixels that are blank in every training image

    def tensors(features: np.ndarray, labels: np.ndarray) -> TensorDataset:
        data = torch.tensor((features - mean) / std, dtype=torch.float32)
        return TensorDataset(data, torch.tensor(labels, dtype=torch.long))

    return tensors(x_train, y_train), tensors(x_test, y_test)


class DigitsMLP(pl.LightningModule):
    def __init__(self, lr: float, epochs: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        accuracy = (logits.argmax(dim=1) == y).float().mean()
        self.log("test_acc", accuracy, sync_dist=True, batch_size=len(y))
        self.log("test_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, batch_size=len(y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams.epochs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


class DigitsData(pl.LightningDataModule):
    """Its ``batch_size`` may change between epochs (the single-process trainer reloads the loaders every epoch); in
    the elastic run it is the per-worker batch at launch and the strategy keeps the global batch."""

    def __init__(self, batch_size: int, seed: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.train_set, self.test_set = digits_splits(seed)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=len(self.test_set))


# ---------------------------------------------------------------------- callbacks of the experiment


class History(Callback):
    """The LR the optimizer used at every step, the test accuracy and loss after every epoch. Its state is replicated
    to joiners in an elastic run, so rank 0 has the whole history at the end, whoever it is."""

    def __init__(self) -> None:
        self.lr: list[float] = []
        self.accuracy: list[float] = []
        self.loss: list[float] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.lr.append(float(optimizer.param_groups[0]["lr"]))  # after ProgressiveLinearLR (listed before us)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        metrics = trainer.callback_metrics  # this epoch's validation has run and its metrics are final here
        if "test_acc" in metrics:
            self.accuracy.append(float(metrics["test_acc"]))
            self.loss.append(float(metrics["test_loss"]))

    def state_dict(self) -> dict[str, Any]:
        return {"lr": self.lr, "accuracy": self.accuracy, "loss": self.loss}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.lr, self.accuracy, self.loss = (list(state_dict[key]) for key in ("lr", "accuracy", "loss"))


class DoubleBatch(Callback):
    """AdaBatch on one worker: double the batch at the given epochs and ramp the LR to batch / initial batch."""

    def __init__(self, data: DigitsData, epochs: tuple[int, ...], ramp: ProgressiveLinearLR) -> None:
        self.data, self.epochs, self.ramp = data, epochs, ramp
        self.initial_batch = data.batch_size

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch + 1 in self.epochs:
            self.data.batch_size *= 2
            self.ramp.start_ramp(trainer.global_step, self.data.batch_size / self.initial_batch)


# ---------------------------------------------------------------------- runs


def make_trainer(config: Config, callbacks: list[Callback], strategy: str = "auto") -> pl.Trainer:
    # one process changes its batch by reloading the loader each epoch; the elastic job re-splits its global batch
    reload_every = 1 if strategy == "auto" else 0
    return pl.Trainer(
        max_epochs=config.epochs, accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks,
        reload_dataloaders_every_n_epochs=reload_every, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )


def run_single_process(config: Config, adabatch: bool, seed: int) -> History:
    pl.seed_everything(seed, verbose=False)
    data, history = DigitsData(config.batch, seed), History()
    callbacks: list[Callback] = []
    if adabatch:
        ramp = ProgressiveLinearLR(ramp_steps=config.ramp_steps)
        callbacks = [ramp, DoubleBatch(data, config.doubling_epochs, ramp)]
    make_trainer(config, [*callbacks, history]).fit(DigitsMLP(config.lr, config.epochs), datamodule=data)
    return history


def run_elastic(config: Config) -> None:
    """One worker of an `elan run` job: the global batch follows the workers (weak scaling), the LR ramps."""
    pl.seed_everything(0, verbose=False)
    data, history = DigitsData(config.batch, 0), History()
    callbacks = [HybridScaling(policy="weak"), ProgressiveLinearLR(ramp_steps=config.ramp_steps), history]
    trainer = make_trainer(config, callbacks, strategy="elan")
    trainer.fit(DigitsMLP(config.lr, config.epochs), datamodule=data)
    if getattr(trainer.strategy, "has_left", False) or not trainer.is_global_zero:
        return
    path = config.out / "adabatch_digits_elastic.json"
    path.write_text(json.dumps(history.state_dict()))
    plot(config.out / "adabatch_digits_elastic.png", {"elastic 1→2→4 workers": history})
    log.info("elastic run: final test accuracy %.4f; history in %s", history.accuracy[-1], path)


def plot(path: Path, runs: dict[str, History]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[examples]'): no %s", path)
        return
    figure, (lr_axis, acc_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for name, history in runs.items():
        lr_axis.plot(history.lr, label=name)
        acc_axis.plot(range(1, len(history.accuracy) + 1), history.accuracy, label=name)
    lr_axis.set(xlabel="optimizer step", ylabel="learning rate used", title="LR (scheduler × ramp)")
    acc_axis.set(xlabel="epoch", ylabel="test accuracy", title="digits test accuracy")
    lr_axis.legend()
    acc_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def compare(config: Config) -> dict[str, Any]:
    """Static vs. single-process AdaBatch over ``config.seeds`` seeds; plot seed 0."""
    finals: dict[str, list[float]] = {"static": [], "adabatch": []}
    losses: dict[str, list[float]] = {"static": [], "adabatch": []}
    first: dict[str, History] = {}
    for seed in range(config.seeds):
        for name in finals:
            history = run_single_process(config, adabatch=name == "adabatch", seed=seed)
            finals[name].append(history.accuracy[-1])
            losses[name].append(history.loss[-1])
            first.setdefault(name, history)
    labels = {"static": f"static batch {config.batch}", "adabatch": "AdaBatch x1, x2, x4"}
    plot(config.out / "adabatch_digits.png", {labels[name]: history for name, history in first.items()})
    means = {name: float(np.mean(values)) for name, values in finals.items()}
    return {"final_accuracy": finals, "final_loss": losses, "mean": means,
            "difference": means["adabatch"] - means["static"]}


def elastic_schedule(config: Config, train_size: int = 1437) -> str:
    """``--schedule`` that doubles the workers when epochs ``doubling_epochs`` start (1 → 2 → 4)."""
    first, second = config.doubling_epochs
    at_1 = first * math.ceil(train_size / config.batch)
    at_2 = at_1 + (second - first) * math.ceil(train_size / (2 * config.batch))
    return f"{at_1}:to=2,{at_2}:to=4"


def run_elastic_job(config: Config) -> History:
    """The elastic run through ``elan run`` (1 → 2 → 4 workers); returns rank 0's history."""
    out = config.out / "elastic"
    out.mkdir(parents=True, exist_ok=True)
    home = tempfile.mkdtemp(prefix="elan-home-")
    command = [
        sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "1", "--job", "adabatch",
        "--state-dir", str(out / "state"), "--schedule", elastic_schedule(config), "--",
        sys.executable, str(Path(__file__).resolve()), "--elastic", "--out", str(out), "--epochs", str(config.epochs),
        "--batch", str(config.batch), "--lr", str(config.lr), "--ramp-steps", str(config.ramp_steps),
    ]
    log.info("elastic run: %s", " ".join(command))
    subprocess.run(command, check=True, env={**os.environ, "ELAN_HOME": home})
    history = History()
    history.load_state_dict(json.loads((out / "adabatch_digits_elastic.json").read_text()))
    return history


def report_elastic(config: Config, static_seed0: float) -> None:
    history = run_elastic_job(config)
    difference = 100 * (history.accuracy[-1] - static_seed0)
    log.info("elastic 1->2->4 workers (seed 0) final test accuracy %.4f vs static %.4f: %+.2f points "
             "(target: within ±0.5); LR curve in %s", history.accuracy[-1], static_seed0, difference,
             config.out / "elastic" / "adabatch_digits_elastic.png")


def parse_args() -> tuple[Config, bool, bool]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elastic", action="store_true", help="one worker of an `elan run` job (see the module doc)")
    parser.add_argument("--epochs", type=int, default=Config.epochs)
    parser.add_argument("--batch", type=int, default=Config.batch, help="initial global batch")
    parser.add_argument("--lr", type=float, default=Config.lr)
    parser.add_argument("--ramp-steps", type=int, default=Config.ramp_steps)
    parser.add_argument("--seeds", type=int, default=Config.seeds, help="seeds averaged in the comparison")
    parser.add_argument("--out", type=Path, default=Config.out, help="directory for the PNG/JSON")
    parser.add_argument("--with-elastic", action="store_true", help="also run the elastic job through `elan run`")
    args = parser.parse_args()
    config = Config(args.epochs, args.batch, args.lr, args.ramp_steps, args.seeds, args.out)
    return config, args.elastic, args.with_elastic


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config, elastic, with_elastic = parse_args()
    config.out.mkdir(parents=True, exist_ok=True)
    if elastic:
        run_elastic(config)
        return
    result = compare(config)
    for name, values in result["final_accuracy"].items():
        loss = " ".join(f"{v:.4f}" for v in result["final_loss"][name])
        log.info("%-9s final test accuracy %s (mean %.4f), test loss %s", name, " ".join(f"{v:.4f}" for v in values),
                 result["mean"][name], loss)
    log.info("AdaBatch - static: %+.2f points (target: within ±0.5); LR curves in %s", 100 * result["difference"],
             config.out / "adabatch_digits.png")
    if with_elastic:
        report_elastic(config, result["final_accuracy"]["static"][0])


if __name__ == "__main__":
    main()
