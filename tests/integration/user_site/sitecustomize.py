"""Test-only: a user's own ``sitecustomize`` (on the jobs' ``PYTHONPATH``) that appends, in every process it runs in,
one line to ``$USER_SITE_LOG``: the process's ``ELAN_WORKER_ID`` (or ``-``), its pid, and whether torch was already
imported when it ran."""

import os
import sys

_log = os.environ.get("USER_SITE_LOG")
if _log:
    with open(_log, "a") as file:
        file.write(f"{os.environ.get('ELAN_WORKER_ID', '-')} {os.getpid()} {'torch' in sys.modules}\n")
