"""Test-only (on PYTHONPATH of the worker-fault jobs): a worker SIGKILLs itself at a point inside the library, as
``$ELAN_TEST_KILL=WORKER:PHASE[:STEP]`` says (``WORKER`` may be ``*``):

* ``send`` — a replication source, right before it publishes the state for its joiner;
* ``receive`` — a joiner, in its new generation, right before it reads its state;
* ``warming`` — a joiner still warming up: prefaulting its receive buffer, before it told the AM it is ready;
* ``coordinate`` — a member at the coordination point after step STEP, before the agreement (rank 0 before it asks
  the AM, the others before they wait for rank 0's answer);
* ``adjusting`` — a member that has the AM's plan (an adjustment agreed), before it re-forms the group;
* ``planned`` — a member other than rank 0 at a coordination point (after step STEP, or the first at which it
  happens) at which the AM decides a plan: it watches the AM's status for 1 s and, once a plan is in flight (rank 0
  asked and got it), dies before it reads the agreement: rank 0 meets its death in the plan's broadcast, and the
  recovery fails the plan's generation, which only rank 0 and the joiners knew of;
* ``recovering`` — a survivor of an earlier death, once it has the recovery's plan (it is one of its members),
  before it enters the plan's generation: the other survivors meet its death while that generation forms;
* ``train_end`` — a member whose training loop ended (Lightning's ``on_train_end``), before it told the launcher;
* ``trained`` — a member once its training ended and it told the launcher so (after the strategy's ``teardown``),
  before the script's code after ``fit``;
* ``loop_over`` — an Accelerate member once its ``epochs()`` loop ran out (it told the launcher its training ended),
  before the script's code after the loop (the probe's ``wait_for_everyone`` before the main process saves);
* ``barrier`` — a member at its first ``ElanStrategy.barrier`` (Lightning's, before the first batch: ``pre_setup``,
  ``_CheckpointConnector.resume_end``; ``barrier:NAME`` the barrier of that name), before it enters it: the others
  meet its death in that barrier (storm seed 953);
* ``ddp_broadcast`` — a member of the launch generation as its elastic DDP broadcasts rank 0's weights (Lightning's
  ``configure_ddp``, before ``resume_end``): the others meet its death in that broadcast (found by
  ``test_start_faults``' kill 0.3 s after a preloaded worker's start: the job failed);
* ``broadcast`` — a member at its first ``ElanStrategy.broadcast`` (``ModelCheckpoint``'s directory, in ``setup``),
  before it enters it: the source may complete it while the others meet the death;
* ``preparing`` — an Accelerate member as it calls ``accelerator.prepare`` (before its training loop): the others meet
  its death in ``prepare``'s collectives (the DDP's broadcast of rank 0's weights) or their first step;
* ``connecting`` — such a survivor once it has arrived in the recovery's generation (every member has), before its
  backend connects: the others meet its death inside their backend's rendezvous;
* ``reshard_committed`` — an ``elan_fsdp`` participant of a live reshard once its commit vote decided that the reshard
  stands (``ReshardCommit``), before it lets its old shards and mirror go: the others meet its death after the commit;
* ``reshard_seed`` — an ``elan_fsdp`` receiver of a live reshard as it seeds the new layout's mirrors (its rows moved,
  before the commit vote): the others meet its death in that seed.

Each kill is written to ``$ELAN_HOME/fault-kills.log`` first. Only the first matching event of the job kills (none
once that log exists: the source that serves the joiner after the recovery lives), and only workers (processes
started by ``elan run`` with ``ELAN_WORKER_ID``)."""

from __future__ import annotations

import os
import signal

_FUNCTIONS = {"send": "send_replica", "receive": "receive_replica"}
_METHODS = {"warming": "_fault_in_spare", "coordinate": "_agree", "adjusting": "_adjust",
            "recovering": "_recovery_plan_for"}
_FRONT_ENDS = {"train_end": ("lightning_elan.strategy.strategy", "_ElanCoordinator", "on_train_end"),
               "trained": ("lightning_elan.strategy.strategy", "ElanStrategy", "teardown"),
               "loop_over": ("lightning_elan.accelerate.accelerator", "ElasticAccelerator", "_training_over"),
               "barrier": ("lightning_elan.strategy.strategy", "ElanStrategy", "barrier"),
               "broadcast": ("lightning_elan.strategy.strategy", "ElanStrategy", "broadcast"),
               "ddp_broadcast": ("lightning_elan.elastic.ddp", "ElasticDistributedDataParallel",
                                 "broadcast_module_state"),
               "preparing": ("lightning_elan.accelerate.accelerator", "ElasticAccelerator", "prepare"),
               "reshard_committed": ("lightning_elan.elastic.live_reshard", "ReshardCommit", "__call__")}
