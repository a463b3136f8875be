"""lightning_elan: elastic data-parallel training for PyTorch Lightning.

``import lightning_elan`` registers ``Trainer(strategy="elan")``. Lightning is imported lazily: the registration runs
as soon as ``lightning.pytorch`` is (or already was) imported, so the ``elan`` command line stays fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from typing import Any

__version__ = "0.1.0"
__all__ = ["ElanEnvironment", "ElanStrategy", "__version__"]

_LIGHTNING = "lightning.pytorch"


def _register_strategy() -> None:
    """Importing the strategy module registers it (see the end of ``strategy/strategy.py``)."""
    module = sys.modules.get("lightning_elan.strategy.strategy")
    if module is not None and not hasattr(module, "register_elan_strategy"):
        return  # that module is importing Lightning right now and registers itself when it finishes
    importlib.import_module("lightning_elan.strategy.strategy").register_elan_strategy()


class _RegisterAfterLightningImport(importlib.abc.MetaPathFinder):
    """Runs the registration right after ``lightning.pytorch`` finishes importing."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            _register_strategy()

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


if _LIGHTNING in sys.modules:
    _register_strategy()
elif not any(isinstance(finder, _RegisterAfterLightningImport) for finder in sys.meta_path):
    sys.meta_path.insert(0, _RegisterAfterLightningImport())


def __getattr__(name: str) -> Any:
    if name in ("ElanStrategy", "ElanEnvironment"):
        from lightning_elan import strategy

        return getattr(strategy, name)
    raise AttributeError(f"module 'lightning_elan' has no attribute {name!r}")
