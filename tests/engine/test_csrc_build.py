"""The CUDA extension compiles (where nvcc is) from the sources shipped in the package, and the pure-torch fallback
keeps the kernel's contract."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
import torch

from lightning_elan.protocol.contract import ENV_NO_CUDA_EXT
from lightning_elan.replication import packing
from lightning_elan.replication.cuda import build, kernels, loader
from lightning_elan.replication.packing import ARENA_ALIGN, arena_layout, arena_views

REPO = Path(__file__).resolve().parents[2]
SOURCES = {"multi_tensor_copy.cu", "runtime.cpp", "bindings.cpp", "elan_cuda.h"}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")


# ------------------------------------------------------------------ compile (CI: nvcc, no GPU)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("csrc-build")
    result = subprocess.run(
        ["bash", str(REPO / "csrc" / "build.sh"), "--out", str(out), "--arch", "90", "--quiet"],
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
    module = import_built(built)
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
    shutil.copytree(build.source_dir(), broken)
    source = broken / "multi_tensor_copy.cu"
    source.write_text(source.read_text().replace("copy_range(src, dst, n);", "copy_range(src, dst, n, oops);"))
    result = subprocess.run(
        [sys.executable, "-m", build.__name__, "--src", str(broken), "--out", str(tmp_path / "out"), "--objects-only",
         "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 1
    assert "multi_tensor_copy.cu failed" in result.stderr


# ------------------------------------------------------------------ sources shipped in the package


def test_the_sources_are_found_in_the_package_not_the_checkout() -> None:
    src = build.source_dir()
    assert src == Path(build.__file__).resolve().parent / "csrc"
    assert SOURCES <= {path.name for path in src.iterdir()}
    assert len(build.source_hash(["90"])) == 16


@pytest.mark.integration
def test_the_wheel_ships_the_sources(tmp_path: Path) -> None:
    """``pip wheel`` of the project holds the .cu/.cpp/.h files next to the build module that compiles them."""
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
         str(REPO)],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (wheel,) = tmp_path.glob("lightning_elan-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"lightning_elan/replication/cuda/csrc/{name}" for name in SOURCES} <= names
    assert "lightning_elan/replication/cuda/build.py" in names


# ------------------------------------------------------------------ loader and fallback (any machine)


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader looks again in this test (and forgets that look afterwards)."""
    monkeypatch.setattr(loader, "_attempt", None)


@pytest.mark.usefixtures("fresh_loader")
def test_without_a_gpu_the_loader_explains_and_falls_back() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert loader.load() is None
    assert not loader.available()
    assert "CPU-only" in loader.status() or "no CUDA device" in loader.status()


@pytest.mark.usefixtures("fresh_loader")
def test_the_extension_can_be_disabled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_NO_CUDA_EXT, "1")
    assert loader.load() is None
    assert "disabled" in loader.status()


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

    got_buffers, got_layout = kernels.pack(tensors)

    assert got_layout == want_layout
    assert sorted(got_buffers) == sorted(want_buffers)
    for key, buf in want_buffers.items():
        assert torch.equal(got_buffers[key].view(torch.uint8), buf.view(torch.uint8))


def test_pack_into_an_arena_and_unpack_into_existing_tensors() -> None:
    tensors = mixed_tensors(1)
    layout = packing.make_layout(tensors)
    places = arena_layout(layout)
    arena = torch.full((places.nbytes,), 0xA5, dtype=torch.uint8)  # poisoned
    views = arena_views(arena, places)

    kernels.pack_into(tensors, layout, views)
    targets = [torch.full_like(t, 7) if t.dtype != torch.bool else torch.zeros_like(t) for t in tensors]
    kernels.unpack_into(views, layout, targets)

    assert all(offset % ARENA_ALIGN == 0 for offset in places.offsets.values())
    reference, _ = packing.pack(tensors)
    for key, view in views.items():
        assert torch.equal(view.view(torch.uint8), reference[key].view(torch.uint8))
    assert [bits(t) for t in targets] == [bits(t) for t in tensors]


def test_unpack_into_checks_shapes() -> None:
    tensors = [torch.ones(3)]
    buffers, layout = packing.pack(tensors)
    with pytest.raises(ValueError, match="does not match"):
        kernels.unpack_into(buffers, layout, [torch.ones(4)])
    with pytest.raises(ValueError, match="targets"):
        kernels.unpack_into(buffers, layout, [])


