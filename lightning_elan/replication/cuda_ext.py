"""Former name of :mod:`lightning_elan.replication.cuda` (kernels, IPC, loader), kept only because
``tests/gpu/test_bandwidth.py`` still imports it; delete once that test imports ``lightning_elan.replication.cuda``."""

from __future__ import annotations

from lightning_elan.replication.cuda import __all__, __getattr__  # noqa: F401
