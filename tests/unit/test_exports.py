"""Every package of ``lightning_elan`` names its exports one way: an ``__all__`` that lists each public name it defines
or takes from its own submodules, and, for names imported on first use, ``_lazy.lazy_exports`` (no hand-written
``__getattr__``). The ``__init__`` files are read with ``ast``; a package is imported only to check that each name of
its ``__all__`` is there (lazy names are listed by ``__dir__`` without importing what defines them).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "lightning_elan"
INITS = sorted(path for path in ROOT.rglob("__init__.py") if "csrc" not in path.parts)


def _package(init: Path) -> str:
    return ".".join(("lightning_elan", *init.parent.relative_to(ROOT).parts))


def _public_names(init: Path, package: str) -> set[str]:
    """Names the ``__init__`` defines, assigns or imports from its own submodules, less the private ones."""
    names: set[str] = set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.ImportFrom) and _own_submodule(node.module or "", package):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(target.id for target in targets if isinstance(target, ast.Name))
    return {name for name in names if not name.startswith("_")}


def _own_submodule(module: str, package: str) -> bool:
    """``module`` is a public submodule of ``package`` (``lightning_elan._lazy``, a helper, is not an export's home)."""
    return module.startswith(f"{package}.") and not any(part.startswith("_") for part in module.split("."))


@pytest.mark.parametrize("init", INITS, ids=_package)
def test_all_lists_every_public_name(init: Path) -> None:
    package = _package(init)
    module = importlib.import_module(package)
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{package} has no __all__"
    assert sorted(_public_names(init, package) - set(exported)) == []
    assert sorted(set(exported) - set(dir(module))) == []


@pytest.mark.parametrize("init", INITS, ids=_package)
def test_lazy_names_come_from_lazy_exports(init: Path) -> None:
    hand_written = [node.name for node in ast.parse(init.read_text()).body
                    if isinstance(node, ast.FunctionDef) and node.name in ("__getattr__", "__dir__")]
    assert hand_written == [], f"{_package(init)}: use lightning_elan._lazy.lazy_exports"
