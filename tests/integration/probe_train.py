"""A plain Lightning training script used by the integration tests (run through `elan run`).

It records, per worker: the dataset indices it trained on (per epoch), a bitwise digest of its parameters and optimizer
state at every step, the LR the optimizer used and the global batch at every step, when validation ran, and, on the
worker that ends as rank 0, the final parameters. ``--scaling POLICY`` adds ``HybridScaling`` and
``ProgressiveLinearLR``. Its options are ``ProbeConfig`` (one flag per field); the config that ran is written to
``OUT/config.json`` and into every worker's record.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import time
import typing
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

import lightning.pytorch as pl
import torch
import torchmetrics
from hold_point import HOLD_LIMIT_S, HoldPoint  # a sibling module (this script's folder is first on sys.path)
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

import lightning_elan
from lightning_elan.callbacks import HybridScaling, ProgressiveLinearLR
from lightning_elan.strategy.fsdp import ElanFSDPStrategy

ELASTIC_STRATEGIES = ("elan", "elan_fsdp", "elan_fsdp_units", "elan_hsdp")
GATE_OPEN = "gate-open"
"""``--gate-at STEP``: the file in OUT that lets rank 0 go on into training step STEP."""


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
    def __init__(self, config: ProbeConfig) -> None:
        super().__init__()
        self.step_sleep = config.step_sleep
        slow = config.slow_worker.split(":") if config.slow_worker else None
        self.slow_worker = (slow[0], float(slow[1])) if slow else None
        self.sleep_model = tuple(float(x) for x in config.sleep_model.split(",")) if config.sleep_model else None
        worker = os.environ.get("ELAN_WORKER_ID", "w0")
        self.progress = config.out / f"progress-{worker}.json" if config.progress else None
        self.wait_for_joiners = config.wait_for_joiners
        self.gate_at = config.gate_at
        self.kill = KillPoint.parse(config.kill_at)
        self.hold_point = HoldPoint.parse(config.out, config.hold_at)
        self.late_vote = config.late_vote.split(":") if config.late_vote else None
        self.out = config.out
        self.worker = os.environ.get("ELAN_WORKER_ID", "w0")
        self.completed_log = config.out / f"completed-{self.worker}.jsonl"
        self.current_indices: list[int] = []
        self.window_indices: list[int] = []  # the samples of the optimizer step being accumulated
        self.batch_step = -1
        self.completed_step = -1  # the batch_step whose samples were logged as completed last
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
        self.sharded = config.strategy.startswith("elan_") and config.strategy != "elan"
        self.first_output: torch.Tensor | None = None  # sharded: the first layer's output, for the backward's holds
        if self.sharded:
            self.net[0].register_forward_hook(lambda _module, _inputs, output: setattr(self, "first_output", output))
        self.consumed: dict[int, list[int]] = {}
        self.digests: list[list] = []
        # [epoch, batch_idx, global_rank, world_size] of every trained batch, seen by training_step and again by
        # the LightningModule's on_train_batch_end (Lightning runs that hook for every trained batch)
        self.trained: list[list[int]] = []
        self.batch_ends: list[list[int]] = []
        self.steps: list[list] = []  # [global_step, epoch, world_size, global_batch, lr used by the optimizer]
        self.validations: list[list[int]] = []  # [epoch, global_step] of every validation run (not sanity checks)
        # what this process accumulated over each epoch, by a torchmetrics metric and by self.log(on_epoch=True): the
        # samples of the batches it trained (a discarded step's first attempt must not count)
        self.samples_seen = torchmetrics.SumMetric(sync_on_compute=False)
        self.epoch_counts: dict[int, dict[str, float]] = {}
        self.ended_samples: list[list[int]] = []  # [epoch, batch_idx, samples] of every batch that ended

    def sleep_seconds(self) -> float:
        """This step's sleep: ``--step-sleep``, plus the slow worker's extra, plus ``C/world + B*world``."""
        seconds = self.step_sleep
        if self.slow_worker is not None and self.slow_worker[0] == self.worker:
            seconds += self.slow_worker[1]
        if self.sleep_model is not None:
            world = self.trainer.world_size
            seconds += self.sleep_model[0] / world + self.sleep_model[1] * world
        return seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Called as ``self(x)``: under ``elan_fsdp`` the module is FSDP2's root unit, whose forward gathers the
        parameters (``self.net(x)`` from ``training_step`` would skip it)."""
        return self.net(x)

    def training_step(self, batch, batch_idx):
        index, x, y = batch
        if self.step_sleep or self.slow_worker or self.sleep_model:
            time.sleep(self.sleep_seconds())
        if getattr(self.trainer.strategy, "sample_weight", 1.0) > 0:
            self.consumed.setdefault(self.current_epoch, []).extend(index.tolist())
        self.current_indices = index.tolist() if getattr(self.trainer.strategy, "sample_weight", 1.0) > 0 else []
        self.window_indices += self.current_indices
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.samples_seen.update(float(len(self.current_indices)))
        self.log("samples_logged", float(len(self.current_indices)), reduce_fx="sum", on_step=False, on_epoch=True,
                 logger=False)  # callback_metrics only: the tests compare the CSV columns
        if self.kill.due(self, "backward"):  # in the backward pass: the others wait in the gradient all-reduce
            self.net[0].weight.register_hook(lambda grad: self.kill.now())
        self.hold("metric")  # the loss is computed; its sync over the job (a collective) is next
        self.log("train_loss", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.trained.append([self.current_epoch, batch_idx, self.trainer.global_rank, self.trainer.world_size])
        if self.progress is not None:  # what this worker is training now: a worker killed after its commit vote
            self.log_training()        # trained samples it never got to log as completed
        self.hold("forward")  # the forward and its logging are done, the backward is next
        if self.hold_point.due("backward", self.batch_step):  # mid-backward, before any all-reduce
            self.in_backward(lambda: self.hold("backward"))
        if self.hold_point.due("allreduce", self.batch_step):  # the survivors then wait in the all-reduce
            self.in_backward(lambda: self.hold("allreduce"))
        return loss

    def in_backward(self, call) -> None:
        """``call()`` in the backward pass, once the later layers' gradients are computed and before the first
        layer's weight gradient (so before DDP's all-reduce or FSDP2's reduce-scatter): a hook on that weight, or, for
        a sharded model (whose registered weight is not the tensor autograd reaches), on the first layer's output."""
        tensor = self.first_output if self.sharded else self.net[0].weight
        tensor.register_hook(lambda grad: call())

    def hold(self, phase: str, step: int | None = None) -> None:
        """``--hold-at``: at that step and phase, hold while the test SIGKILLs the victim (``hold_point.py``)."""
        step = self.batch_step if step is None else step
        if not self.hold_point.due(phase, step) or self.trainer.sanity_checking:
            return
        if phase == "allreduce" and self.worker != self.hold_point.worker:
            self.hold_point.mark(self.worker)  # go on into the all-reduce and wait there
            return
        if phase in ("optimizer", "checkpoint"):  # every member committed this step: the samples of a member killed
            self.log_completed()                   # now or during the recovery (w1+w2) count
        self.hold_point.hold(self.worker, lambda: self.trainer.strategy.engine.peer_failed)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_ends.append([self.current_epoch, batch_idx, self.trainer.global_rank, self.trainer.world_size])
        self.ended_samples.append([self.current_epoch, batch_idx, len(self.current_indices)])
        if self.trainer.global_step > self.batch_step:  # this batch applied its step (accumulation: the window's last)
            self.log_completed()
        self.hold("batch_end")
        if self.progress is not None:  # the last step this worker completed, readable while the job runs
            partial = self.progress.with_suffix(".tmp")
            partial.write_text(json.dumps({"step": self.trainer.global_step, "pid": os.getpid(), "at": time.time()}))
            partial.replace(self.progress)

    def log_training(self) -> None:
        """Append the samples of the batch being trained now (``training-<worker>.jsonl``), flushed."""
        line = {"epoch": self.current_epoch, "step": self.trainer.global_step, "indices": self.current_indices}
        with open(self.out / f"training-{self.worker}.jsonl", "a") as file:
            file.write(json.dumps(line) + "\n")

    def log_completed(self) -> None:
        """Append the samples of a step that is applied (flushed: a worker killed later keeps them), once."""
        if self.completed_step == self.batch_step:
            return
        self.completed_step = self.batch_step
        line = {"epoch": self.current_epoch, "step": self.trainer.global_step, "indices": self.window_indices}
        with open(self.completed_log, "a") as file:
            file.write(json.dumps(line) + "\n")

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        if batch_idx == 1:
            self.hold("validation", self.trainer.global_step)
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_train_batch_start(self, batch, batch_idx):
        trainer = self.trainer
        if self.gate_at == trainer.global_step and trainer.global_rank == 0:
            wait_for_gate(self.out / GATE_OPEN)
        if self.wait_for_joiners and trainer.global_rank == 0:
            wait_for_joiners_due_at(trainer.global_step + 1, lambda: trainer.strategy.engine.peer_failed)
        self.digests.append([trainer.global_step, trainer.world_size, trainer.global_rank, state_digest(self)])
        self.batch_step = trainer.global_step  # the step this batch trains (global_step grows during the batch)
        if batch_idx % trainer.accumulate_grad_batches == 0:  # the first batch of an optimizer step
            self.window_indices = []
        self.hold("data")  # the batch is fetched, the loader's workers (--num-workers) prefetch the next ones

    def on_save_checkpoint(self, checkpoint):
        self.hold("checkpoint", self.trainer.global_step)  # every rank dumps the checkpoint, rank 0 writes it

    def on_after_backward(self):
        if self.kill.due(self, "vote"):  # the gradients are all-reduced; its commit vote follows
            self.kill.now()
        self.hold("vote")
        if self.late_vote is not None and self.late_vote[:2] == [self.worker, str(self.trainer.global_step)]:
            (self.out / f"late-vote-{self.worker}").write_text(str(os.getpid()))
            time.sleep(float(self.late_vote[2]))

    def on_before_optimizer_step(self, optimizer):
        # after the callbacks' hook: ProgressiveLinearLR has scaled the LR for this step
        trainer = self.trainer
        global_batch = getattr(getattr(trainer.strategy, "data_position", None), "global_batch", None)
        lr = optimizer.param_groups[0]["lr"]
        self.steps.append([trainer.global_step, trainer.current_epoch, trainer.world_size, global_batch, lr])

    def after_update(self) -> None:
        """The optimizer's step post-hook: every member committed the step (the vote comes after the hooks before the
        update and any clipping) and this one applied it."""
        if self.kill.due(self, "optimizer"):  # every member committed this step: its samples count
            self.log_completed()
            self.kill.now()
        self.hold("optimizer")

    def on_train_epoch_start(self):
        self.samples_seen.reset()
        self.record_logged_count(self.current_epoch - 1)

    def on_train_end(self):
        if self.epoch_counts:
            self.record_logged_count(max(self.epoch_counts))
        self.save_final_state()

    def save_final_state(self) -> None:
        """Rank 0's parameters and optimizer state once training ended, inside ``fit`` (a member killed in the
        script's code after ``fit`` does not take them along); under ``elan_fsdp`` the full state, gathered by every
        member (a collective), as a user of a sharded model gets it."""
        trainer = self.trainer
        if getattr(trainer.strategy, "has_left", False):
            return
        if isinstance(trainer.strategy, ElanFSDPStrategy):
            parameters, optimizer = gathered_state(trainer)
        elif trainer.global_rank == 0:
            parameters, optimizer = {k: v.cpu() for k, v in self.state_dict().items()}, optimizer_state(trainer)
        if trainer.global_rank != 0:
            return
        torch.save(parameters, self.out / "final.pt")
        torch.save(optimizer, self.out / "final-optimizer.pt")

    def record_logged_count(self, epoch: int) -> None:
        """The epoch's ``samples_logged`` (Lightning computes it after ``on_train_epoch_end``)."""
        value = self.trainer.callback_metrics.get("samples_logged")
        if epoch >= 0 and value is not None and epoch in self.epoch_counts:
            self.epoch_counts[epoch]["logged"] = float(value)

    def on_train_epoch_end(self):
        self.epoch_counts[self.current_epoch] = {"metric": float(self.samples_seen.compute())}
        self.hold("epoch_end", self.trainer.global_step)  # the epoch's sync_dist aggregates are synced after this

    def on_validation_epoch_end(self):
        if not self.trainer.sanity_checking:
            self.validations.append([self.trainer.current_epoch, self.trainer.global_step])

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
        optimizer.register_step_post_hook(lambda *_: self.after_update())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@dataclass(frozen=True)
class KillPoint:
    """``--kill-at WORKER:STEP:PHASE``: that worker SIGKILLs itself at that global step, in that phase (``backward``:
    while the others wait in the gradient all-reduce; ``vote``: after the all-reduce, before its commit vote, while
    the others wait for the decision; ``optimizer``: after every member committed the step)."""

    worker: str | None = None
    step: int = -1
    phase: str = ""

    @classmethod
    def parse(cls, text: str | None) -> KillPoint:
        if not text:
            return cls()
        worker, step, phase = text.split(":")
        if phase not in ("backward", "vote", "optimizer"):
            raise ValueError(f"unknown kill phase {phase!r}")
        return cls(worker, int(step), phase)

    def due(self, model: ProbeModel, phase: str) -> bool:
        return (self.worker == model.worker and phase == self.phase and model.trainer.global_step == self.step
                and not model.trainer.sanity_checking)

    @staticmethod
    def now() -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def wait_for_gate(gate: Path) -> None:
    """Hold rank 0 (the others wait in the step's collectives) until the test creates ``gate``."""
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{gate} not created within {HOLD_LIMIT_S} s")
        time.sleep(0.1)


def wait_for_joiners_due_at(step: int, failed: typing.Callable[[], bool], timeout_s: float = 240.0) -> None:
    """Hold rank 0 until every queued request due at ``step`` has all its new workers ready (registered), so that it
    applies at the first coordination at or after its scheduled step, whatever the joiners' start-up time; not once
    a member of its generation died (a replacement is queued then: the recovery must not wait for it)."""
    address = os.environ.get("ELAN_AM_ADDRESS")
    if not address:
        return
    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + timeout_s
    with AMClient(address, os.environ["ELAN_JOB"]) as client:
        while True:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if failed() or all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"joiners of {due} not ready after {timeout_s} s")
            time.sleep(0.1)


