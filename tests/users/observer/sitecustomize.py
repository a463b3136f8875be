"""Test-only (on ``PYTHONPATH`` of the corpus' jobs, never imported by a user script): what the harness sees of a
worker, and the two things it does to one. Inactive unless ``$USERS_OBSERVE`` names a directory.

When ``lightning.pytorch`` or ``pytorch_lightning`` is imported, every ``Trainer`` built afterwards gets one more
callback (the scripts are not changed), which appends to ``$USERS_OBSERVE/observe-<pid>.jsonl``, one flushed line per
event, so a worker SIGKILLed later keeps what it wrote:

* ``start``: at every training batch's start, the step, world size, rank and a bitwise digest of the parameters,
  every optimizer's state and its hyperparameters, and every LR scheduler's state (members must agree bit for bit at
  every step; ``hyper`` lists the hyperparameters and ``schedulers`` the schedulers' states, to tell which one
  differs: a learning rate a scheduler did not decay, a plateau scheduler that did not see an epoch);
* ``trained``: at every trained batch's end (its step applied), the epoch and the samples this process trained —
  the ``index`` of a dict batch, the first element of a tuple batch when it holds integers, else a digest of each
  row of the first tensor (a dataset that cannot return its index, like the demo transformer's) — minus the stand-in
  sample of a rank that had none (weight 0);
* ``final``: at the end of ``fit`` on rank 0, ``final-<pid>-<fit>.pt``: the parameters, buffers and optimizer states.

A script that trains in stages (several ``fit`` calls): the records of a process's n-th fit (from 0) count steps and
epochs from ``n * FIT_OFFSET``.

``$USERS_HOLD=1``: rank 0 holds each batch until every scale request due at its step has its joiners ready, so a
scheduled adjustment lands at its step whatever the joiners' start-up time (meanwhile it touches ``holding-<pid>``
every half second: the harness takes a job whose files stop changing for a long time as hung).

``$USERS_KILL=STEP[:PHASE]``: the process that is rank 1 in the training batch that starts at global step STEP
SIGKILLs itself (once per job, written first to ``$USERS_OBSERVE/kills.log``). ``start`` (default): as the batch
starts, so the others meet its death inside ``training_step`` (the forward's collectives, the gradient all-reduce) and
redo the step without it; ``optimizer``: once every member committed the batch's first optimizer step — as this process
applied it (the optimizer's step post-hook; with two optimizers, the others apply the first step and meet the death in
the second), or as a closure evaluated again inside that step (L-BFGS) has its gradients (its second
``on_before_optimizer_step``); ``end``: after the batch's step is
applied and its samples recorded, so the others meet it at the batch boundary; ``backward``: as its backward pass
starts (a hook on the loss's gradient), so the others meet its death in the first collective of their backward (a
gather's backward under ``all_gather(sync_grads=True)``, or the gradient all-reduce). ``$USERS_KILL_RANK``: another rank
than 1 is the victim (0: the job loses its rank 0, which writes the logs and checkpoints).
``$USERS_KILL=setup``: the process that is rank 1 SIGKILLs itself in the callbacks' ``setup`` hook, before the
training loop (the others meet its death in ``ModelCheckpoint``'s directory broadcast or Lightning's ``post_setup``
barrier); ``train_start``: in the last callback's ``on_train_start`` (the others meet its death in a collective of
the LightningModule's hook); ``epoch_start``: in the first callback's ``on_train_epoch_start`` of the epoch that starts
at global step STEP (the others meet it in a collective of the callbacks' or the module's hook of that name);
``epoch_end``: in the first callback's ``on_train_epoch_end`` of the epoch whose last batch started at STEP (the others
meet its death in a collective of the callbacks' or the module's hook of that name);
``train_end``: in the last callback's ``on_train_end`` (STEP: the job's last global step; the others meet its death
in a collective of the LightningModule's hook);
``$USERS_KILL_FIT=N``: only in the process's fit N (from 0; a script that fits again, ``fit_again_hparams.py``).
``$USERS_KILL=sanity``: in the callbacks' ``on_validation_epoch_end`` of the sanity check (the others meet
its death in the LightningModule's hook of the same name, a torchmetrics ``compute()`` say).
``STEP:validation``: as the first batch of the training loop's validation after the batch that started at STEP starts;
``STEP:validation_end``: in the callbacks' ``on_validation_epoch_end`` of that validation, so the others have run all
of theirs and meet its death in the LightningModule's hook (a reduce of the outputs it kept, say).

``$USERS_FREEZE=fit_end``: the process that is rank 1 (or ``$USERS_KILL_RANK``) stops itself (SIGSTOP) in the
callbacks' ``on_fit_end``, after the training: a frozen process, which never exits.

``$USERS_DIE_RECOVERING=WORKER``: the worker of that id SIGKILLs itself once it has the plan of a recovery it is a
member of (from another death), before it enters the plan's generation: the other survivors meet its death as that
generation forms, and recover from it in turn (written first to ``$USERS_OBSERVE/recovering.log``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

TRAINER_MODULES = ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer")
HOLD_LIMIT_S = 300.0


def _observe_dir() -> str | None:
    return os.environ.get("USERS_OBSERVE") or None


# ---------------------------------------------------------------------- what a worker records


def _write(record: dict[str, Any]) -> None:
    record["at"] = time.time()
    path = os.path.join(_observe_dir() or ".", f"observe-{os.getpid()}.jsonl")
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")


def _tensors(module: Any, optimizers: list[Any], buffers: bool = True) -> dict[str, Any]:
    """The parameters (and buffers) by name, then every optimizer's per-parameter state (``opt<i>.<slot>.<key>``)."""

    if buffers:
        tensors = {name: value.detach() for name, value in module.state_dict().items()}
    else:
        tensors = {name: value.detach() for name, value in module.named_parameters()}
    for number, optimizer in enumerate(optimizers):
        state = optimizer.state_dict()["state"]
        for slot in sorted(state):
            for key, value in sorted(state[slot].items()):
                if key not in PER_PROCESS_STATE:
                    tensors[f"opt{number}.{slot}.{key}"] = _as_tensor(value)
    return tensors


