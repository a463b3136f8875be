"""Test-only (on PYTHONPATH of the worker-fault jobs): a worker SIGKILLs itself at a phase inside the library, as
``$ELAN_TEST_KILL=WORKER:PHASE`` says (``WORKER`` may be ``*``): ``send`` — a replication source, right before it
publishes the state for its joiner; ``receive`` — a joiner, in its new generation, right before it reads its state.
Each kill is written to ``$ELAN_HOME/fault-kills.log`` first. Only the first matching event of the job kills (none
once that log exists: the source that serves the joiner after the recovery lives), and only workers (processes
started by ``elan run`` with ``ELAN_WORKER_ID``)."""

from __future__ import annotations

import os
import signal


def _kill(phase: str) -> None:
    path = os.path.join(os.environ.get("ELAN_HOME", "."), "fault-kills.log")
    try:
        log = open(path, "x")  # exclusive creation: the job's first kill only
    except FileExistsError:
        return
    with log:
        log.write(f"{os.environ['ELAN_WORKER_ID']} {phase} {os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _install(phase: str) -> None:
    from lightning_elan.elastic import worker

    name = {"send": "send_replica", "receive": "receive_replica"}[phase]
    original = getattr(worker, name)

    def killed(*args, **kwargs):
        _kill(phase)
        return original(*args, **kwargs)

    setattr(worker, name, killed)


_plan = os.environ.get("ELAN_TEST_KILL", "")
_worker = os.environ.get("ELAN_WORKER_ID")
if _plan and _worker:
    _target, _, _phase = _plan.partition(":")
    if _target in ("*", _worker):
        _install(_phase)
