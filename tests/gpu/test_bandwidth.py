"""Micro-benchmarks (printed; run with -s): packed copy vs a plain device-to-device copy of the same bytes, and
per-tensor vs packed replication of a ResNet-50-sized state. Set ELAN_BENCH_OUT=path.json to keep the figures."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
from state_gen import resnet50_state

from lightning_elan.replication import cuda_ext, packing
from lightning_elan.replication.packing import make_layout

pytestmark = pytest.mark.gpu
RESULTS: dict[str, float] = {}


def timed(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def record(name: str, value: float, unit: str) -> None:
    RESULTS[name] = value
    print(f"{name}: {value:.3f} {unit}")
    out = os.environ.get("ELAN_BENCH_OUT")
    if out:
        with open(out, "w") as f:
            json.dump(RESULTS, f, indent=1)


def per_tensor_copy(srcs: list[torch.Tensor], dsts: list[torch.Tensor]) -> None:
    for s, d in zip(srcs, dsts, strict=True):
        d.copy_(s)


def test_packed_copy_bandwidth_vs_plain_device_to_device(ext: object) -> None:
    tensors = resnet50_state(optimizer_copies=1)
    layout = make_layout(tensors)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    buffers, _ = packing.pack(tensors)
    slices = [buffers[s.key][s.offset : s.offset + s.numel].view(s.shape) for s in layout.specs]
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)

    plain = timed(lambda: flat_dst.copy_(flat_src))
    kernel = timed(lambda: cuda_ext.multi_tensor_copy(tensors, slices, use_ext=True))
    torch_pack = timed(lambda: packing.pack(tensors))
    loop = timed(lambda: per_tensor_copy(tensors, slices))

    gb = nbytes / 1e9
    record("state_MB", nbytes / 1e6, "MB")
    record("tensors", float(len(tensors)), "")
    record("plain_d2d_GBps", gb / plain, "GB/s (bytes copied)")
    record("packed_kernel_GBps", gb / kernel, "GB/s")
    record("torch_cat_pack_GBps", gb / torch_pack, "GB/s")
    record("per_tensor_copy_GBps", gb / loop, "GB/s")
    record("packed_kernel_vs_plain", plain / kernel, "(target >= 0.80)")


def test_per_tensor_vs_packed_replication_resnet50(ext: object) -> None:
    """Within one GPU: replicate a ResNet-50 state (params + buffers + momentum) tensor by tensor, or packed
    (pack kernel, one buffer copy per dtype, unpack kernel into the destination tensors)."""
    src = resnet50_state(optimizer_copies=1)
    dst = [torch.empty_like(t) for t in src]
    buffers, _ = cuda_ext.pack(src, use_ext=True)
    remote = {key: torch.empty_like(buf) for key, buf in buffers.items()}

    def packed() -> None:
        bufs, lay = cuda_ext.pack(src, use_ext=True)
        for key, buf in bufs.items():
            remote[key].copy_(buf)
        cuda_ext.unpack_into(remote, lay, dst, use_ext=True)

    per_tensor = timed(lambda: per_tensor_copy(src, dst))
    packed_time = timed(packed)
    record("replicate_per_tensor_ms", per_tensor * 1e3, "ms")
    record("replicate_packed_ms", packed_time * 1e3, "ms")
    torch.cuda.synchronize()
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))