PER_PROCESS_STATE = ("prev_loss",)
"""Optimizer state that is each process's own by construction, as under DDP: L-BFGS keeps the last loss its closure
returned, the process's loss over its share of the batch."""


def _as_tensor(value: Any) -> Any:
    """An optimizer state's value as one tensor: L-BFGS keeps lists of tensors (its history) and None (before its
    first step) beside tensors and numbers."""
    import torch

    if torch.is_tensor(value):
        return value.detach()
    if value is None:
        return torch.zeros(0)
    if isinstance(value, (list, tuple)):
        parts = [_as_tensor(part).reshape(-1).double() for part in value]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return torch.tensor(value)


def _digest(module: Any, optimizers: list[Any], schedulers: list[str]) -> str:
    """Of the parameters, optimizer states, the optimizers' hyperparameters (a rank whose scheduler did not step
    trains on with another LR) and the schedulers' states: buffers (BatchNorm's running statistics) are each process's
    own between forwards (DDP broadcasts rank 0's at the next forward)."""
    digest = hashlib.sha256()
    for name, tensor in _tensors(module, optimizers, buffers=False).items():
        digest.update(name.encode())
        digest.update(_raw_bytes(tensor))
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            digest.update(repr(sorted((key, value) for key, value in group.items() if key != "params")).encode())
    for state in schedulers:
        digest.update(state.encode())
    return digest.hexdigest()


def _scheduler_states(trainer: Any) -> list[str]:
    """Each LR scheduler's ``state_dict`` (what a checkpoint keeps of it), less any function it holds."""
    return [repr(sorted((key, value) for key, value in config.scheduler.state_dict().items() if not callable(value)))
            for config in trainer.lr_scheduler_configs]


def _raw_bytes(tensor: Any) -> bytes:
    """A tensor's bytes; a DTensor's (``elan_fsdp``) are its local shard's: no collective in a hook, and the digests of
    a sharded job's members differ (compare its gathered state instead)."""
    import torch

    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample_ids(batch: Any) -> list[Any]:

    if isinstance(batch, dict) and "index" in batch:
        return batch["index"].tolist()
    first = batch[0] if isinstance(batch, (list, tuple)) else batch
    if isinstance(batch, (list, tuple)) and first.dim() == 1 and not first.is_floating_point():
        return first.tolist()
    rows = first.reshape(len(first), -1).cpu()
    return [hashlib.sha1(_raw_bytes(row)).hexdigest()[:16] for row in rows]


def _sample_weight(trainer: Any) -> float:
    return float(getattr(trainer.strategy, "sample_weight", 1.0))


# ---------------------------------------------------------------------- what the harness does to a worker


def _hold_for_joiners(step: int) -> None:
    """Rank 0: wait until the requests due at ``step`` have every new worker ready (as the probes' flag does)."""
    address = os.environ.get("ELAN_AM_ADDRESS")
    if not address or os.environ.get("USERS_HOLD") != "1":
        return
    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + HOLD_LIMIT_S
    heartbeat = os.path.join(_observe_dir() or ".", f"holding-{os.getpid()}")
    with AMClient(address, os.environ["ELAN_JOB"]) as client:
        while True:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"joiners of {due} not ready after {HOLD_LIMIT_S} s")
            with open(heartbeat, "w") as file:
                file.write(str(time.time()))
            time.sleep(0.5)


