"""The AM wire protocol: the typed contract (``contract``), framing and validation (``messages``) and the client.

Exports are resolved lazily (PEP 562), so importing the pure ``contract`` or ``messages`` module does not import zmq.
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports

# name -> submodule that defines it
_LAZY_EXPORTS: dict[str, str] = {
    "AMClient": "client",
    "AMError": "client",
    "AMUnavailable": "client",
    "MAX_MESSAGE_BYTES": "messages",
    "ProtocolError": "contract",
}

__all__ = sorted(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)
