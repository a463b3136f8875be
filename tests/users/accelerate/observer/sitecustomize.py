"""Test-only (on ``PYTHONPATH`` of the Accelerate corpus' jobs, never imported by a script): what the harness sees of
a worker, and the two things it does to one. Inactive unless ``$USERS_OBSERVE`` names a directory.

When ``lightning_elan.accelerate.accelerator`` is imported, ``ElasticAccelerator.backward`` (which every script calls
once per micro-batch) is wrapped. Before each backward it appends to ``$USERS_OBSERVE/observe-<pid>.jsonl`` (one flushed
line: a worker SIGKILLed later keeps what it wrote) the optimizer step being trained, the world size, the rank, how many
backwards the process ran before in that step at that world size, and a bitwise digest of every prepared model's
parameters and buffers, every prepared optimizer's state and every prepared LR scheduler's state: members must agree bit
for bit at every step. Before the backward of a step's last micro-batch:

* ``$USERS_HOLD=1``: rank 0 holds until every scale request due at the next step has its joiners ready, so a scheduled
  adjustment lands at its step whatever the joiners' start-up time (a replacement for a dead worker is due at once);
* ``$USERS_KILL=STEP``: the process that is rank 1 at optimizer step STEP writes its worker id and pid to
  ``$USERS_OBSERVE/victim.json`` (once per job) and waits there: the harness SIGKILLs it (``os.kill``) while the
  other members go on into the step's gradient all-reduce;
* ``$USERS_AWAIT_DEATH=STEP``: the process that is rank 0 at optimizer step STEP waits before that backward until the
  victim is dead and its own generation failed (the all-reduce then meets a failed generation at its start);
* ``$USERS_KILL_EVALUATION=N``: the last two at the step's N-th backward instead (from 1: an optimizer that evaluates
  its closure several times in one step, L-BFGS, has updated the parameters N - 1 times before it);
* ``$USERS_KILL_MICRO=first``: the last two at the step's first micro-batch of an ``accumulate()`` window (one with
  ``sync_gradients`` off) instead of its last; ``taken``: as the step's first batch is taken, before its forward;
* ``$USERS_DIE_IN_SAVE=N``: the process that is rank 1 SIGKILLs itself as DCP starts its N-th write of files
  (``save_state`` under FSDP2 writes the model, then the optimizer);
* ``$USERS_DIE_EVALUATING=PASS:RANK``: the process that is rank RANK SIGKILLs itself as it takes the first batch of
  its PASS-th pass over an elastic evaluation loader (0: the first), before that batch's forward (whose buffer
  broadcast, the first after a synchronised step, then meets the death on the others);
* ``$USERS_DIE_AFTER_LOOP=RANK``: the process that is rank RANK SIGKILLs itself as it enters its first
  ``wait_for_everyone()`` after its ``epochs()`` loop ran out (the script's final barrier before the main process
  saves): the others meet its death in that barrier;
* ``$USERS_DIE_GATHERING_STATE=RANK``: the process that is rank RANK SIGKILLs itself as it enters its first
  ``get_state_dict()`` after its ``epochs()`` loop ran out (under FSDP2 the others meet its death in the gathers);
* ``$USERS_DIE_PADDING=RANK``: the process that is rank RANK SIGKILLs itself as it enters its first
  ``pad_across_processes()`` (in an evaluation pass, after its forward: the others meet its death in that call's
  all-gather of the sizes).
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
from typing import Any

TARGET = "lightning_elan.accelerate.accelerator"
HOLD_LIMIT_S = 240.0
VICTIM_WAIT_S = 60.0
_SEEN: dict[str, Any] = {}  # the accelerator, once a backward ran
PER_PROCESS_STATE = ("prev_loss",)
"""Optimizer state that is each process's own by construction, as under DDP: L-BFGS keeps the last loss its closure
returned, the process's loss over its share of the batch."""


def _observe_dir() -> str | None:
    return os.environ.get("USERS_OBSERVE") or None


def _write(record: dict[str, Any]) -> None:
    record["at"] = time.time()
    with open(os.path.join(_observe_dir() or ".", f"observe-{os.getpid()}.jsonl"), "a") as file:
        file.write(json.dumps(record) + "\n")


def _digest(accelerator: Any) -> str:
    """Parameters and buffers of every prepared model, then every prepared optimizer's per-parameter state and its
    hyperparameters, then every prepared LR scheduler's state. Under FSDP2 a member's shards (its digests differ from
    the others')."""

    digest = hashlib.sha256()
    tensors: list[tuple[str, Any]] = []
    for number, model in enumerate(accelerator._models):
        tensors += [(f"model{number}.{k}", v) for k, v in accelerator.unwrap_model(model).state_dict().items()]
    for number, optimizer in enumerate(accelerator._optimizers):
        state = optimizer.state_dict()["state"]
        tensors += [(f"opt{number}.{slot}.{key}", value) for slot in sorted(state)
                    for key, value in sorted(state[slot].items()) if key not in PER_PROCESS_STATE]
    for name, value in tensors:
        digest.update(name.encode())
        digest.update(_state_bytes(value))
    for optimizer in accelerator._optimizers:  # the hyperparameters too: a scheduler a rank did not step
        for group in optimizer.param_groups:
            digest.update(repr(sorted((key, value) for key, value in group.items() if key != "params")).encode())
    for scheduler in accelerator._schedulers:  # and each scheduler's state, less the functions it holds
        state = scheduler.state_dict()
        digest.update(repr(sorted((key, value) for key, value in state.items() if not callable(value))).encode())
    return digest.hexdigest()


