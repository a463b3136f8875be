"""Pack / unpack kernels of the optional CUDA extension and their pure-torch fallback: owns one-launch copies.

* :func:`pack` / :func:`pack_into`: one kernel launch copies every CUDA tensor into its slice of the per-dtype
  buffers (fallback: :func:`lightning_elan.replication.packing.pack`, ``torch.cat`` / ``copy_``);
* :func:`unpack_into`: one launch copies the buffer slices into existing tensors (fallback: ``copy_`` per tensor);
  per call, the checks and byte offsets run in C++ (tens of microseconds of host time for ~600 tensors);
* :func:`multi_tensor_copy`: ``dsts[i].copy_(srcs[i])`` for many pairs in one launch per device;
* :func:`prepare_copy` / :func:`prepare_pack` / :func:`prepare_unpack`: a :class:`CopyPlan` for fixed tensors
  (parameters, optimizer state), checked and with its kernel table uploaded once; ``plan.run()`` is one launch per
  device and no other work (fallback: the same ``copy_`` calls, their slices computed once).

Both paths produce the same bytes and the same :class:`~lightning_elan.replication.packing.PackedLayout` (the
contract the unit and GPU tests check). The module comes from :func:`lightning_elan.replication.cuda.loader.load`.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from lightning_elan.replication import packing
from lightning_elan.replication.cuda import loader
from lightning_elan.replication.packing import PackedLayout, TensorSpec, dtype_from_str, make_layout

log = logging.getLogger(__name__)

__all__ = [
    "CopyPlan",
    "multi_tensor_copy",
    "pack",
    "pack_into",
    "prepare_copy",
    "prepare_pack",
    "prepare_unpack",
    "unpack_into",
]


# --------------------------------------------------------------------------------------------
# pack / unpack (contract: identical to packing.pack / packing.unpack)
# --------------------------------------------------------------------------------------------


def _current_stream(device_index: int) -> int:
    """Torch's current stream of a CUDA device as a raw ``cudaStream_t`` (where the extension launches, so that the
    copies are ordered with the caller's torch work exactly as ``copy_`` would be)."""
    return torch.cuda.current_stream(device_index).cuda_stream


def _module_for(buffers: dict[str, torch.Tensor], use_ext: bool | None) -> ModuleType | None:
    """The extension when it may run and some buffer is on a GPU (CPU-only buffers never reach the kernel)."""
    if use_ext is False or not any(b.is_cuda for b in buffers.values()):
        return None
    return loader.load()


def multi_tensor_copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor], *, use_ext: bool | None = None) -> bool:
    """``dsts[i].copy_(srcs[i])`` for all ``i`` (same shapes/bytes); True when the kernel took any pair.

    The kernel takes, in one launch per device, the pairs where both tensors are contiguous CUDA tensors of one device,
    dtype and shape (checked in C++); the other pairs (and everything, without the extension) use ``copy_``.
    """
    module = loader.load() if use_ext is not False else None
    if module is None:
        for src, dst in zip(srcs, dsts, strict=True):
            dst.detach().copy_(src.detach())
        return False
    fallback = module.copy_pairs(srcs, dsts, _current_stream)
    for i in fallback:
        dsts[i].detach().copy_(srcs[i].detach())
    return len(fallback) < len(srcs)


def pack(tensors: list[torch.Tensor], *, use_ext: bool | None = None) -> tuple[dict[str, torch.Tensor], PackedLayout]:
    """Same result as :func:`packing.pack`; CUDA tensors go through one kernel launch when the extension is loaded."""
    if not (use_ext is not False and loader.load() is not None and any(t.is_cuda for t in tensors)):
        return packing.pack(tensors)
    layout = make_layout(tensors)
    buffers: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}
    for spec, t in zip(layout.specs, tensors, strict=True):
        first.setdefault(spec.key, t)
    for key in sorted(first):
        buffers[key] = torch.empty(layout.buffer_numels[key], dtype=first[key].dtype, device=first[key].device)
    module = _module_for(buffers, use_ext)
    if module is None:
        _pack_by_copy(tensors, layout, buffers)
        return buffers, layout
    _pack_with(module, tensors, layout, buffers, _build_index(module, layout))  # a fresh layout: not worth caching
    return buffers, layout


def pack_into(
    tensors: list[torch.Tensor], layout: PackedLayout, buffers: dict[str, torch.Tensor], *, use_ext: bool | None = None
) -> None:
    """Copy ``tensors`` into the slices ``layout`` gives them in preallocated ``buffers`` (any devices).

    With the extension, the checks and offsets are computed in C++ (the layout's byte offsets once per layout) and the
    eligible tensors go in one launch per device; the rest (non-contiguous, CPU, other device) use ``copy_``.
    """
    module = _module_for(buffers, use_ext)
    if module is None:
        _pack_by_copy(tensors, layout, buffers)
        return
    _pack_with(module, tensors, layout, buffers, _layout_index(module, layout))


