"""The classic ``pytorch_lightning`` tree of the Lightning-facing modules, made at import time from their one source.

``lightning.pytorch`` and ``pytorch_lightning`` are two separate class trees: a ``pytorch_lightning.Trainer`` takes only
``pytorch_lightning`` strategies and callbacks. Lightning produces its mirrored packages by rewriting its source; this
module does the same at import time, so there is no second copy to keep in step. An import hook serves
``lightning_elan.pytorch_lightning.X`` for every module ``lightning_elan.X`` in :data:`MIRRORED`: it reads the source
file of ``lightning_elan.X``, rewrites its imports on the syntax tree (:class:`ImportRewriter`) and compiles that tree
under the original file name. Line numbers are unchanged, so tracebacks, ``inspect.getsource`` and ``linecache`` read
the real file; classes live in a real module (``lightning_elan.pytorch_lightning.strategy.strategy``), so they pickle
by reference and LightningCLI's ``class_path`` finds them. Modules not in :data:`MIRRORED` (the engine, data, scaling,
protocol, …) are imported under their own name from both trees: one ``ElasticWorker`` class, one ``DataPosition``.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path
from types import CodeType
from typing import Any

log = logging.getLogger(__name__)

PACKAGE = "lightning_elan"
MIRROR_ROOT = "lightning_elan.pytorch_lightning"
"""The mirror of ``lightning_elan`` itself: mirrored ``lightning_elan.X`` is ``lightning_elan.pytorch_lightning.X``."""

# The modules that import Lightning, directly or through another module of this list: each exists once per class tree.
# A module that imports neither must NOT be listed (both trees share it, so a state object or an isinstance check means
# the same in both). The parent packages of a listed module are listed too (their __init__ runs under the mirrored
# name), and a module shared by both trees lives outside these packages (importing it would import their Lightning
# side). tests/unit/test_classic_mirror.py derives this set from the sources and checks it.
MIRRORED = frozenset({
    "lightning_elan.compat",
    "lightning_elan.strategy",
    "lightning_elan.strategy.environment",
    "lightning_elan.strategy.fsdp",
    "lightning_elan.strategy.strategy",
    "lightning_elan.callbacks",
    "lightning_elan.callbacks.hybrid",
    "lightning_elan.callbacks.lr_ramp",
})

RENAMED = {"lightning.pytorch": "pytorch_lightning", "lightning.fabric": "lightning_fabric"}
"""Lightning's unified packages and their classic twins (the same modules, released as separate distributions)."""


class MirrorError(ImportError):
    """A mirrored module imports Lightning or a mirrored module in a form the rewrite cannot map."""


def _renamed(name: str, renames: dict[str, str]) -> str | None:
    for source, target in renames.items():
        if name == source or name.startswith(source + "."):
            return target + name[len(source) :]
    return None


def mirror_name(name: str) -> str | None:
    """The classic tree's name for the module ``name``, or None when both trees share it."""
    if name in MIRRORED:
        return MIRROR_ROOT + name[len(PACKAGE) :]
    return _renamed(name, RENAMED)


def original_name(name: str) -> str | None:
    """The module whose source the mirrored module ``name`` is made from, or None when ``name`` is not a mirror."""
    original = _renamed(name, {MIRROR_ROOT: PACKAGE})
    return original if original in MIRRORED else None


class ImportRewriter(ast.NodeTransformer):
    """Maps every import of the module ``module`` (a name in :data:`MIRRORED`) to the classic tree."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]

    def visit_Import(self, node: ast.Import) -> ast.Import:
        for alias in node.names:
            self._refuse_lightning_root(alias.name, node)
            target = mirror_name(alias.name)
            if target is None:
                continue
            if alias.asname is None:
                raise self._error(node, f"`import {alias.name}` binds the shared top-level name: write `import "
                                        f"{alias.name} as NAME`")
            alias.name = target
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.ImportFrom | list[ast.ImportFrom]:
        module = self._absolute(node)
        self._refuse_lightning_root(module, node)
        node.module, node.level = mirror_name(module) or module, 0
        if node.module != module:
            return node
        mirrored = [alias for alias in node.names if f"{module}.{alias.name}" in MIRRORED]
        if not mirrored:
            return node
        if module != PACKAGE:
            raise self._error(node, f"{module} is shared but its submodules {[a.name for a in mirrored]} are mirrored")
        shared = [alias for alias in node.names if alias not in mirrored]
        rewritten = [ast.ImportFrom(module=MIRROR_ROOT, names=mirrored, level=0)]
        if shared:
            rewritten.append(ast.ImportFrom(module=module, names=shared, level=0))
        return [ast.copy_location(new, node) for new in rewritten]

    def _absolute(self, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        return importlib.util.resolve_name("." * node.level + (node.module or ""), self.package)

    def _refuse_lightning_root(self, name: str, node: ast.stmt) -> None:
        """``lightning`` itself (``from lightning import Trainer``) has no classic twin: name its subpackage."""
        if name == "lightning":
            raise self._error(node, "import from lightning.pytorch or lightning.fabric, not from lightning")

    def _error(self, node: ast.stmt, reason: str) -> MirrorError:
        return MirrorError(f"cannot mirror {self.module} (line {node.lineno}): {reason}")


def mirrored_code(source: bytes, path: str, module: str, is_package: bool) -> CodeType:
    """The code of ``module``'s source with its imports mapped to the classic tree (line numbers and file kept)."""
    tree = ImportRewriter(module, is_package).visit(ast.parse(source, filename=path))
    return compile(ast.fix_missing_locations(tree), path, "exec", dont_inherit=True)


class MirrorLoader(importlib.machinery.SourceFileLoader):
    """Loads a mirrored module from its original's source file (``get_source``/``get_filename`` are that file's)."""

    def __init__(self, fullname: str, path: str, original: str) -> None:
        super().__init__(fullname, path)
        self.original = original

    def get_code(self, fullname: str) -> CodeType:
        """Compiled from the source every time: the bytecode cache next to the file belongs to the original."""
        source = self.get_data(self.path)
        return mirrored_code(source, self.path, self.original, self.is_package(fullname))


class MirrorFinder(importlib.abc.MetaPathFinder):
    """Finds ``lightning_elan.pytorch_lightning.X`` for every ``lightning_elan.X`` in :data:`MIRRORED`."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        original = original_name(fullname)
        if original is None:
            return None
        source = source_path(original)
        is_package = source.name == "__init__.py"
        log.debug("mirroring %s as %s", original, fullname)
        spec = importlib.util.spec_from_file_location(fullname, source, loader=MirrorLoader(fullname, str(source),
                                                                                             original))
        if spec is not None and is_package:
            # no directory of its own: this finder serves its mirrored submodules, and a shared one is imported under
            # its own name (the original directory on __path__ would load it a second time, unmapped)
            spec.submodule_search_locations = []
        return spec


def source_path(module: str) -> Path:
    """The source file of ``lightning_elan``'s module ``module``, found without importing it or its packages."""
    base = Path(__file__).resolve().parent.joinpath(*module.split(".")[1:])
    package = base / "__init__.py"
    return package if package.is_file() else base.with_suffix(".py")


def install() -> None:
    """Put the mirror's finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MirrorFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MirrorFinder())
