"""GPU tests: everything here is marked ``gpu`` and skipped without a CUDA device.

Run on a GPU machine with ``python -m pytest -q -m gpu tests/gpu -s`` (``-s`` shows the benchmark figures). The
extension-backed cases build the extension first (``loader.load(build=True)``); they skip, with the reason, when it
cannot be built, and the pure-torch cases still run.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from lightning_elan.replication.cuda import loader


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "tests/gpu/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(scope="session")
def ext() -> ModuleType:
    """The built extension, or skip with the loader's reason."""
    module = loader.load(build=True)  # looks again, building, even if an earlier look did not build
    if module is None:
        pytest.skip(f"CUDA extension unavailable: {loader.status()}")
    return module


@pytest.fixture(params=["torch", "ext"])
def backend(request: pytest.FixtureRequest) -> str:
    """Run a test on the pure-torch path and on the extension."""
    if request.param == "ext":
        request.getfixturevalue("ext")
    return request.param
