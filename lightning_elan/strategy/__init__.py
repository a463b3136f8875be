"""The elastic strategy and its cluster environment (imported lazily: the pure modules here need no Lightning)."""

from __future__ import annotations

from typing import Any

__all__ = ["ElanEnvironment", "ElanStrategy"]


def __getattr__(name: str) -> Any:
    if name == "ElanStrategy":
        from lightning_elan.strategy.strategy import ElanStrategy

        return ElanStrategy
    if name == "ElanEnvironment":
        from lightning_elan.strategy.environment import ElanEnvironment

        return ElanEnvironment
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
