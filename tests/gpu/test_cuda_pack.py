"""Pack/unpack on CUDA: the extension's kernel and the pure-torch path against torch, bit-exact."""

from __future__ import annotations

import pytest
import torch
from state_gen import assert_arena_holds, assert_bits_equal, mixed_state, raw

from lightning_elan.replication import packing
from lightning_elan.replication.cuda import ipc, kernels
from lightning_elan.replication.packing import arena_layout, arena_views

pytestmark = pytest.mark.gpu
POISON = 0xA5


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    if out.numel() and out.is_contiguous():
        out.view(-1).view(torch.uint8).fill_(POISON)
    elif out.numel():
        out.zero_()
    return out


@pytest.mark.parametrize("seed", range(4))
def test_pack_matches_torch_packing(backend: str, seed: int) -> None:
    tensors = mixed_state(seed)  # fresh random inputs per seed

    want_buffers, want_layout = packing.pack(tensors)
    got_buffers, got_layout = kernels.pack(tensors, use_ext=backend == "ext")

    assert got_layout == want_layout
    assert sorted(got_buffers) == sorted(want_buffers)
    for key in want_buffers:
        assert torch.equal(raw(got_buffers[key]), raw(want_buffers[key])), key


@pytest.mark.parametrize("seed", range(4))
def test_pack_into_a_poisoned_arena_writes_exactly_the_buffers(backend: str, seed: int) -> None:
    tensors = mixed_state(seed + 10)
    layout = packing.make_layout(tensors)
    places = arena_layout(layout)
    arena = torch.full((places.nbytes + 4096,), POISON, dtype=torch.uint8, device="cuda")

    kernels.pack_into(tensors, layout, arena_views(arena, places), use_ext=backend == "ext")
    torch.cuda.synchronize()

    assert_arena_holds(arena, places, packing.pack(tensors)[0], POISON)


@pytest.mark.parametrize("seed", range(4))
def test_unpack_into_poisoned_targets_restores_every_tensor(backend: str, seed: int) -> None:
    tensors = mixed_state(seed + 20)
    buffers, layout = kernels.pack(tensors, use_ext=backend == "ext")
    targets = [poisoned_like(t) for t in tensors]

    kernels.unpack_into(buffers, layout, targets, use_ext=backend == "ext")
    torch.cuda.synchronize()

    assert_bits_equal(targets, tensors)
    assert_bits_equal(packing.unpack(buffers, layout), tensors)


def test_the_kernel_path_is_one_launch(ext: object) -> None:
    tensors = [t for t in mixed_state(1) if t.is_contiguous()]
    buffers, layout = packing.pack([torch.empty_like(t) for t in tensors])
    slices = [buffers[s.key][s.offset : s.offset + s.numel].view(s.shape) for s in layout.specs]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        assert kernels.multi_tensor_copy(tensors, slices, use_ext=True)
        torch.cuda.synchronize()
    launches = [e for e in prof.events() if "multi_tensor_copy_kernel" in e.name]
    assert len(launches) == 1, [e.name for e in prof.events()]


def test_cpu_tensors_in_a_cuda_state_still_pack(backend: str) -> None:
    tensors = [*mixed_state(2)[:5], torch.arange(10), torch.randn(3, 3).t()]

    got, layout = kernels.pack(tensors, use_ext=backend == "ext")
    want, want_layout = packing.pack(tensors)

    assert layout == want_layout
    for key in want:
        assert got[key].device == want[key].device
        assert torch.equal(raw(got[key]).cpu(), raw(want[key]).cpu())


def test_topology_queries_agree_with_torch() -> None:
    props = torch.cuda.get_device_properties(0)
    expected = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    assert ipc.pci_bus_id(0) == expected
    for peer in range(1, torch.cuda.device_count()):
        assert ipc.can_access_peer(0, peer) == torch.cuda.can_device_access_peer(0, peer)