def test_arena_layout_sizes_in_bytes_sorted_by_key() -> None:
    tensors = [torch.ones(3, dtype=torch.float64), torch.ones(5, dtype=torch.int8), torch.ones(1)]
    layout = packing.make_layout(tensors)

    places = arena_layout(layout)

    assert list(places.offsets) == sorted(layout.buffer_numels)
    assert places.sizes == {"cpu:torch.float32": 4, "cpu:torch.float64": 24, "cpu:torch.int8": 5}
    assert places.nbytes == 2 * 256 + 5


# ------------------------------------------------------------------ the C++ glue on CPU tensors (built module, no GPU)


def import_built(built: Path) -> ModuleType:
    module = loader.import_file(next(built.glob("lightning_elan_cuda*.so")))
    if module is None:  # e.g. a CUDA runtime the loader cannot find on this machine (the warning says why)
        pytest.skip("built, but cannot be imported here")
    return module


def force_cpp(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """Route the kernels through ``module`` even for CPU buffers: the C++ checks run and hand every tensor to copy_."""
    monkeypatch.setattr(loader, "load", lambda build=None: module)
    monkeypatch.setattr(kernels, "_module_for", lambda buffers, use_ext: module)


@needs_nvcc
def test_the_cpp_paths_hand_cpu_tensors_back_to_copy(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = import_built(built)
    force_cpp(module, monkeypatch)
    tensors = mixed_tensors(2)
    layout = packing.make_layout(tensors)
    reference, _ = packing.pack(tensors)
    buffers = {key: torch.zeros_like(buf) for key, buf in reference.items()}
    targets = [torch.zeros_like(t) for t in tensors]
    copied = [torch.zeros_like(t) for t in tensors]

    kernels.pack_into(tensors, layout, buffers)
    kernels.unpack_into(buffers, layout, targets)
    got, got_layout = kernels.pack(tensors)
    launched = kernels.multi_tensor_copy(tensors, copied)

    assert not launched
    assert got_layout == layout
    for key, buf in reference.items():
        assert bits(buffers[key]) == bits(buf) and bits(got[key]) == bits(buf), key
    assert [bits(t) for t in targets] == [bits(t) for t in tensors] == [bits(t) for t in copied]
    index = kernels._layout_index(module, layout)
    assert kernels._layout_index(module, layout) is index  # built once per layout
    fallback = module.pack_into(tensors, [buffers[key] for key in index.keys], index.native, lambda device: 0)
    assert fallback == [i for i, t in enumerate(tensors) if t.numel()]  # 0-byte tensors need no copy


@needs_nvcc
@pytest.mark.parametrize("use_cpp", [True, False], ids=["cpp", "torch"])
def test_plans_rerun_on_new_contents_and_into_parameters(
    built: Path, monkeypatch: pytest.MonkeyPatch, use_cpp: bool
) -> None:
    if use_cpp:
        force_cpp(import_built(built), monkeypatch)
    tensors = mixed_tensors(3)
    layout = packing.make_layout(tensors)
    buffers, _ = packing.pack([torch.zeros_like(t) for t in tensors])
    params = [torch.nn.Parameter(torch.zeros_like(t)) if t.is_floating_point() else torch.zeros_like(t)
              for t in tensors]  # fmt: skip

    pack_plan = kernels.prepare_pack(tensors, layout, buffers)
    unpack_plan = kernels.prepare_unpack(buffers, layout, params)
    for seed in (4, 5):
        with torch.no_grad():
            for t, fresh in zip(tensors, mixed_tensors(seed), strict=True):
                t.copy_(fresh)
        pack_plan.run()
        unpack_plan.run()
        reference, _ = packing.pack(tensors)
        assert all(bits(buffers[key]) == bits(buf) for key, buf in reference.items())
        assert [bits(p.detach()) for p in params] == [bits(t) for t in tensors]
    copied_by_copy = sum(1 for t in tensors if t.numel()) if use_cpp else len(tensors)  # C++ skips 0-byte pairs
    assert pack_plan.devices == [] and pack_plan.nbytes == 0 and pack_plan.fallback_count == copied_by_copy
    with pytest.raises(ValueError, match="does not match"):
        kernels.prepare_unpack(buffers, layout, [torch.zeros(2), *params[1:]])
    with pytest.raises(ValueError, match="does not match"):
        kernels.unpack_into(buffers, layout, [*params[:-1], torch.zeros(11, dtype=torch.float64)])
