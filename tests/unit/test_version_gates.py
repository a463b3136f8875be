"""The torch and Accelerate version gates: ``torch_compat`` and ``accelerate.compat`` refuse, at import, a version
their private calls were not read from, naming it and the supported range; pyproject.toml declares the same ranges."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from lightning_elan import torch_compat
from lightning_elan.accelerate import compat as accelerate_compat

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


TORCH = ("torch", torch_compat.check_torch_version, ">=2.3,<2.14")
ACCELERATE = ("accelerate", accelerate_compat.check_accelerate_version, ">=1.0,<1.16")


@pytest.mark.parametrize(("gate", "version"), [
    (TORCH, "2.3.0"), (TORCH, "2.11.0+cu130"), (TORCH, "2.13.0+cpu"), (TORCH, "2.13.1"), (TORCH, "2.13.0a0+git1234567"),
    (ACCELERATE, "1.0.0"), (ACCELERATE, "1.15.0"), (ACCELERATE, "1.15.2"),
])
def test_a_tested_version_is_accepted(gate: tuple[str, Callable[[str], None], str], version: str) -> None:
    _, check, _ = gate
    check(version)


@pytest.mark.parametrize(("gate", "version"), [
    (TORCH, "2.14.0"), (TORCH, "2.14.0a0+git1234567"), (TORCH, "2.14.0.dev20260101+cu130"), (TORCH, "3.0.0"),
    (TORCH, "2.2.2"), (ACCELERATE, "1.16.0"), (ACCELERATE, "1.16.0rc1"), (ACCELERATE, "2.0.0"), (ACCELERATE, "0.34.2"),
])
def test_an_untested_version_is_refused_with_the_version_and_the_range(
        gate: tuple[str, Callable[[str], None], str], version: str) -> None:
    package, check, supported = gate
    with pytest.raises(ImportError) as refused:
        check(version)
    message = str(refused.value)
    assert f"found {package} {version}" in message
    assert f"{package}{supported}" in message


def _import_error(code: str) -> str:
    """Run ``code`` in a fresh interpreter; the last line of its traceback (it must fail)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode != 0, done.stdout
    return done.stderr.strip().splitlines()[-1]


def test_importing_the_torch_fence_under_a_newer_torch_fails() -> None:
    error = _import_error("import torch; torch.__version__ = '2.14.0'; import lightning_elan.torch_compat")
    assert error.startswith("ImportError") and "found torch 2.14.0" in error


def test_importing_the_accelerate_fence_under_a_newer_accelerate_fails() -> None:
    error = _import_error(
        "import importlib.metadata as metadata; real = metadata.version; "
        "metadata.version = lambda name: '1.16.0' if name == 'accelerate' else real(name); "
        "import lightning_elan.accelerate.compat")
    assert error.startswith("ImportError") and "found accelerate 1.16.0" in error


def _requirements() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    return {"dependencies": project["dependencies"], **project["optional-dependencies"]}


def test_pyproject_declares_the_ranges_the_gates_accept() -> None:
    requirements = _requirements()
    assert f"torch{torch_compat.SUPPORTED_TORCH}" in requirements["dependencies"]
    for extra in ("accelerate", "dev"):
        assert f"accelerate{accelerate_compat.SUPPORTED_ACCELERATE}" in requirements[extra]
