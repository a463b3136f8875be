"""Deterministic mixed-dtype states for the GPU tests (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64, torch.uint8,
    torch.bool, torch.complex64,
]  # fmt: skip
SIZES = [0, 1, 3, 7, 31, 1023, 4097, 65_537, 300_001]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bits (every byte pattern, NaNs included for floats), made on the CPU from ``g``."""
    nbytes = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw & 1).bool().view(shape)
    return raw.view(dtype).view(shape)


def mixed_state(seed: int, device: str | torch.device = "cuda") -> list[torch.Tensor]:
    """Every dtype × odd sizes, a 0-d tensor, non-contiguous views, misaligned contiguous slices."""
    g = torch.Generator().manual_seed(seed)
    tensors = [random_tensor((n,), dtype, g).to(device) for dtype in DTYPES for n in SIZES[seed % 3 :: 2]]
    tensors.append(random_tensor((), torch.float32, g).to(device))
    tensors.append(random_tensor((37, 53), torch.float32, g).to(device).t())  # non-contiguous
    base = random_tensor((4099,), torch.float32, g).to(device)
    tensors.append(base[3:2050])  # contiguous, 12 bytes past a 16-byte boundary
    raw = random_tensor((10_001,), torch.uint8, g).to(device)
    tensors.append(raw[1:9_000])  # byte-misaligned
    tensors.append(random_tensor((5, 7, 9), torch.float16, g).to(device).permute(2, 0, 1))
    return tensors


def resnet50_shapes() -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Parameter and buffer shapes of torchvision's ResNet-50 (25.6 M parameters), without torchvision."""
    shapes: list[tuple[tuple[int, ...], torch.dtype]] = []

    def bn(c: int) -> None:
        shapes.extend([((c,), torch.float32)] * 4 + [((), torch.int64)])

    shapes.append(((64, 3, 7, 7), torch.float32))
    bn(64)
    inplanes = 64
    for width, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True):
        for block in range(blocks):
            shapes.append(((width, inplanes, 1, 1), torch.float32))
            bn(width)
            shapes.append(((width, width, 3, 3), torch.float32))
            bn(width)
            shapes.append(((width * 4, width, 1, 1), torch.float32))
            bn(width * 4)
            if block == 0:
                shapes.append(((width * 4, inplanes, 1, 1), torch.float32))
                bn(width * 4)
            inplanes = width * 4
    shapes += [((1000, 2048), torch.float32), ((1000,), torch.float32)]
    return shapes


def resnet50_state(device: str | torch.device = "cuda", optimizer_copies: int = 1) -> list[torch.Tensor]:
    """Parameters, buffers and ``optimizer_copies`` momentum-like copies of the float parameters."""
    g = torch.Generator().manual_seed(0)
    model = [random_tensor(shape, dtype, g).to(device) for shape, dtype in resnet50_shapes()]
    extra = [t.clone() for _ in range(optimizer_copies) for t in model if t.is_floating_point()]
    return model + extra


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in logical order (bit-exact comparison, NaNs included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bits_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g.dtype, tuple(g.shape)) == (w.dtype, tuple(w.shape)), i
        assert torch.equal(raw(g), raw(w)), f"tensor {i} ({w.dtype}, {tuple(w.shape)}) differs"


def assert_arena_holds(arena: torch.Tensor, places: Any, buffers: dict[str, torch.Tensor], poison: int) -> None:
    """Each packed buffer sits at its arena offset, bit for bit; every other byte still holds ``poison``."""
    written = torch.zeros(arena.numel(), dtype=torch.bool, device=arena.device)
    for key, offset in places.offsets.items():
        size = places.sizes[key]
        assert torch.equal(arena[offset : offset + size], raw(buffers[key])), key
        written[offset : offset + size] = True
    assert bool((arena[~written] == poison).all()), "bytes outside the buffers were written"
