"""Prepared copy plans (kernels.prepare_copy / prepare_pack / prepare_unpack) on CUDA, bit-exact against torch.

Every case runs on the pure-torch plan and on the extension's (``backend``); outputs are poisoned before each run and
the inputs refilled with fresh random bits between runs, so a plan that copied stale or neighbouring bytes shows.
"""

from __future__ import annotations

import pytest
import torch
from state_gen import DTYPES, assert_arena_holds, assert_bits_equal, mixed_state, random_tensor

from lightning_elan.replication import packing
from lightning_elan.replication.cuda import kernels
from lightning_elan.replication.packing import arena_layout, arena_views

pytestmark = pytest.mark.gpu
POISON = 0xA5


def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with POISON bytes (zeros where its memory is not one dense range)."""
    with torch.no_grad():
        if t.numel() and t.is_contiguous():
            t.view(-1).view(torch.uint8).fill_(POISON)
        elif t.numel():
            t.zero_()


def refill_(tensors: list[torch.Tensor], g: torch.Generator) -> None:
    """New random bits into every tensor, in place (views included): plans keep pointing at the same storage."""
    with torch.no_grad():
        for t in tensors:
            t.copy_(random_tensor(tuple(t.shape), t.dtype, g).to(t.device))


@pytest.mark.parametrize("seed", range(3))
def test_prepared_pack_and_unpack_round_trip_bit_exact(backend: str, seed: int) -> None:
    use_ext = backend == "ext"
    tensors = mixed_state(seed + 30)  # every dtype, odd sizes, 0-d, empty, non-contiguous and misaligned views
    layout = packing.make_layout(tensors)
    places = arena_layout(layout)
    arena = torch.empty(places.nbytes + 4096, dtype=torch.uint8, device="cuda")
    buffers = arena_views(arena, places)
    targets = [torch.empty_like(t) for t in tensors]  # empty_like keeps the permuted strides: some targets fall back

    pack_plan = kernels.prepare_pack(tensors, layout, buffers, use_ext=use_ext)
    unpack_plan = kernels.prepare_unpack(buffers, layout, targets, use_ext=use_ext)
    if use_ext:
        assert pack_plan.devices == [0] and unpack_plan.devices == [0]
        assert 0 < pack_plan.fallback_count < len(tensors)  # the non-contiguous views only
        assert pack_plan.nbytes == sum(t.numel() * t.element_size() for t in tensors if t.is_contiguous())

    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        refill_(tensors, g)
        arena.fill_(POISON)
        for t in targets:
            poison_(t)

        pack_plan.run()
        unpack_plan.run()
        torch.cuda.synchronize()

        assert_arena_holds(arena, places, packing.pack(tensors)[0], POISON)
        assert_bits_equal(targets, tensors)


Pairs = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


def aligned_pairs(dtype: torch.dtype, g: torch.Generator) -> Pairs:
    """Sources and destinations (in one poisoned byte arena) at every relative 16-byte alignment, odd sizes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    sizes = [1, 15, 17, 1_001, 70_001]  # 70_001 * 4 bytes spans several 64 KiB chunks
    shifts = range(0, 16, itemsize)  # byte offsets a view of this dtype can have inside 16 bytes
    # per pair: its bytes, a 16-byte gap, up to 15 bytes of rounding and 15 of shift (< 64)
    room = sum(n * itemsize + 64 for n in sizes) * len(shifts) ** 2
    arena = torch.full((room,), POISON, dtype=torch.uint8, device="cuda")
    srcs, dsts, cursor = [], [], 0
    for n in sizes:
        for src_shift in shifts:
            for dst_shift in shifts:
                base = random_tensor((n + 16 // itemsize,), dtype, g).to("cuda")
                srcs.append(base[src_shift // itemsize : src_shift // itemsize + n])
                cursor = -(-cursor // 16) * 16 + dst_shift
                dsts.append(arena[cursor : cursor + n * itemsize].view(dtype))
                cursor += n * itemsize + 16
    return srcs, dsts, arena


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.float32, torch.float64])
def test_prepared_copy_at_every_relative_alignment(backend: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(7)
    srcs, dsts, arena = aligned_pairs(dtype, g)
    written = torch.zeros(arena.numel(), dtype=torch.bool, device="cuda")
    for d in dsts:
        start = d.data_ptr() - arena.data_ptr()
        written[start : start + d.numel() * d.element_size()] = True

    plan = kernels.prepare_copy(srcs, dsts, use_ext=backend == "ext")
    for _ in range(2):
        refill_(srcs, g)
        plan.run()
        torch.cuda.synchronize()
        assert_bits_equal(dsts, srcs)
        assert bool((arena[~written] == POISON).all()), "bytes between the destinations were written"
    if backend == "ext":
        assert plan.fallback_count == 0 and plan.ntasks == len(srcs)


def test_prepared_copy_of_mixed_dtypes_odd_sizes_and_empty_tensors(backend: str) -> None:
    g = torch.Generator().manual_seed(11)
    srcs = [random_tensor((n,), dtype, g).to("cuda") for dtype in DTYPES for n in (0, 1, 3, 65_537)]
    srcs += [random_tensor((), torch.float64, g).to("cuda"), random_tensor((0, 5), torch.int32, g).to("cuda")]
    dsts = [torch.empty_like(t) for t in srcs]
    for d in dsts:
        poison_(d)

    plan = kernels.prepare_copy(srcs, dsts, use_ext=backend == "ext")
    plan.run()
    torch.cuda.synchronize()

    assert_bits_equal(dsts, srcs)
    if backend == "ext":
        assert plan.fallback_count == 0
        assert plan.ntasks == sum(1 for t in srcs if t.numel())  # 0-byte pairs are skipped, not launched


def test_a_plan_runs_on_the_given_stream(backend: str) -> None:
    srcs = mixed_state(3)
    dsts = [torch.empty_like(t) for t in srcs]
    for d in dsts:
        poison_(d)
    plan = kernels.prepare_copy(srcs, dsts, use_ext=backend == "ext")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the poison is queued on the current stream

    plan.run(side)
    side.synchronize()

    assert_bits_equal(dsts, srcs)


def test_the_prepared_plan_is_one_launch(ext: object) -> None:
    tensors = [t for t in mixed_state(1) if t.is_contiguous()]
    buffers, layout = packing.pack([torch.empty_like(t) for t in tensors])
    plan = kernels.prepare_pack(tensors, layout, buffers, use_ext=True)
    assert plan.fallback_count == 0
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        plan.run()
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "multi_tensor_copy_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]
    memcpys = [e for e in prof.events() if "Memcpy" in e.name or "memcpy" in e.name]
    assert not memcpys, [e.name for e in memcpys]  # the table was uploaded once, at preparation


def test_a_plan_refuses_to_run_after_a_tensor_got_new_storage(ext: object) -> None:
    params = [torch.nn.Parameter(torch.randn(1000, device="cuda")) for _ in range(3)]
    buffers, layout = packing.pack([p.detach() for p in params])
    plan = kernels.prepare_unpack(buffers, layout, params, use_ext=True)
    plan.run()  # into leaves that require grad: no autograd error (raw copy, like copy_ under no_grad)
    torch.cuda.synchronize()
    assert_bits_equal(params, packing.unpack(buffers, layout))

    params[1].data = torch.zeros(1000, device="cuda")
    with pytest.raises(RuntimeError, match="new storage"):
        plan.run()
    kernels.prepare_unpack(buffers, layout, params, use_ext=True).run()  # a fresh plan sees the new storage
    torch.cuda.synchronize()
    assert_bits_equal(params, packing.unpack(buffers, layout))


def test_per_call_unpack_into_bumps_versions_and_checks_targets(ext: object) -> None:
    tensors = [torch.randn(5, device="cuda"), torch.arange(7, device="cuda")]
    buffers, layout = kernels.pack(tensors, use_ext=True)
    targets = [torch.empty_like(t) for t in tensors]
    versions = [t._version for t in targets]

    kernels.unpack_into(buffers, layout, targets, use_ext=True)
    torch.cuda.synchronize()

    assert_bits_equal(targets, tensors)
    assert all(t._version > v for t, v in zip(targets, versions, strict=True))  # as copy_ would
    with pytest.raises(ValueError, match="does not match"):
        kernels.unpack_into(buffers, layout, [targets[0], torch.empty(7, device="cuda")], use_ext=True)
    with pytest.raises(ValueError, match="does not match"):
        kernels.prepare_unpack(buffers, layout, [targets[0], torch.empty(8, dtype=torch.int64, device="cuda")])
