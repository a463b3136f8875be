"""The optional CUDA extension and its pure-torch fallback, behind one API (exports resolved lazily, PEP 562).

* :mod:`~lightning_elan.replication.cuda.build` compiles the sources shipped in ``csrc/`` (package data);
* :mod:`~lightning_elan.replication.cuda.loader` finds, builds on request and imports the module, or says why not;
* :mod:`~lightning_elan.replication.cuda.kernels` packs / unpacks / copies many tensors in one launch (``CopyPlan``);
* :mod:`~lightning_elan.replication.cuda.ipc` shares GPU memory across processes and answers device queries.

Tests that replace a function do it on the submodule that defines it (``monkeypatch.setattr(ipc, "ipc_open", ...)``).
"""

from __future__ import annotations

from lightning_elan._lazy import lazy_exports

_LOADER = ("MODULE_NAME", "available", "load", "status")
_KERNELS = ("CopyPlan", "multi_tensor_copy", "pack", "pack_into", "prepare_copy", "prepare_pack", "prepare_unpack",
            "unpack_into")  # fmt: skip
_IPC = ("IpcHandle", "IpcMapping", "alloc_shareable", "can_access_peer", "device_index", "ipc_export", "ipc_open",
        "pci_bus_id")  # fmt: skip
# name -> submodule that defines it
_LAZY_EXPORTS: dict[str, str] = {
    **dict.fromkeys(_LOADER, "loader"),
    **dict.fromkeys(_KERNELS, "kernels"),
    **dict.fromkeys(_IPC, "ipc"),
}

__all__ = sorted(_LAZY_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY_EXPORTS)
