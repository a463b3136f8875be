"""lightning_elan: elastic data-parallel training for PyTorch Lightning.

``import lightning_elan`` registers ``Trainer(strategy="elan")`` with ``lightning.pytorch`` and with the classic
``pytorch_lightning``, whichever are installed (the classic tree's classes: :mod:`lightning_elan.pytorch_lightning`).
Lightning is imported lazily: each registration runs as soon as its package is (or already was) imported, so the
``elan`` command line stays fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

from lightning_elan._lazy import lazy_exports

__version__ = "0.1.0"
__all__ = ["ElanEnvironment", "ElanFSDPStrategy", "ElanStrategy", "__version__"]

# each Lightning package "elan" is registered with, and the module whose import registers it there (the end of
# strategy/strategy.py; the classic tree's copy is made by lightning_elan._classic)
_TREES = {
    "lightning.pytorch": "lightning_elan.strategy.strategy",
    "pytorch_lightning": "lightning_elan.pytorch_lightning.strategy.strategy",
}


def _register_strategy(strategy_module: str) -> None:
    """Importing the strategy module registers it (see the end of ``strategy/strategy.py``); ``"elan_fsdp"`` is
    registered from its own module beside it (``strategy/fsdp.py``)."""
    module = sys.modules.get(strategy_module)
    if module is not None and not hasattr(module, "register_elan_strategy"):
        return  # that module is importing Lightning right now: it registers both when it finishes
    importlib.import_module(strategy_module).register_elan_strategy()
    fsdp_module = strategy_module.rpartition(".")[0] + ".fsdp"
    module = sys.modules.get(fsdp_module)
    if module is not None and not hasattr(module, "register_elan_fsdp_strategy"):
        return  # the FSDP module is importing Lightning right now: it registers itself when it finishes
    importlib.import_module(fsdp_module).register_elan_fsdp_strategy()


class _RegisterAfterLightningImport(importlib.abc.MetaPathFinder):
    """Runs the registration right after the Lightning package ``package`` finishes importing."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.package:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_strategy(_TREES[fullname])

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


def _register_when_imported(package: str) -> None:
    """Register now if ``package`` is imported already, else right after its import (it may never be installed)."""
    if package in sys.modules:
        _register_strategy(_TREES[package])
    elif not any(isinstance(finder, _RegisterAfterLightningImport) and finder.package == package
                 for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterLightningImport(package))


def _register_everywhere() -> None:
    for package in _TREES:
        _register_when_imported(package)


_register_everywhere()


__getattr__, __dir__ = lazy_exports(__name__, {"ElanStrategy": "strategy", "ElanFSDPStrategy": "strategy",
                                               "ElanEnvironment": "strategy"})