def _state_bytes(value: Any) -> bytes:
    """A state value's bytes: a tensor's (a DTensor's, under FSDP2: this member's shard), a number's; L-BFGS keeps
    lists of tensors (its history) and None (before its first step) too."""
    import torch

    if value is None:
        return b"none"
    if isinstance(value, (list, tuple)):
        return b"".join(_state_bytes(part) for part in value) + b"|"
    local = value.to_local() if hasattr(value, "to_local") else value
    tensor = torch.as_tensor(local).detach().cpu().contiguous().reshape(-1)
    return tensor.view(torch.uint8).numpy().tobytes()


def _hold_for_joiners(step: int) -> None:
    """Rank 0: wait until the requests due at ``step`` have every new worker ready."""
    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + HOLD_LIMIT_S
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while True:
            due = [request for request in client.status()["pending"] if (request.get("at_step") or 0) <= step]
            if all(state == "ready" for request in due for state in request["worker_status"].values()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"joiners of {due} not ready after {HOLD_LIMIT_S} s")
            time.sleep(0.05)


def _offer_as_victim(step: int) -> None:
    """Write this process's worker id and pid, then wait for the harness's SIGKILL (SIGKILL itself if none comes)."""
    try:
        file = open(os.path.join(_observe_dir() or ".", "victim.json"), "x")  # the job's first victim only
    except FileExistsError:
        return
    with file:
        file.write(json.dumps({"worker": os.environ["ELAN_WORKER_ID"], "pid": os.getpid(), "step": step}))
    time.sleep(VICTIM_WAIT_S)
    os.kill(os.getpid(), signal.SIGKILL)


def _await_the_victims_death(accelerator: Any) -> None:
    """Rank 0, before its backward: wait until the victim was killed and this process's watch has failed its
    generation (``ElasticProcessGroup._failed_prefixes``), so the backward's gradient all-reduce meets a failed
    generation before it starts (rather than a peer dying while it runs)."""
    deadline = time.monotonic() + VICTIM_WAIT_S
    path = os.path.join(_observe_dir() or ".", "victim.json")
    while time.monotonic() < deadline:
        try:
            with open(path) as file:
                pid = json.load(file)["pid"]
        except (OSError, ValueError):
            pid = None
        if pid is not None and not os.path.exists(f"/proc/{pid}") and accelerator.engine.group._failed_prefixes:
            return
        time.sleep(0.02)
    raise TimeoutError("the victim's death was not seen")


def _backward_of_the_step(step: int, world: int) -> int:
    """How many backwards this process ran before this one in the step at this world size (0: the first)."""
    key = (step, world)
    count = _SEEN.get("backwards", {}).get(key, 0)
    _SEEN["backwards"] = {key: count + 1}
    return count


def _before_backward(accelerator: Any) -> None:
    if "ELAN_WORKER_ID" not in os.environ or accelerator.has_left:
        return
    _SEEN["accelerator"] = accelerator
    step, rank, world = accelerator.optimizer_steps, accelerator.process_index, accelerator.num_processes
    backward = _backward_of_the_step(step, world)
    if accelerator.sync_gradients and rank == 0 and os.environ.get("USERS_HOLD") == "1":
        _hold_for_joiners(step + 1)
    evaluation = os.environ.get("USERS_KILL_EVALUATION")
    if evaluation is not None:
        due = backward == int(evaluation) - 1
    else:
        due = accelerator.sync_gradients == (os.environ.get("USERS_KILL_MICRO", "last") == "last")
    if due:
        if rank == 1 and os.environ.get("USERS_KILL") == str(step):
            _offer_as_victim(step)
        if rank == 0 and os.environ.get("USERS_AWAIT_DEATH") == str(step):
            _await_the_victims_death(accelerator)
    _write({"step": step, "world": world, "rank": rank, "worker": os.environ["ELAN_WORKER_ID"],
            "backward": backward, "digest": _digest(accelerator)})


