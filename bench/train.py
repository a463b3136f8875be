"""The benchmark's training script: one Lightning script, started by ``elan run``, plain DDP processes or torchrun.

    --launcher elan      strategy="elan" (an ``ElanStrategy`` with a fixed global batch; ``--strategy elan_fsdp``: an
                         ``ElanFSDPStrategy``, the model one FSDP2 unit; ``elan_hsdp``: with ``hsdp_group_size=2``);
                         started by ``elan run``
    --launcher ddp       Lightning's strategy="ddp", processes started by the harness with MASTER_ADDR/PORT, RANK,
                         WORLD_SIZE; ``--stop-at-step S`` saves a full checkpoint (fsync) at step S and stops,
                         ``--resume PATH`` loads one (stop-and-restart); with ``--ckpt-dir`` it checkpoints every
                         ``--ckpt-every`` steps and resumes from the latest, as under torchrun (bench/goodput.py)
    --launcher model_parallel  Lightning's ``ModelParallelStrategy`` (FSDP2 over the data-parallel mesh), started as
                         ``ddp``; its ``--stop-at-step`` checkpoint is a sharded (DCP) directory that ``--resume``
                         loads at another world size: stop-and-restart for ``elan_fsdp`` (bench/fsdp_reshard.py)
    --launcher torchrun  strategy="ddp" under torchrun elastic: a checkpoint every ``--ckpt-every`` steps, resumed
                         from at start, as torchrun's documentation prescribes

Every worker appends its step completion times to ``--steps-dir`` (see ``bench.workload.StepTimes``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

import lightning_elan
from bench.workload import BenchModel, RepeatedDataset, ShardedBenchModel, StepTimes, skip_teardown

log = logging.getLogger("bench.train")
CHECKPOINT_NAME = "last.ckpt"


def fsync_path(path: Path) -> None:
    """Flush ``path``'s data (a file, or every file of a checkpoint directory) and its directory entry to disk."""
    for part in sorted(path.rglob("*")) if path.is_dir() else []:
        if part.is_file():
            _fsync_one(part)
    _fsync_one(path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _fsync_one(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_durably(trainer: pl.Trainer, path: Path) -> float:
    """A full Lightning checkpoint (weights, Adam state, loops), written, fsynced and renamed into place."""
    started = time.perf_counter()
    tmp = path.with_suffix(".tmp")
    trainer.save_checkpoint(tmp)  # rank 0 writes (a sharded directory: every rank its part); all wait at a barrier
    if trainer.is_global_zero:
        fsync_path(tmp)
        if path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
        fsync_path(path)
    trainer.strategy.barrier("bench-checkpoint")
    return time.perf_counter() - started


class StopAtStep(Callback):
    """Stop-and-restart: at step ``step`` write a durable checkpoint, then end ``fit`` cleanly on every rank."""

    def __init__(self, step: int, path: Path) -> None:
        self.step = step
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            seconds = save_durably(trainer, self.path)
            log.info("step %d: checkpoint %s saved and fsynced in %.3f s; stopping", self.step, self.path, seconds)
            trainer.should_stop = True


class PeriodicCheckpoint(Callback):
    """torchrun elastic: a durable checkpoint every ``every`` steps, the script resumes from the latest at start."""

    def __init__(self, every: int, path: Path) -> None:
        self.every = every
        self.path = path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            save_durably(trainer, self.path)


class StopFile(Callback):
    """Ends ``fit`` at the step written in ``path`` (the harness writes a step a few steps ahead of every worker,
    so all ranks of a job stop at the same step without a collective)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop_at: int | None = None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._stop_at is None and self.path.exists():
            text = self.path.read_text().strip()
            self._stop_at = int(text) if text else None
        if self._stop_at is not None and trainer.global_step >= self._stop_at:
            trainer.should_stop = True


class ExitOnSigterm(Callback):
    """torchrun stops workers with SIGTERM and SIGKILLs them 30 s later. Lightning 2.6's SIGTERM handler broadcasts
    the flag to the other ranks from inside the signal handler: when the signal lands while the worker is inside a
    collective, that nested broadcast deadlocks against the peers' all-reduce and every restart sat out the 30 s.
    A torchrun script that checkpoints periodically loses nothing by exiting at once, so once training starts (after
    Lightning installed its handlers) this one replaces them."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        signal.signal(signal.SIGTERM, _exit_now)


def _exit_now(signum: int, frame: Any) -> None:
    os._exit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launcher", choices=("elan", "ddp", "model_parallel", "torchrun"), required=True)
    parser.add_argument("--strategy", choices=("elan", "elan_fsdp", "elan_hsdp"), default="elan",
                        help="with --launcher elan (elan_hsdp: elan_fsdp with hsdp_group_size=2)")
    parser.add_argument("--model", default="tiny", help="tiny, 1m, 11m or 25m")
    parser.add_argument("--global-batch", type=int, default=48, help="samples per step over all workers")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--steps-dir", type=Path, required=True)
    parser.add_argument("--label", default="worker", help="prefix of this process's step file")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "gpu"))
    parser.add_argument("--stop-at-step", type=int, default=None)
    parser.add_argument("--checkpoint", type=Path, default=None, help="ddp: file written at --stop-at-step")
    parser.add_argument("--resume", type=Path, default=None, help="ddp: checkpoint to start from")
    parser.add_argument("--ckpt-dir", type=Path, default=None, help="torchrun, ddp: folder of the periodic checkpoint")
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--epoch-steps", type=int, default=1000, help="global batches per epoch")
    parser.add_argument("--stop-file", type=Path, default=None, help="stop at the step this file names, once it exists")
    parser.add_argument("--slow-worker", default=None, metavar="W:FACTOR",
                        help="worker W (ELAN_WORKER_ID) computes FACTOR times as long per step (a straggler)")
    parser.add_argument("--sleep-model", default=None, metavar="C,B", help="sleep C/k + B*k s per step at world k")
    return parser.parse_args(argv)


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """``BenchModel``'s straggler and sleep-model arguments from ``--slow-worker`` and ``--sleep-model``."""
    options: dict[str, Any] = {}
    if args.slow_worker:
        worker, _, factor = args.slow_worker.partition(":")
        if worker == os.environ.get("ELAN_WORKER_ID"):
            options["slowdown"] = float(factor)
    if args.sleep_model:
        c, _, b = args.sleep_model.partition(",")
        options["sleep_model"] = (float(c), float(b))
    return options


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("ELAN_WORLD_SIZE") or 2)


