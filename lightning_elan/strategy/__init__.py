"""The elastic strategy and its cluster environment (imported lazily: the pure modules here need no Lightning)."""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports

__all__ = ["ElanEnvironment", "ElanFSDPStrategy", "ElanStrategy"]


__getattr__, __dir__ = lazy_exports(__name__, {"ElanStrategy": "strategy", "ElanFSDPStrategy": "fsdp",
                                               "ElanEnvironment": "environment"})
