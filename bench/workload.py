"""The benchmark's model, data and per-step timestamp recorder (shared by every launcher).

Models are plain MLPs in float32 trained with Adam, sized by parameter count: ``tiny`` (CI smoke test), ``1m``,
``11m`` and ``25m``. A joiner needs the parameters and Adam's two moments: 12 bytes per parameter.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, TextIO

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import Dataset

from bench.sizes import CLASSES, IN_FEATURES, MODEL_SIZES, ModelSize

BASE_SAMPLES = 1024  # distinct samples; the dataset repeats them up to its virtual length


class RepeatedDataset(Dataset):
    """``length`` samples cycling over ``BASE_SAMPLES`` fixed random ones (cheap, deterministic, long epochs)."""

    def __init__(self, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(BASE_SAMPLES, IN_FEATURES, generator=generator)
        self.y = torch.randint(CLASSES, (BASE_SAMPLES,), generator=generator)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[index % BASE_SAMPLES], self.y[index % BASE_SAMPLES]


def build_mlp(size: ModelSize) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, size.width), nn.ReLU()]
    for _ in range(size.depth - 1):
        layers += [nn.Linear(size.width, size.width), nn.ReLU()]
    layers.append(nn.Linear(size.width, CLASSES))
    return nn.Sequential(*layers)


class BenchModel(pl.LightningModule):
    """The benchmark MLP. ``slowdown`` > 1 makes this process a straggler: its forward pass sleeps (slowdown − 1) ×
    three times its own length (forward + backward ≈ 3 forwards), so its compute per step is about ``slowdown`` ×
    the others'. ``sleep_model = (C, B)`` adds ``C/k + B·k`` seconds per step at world size k: a job whose compute
    shrinks with more workers while its communication grows (it stops scaling)."""

    def __init__(self, size: str = "tiny", lr: float = 1e-4, slowdown: float = 1.0,
                 sleep_model: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = build_mlp(MODEL_SIZES[size])
        self.slowdown, self.sleep_model = slowdown, sleep_model

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        started = time.perf_counter()
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        if self.slowdown > 1:
            time.sleep((self.slowdown - 1) * 3 * (time.perf_counter() - started))
        if self.sleep_model is not None:
            world = self.trainer.world_size
            time.sleep(self.sleep_model[0] / world + self.sleep_model[1] * world)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class ShardedBenchModel(BenchModel):
    """The benchmark MLP for Lightning's own ``ModelParallelStrategy``: sharded with FSDP2 in ``configure_model``
    over the data-parallel mesh, as Lightning's guide does (the stop-and-restart baseline of ``elan_fsdp``)."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


class StepFile:
    """Appends one JSON line per optimizer step (``time.time()`` after the step) to this process's own file.

    The first line describes the process: its pid, worker id, spawn time (the launcher's ``ELAN_SPAWN_TIME``, or
    ``BENCH_SPAWN_TIME`` set by the harness) and start time. Every later line is ``{"s": step, "t": time, "w":
    world size, "r": rank}``. Lines are flushed at once so the harness can follow the job while it runs.
    """

    def __init__(self, directory: Path, label: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{label}-{os.getpid()}.jsonl"
        self._file: TextIO = self.path.open("a", buffering=1)
        worker = os.environ.get("ELAN_WORKER_ID") or os.environ.get("RANK") or "w0"
        self._write({"event": "start", "pid": os.getpid(), "worker": worker, "spawn": spawn_time(), "t": time.time()})

    def step(self, step: int, world_size: int, rank: int, phases: list[float] | None = None) -> None:
        record: dict[str, Any] = {"s": step, "t": time.time(), "w": world_size, "r": rank}
        if phases:
            record["p"] = [round(seconds, 4) for seconds in phases]
        self._write(record)

    def flush(self) -> None:
        self._file.flush()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")


class StepTimes(Callback):
    """A :class:`StepFile` fed by Lightning: one line per trained batch, with the seconds of its phases (``p``: from
    the previous batch's end (an adjustment runs there), forward, backward with the gradient all-reduce, the commit
    vote, the optimizer step to the batch's end)."""

    def __init__(self, directory: Path, label: str) -> None:
        self.file = StepFile(directory, label)
        self._marks: list[float] = []
        self._last_end: float | None = None

    @property
    def path(self) -> Path:
        return self.file.path

    def on_train_batch_start(self, *args: Any) -> None:
        self._marks = [self._last_end or time.perf_counter(), time.perf_counter()]

    def on_before_backward(self, *args: Any) -> None:
        self._marks.append(time.perf_counter())

    def on_after_backward(self, *args: Any) -> None:
        self._marks.append(time.perf_counter())

    def on_before_optimizer_step(self, *args: Any) -> None:
        self._marks.append(time.perf_counter())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._last_end = time.perf_counter()
        marks = [*self._marks, self._last_end]
        phases = [later - earlier for earlier, later in itertools.pairwise(marks)] if len(marks) == 6 else None
        self.file.step(trainer.global_step, trainer.world_size, trainer.global_rank, phases)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.file.flush()


def spawn_time() -> float:
    """When this process was started: the launcher's stamp if there is one, else the kernel's start time."""
    for key in ("ELAN_SPAWN_TIME", "BENCH_SPAWN_TIME"):
        if os.environ.get(key):
            return float(os.environ[key])
    return process_start_time()


def process_start_time(pid: int | None = None) -> float:
    """``time.time()`` at which ``pid`` (default: this process) was started, from ``/proc`` (Linux)."""
    stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")


def skip_teardown() -> None:
    """Leave without running destructors. torch 2.13: freeing plain DDP's Reducer drops the last reference to its
    gloo group, whose destructor joins the group's worker thread while holding the GIL; a worker thread still
    freeing a finished all-reduce needs the GIL — the process hangs (seen with py-spy, one run in a few). Step files
    and checkpoints are written and flushed before, so nothing is lost."""
    logging.shutdown()
    os._exit(0)
