"""The CUDA extension compiles (where nvcc is), and the pure-torch fallback keeps the kernel's contract."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_elan.replication import cuda_ext, packing
from lightning_elan.replication.cuda_ext import arena_layout, arena_views

CSRC = Path(__file__).resolve().parents[2] / "csrc"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


# ------------------------------------------------------------------ compile (CI: nvcc, no GPU)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("csrc-build")
    result = subprocess.run(
        ["bash", str(CSRC / "build.sh"), "--out", str(out), "--arch", "90", "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, f"csrc/ does not compile:\n{result.stdout}\n{result.stderr}"
    return out


@needs_nvcc
def test_csrc_compiles_and_links(built: Path) -> None:
    for name in ("multi_tensor_copy.o", "runtime.o", "bindings.o"):
        assert (built / name).stat().st_size > 0
    assert list(built.glob("lightning_elan_cuda*.so"))


@needs_nvcc
def test_the_built_module_imports_and_answers_without_a_gpu(built: Path) -> None:
    path = next(built.glob("lightning_elan_cuda*.so"))
    loader = importlib.machinery.ExtensionFileLoader("lightning_elan_cuda", str(path))
    spec = importlib.util.spec_from_file_location("lightning_elan_cuda", path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    try:
        loader.exec_module(module)
    except ImportError as error:  # e.g. a CUDA runtime the loader cannot find on this machine
        pytest.skip(f"built, but cannot be imported here: {error}")
    expected = {"multi_tensor_copy", "alloc_shareable", "ipc_get_handle", "ipc_open", "ipc_close", "memcpy_async"}
    assert expected | {"device_count", "pci_bus_id", "can_access_peer"} <= set(dir(module))
    count = module.device_count()
    assert isinstance(count, int)
    if count == 0:
        with pytest.raises(RuntimeError, match="cudaDeviceGetPCIBusId"):
            module.pci_bus_id(0)


@needs_nvcc
def test_a_broken_kernel_fails_the_build(tmp_path: Path) -> None:
    """The build reports a compile error (so CI goes red) instead of silently falling back."""
    broken = tmp_path / "csrc"
    shutil.copytree(CSRC, broken, ignore=shutil.ignore_patterns("build"))
    source = broken / "multi_tensor_copy.cu"
    source.write_text(source.read_text().replace("copy_range(src, dst, n);", "copy_range(src, dst, n, oops);"))
    result = subprocess.run(
        [sys.executable, str(broken / "build.py"), "--out", str(tmp_path / "out"), "--objects-only", "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1
    assert "multi_tensor_copy.cu failed" in result.stderr


# ------------------------------------------------------------------ loader and fallback (any machine)


def test_without_a_gpu_the_loader_explains_and_falls_back() -> None:
    cuda_ext._reset_for_tests()
    try:
        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
        assert cuda_ext.load() is None
        assert not cuda_ext.available()
        assert "CPU-only" in cuda_ext.status() or "no CUDA device" in cuda_ext.status()
    finally:
        cuda_ext._reset_for_tests()


def test_the_extension_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cuda_ext.ENV_DISABLE, "1")
    cuda_ext._reset_for_tests()
    try:
        assert cuda_ext.load() is None
        assert "disabled" in cuda_ext.status()
    finally:
        cuda_ext._reset_for_tests()


def mixed_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(3, 7, generator=g),
        torch.randint(-100, 100, (13,), generator=g),
        torch.randn(5, 4, generator=g).t(),
        torch.randn(1, generator=g, dtype=torch.float64),
        torch.empty(0),
        torch.randn(9, generator=g).bfloat16(),
        torch.tensor(True),
        torch.randn(11, generator=g),
    ]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def test_fallback_pack_is_packing_pack() -> None:
    tensors = mixed_tensors(0)
    want_buffers, want_layout = packing.pack(tensors)

    got_buffers, got_layout = cuda_ext.pack(tensors)

    assert got_layout == want_layout
    assert sorted(got_buffers) == sorted(want_buffers)
    for key, buf in want_buffers.items():
        assert torch.equal(got_buffers[key].view(torch.uint8), buf.view(torch.uint8))


def test_pack_into_an_arena_and_unpack_into_existing_tensors() -> None:
    tensors = mixed_tensors(1)
    layout = packing.make_layout(tensors)
    places = arena_layout(layout)
    arena = torch.full((places.nbytes,), 0xA5, dtype=torch.uint8)  # poisoned
    views = arena_views(arena, layout, places)

    cuda_ext.pack_into(tensors, layout, views)
    targets = [torch.full_like(t, 7) if t.dtype != torch.bool else torch.zeros_like(t) for t in tensors]
    cuda_ext.unpack_into(views, layout, targets)

    assert all(offset % cuda_ext.ARENA_ALIGN == 0 for offset in places.offsets.values())
    reference, _ = packing.pack(tensors)
    for key, view in views.items():
        assert torch.equal(view.view(torch.uint8), reference[key].view(torch.uint8))
    assert [bits(t) for t in targets] == [bits(t) for t in tensors]


def test_unpack_into_checks_shapes() -> None:
    tensors = [torch.ones(3)]
    buffers, layout = packing.pack(tensors)
    with pytest.raises(ValueError, match="does not match"):
        cuda_ext.unpack_into(buffers, layout, [torch.ones(4)])
    with pytest.raises(ValueError, match="targets"):
        cuda_ext.unpack_into(buffers, layout, [])


def test_arena_layout_sizes_in_bytes_sorted_by_key() -> None:
    tensors = [torch.ones(3, dtype=torch.float64), torch.ones(5, dtype=torch.int8), torch.ones(1)]
    layout = packing.make_layout(tensors)

    places = arena_layout(layout)

    assert list(places.offsets) == sorted(layout.buffer_numels)
    assert places.sizes == {"cpu:torch.float32": 4, "cpu:torch.float64": 24, "cpu:torch.int8": 5}
    assert places.nbytes == 2 * 256 + 5
