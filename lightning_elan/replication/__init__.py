"""State replication: packing, transports and source planning.

Exports are resolved lazily (PEP 562), so importing a pure-logic submodule such as
``lightning_elan.replication.sources`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule that defines it (other modules' public names go here too)
_LAZY_EXPORTS: dict[str, str] = {
    # packing
    "PackedLayout": "packing",
    "TensorRef": "packing",
    "TensorSpec": "packing",
    "empty_buffers": "packing",
    "join_tensors": "packing",
    "pack": "packing",
    "split_tensors": "packing",
    "state_nbytes": "packing",
    "unpack": "packing",
    # transport
    "TransferGroup": "transport",
    "clear_header": "transport",
    "make_transfer_group": "transport",
    "receive_state": "transport",
    "send_state": "transport",
}

__all__ = sorted(_LAZY_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _LAZY_EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_EXPORTS))