def state_digest(model: ProbeModel) -> str:
    """Of this process's parameters and optimizer state (under ``elan_fsdp``: of its shards, which differ by rank)."""
    digest = hashlib.sha256()
    for tensor in model.state_dict().values():
        digest.update(_local(tensor).numpy().tobytes())
    optimizer = model.trainer.optimizers[0]
    for state in optimizer.state.values():
        for key in sorted(state):
            digest.update(_local(state[key]).numpy().tobytes())
    digest.update(repr([group["lr"] for group in optimizer.param_groups]).encode())
    return digest.hexdigest()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor's values, or a DTensor's local shard (``elan_fsdp``), on the CPU."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.detach().cpu()


@dataclass
class ProbeConfig:
    """What one probe run does: every default is here, the CLI flags are generated from the fields."""

    out: Path
    samples: int = 100
    batch_size: int = 6  # per worker (the DataLoader's batch_size)
    epochs: int = 3
    num_workers: int = 0
    accumulate: int = 1  # Trainer(accumulate_grad_batches=...)
    global_batch: int | None = None  # ElanStrategy(global_batch_size=...)
    no_shuffle: bool = False
    val: bool = False
    strategy: str = "elan"
    """'elan', 'elan_fsdp' (the model sharded by FSDP2), 'elan_fsdp_units' (each Linear its own FSDP2 unit:
    ``shard_modules={Linear}``), 'elan_hsdp' (``ElanFSDPStrategy(hsdp_group_size=2)``: HSDP at 4 workers, FSDP at 3
    or 5), or a Lightning strategy for comparisons."""
    devices: str = "auto"
    accelerator: str = "cpu"  # 'gpu' for the CUDA runs of tests/gpu
    backend: str | None = None  # process group backend of the elan strategy (e.g. gloo)
    full_lightning: bool = False  # CSV logger, ModelCheckpoint, progress bar
    step_sleep: float = 0.0  # seconds to sleep per step (slows a job down; no effect on the numbers)
    slow_worker: str | None = None  # WORKER:SECONDS: that worker sleeps this much more per step (a straggler)
    sleep_model: str | None = None  # C,B: every worker sleeps C/world_size + B*world_size more per step
    progress: bool = False  # each worker keeps OUT/progress-<worker>.json: its last completed step and its pid
    scaling: str | None = None  # add HybridScaling with this policy: strong, weak or hybrid
    ramp_steps: int = 4  # ProgressiveLinearLR ramp (with scaling)
    profile: Path | None = None  # ThroughputModel JSON for HybridScaling (not learned further)
    # rank 0 holds each batch until the requests due at its step have their joiners ready (the step becomes exact)
    wait_for_joiners: bool = False
    # STEP: rank 0 holds before training step STEP until the test creates OUT/gate-open (the job cannot end first)
    gate_at: int | None = None
    kill_at: str | None = None  # WORKER:STEP:PHASE (KillPoint)
    hold_at: str | None = None  # WORKER:STEP:PHASE (hold_point.HoldPoint: the test SIGKILLs WORKER there)
    # WORKER:STEP:SECONDS: that worker sleeps between its gradient all-reduce and its commit vote at that step, after
    # writing OUT/late-vote-WORKER (the others vote and wait for its vote meanwhile)
    late_vote: str | None = None

    def __post_init__(self) -> None:
        if self.scaling not in (None, "strong", "weak", "hybrid"):
            raise ValueError(f"scaling must be strong, weak or hybrid, got {self.scaling!r}")

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> ProbeConfig:
        """``--field-name VALUE`` for every field (``--flag`` alone for the booleans)."""
        parser = argparse.ArgumentParser(description=__doc__)
        hints = typing.get_type_hints(cls)
        for item in fields(cls):
            flag = "--" + item.name.replace("_", "-")
            kind = _flag_type(hints[item.name])
            if kind is bool:
                parser.add_argument(flag, action="store_true")
            elif item.default is MISSING:
                parser.add_argument(flag, type=kind, required=True)
            else:
                parser.add_argument(flag, type=kind, default=item.default)
        return cls(**vars(parser.parse_args(argv)))

    def to_dict(self) -> dict:
        return {key: str(value) if isinstance(value, Path) else value for key, value in asdict(self).items()}


