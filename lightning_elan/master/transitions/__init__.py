"""Every transition of the AM's job state (``JobState``), one family per module (pure: no sockets, no torch).

Bottom first (a module imports only those above it in this list, and ``master/state.py``):

* ``pool``: the standby pool (``pending_workers`` of no request, ``standby``)
* ``requests``: scale requests and the queue (``pending``, the joiners' readiness, failed requests, ``shutdown``)
* ``leaving``: a worker asks to leave (``leave`` requests at the head of the queue)
* ``resolving``: the head request resolved again against the members when it is decided (``to N`` leaves N)
* ``adjustments``: every change of ``members`` and ``generation``: generation 0, plan, commit, report
* ``finishing``: whether the job is done (the one rule: the members' exits), and finishing it
* ``recovering``: worker exits and the recovery from a dead member (``exits``, ``recovery``, ``failed_reason``)
* ``enrolling``: workers started by a scheduler (``elan worker``) enrol; the AM's own clock for such a job
* ``launching``: the job of ``elan run``: ``start_job`` and the launcher's poll
* ``status_view``: the ``status`` reply (reads only)
"""

from __future__ import annotations

__all__: list[str] = []  # the families are imported as modules: ``from lightning_elan.master.transitions import pool``
