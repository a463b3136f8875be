"""Micro-benchmarks (printed; run with -s). Each figure says what it includes:

(a) kernel device time: a prepared plan (checks done and table uploaded once) queued back to back, against a plain
    device-to-device ``copy_`` of the same bytes queued back to back: GPU time per copy, host work hidden behind the
    queue (asserted: packed_kernel_vs_plain and unpack_kernel_vs_plain >= 0.80); per chunk size too;
(b) end to end, one call at a time (CUDA events around each call, the GPU idle before it, so host work counts):
    per-call ``pack_into`` (C++ checks, table upload, launch), ``plan.run``, ``pack`` (layout + allocation + copy),
    ``torch.cat`` packing, per-tensor ``copy_``; and the host time of each call alone (perf_counter, no sync);
(c) replication of a ResNet-50-sized state (params + buffers + momentum) within one GPU: per-tensor ``copy_`` against
    packed (pack plan, one buffer copy per dtype, unpack plan), the one-time preparation of both plans, and the per-call
    (unprepared) packed path.

ELAN_BENCH_OUT=path.json keeps the figures.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import pytest
import torch
from state_gen import resnet50_state

from lightning_elan.replication import packing
from lightning_elan.replication.cuda import kernels
from lightning_elan.replication.packing import PackedLayout, empty_buffers, make_layout

pytestmark = pytest.mark.gpu
RESULTS: dict[str, float] = {}
KIB = 1024
TARGET = 0.80  # packed (and unpacked) copy bandwidth against a plain device-to-device copy of the same bytes


def end_to_end(fn: Callable[[], object], repeat: int = 20, warmup: int = 3) -> float:
    """Median seconds of one call, host work included: the GPU is idle when the start event is recorded, so the
    interval covers the host preparing and launching as well as the GPU copying."""
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


def device_time(fn: Callable[[], object], calls: int = 50, repeat: int = 5) -> float:
    """GPU seconds per call: ``calls`` calls queued back to back between two events. The host enqueues faster than the
    GPU copies (microseconds against ~0.15 ms), so the queue never drains and the interval is GPU time. Median of
    ``repeat``."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return sorted(times)[len(times) // 2]


def host_time(fn: Callable[[], object], repeat: int = 20) -> float:
    """Median seconds the host spends in one call (the GPU drained before each, so a launch never waits for room)."""
    fn()
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
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