def unpack_into(
    buffers: dict[str, torch.Tensor],
    layout: PackedLayout,
    targets: list[torch.Tensor],
    *,
    use_ext: bool | None = None,
) -> None:
    """Copy each tensor of the packed state into the existing tensor at the same position of ``targets``.

    The in-place alternative to :func:`packing.unpack` (which returns views): e.g. straight into a model's parameters.
    Raises ValueError, before copying anything, when a target's shape or dtype differs from its spec.
    """
    if len(targets) != len(layout.specs):
        raise ValueError(f"{len(targets)} targets for {len(layout.specs)} packed tensors")
    module = _module_for(buffers, use_ext)
    if module is None:
        _check_targets(layout, targets)
        for spec, target in zip(layout.specs, targets, strict=True):
            target.detach().copy_(_slice(buffers[spec.key], spec))
        return
    index = _layout_index(module, layout)
    fallback = module.unpack_into([buffers[key] for key in index.keys], index.native, targets, _current_stream)
    for i in fallback:
        spec = layout.specs[i]
        targets[i].detach().copy_(_slice(buffers[spec.key], spec))


def _pack_by_copy(tensors: list[torch.Tensor], layout: PackedLayout, buffers: dict[str, torch.Tensor]) -> None:
    for spec, t in zip(layout.specs, tensors, strict=True):
        _slice(buffers[spec.key], spec).copy_(t.detach())


def _pack_with(
    module: ModuleType,
    tensors: list[torch.Tensor],
    layout: PackedLayout,
    buffers: dict[str, torch.Tensor],
    index: _Index,
) -> None:
    fallback = module.pack_into(tensors, [buffers[key] for key in index.keys], index.native, _current_stream)
    for i in fallback:
        spec = layout.specs[i]
        _slice(buffers[spec.key], spec).copy_(tensors[i].detach())


def _check_targets(layout: PackedLayout, targets: list[torch.Tensor]) -> None:
    for spec, target in zip(layout.specs, targets, strict=True):
        if tuple(target.shape) != spec.shape or str(target.dtype) != spec.dtype:
            raise ValueError(f"target {tuple(target.shape)}/{target.dtype} does not match {spec.shape}/{spec.dtype}")