_AFTER = {"recovering", "trained", "loop_over", "reshard_committed"}  # killed when the method returns, not when called


def _kill(phase: str) -> None:
    path = os.path.join(os.environ.get("ELAN_HOME", "."), "fault-kills.log")
    try:
        log = open(path, "x")  # exclusive creation: the job's first kill only
    except FileExistsError:
        return
    with log:
        log.write(f"{os.environ['ELAN_WORKER_ID']} {phase} {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _killing(phase: str, original, step: int | None):
    def killed(*args, **kwargs):
        due = step is None or step == args[1]  # coordinate: ``_agree(self, step)``
        if due and phase not in _AFTER:
            _kill(phase)
        result = original(*args, **kwargs)
        if due and phase in _AFTER:
            _kill(phase)
        return result

    return killed


def _install(phase: str, step: int | None) -> None:
    from lightning_elan.elastic import worker

    if phase == "connecting":
        _install_connecting(worker)
        return
    if phase == "reshard_seed":
        _install_reshard_seed()
        return
    if phase == "planned":
        _install_planned(worker, step)
        return
    if phase in _FRONT_ENDS:
        import importlib

        module, owner_name, name = _FRONT_ENDS[phase]
        owner = getattr(importlib.import_module(module), owner_name)
        setattr(owner, name, _killing(phase, getattr(owner, name), step))
        return
    owner, name = (worker, _FUNCTIONS[phase]) if phase in _FUNCTIONS else (worker.ElasticWorker, _METHODS[phase])
    setattr(owner, name, _killing(phase, getattr(owner, name), step))


def _install_connecting(worker) -> None:
    """Kill at the backend's construction of a generation entered by a recovery (not the launch's or a resize's)."""
    from lightning_elan.elastic import process_group

    recovering = []
    plan_for = worker.ElasticWorker._recovery_plan_for
    create = process_group.ElasticProcessGroup._create

    def recovery_plan_for(*args, **kwargs):
        recovering.append(True)
        return plan_for(*args, **kwargs)

    def created(*args, **kwargs):
        if recovering:
            _kill("connecting")
        return create(*args, **kwargs)

    worker.ElasticWorker._recovery_plan_for = recovery_plan_for
    process_group.ElasticProcessGroup._create = created


def _install_planned(worker, step: int | None) -> None:
    agree = worker.ElasticWorker._agree

    def agreeing(self, at_step: int):
        if (step is None or step == at_step) and self.rank != 0 and _a_plan_in_flight_within(1.0):
            _kill("planned")
        return agree(self, at_step)

    worker.ElasticWorker._agree = agreeing


def _a_plan_in_flight_within(seconds: float) -> bool:
    import time

    from lightning_elan.protocol.client import AMClient

    deadline = time.monotonic() + seconds
    with AMClient(os.environ["ELAN_AM_ADDRESS"], os.environ["ELAN_JOB"]) as client:
        while client.status().get("in_flight") is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
    return True


def _install_reshard_seed() -> None:
    """Kill at a mirror's seed inside a live reshard (not the launch generation's)."""
    from lightning_elan.elastic.fsdp_mirroring import StepMirroring
    from lightning_elan.replication.shard_mirror import ShardMirror

    resharding = []
    move, seed = StepMirroring.move, ShardMirror.seed

    def moving(*args, **kwargs):
        resharding.append(True)
        try:
            return move(*args, **kwargs)
        finally:
            resharding.pop()

    def seeding(*args, **kwargs):
        if resharding:
            _kill("reshard_seed")
        return seed(*args, **kwargs)

    StepMirroring.move, ShardMirror.seed = moving, seeding


_plan = os.environ.get("ELAN_TEST_KILL", "")
_worker = os.environ.get("ELAN_WORKER_ID")
if _plan and _worker:
    _target, _phase, *_step = _plan.split(":")
    if _target in ("*", _worker):
        _install(_phase, (int(_step[0]) if _step[0].isdigit() else _step[0]) if _step else None)

