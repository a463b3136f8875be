"""The AM wire protocol: the typed contract (``contract``), framing and validation (``messages``) and the client.

Exports are resolved lazily (PEP 562), so importing the pure ``contract`` or ``messages`` module does not import zmq.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule that defines it
_LAZY_EXPORTS: dict[str, str] = {
    "AMClient": "client",
    "AMError": "client",
    "AMUnavailable": "client",
    "MAX_MESSAGE_BYTES": "messages",
    "ProtocolError": "contract",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