def _slice(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    return buffer[spec.offset : spec.offset + spec.numel].view(spec.shape)


# --------------------------------------------------------------------------------------------
# the layout in bytes, for C++ (built once per PackedLayout)
# --------------------------------------------------------------------------------------------


@dataclass
class _Index:
    """A layout's per-tensor buffer position, byte offset, size, dtype and shape as a C++ ``LayoutIndex``."""

    specs: list[TensorSpec]  # the layout's list, to notice a layout whose specs were replaced
    count: int
    keys: list[str]  # buffer keys, sorted: the C++ side takes the buffers as a list in this order
    native: Any


_indexes: dict[int, _Index] = {}  # id(layout) -> index, dropped when the layout is collected


def _layout_index(module: ModuleType, layout: PackedLayout) -> _Index:
    """The cached index of ``layout`` (a layout is not modified once used: it describes buffers that exist)."""
    cached = _indexes.get(id(layout))
    if cached is not None and cached.specs is layout.specs and cached.count == len(layout.specs):
        return cached
    index = _build_index(module, layout)
    if id(layout) not in _indexes:
        weakref.finalize(layout, _indexes.pop, id(layout), None)
    _indexes[id(layout)] = index
    return index


def _build_index(module: ModuleType, layout: PackedLayout) -> _Index:
    specs = layout.specs
    keys = sorted({spec.key for spec in specs})
    position = {key: i for i, key in enumerate(keys)}
    dtypes = {name: dtype_from_str(name) for name in {spec.dtype for spec in specs}}
    itemsize = {name: dtype.itemsize for name, dtype in dtypes.items()}
    native = module.LayoutIndex(
        key=[position[spec.key] for spec in specs],
        byte_offset=[spec.offset * itemsize[spec.dtype] for spec in specs],
        nbytes=[spec.numel * itemsize[spec.dtype] for spec in specs],
        dtype=[dtypes[spec.dtype] for spec in specs],
        shape=[spec.shape for spec in specs],
        nkeys=len(keys),
    )
    return _Index(specs, len(specs), keys, native)


# --------------------------------------------------------------------------------------------
# prepared copies: checks, offsets and the kernel's table done once for fixed tensors
# --------------------------------------------------------------------------------------------


class CopyPlan:
    """A copy between fixed tensors prepared once; :meth:`run` repeats it (one kernel launch per device).

    Built by :func:`prepare_copy`, :func:`prepare_pack` or :func:`prepare_unpack`. The extension's part holds the
    device addresses of the tensors (and references keeping them alive); the pairs the kernel cannot take (and all
    pairs, without the extension) are kept as ``(src, dst)`` tensors and copied with ``copy_`` after the launch.
    Parameters and optimizer state keep their storage between adjustments, which is what makes a plan reusable;
    ``run(check=True)`` (the default, a few microseconds in C++) raises if one of the kernel's tensors got new storage.
    """

    def __init__(self, native: Any | None, fallback: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._native = native
        self._devices: list[int] = list(native.devices) if native is not None else []
        self._fallback = fallback

    @property
    def devices(self) -> list[int]:
        """CUDA device indices the plan launches on (empty without the extension)."""
        return list(self._devices)

    @property
    def nbytes(self) -> int:
        """Bytes the kernel copies per run."""
        return int(self._native.nbytes) if self._native is not None else 0

    @property
    def ntasks(self) -> int:
        """Tensors the kernel copies per run (0-byte ones are skipped)."""
        return int(self._native.ntasks) if self._native is not None else 0

    @property
    def fallback_count(self) -> int:
        """Pairs copied with ``copy_`` per run."""
        return len(self._fallback)

    def run(self, stream: torch.cuda.Stream | None = None, *, check: bool = True) -> None:
        """Copy again: on ``stream`` (for its device) or torch's current stream of each device."""
        if self._native is not None:
            self._native.run(self._streams(stream), check)
        if self._fallback:
            with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()):
                for src, dst in self._fallback:  # no_grad: in-place into leaves (parameters) like the kernel
                    dst.copy_(src)

    def _streams(self, stream: torch.cuda.Stream | None) -> list[int]:
        if stream is None:
            return [torch.cuda.current_stream(d).cuda_stream for d in self._devices]
        index = stream.device.index
        return [stream.cuda_stream if d == index else torch.cuda.current_stream(d).cuda_stream for d in self._devices]


def prepare_copy(
    srcs: list[torch.Tensor], dsts: list[torch.Tensor], *, use_ext: bool | None = None, chunk_bytes: int | None = None
) -> CopyPlan:
    """A plan for ``dsts[i].copy_(srcs[i])`` (see :func:`multi_tensor_copy`)."""
    module = loader.load() if use_ext is not False else None
    if module is None:
        return CopyPlan(None, list(zip(srcs, dsts, strict=True)))
    native = module.prepare_pairs(srcs, dsts, chunk_bytes or module.DEFAULT_CHUNK_BYTES)
    return CopyPlan(native, [(srcs[i], dsts[i]) for i in native.fallback])


def prepare_pack(
    tensors: list[torch.Tensor],
    layout: PackedLayout,
    buffers: dict[str, torch.Tensor],
    *,
    use_ext: bool | None = None,
    chunk_bytes: int | None = None,
) -> CopyPlan:
    """A plan for :func:`pack_into` of these tensors into these buffers."""
    module = _module_for(buffers, use_ext)
    if module is None:
        pairs = [(t, _slice(buffers[spec.key], spec)) for spec, t in zip(layout.specs, tensors, strict=True)]
        return CopyPlan(None, pairs)
    index = _layout_index(module, layout)
    native = module.prepare_pack(
        tensors, [buffers[key] for key in index.keys], index.native, chunk_bytes or module.DEFAULT_CHUNK_BYTES
    )
    specs = layout.specs
    return CopyPlan(native, [(tensors[i], _slice(buffers[specs[i].key], specs[i])) for i in native.fallback])


def prepare_unpack(
    buffers: dict[str, torch.Tensor],
    layout: PackedLayout,
    targets: list[torch.Tensor],
    *,
    use_ext: bool | None = None,
    chunk_bytes: int | None = None,
) -> CopyPlan:
    """A plan for :func:`unpack_into` of these buffers into these targets (checked now: ValueError)."""
    if len(targets) != len(layout.specs):
        raise ValueError(f"{len(targets)} targets for {len(layout.specs)} packed tensors")
    module = _module_for(buffers, use_ext)
    if module is None:
        _check_targets(layout, targets)
        return CopyPlan(None, [(_slice(buffers[s.key], s), t) for s, t in zip(layout.specs, targets, strict=True)])
    index = _layout_index(module, layout)
    native = module.prepare_unpack(
        [buffers[key] for key in index.keys], index.native, targets, chunk_bytes or module.DEFAULT_CHUNK_BYTES
    )
    specs = layout.specs
    return CopyPlan(native, [(_slice(buffers[specs[i].key], specs[i]), targets[i]) for i in native.fallback])
