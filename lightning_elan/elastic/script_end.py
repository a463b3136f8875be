"""Tells the launcher when this worker's training loop ended and, at interpreter exit, that its script ran to its end.

A signal that kills the process after its script ended (a crash while the interpreter finalizes) is then told apart
from a death in training: the launcher counts such a worker as finished, with a warning. A death after its training
loop ended is still a death, but once every member has exited, one member's mark shows the job's training complete
(unless a script ended in an uncaught exception, which is marked at exit too).
"""

from __future__ import annotations

import atexit
import logging
import sys

import torch.distributed as dist

from lightning_elan.protocol.contract import script_ended_key, script_failed_key, training_ended_key

log = logging.getLogger(__name__)

__all__ = ["mark_script_end_at_exit", "mark_training_ended"]


def mark_script_end_at_exit(store: dist.Store, worker_id: str) -> None:
    """Register the exit hook; registered before the process group's own, it runs after it (``atexit`` is LIFO)."""
    atexit.register(_mark_script_end, store, worker_id)


def _mark_script_end(store: dist.Store, worker_id: str) -> None:
    if getattr(sys, "last_value", None) is not None:  # an uncaught exception ended the script: not a finished worker
        _mark_script_failed(store, worker_id)
        return
    try:
        store.set(script_ended_key(worker_id), b"1")
    except Exception as error:  # the job's store is gone (the launcher ended first): nobody is left to tell
        log.debug("worker %s could not record that its script ended: %s", worker_id, error)


def mark_training_ended(store: dist.Store, worker_id: str) -> None:
    """This member's training loop ended having trained the job's last step (called once, before its script's code
    after the loop)."""
    try:
        store.set(training_ended_key(worker_id), b"1")
    except Exception as error:  # the job's store is gone: a death from here on is judged as a death in training
        log.warning("worker %s could not record that its training ended: %s", worker_id, error)


def _mark_script_failed(store: dist.Store, worker_id: str) -> None:
    """An uncaught exception ended the script: a crash that follows is that failure, not a death after the job's
    training (see ``mark_training_ended``)."""
    try:
        store.set(script_failed_key(worker_id), b"1")
    except Exception as error:  # the job's store is gone: nobody is left to judge the death
        log.debug("worker %s could not record that its script failed: %s", worker_id, error)
