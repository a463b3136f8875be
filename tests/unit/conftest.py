"""Fixtures shared by the unit tests."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist


@pytest.fixture
def store() -> dist.TCPStore:
    """A TCPStore served by this test process on a free loopback port (spawned readers connect to ``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))
