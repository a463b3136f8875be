"""Fixtures of the engine tests: real worker processes (gloo, shared memory), no Trainer."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch.distributed as dist

ENGINE_TESTS = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test here starts processes: marked ``integration`` (``-m "not integration"`` runs the unit tests only)."""
    for item in items:
        if ENGINE_TESTS in item.path.parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture
def store() -> dist.TCPStore:
    """A TCPStore served by this test process on a free loopback port (spawned readers connect to ``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=60))