def build_strategy(args: argparse.Namespace) -> Any:
    if args.launcher == "elan" and args.strategy in ("elan_fsdp", "elan_hsdp"):
        from lightning_elan.strategy.fsdp import ElanFSDPStrategy

        hsdp_group_size = 2 if args.strategy == "elan_hsdp" else None
        return ElanFSDPStrategy(global_batch_size=args.global_batch, hsdp_group_size=hsdp_group_size)
    if args.launcher == "elan":
        return lightning_elan.ElanStrategy(global_batch_size=args.global_batch)
    if args.launcher == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=world_size(), tensor_parallel_size=1)
    return "ddp"


def local_world_size() -> int:
    """Workers of this torchrun agent (``--nproc-per-node``): 1 for the one-worker-per-node jobs."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or 1)


def build_trainer(args: argparse.Namespace, callbacks: list[Callback]) -> pl.Trainer:
    torchrun = args.launcher == "torchrun"
    world = world_size()
    per_node = local_world_size() if torchrun else 1
    return pl.Trainer(
        strategy=build_strategy(args),
        accelerator=args.accelerator,
        devices=per_node if torchrun else 1 if args.launcher == "elan" else world,
        num_nodes=world // per_node if torchrun else 1,
        max_steps=args.max_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=callbacks,
    )


def build_callbacks(args: argparse.Namespace) -> tuple[list[Callback], Path | None]:
    """The step recorder plus the launcher's checkpoint callback; returns them and the checkpoint to resume."""
    callbacks: list[Callback] = [StepTimes(args.steps_dir, args.label)]
    resume = args.resume
    if args.stop_file is not None:
        callbacks.append(StopFile(args.stop_file))
    if args.launcher in ("ddp", "model_parallel") and args.stop_at_step is not None:
        if args.checkpoint is None:
            raise SystemExit("--stop-at-step needs --checkpoint")
        callbacks.append(StopAtStep(args.stop_at_step, args.checkpoint))
    if args.launcher == "torchrun" or (args.launcher == "ddp" and args.ckpt_dir is not None):
        if args.ckpt_dir is None:
            raise SystemExit("--launcher torchrun needs --ckpt-dir")
        args.ckpt_dir.mkdir(parents=True, exist_ok=True)
        latest = args.ckpt_dir / CHECKPOINT_NAME
        callbacks.append(PeriodicCheckpoint(args.ckpt_every, latest))
        resume = latest if latest.exists() else None
        callbacks.append(ExitOnSigterm())
    return callbacks, resume


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s: %(message)s")
    log.setLevel(logging.INFO)
    logging.getLogger("lightning_elan").setLevel(os.environ.get("BENCH_ELAN_LOG", "WARNING"))
    args = parse_args(argv)
    pl.seed_everything(0, verbose=False)
    callbacks, resume = build_callbacks(args)
    # per-worker batch at launch; elan keeps the global batch fixed under resizes (strong scaling)
    initial_world = 2 if args.launcher == "elan" else world_size()
    dataset = RepeatedDataset(args.global_batch * args.epoch_steps)
    loader = DataLoader(dataset, batch_size=max(1, args.global_batch // initial_world), shuffle=True)
    model = (ShardedBenchModel if args.launcher == "model_parallel" else BenchModel)(args.model, **model_options(args))
    trainer = build_trainer(args, callbacks)
    trainer.fit(model, loader, ckpt_path=str(resume) if resume else None)
    if args.accelerator == "gpu":
        torch.cuda.synchronize()
    if args.launcher != "elan":  # plain DDP under `ddp` and torchrun
        skip_teardown()


if __name__ == "__main__":
    main()