def on_cuda(_: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def state_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def assert_packed(tensors: list[torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
    reference, _ = packing.pack(tensors)
    for key, buf in reference.items():
        assert torch.equal(buffers[key].view(torch.uint8), buf.view(torch.uint8)), key


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def plan_device_time(plan: kernels.CopyPlan) -> float:
    return device_time(lambda: plan.run(check=False))


def test_a_kernel_device_bandwidth_vs_plain_device_to_device(ext: object) -> None:
    tensors = resnet50_state(optimizer_copies=1)
    layout = make_layout(tensors)
    buffers = empty_buffers(layout, on_cuda)
    nbytes = state_bytes(tensors)
    flat_src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    flat_dst = torch.empty_like(flat_src)
    gb = nbytes / 1e9

    plain = device_time(lambda: flat_dst.copy_(flat_src))
    record("state_MB", nbytes / 1e6, "MB")
    record("tensors", float(len(tensors)), "")
    record("plain_d2d_GBps", gb / plain, "GB/s (bytes copied; GPU time, queued back to back)")
    for chunk in (32 * KIB, 64 * KIB, 128 * KIB, 256 * KIB):
        plan = kernels.prepare_pack(tensors, layout, buffers, use_ext=True, chunk_bytes=chunk)
        assert plan.fallback_count == 0 and plan.nbytes == nbytes
        record(f"plan_kernel_GBps_chunk_{chunk // KIB}K", gb / plan_device_time(plan), "GB/s (GPU time)")

    pack_plan = kernels.prepare_pack(tensors, layout, buffers, use_ext=True)
    kernel = plan_device_time(pack_plan)
    record("packed_kernel_GBps", gb / kernel, "GB/s (prepared pack plan, default chunk; GPU time)")
    record("packed_kernel_vs_plain", plain / kernel, "(GPU time ratio; target >= 0.80)")
    targets = [torch.empty_like(t) for t in tensors]
    unpack_plan = kernels.prepare_unpack(buffers, layout, targets, use_ext=True)
    unpack = plan_device_time(unpack_plan)
    record("unpack_kernel_GBps", gb / unpack, "GB/s (prepared unpack plan; GPU time)")
    record("unpack_kernel_vs_plain", plain / unpack, "(GPU time ratio; target >= 0.80)")

    torch.cuda.synchronize()
    assert_packed(tensors, buffers)
    assert_same_bits(targets, tensors)
    assert plain / kernel >= TARGET, f"packed copy at {plain / kernel:.2f} of a plain D2D copy of the same bytes"
    assert plain / unpack >= TARGET, f"unpack at {plain / unpack:.2f} of a plain D2D copy of the same bytes"


def test_b_end_to_end_pack_including_host_work(ext: object) -> None:
    tensors = resnet50_state(optimizer_copies=1)
    layout = make_layout(tensors)
    buffers = empty_buffers(layout, on_cuda)
    slices = [buffers[s.key][s.offset : s.offset + s.numel].view(s.shape) for s in layout.specs]
    gb = state_bytes(tensors) / 1e9

    t0 = time.perf_counter()
    plan = kernels.prepare_pack(tensors, layout, buffers, use_ext=True)  # builds and caches the layout's index too
    torch.cuda.synchronize()
    record("prepare_pack_ms", (time.perf_counter() - t0) * 1e3, "ms (one time: layout index, checks, table upload)")
    t0 = time.perf_counter()
    make_layout(tensors)
    record("make_layout_ms", (time.perf_counter() - t0) * 1e3, "ms (packing.make_layout, Python; part of pack())")

    cases: dict[str, Callable[[], object]] = {
        "plan_run": lambda: plan.run(),
        "pack_into_per_call": lambda: kernels.pack_into(tensors, layout, buffers, use_ext=True),
        "multi_tensor_copy_per_call": lambda: kernels.multi_tensor_copy(tensors, slices, use_ext=True),
        "pack_allocating": lambda: kernels.pack(tensors, use_ext=True),
        "torch_cat_pack": lambda: packing.pack(tensors),
        "per_tensor_copy": lambda: per_tensor_copy(tensors, slices),
    }
    for name, fn in cases.items():
        record(f"{name}_e2e_GBps", gb / end_to_end(fn), "GB/s (one call, host work included)")
        record(f"{name}_host_us", host_time(fn) * 1e6, "us of host time per call")
    record("plan_run_unchecked_host_us", host_time(lambda: plan.run(check=False)) * 1e6, "us of host time per call")

    torch.cuda.synchronize()
    assert_packed(tensors, buffers)


def replicate(
    pack_step: Callable[[], object], local: dict[str, torch.Tensor], remote: dict[str, torch.Tensor],
    unpack_step: Callable[[], object],
) -> None:  # fmt: skip
    """Pack, one copy per dtype buffer (the transport's part, here within the GPU), unpack."""
    pack_step()
    for key, buf in local.items():
        remote[key].copy_(buf)
    unpack_step()


def poisoned(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.view(-1).view(torch.uint8).fill_(0xA5)


def test_c_per_tensor_vs_packed_replication_resnet50(ext: object) -> None:
    """Within one GPU: replicate a ResNet-50 state (params + buffers + momentum) tensor by tensor, or packed."""
    src = resnet50_state(optimizer_copies=1)
    dst = [torch.empty_like(t) for t in src]
    layout: PackedLayout = make_layout(src)
    local, remote = empty_buffers(layout, on_cuda), empty_buffers(layout, on_cuda)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    pack_plan = kernels.prepare_pack(src, layout, local, use_ext=True)
    unpack_plan = kernels.prepare_unpack(remote, layout, dst, use_ext=True)
    torch.cuda.synchronize()
    record("replicate_prepare_ms", (time.perf_counter() - t0) * 1e3, "ms (one time: both plans, layout index)")
    assert pack_plan.fallback_count == 0 and unpack_plan.fallback_count == 0

    def planned() -> None:
        replicate(pack_plan.run, local, remote, unpack_plan.run)

    def per_call() -> None:
        replicate(lambda: kernels.pack_into(src, layout, local, use_ext=True), local, remote,
                  lambda: kernels.unpack_into(remote, layout, dst, use_ext=True))  # fmt: skip

    record("replicate_per_tensor_ms", end_to_end(lambda: per_tensor_copy(src, dst)) * 1e3, "ms (end to end)")
    record("replicate_packed_ms", end_to_end(planned) * 1e3, "ms (end to end, prepared plans)")
    record("replicate_packed_per_call_ms", end_to_end(per_call) * 1e3, "ms (end to end, unprepared pack/unpack)")
    record("replicate_packed_device_ms", device_time(planned, calls=10) * 1e3, "ms (GPU time, prepared plans)")
    record("replicate_packed_host_us", host_time(planned) * 1e6, "us of host time (prepared plans)")

    for step in (planned, per_call):
        poisoned(dst)
        step()
        torch.cuda.synchronize()
        assert_same_bits(dst, src)