def _kill_if_due(step: int, rank: int, phase: str, before: Callable[[], None] = lambda: None) -> None:
    """SIGKILL this process if ``$USERS_KILL`` names this batch's step and ``phase``, and it is rank 1 (or the rank
    ``$USERS_KILL_RANK`` names); ``before`` runs first."""
    plan = os.environ.get("USERS_KILL")
    if not plan or rank != int(os.environ.get("USERS_KILL_RANK", "1")) or "ELAN_WORKER_ID" not in os.environ:
        return
    fit = _FITS if phase == "setup" else _FITS - 1  # setup runs before on_fit_start counts the fit
    if os.environ.get("USERS_KILL_FIT") not in (None, str(fit)):
        return
    kill_step, _, kill_phase = plan.partition(":")
    before_loop = ("setup", "sanity")
    due = phase == plan if plan in before_loop else phase not in before_loop and (step, phase) == (
        int(kill_step), kill_phase or "start")
    if not due:
        return
    try:
        log = open(os.path.join(_observe_dir() or ".", "kills.log"), "x")  # the job's first kill only
    except FileExistsError:
        return
    with log:
        log.write(json.dumps({"worker": os.environ["ELAN_WORKER_ID"], "pid": os.getpid(), "step": step,
                              "phase": phase}) + "\n")
    before()
    os.kill(os.getpid(), signal.SIGKILL)


def _freeze_if_due(rank: int, phase: str) -> None:
    """``$USERS_FREEZE=PHASE``: the process that is rank 1 (or ``$USERS_KILL_RANK``) stops itself (SIGSTOP) there, once
    per job (written first to ``$USERS_OBSERVE/kills.log``): a frozen process, which never exits by itself."""
    if os.environ.get("USERS_FREEZE") != phase or rank != int(os.environ.get("USERS_KILL_RANK", "1")):
        return
    try:
        log = open(os.path.join(_observe_dir() or ".", "kills.log"), "x")
    except FileExistsError:
        return
    with log:
        log.write(json.dumps({"worker": os.environ.get("ELAN_WORKER_ID"), "pid": os.getpid(), "step": -1,
                              "phase": f"freeze:{phase}"}) + "\n")
    os.kill(os.getpid(), signal.SIGSTOP)


def _die_once_recovering() -> None:
    """``$USERS_DIE_RECOVERING``: this worker SIGKILLs itself once it has a recovery plan it is a member of."""
    from lightning_elan.elastic.worker import ElasticWorker

    original = ElasticWorker._recovery_plan_for
    if getattr(original, "_users_dying", False):
        return

    @functools.wraps(original)
    def recovery_plan_for(self: Any, *args: Any, **kwargs: Any) -> Any:
        plan = original(self, *args, **kwargs)
        if self.worker_id in plan.members:
            with open(os.path.join(_observe_dir() or ".", "recovering.log"), "w") as log:
                log.write(json.dumps({"worker": self.worker_id, "pid": os.getpid(), "generation": plan.generation}))
            os.kill(os.getpid(), signal.SIGKILL)
        return plan

    recovery_plan_for._users_dying = True  # type: ignore[attr-defined]
    ElasticWorker._recovery_plan_for = recovery_plan_for


# ---------------------------------------------------------------------- the callback


_FITS = 0
"""Training fits this process started (``on_fit_start``): a script that trains in stages fits more than once."""
FIT_OFFSET = 1000
"""The records of the n-th fit (from 0) of a process count steps and epochs from ``n * FIT_OFFSET``, so that the
stages of a script are told apart (a one-fit script's records are the trainer's own steps and epochs)."""


def _recorded(value: int) -> int:
    return value + FIT_OFFSET * max(_FITS - 1, 0)