def _instrument(module: Any) -> None:
    accelerator_class = module.ElasticAccelerator
    original = accelerator_class.backward

    @functools.wraps(original)
    def backward(self: Any, loss: Any, **kwargs: Any) -> None:
        _before_backward(self)
        return original(self, loss, **kwargs)

    accelerator_class.backward = backward
    if os.environ.get("USERS_KILL_MICRO") == "taken":
        _at_first_batch_taken(accelerator_class)
    if os.environ.get("USERS_DIE_IN_SAVE"):
        _die_in_save(int(os.environ["USERS_DIE_IN_SAVE"]))
    if os.environ.get("USERS_DIE_AFTER_LOOP"):
        _die_at_first_call(accelerator_class, "wait_for_everyone", int(os.environ["USERS_DIE_AFTER_LOOP"]), True)
    if os.environ.get("USERS_DIE_GATHERING_STATE"):
        _die_at_first_call(accelerator_class, "get_state_dict", int(os.environ["USERS_DIE_GATHERING_STATE"]), True)
    if os.environ.get("USERS_DIE_PADDING"):
        _die_at_first_call(accelerator_class, "pad_across_processes", int(os.environ["USERS_DIE_PADDING"]), False)
    if os.environ.get("USERS_DIE_EVALUATING"):
        pass_index, rank = (int(part) for part in os.environ["USERS_DIE_EVALUATING"].split(":"))
        _die_evaluating(pass_index, rank)


def _at_first_batch_taken(accelerator_class: Any) -> None:
    """``USERS_KILL_MICRO=taken``: the victim offers itself, and rank 0 awaits its death, as the first batch of step
    ``USERS_KILL`` is taken (before the step's first forward: DDP's buffer broadcast then meets the death)."""
    original = accelerator_class.take_global_batch

    @functools.wraps(original)
    def take_global_batch(self: Any, loader: Any) -> None:
        original(self, loader)
        step = os.environ.get("USERS_KILL")
        if self.has_left or step != str(self.optimizer_steps) or _SEEN.get("taken_at") == step:
            return
        _SEEN["taken_at"] = step
        if self.process_index == 1:
            _offer_as_victim(self.optimizer_steps)
        if self.process_index == 0 and os.environ.get("USERS_AWAIT_DEATH") == step:
            _await_the_victims_death(self)

    accelerator_class.take_global_batch = take_global_batch


def _die_in_save(write: int) -> None:
    """The process that is rank 1 SIGKILLs itself as DCP starts the process's WRITE-th write (``save_state`` under
    FSDP2 makes two: the model's, then the optimizer's): the others wait in the write's all-reduce."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data

    @functools.wraps(original)
    def write_data(self: Any, *args: Any, **kwargs: Any) -> Any:
        accelerator = _SEEN.get("accelerator")
        _SEEN["writes"] = _SEEN.get("writes", 0) + 1  # every process counts its writes: a survivor saves again
        if accelerator is not None and accelerator.process_index == 1:
            if _SEEN["writes"] == write:
                with open(os.path.join(_observe_dir() or ".", "died-in-save.json"), "w") as file:
                    file.write(json.dumps({"write": write, "worker": os.environ["ELAN_WORKER_ID"], "pid": os.getpid()}))
                os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    _FileSystemWriter.write_data = write_data


def _die_at_first_call(accelerator_class: Any, method: str, rank: int, after_the_loop: bool) -> None:
    """Rank ``rank`` SIGKILLs itself as it enters its first call of ``method`` (``after_the_loop``: its first once its
    loop ran out), writing ``died-after-loop.json`` (``after_the_loop``) or ``died-in-<method>.json`` first."""
    original = getattr(accelerator_class, method)
    record = "died-after-loop.json" if after_the_loop else f"died-in-{method}.json"

    @functools.wraps(original)
    def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        due = self._loop_ran_out or not after_the_loop
        if due and not self.has_left and self.process_index == rank and not _SEEN.get("died_at_call"):
            _SEEN["died_at_call"] = True
            with open(os.path.join(_observe_dir() or ".", record), "w") as file:
                file.write(json.dumps({"worker": os.environ["ELAN_WORKER_ID"], "pid": os.getpid(), "in": method}))
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, *args, **kwargs)

    setattr(accelerator_class, method, dying)


def _die_evaluating(pass_index: int, rank: int) -> None:
    """``USERS_DIE_EVALUATING``: the process that is rank ``rank`` SIGKILLs itself as its ``pass_index``-th pass over
    an elastic evaluation loader yields its first batch (every process counts its passes)."""
    from lightning_elan.accelerate.data import ElasticEvaluationLoader

    original = ElasticEvaluationLoader.__iter__

    @functools.wraps(original)
    def __iter__(self: Any) -> Any:
        passes = _SEEN["passes"] = _SEEN.get("passes", -1) + 1
        for index, batch in enumerate(original(self)):
            accelerator = _SEEN.get("accelerator")
            if index == 0 and passes == pass_index and accelerator is not None and accelerator.process_index == rank:
                with open(os.path.join(_observe_dir() or ".", "died-evaluating.json"), "w") as file:
                    file.write(json.dumps({"pass": passes, "worker": os.environ["ELAN_WORKER_ID"], "pid": os.getpid()}))
                os.kill(os.getpid(), signal.SIGKILL)
            yield batch

    ElasticEvaluationLoader.__iter__ = __iter__


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
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _observe_dir() is not None:
    # a worker forked by elan run's preload process has these modules already: instrument them now, others on import
    for _name in (TARGET,):
        if _name in sys.modules:
            _instrument(sys.modules[_name])
    sys.meta_path.insert(0, _Finder())
