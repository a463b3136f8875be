"""State replication: source planning, packing, transports, carrying out a plan, cleaning the store up.

Modules: ``topology`` (where a worker is), ``planner`` / ``sources`` (who sends to whom, over what), ``packing`` (flat
per-dtype buffers, arenas), ``transports`` (``StateTransport``: collective, shared memory, CUDA IPC), ``exchange``
(a plan carried out through the transports), ``keys`` (deleting an adjustment's store keys), ``cuda`` (the optional
CUDA extension: build, loader, kernels, IPC).

Exports are resolved lazily (PEP 562), so importing a pure-logic submodule such as
``lightning_elan.replication.sources`` does not import torch.
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports

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
    # exchange
    "OutgoingReplication": "exchange",
    "ReplicationContext": "exchange",
    "receive_replica": "exchange",
    "send_replica": "exchange",
    # keys
    "delete_keys": "keys",
    "delete_prefix": "keys",
    # transports
    "TRANSPORTS": "transports",
    "Channel": "transports",
    "CollectiveTransport": "transports",
    "CudaIpcTransport": "transports",
    "Received": "transports",
    "ShmTransport": "transports",
    "StateTransport": "transports",
    "TransportUnavailable": "transports",
    "transport_for": "transports",
}

__all__ = sorted(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)