def _flag_type(annotation: object) -> type:
    """``int | None`` → ``int``: the type a flag's text converts to."""
    options = [option for option in typing.get_args(annotation) if option is not type(None)]
    return options[0] if options else annotation


def optimizer_state(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The optimizer's state tensors and the LR of each group, flat (``state.<param>.<name>``, ``lr.<group>``)."""
    optimizer = trainer.optimizers[0]
    flat = {f"state.{index}.{name}": torch.as_tensor(value).cpu().double()
            for index, state in optimizer.state_dict()["state"].items() for name, value in state.items()}
    flat.update({f"lr.{i}": torch.tensor(group["lr"]) for i, group in enumerate(optimizer.param_groups)})
    return flat


def gathered_state(trainer: pl.Trainer) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``elan_fsdp``: the full parameters and optimizer state (a collective of every member; rank 0 holds the
    optimizer's), the optimizer's flat as :func:`optimizer_state` writes a whole one (keyed by parameter position)."""
    strategy, optimizer = trainer.strategy, trainer.optimizers[0]
    parameters = {name: value.detach().cpu() for name, value in strategy.lightning_module_state_dict().items()}
    by_name = strategy.optimizer_state(optimizer).get("state", {})
    positions = {name: index for index, (name, _) in enumerate(trainer.lightning_module.named_parameters())}
    flat = {f"state.{positions[name]}.{key}": torch.as_tensor(value).cpu().double()
            for name, state in by_name.items() for key, value in state.items()}
    flat.update({f"lr.{i}": torch.tensor(group["lr"]) for i, group in enumerate(optimizer.param_groups)})
    return parameters, flat


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s: %(message)s")
    logging.getLogger("lightning_elan").setLevel(os.environ.get("ELAN_PROBE_LOG", "INFO"))
    config = ProbeConfig.from_argv()
    config.out.mkdir(parents=True, exist_ok=True)
    (config.out / "config.json").write_text(json.dumps(config.to_dict()))  # the same for every worker

    pl.seed_everything(7)
    model = ProbeModel(config)
    dataset = IndexedDataset(config.samples)
    loader_kwargs = {"num_workers": config.num_workers, "persistent_workers": config.num_workers > 0}
    train = DataLoader(dataset, batch_size=config.batch_size, shuffle=not config.no_shuffle, **loader_kwargs)
    val = DataLoader(IndexedDataset(30), batch_size=5) if config.val else None
    strategy = config.strategy
    elastic = {"elan": lightning_elan.ElanStrategy, "elan_fsdp": ElanFSDPStrategy,
               "elan_fsdp_units": lambda **kwargs: ElanFSDPStrategy(shard_modules={torch.nn.Linear}, **kwargs),
               "elan_hsdp": lambda **kwargs: ElanFSDPStrategy(hsdp_group_size=2, **kwargs)}
    if strategy in elastic and (config.global_batch or config.backend or strategy not in ("elan", "elan_fsdp")):
        strategy = elastic[strategy](global_batch_size=config.global_batch, process_group_backend=config.backend)
    full = config.full_lightning
    callbacks = [ModelCheckpoint(every_n_train_steps=4, save_top_k=-1)] if full else []
    if config.scaling:
        profile = None if config.profile is None else str(config.profile)
        scaling = HybridScaling(policy=config.scaling, profile=profile, learn=profile is None)
        callbacks += [scaling, ProgressiveLinearLR(ramp_steps=config.ramp_steps)]
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=config.accelerator,
        devices=int(config.devices) if config.devices.isdigit() else config.devices,
        max_epochs=config.epochs,
        accumulate_grad_batches=config.accumulate,
        default_root_dir=config.out,
        logger=CSVLogger(config.out / "logs", flush_logs_every_n_steps=1) if full else False,
        log_every_n_steps=1,
        callbacks=callbacks,
        enable_checkpointing=full,
        enable_progress_bar=full,
        enable_model_summary=False,
        limit_val_batches=1.0 if config.val else 0,
        num_sanity_val_steps=2 if config.val else 0,
    )
    try:
        trainer.fit(model, train, val)
    except SystemExit as end:  # a worker that left the job ends its script after fit (exit 0): its record first
        if not end.code:
            write_record(config, trainer, model)
        raise
    write_record(config, trainer, model)
    if config.strategy not in ELASTIC_STRATEGIES and torch.distributed.is_initialized():
        # a plain Lightning comparison run: rank 0 hosts the store, so no rank may exit while another still uses it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def write_record(config: ProbeConfig, trainer: pl.Trainer, model: ProbeModel) -> None:
    """``OUT/record-<worker>.json``: what this worker trained and saw."""
    worker = os.environ.get("ELAN_WORKER_ID", "w0")
    record = {
        "worker": worker,
        "config": config.to_dict(),
        "left": getattr(trainer.strategy, "has_left", False),
        "global_step": trainer.global_step,
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "consumed": model.consumed,
        "digests": model.digests,
        "trained": model.trained,
        "batch_ends": model.batch_ends,
        "steps": model.steps,
        "validations": model.validations,
        "epoch_counts": model.epoch_counts,
        "ended_samples": model.ended_samples,
    }
    (config.out / f"record-{worker}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
