"""Which worker commands `elan run` forks from its preloaded interpreter, and what that interpreter imports first
(``launcher/preload.py``; the forking itself: tests/integration/test_preloaded_workers.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lightning_elan.launcher.preload import modules_to_preload, preloadable_command


@pytest.fixture
def script(tmp_path: Path) -> Path:
    (tmp_path / "model.py").write_text("import lightning.pytorch as pl\nfrom torchmetrics import Accuracy\n")
    path = tmp_path / "train.py"
    path.write_text("import os\nimport numpy as np\nfrom model import Net\n\n"
                    "def main():\n    from lightning_elan.accelerate import ElasticAccelerator\n")
    return path


def test_the_script_and_the_modules_beside_it_name_what_is_preloaded(script: Path) -> None:
    assert modules_to_preload(script) == ("torch", "numpy", "lightning.pytorch", "torchmetrics", "lightning_elan")


def test_torch_is_preloaded_whatever_the_script_imports(tmp_path: Path) -> None:
    plain = tmp_path / "plain.py"
    plain.write_text("import json\nfrom . import sibling\n")
    assert modules_to_preload(plain) == ("torch",)
    broken = tmp_path / "broken.py"
    broken.write_text("def (:\n")
    assert modules_to_preload(broken) == ("torch",)
    assert modules_to_preload(None) == ("torch",)


def test_a_script_run_by_this_interpreter_with_harmless_options_is_preloadable(script: Path) -> None:
    for options in ([], ["-u"], ["-X", "faulthandler"], ["-Xdev", "-W", "ignore", "-B"]):
        command = preloadable_command([sys.executable, *options, str(script), "--epochs", "2"])
        assert command is not None, options
        assert command.argv == (sys.executable, *options, str(script), "--epochs", "2")
        assert "lightning.pytorch" in command.modules


def test_a_module_run_with_dash_m_is_preloadable_and_scanned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "fit.py").write_text("import accelerate\n")
    monkeypatch.chdir(tmp_path)
    command = preloadable_command([sys.executable, "-m", "trainpkg.fit"])
    assert command is not None and command.modules == ("torch", "accelerate")


@pytest.mark.parametrize("options", [["-E"], ["-I"], ["-S"], ["-s"], ["-c", "print(1)"], ["-"], ["-x"]])
def test_options_that_skip_or_isolate_start_up_are_not_preloaded(script: Path, options: list[str]) -> None:
    assert preloadable_command([sys.executable, *options, str(script)]) is None


def test_other_programs_and_interpreters_are_not_preloaded(script: Path, tmp_path: Path) -> None:
    assert preloadable_command(["bash", str(script)]) is None
    assert preloadable_command([sys.executable, str(tmp_path / "missing.py")]) is None
    other = tmp_path / "bin" / "python"
    other.parent.mkdir()
    other.write_bytes(Path(sys.executable).read_bytes())
    other.chmod(0o755)
    assert preloadable_command([str(other), str(script)]) is None
    assert preloadable_command([]) is None


def test_the_interpreter_may_be_named_by_its_path_or_found_on_path(script: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    assert preloadable_command([os.path.basename(sys.executable), str(script)]) is not None