def _observer_class(callback_base: type) -> type:
    class CorpusObserver(callback_base):  # type: ignore[misc, valid-type]
        batch_step = -1  # the global step at which the current training batch started
        gradients_final = 0  # the batch's on_before_optimizer_step calls so far

        def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
            _kill_if_due(-1, trainer.global_rank, "setup")
            if os.environ.get("USERS_DIE_RECOVERING") == os.environ.get("ELAN_WORKER_ID"):
                _die_once_recovering()

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            global _FITS
            _FITS += 1
            for optimizer in trainer.optimizers:  # the optimizer phase: once a step of the batch is applied here
                optimizer.register_step_post_hook(lambda *_: self._at_optimizer_step(trainer))

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            _kill_if_due(trainer.global_step, trainer.global_rank, "train_start")

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            _kill_if_due(trainer.global_step, trainer.global_rank, "train_end")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            step, rank = trainer.global_step, trainer.global_rank
            self.batch_step, self.gradients_final = step, 0
            if rank == 0:
                _hold_for_joiners(step + 1)
            _kill_if_due(step, rank, "start")
            schedulers = _scheduler_states(trainer)
            _write({"event": "start", "step": _recorded(step), "world": trainer.world_size, "rank": rank,
                    "worker": os.environ.get("ELAN_WORKER_ID"),
                    "digest": _digest(pl_module, trainer.optimizers, schedulers),
                    "hyper": [repr(sorted((k, v) for k, v in g.items() if k != "params")) for o in trainer.optimizers
                              for g in o.param_groups], "schedulers": schedulers})

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            _write_trained(trainer, batch, batch_idx)
            _kill_if_due(self.batch_step, trainer.global_rank, "end")

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            if loss.requires_grad:
                rank = trainer.global_rank
                loss.register_hook(lambda grad: _kill_if_due(self.batch_step, rank, "backward"))

        def on_validation_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int,
                                      dataloader_idx: int = 0) -> None:
            if trainer.state.fn == "fit" and not trainer.sanity_checking:  # a validation run of the training loop
                _kill_if_due(self.batch_step, trainer.global_rank, "validation")

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            if trainer.sanity_checking:  # before the LightningModule's hook, which may sync its metrics
                _kill_if_due(-1, trainer.global_rank, "sanity")
            elif trainer.state.fn == "fit":
                _kill_if_due(self.batch_step, trainer.global_rank, "validation_end")

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            self.gradients_final += 1  # a closure evaluated again inside the step (L-BFGS): the first was committed
            if self.gradients_final == 2:
                self._at_optimizer_step(trainer)

        def _at_optimizer_step(self, trainer: Any) -> None:
            _kill_if_due(self.batch_step, trainer.global_rank, "optimizer")

        def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
            import torch

            _freeze_if_due(trainer.global_rank, "fit_end")
            if trainer.global_rank != 0:
                return
            path = os.path.join(_observe_dir() or ".", f"final-{os.getpid()}-{_FITS}.pt")
            torch.save({name: t.clone() for name, t in _tensors(pl_module, trainer.optimizers).items()}, path)
            _write({"event": "final", "step": _recorded(trainer.global_step), "epoch": _recorded(trainer.current_epoch),
                    "world": trainer.world_size, "path": path, "fit": _FITS})

    return CorpusObserver


def _write_trained(trainer: Any, batch: Any, batch_idx: int) -> None:
    """The ``trained`` record of a batch whose step stands: its samples (none for a stand-in share)."""
    samples = _sample_ids(batch) if _sample_weight(trainer) > 0 else []
    _write({"event": "trained", "epoch": _recorded(trainer.current_epoch), "step": _recorded(trainer.global_step),
            "batch_idx": batch_idx, "rank": trainer.global_rank, "world": trainer.world_size, "samples": samples})


def _first_hook_class(callback_base: type) -> type:
    class FirstBatchEndHook(callback_base):  # type: ignore[misc, valid-type]
        """The first of the trainer's callbacks: phase ``hooks`` kills as the batch's ``on_train_batch_end`` hooks
        begin, before any user callback's (the others meet the death in a collective of those hooks); the victim's
        ``trained`` record (its step stands) is written first."""

        batch_step = -1

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            _kill_if_due(trainer.global_step, trainer.global_rank, "epoch_start")

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batch_step = trainer.global_step

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            _kill_if_due(self.batch_step, trainer.global_rank, "hooks",
                         before=lambda: _write_trained(trainer, batch, batch_idx))

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            _kill_if_due(self.batch_step, trainer.global_rank, "epoch_end")

    return FirstBatchEndHook


def _instrument(module: Any) -> None:
    package = module.__name__.split(".trainer.")[0]
    callback_base = importlib.import_module(f"{package}.callbacks").Callback
    trainer_class = module.Trainer
    observer, first_hook = _observer_class(callback_base), _first_hook_class(callback_base)
    original = trainer_class.__init__

    @functools.wraps(original)  # LightningCLI reads the Trainer's arguments from this signature
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.callbacks.insert(0, first_hook())
        self.callbacks.append(observer())

    trainer_class.__init__ = __init__


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _instrument(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in TRAINER_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _observe_dir() is not None:
    # a worker forked by elan run's preload process has these modules already: instrument them now, others on import
    for _name in TRAINER_MODULES:
        if _name in sys.modules:
            _instrument(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
