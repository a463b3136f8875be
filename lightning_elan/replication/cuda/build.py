"""Compiling the optional CUDA extension (module ``lightning_elan_cuda``) without setuptools: owns the toolchain
lookup, the compile/link commands, the build stamp and the ``python -m lightning_elan.replication.cuda.build`` CLI.

The sources ship inside the package (``lightning_elan/replication/cuda/csrc/``, package data of the wheel), found
through :func:`source_dir`, so an installed wheel builds exactly as a source checkout does. Three translation units,
compiled in parallel, then linked into one Python extension module:

* ``multi_tensor_copy.cu`` with ``nvcc`` (no torch header: fast, any torch build),
* ``runtime.cpp`` with the host compiler against ``cuda_runtime.h``,
* ``bindings.cpp`` with the host compiler against torch's headers (the only file including ``torch/extension.h``).

Nothing here needs a GPU, nor a CUDA build of torch: CI runs it on machines with ``nvcc`` and a CPU torch to catch a
broken kernel or binding before any GPU run. :mod:`lightning_elan.replication.cuda.loader` calls :func:`build` to
build at run time (into the cache directory) when asked to.

Usage: ``python -m lightning_elan.replication.cuda.build [--out DIR] [--src DIR] [--arch 90] [--objects-only]
[--quiet]`` (``python csrc/build.py`` in a source checkout runs the same). ``--out`` defaults to
``$ELAN_CUDA_EXT_DIR``, else ``~/.cache/lightning_elan/cuda_ext`` (where the loader looks); ``--arch`` to
``$ELAN_CUDA_ARCHS`` (``;``/``,`` separated, e.g. ``"80;90"``), else the visible GPU's compute capability, else 90.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.resources
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_elan.protocol.contract import ENV_CUDA_ARCHS, ENV_CUDA_EXT_DIR

log = logging.getLogger(__name__)

MODULE_NAME = "lightning_elan_cuda"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lightning_elan" / "cuda_ext"
SOURCES = ("multi_tensor_copy.cu", "runtime.cpp", "bindings.cpp")
HEADERS = ("elan_cuda.h",)
DEFAULT_ARCH = "90"


def source_dir() -> Path:
    """The C++/CUDA sources shipped in this package (``csrc/`` next to this module, in a wheel as in a checkout).

    Read through :mod:`importlib.resources`, so it names the installed copy; a package installed as files (what pip
    does with a wheel) is required, since the compilers need real paths.
    """
    return Path(str(importlib.resources.files(__package__ or "lightning_elan.replication.cuda") / "csrc"))


def default_out_dir() -> Path:
    """``$ELAN_CUDA_EXT_DIR``, else the per-user cache (never inside the package: it may be read-only)."""
    return Path(os.environ[ENV_CUDA_EXT_DIR]) if os.environ.get(ENV_CUDA_EXT_DIR) else CACHE_DIR


class BuildError(RuntimeError):
    """A compile or link step failed, or a tool is missing; the message says which and why."""


@dataclass
class Toolchain:
    nvcc: str
    cuda_home: Path
    cxx: str
    torch_includes: list[str] = field(default_factory=list)
    torch_lib: str = ""
    python_include: str = ""
    cxx11_abi: int = 1


def find_cuda_home() -> Path | None:
    """``$CUDA_HOME``/``$CUDA_PATH``, the toolkit around ``nvcc`` (wrappers resolved), or ``/usr/local/cuda``."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
        candidates.extend(_nvcc_wrapper_targets(Path(nvcc)))
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return Path(candidate)
    return None


def _nvcc_wrapper_targets(nvcc: Path) -> list[str]:
    """Toolkit roots named inside a small shell wrapper such as ``exec /usr/local/cuda-13.0/bin/nvcc "$@"``."""
    try:
        if nvcc.stat().st_size > 4096:
            return []
        text = nvcc.read_text(errors="ignore")
    except OSError:
        return []
    return [str(Path(word).parent.parent) for word in text.split() if word.endswith("/bin/nvcc")]


def toolchain() -> Toolchain:
    """Locate nvcc, the CUDA headers, the host compiler and torch's headers; raises :class:`BuildError`."""
    cuda_home = find_cuda_home()
    nvcc = shutil.which("nvcc") or (str(cuda_home / "bin" / "nvcc") if cuda_home else None)
    if nvcc is None or not Path(nvcc).exists():
        raise BuildError("no CUDA toolkit: nvcc is not on PATH and CUDA_HOME is not set")
    if cuda_home is None:
        raise BuildError(f"found {nvcc} but no CUDA headers (include/cuda_runtime.h): set CUDA_HOME")
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise BuildError("no host C++ compiler (c++/g++) on PATH")
    try:
        import torch
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError as error:
        raise BuildError(f"torch is needed to build the bindings: {error}") from error
    return Toolchain(
        nvcc=nvcc,
        cuda_home=cuda_home,
        cxx=cxx,
        torch_includes=include_paths(),
        torch_lib=library_paths()[0],
        python_include=sysconfig.get_paths()["include"],
        cxx11_abi=int(torch.compiled_with_cxx11_abi()),
    )


def default_archs() -> list[str]:
    env = os.environ.get(ENV_CUDA_ARCHS)
    if env:
        return [arch.strip().replace(".", "") for arch in env.replace(",", ";").split(";") if arch.strip()]
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return [f"{major}{minor}"]
    except Exception:
        pass
    return [DEFAULT_ARCH]


def _cuda_lib_dir(cuda_home: Path) -> Path:
    for name in ("lib64", "lib", "targets/x86_64-linux/lib"):
        if (cuda_home / name / "libcudart.so").exists():
            return cuda_home / name
    return cuda_home / "lib64"


def commands(tc: Toolchain, src: Path, out: Path, archs: list[str]) -> tuple[dict[str, list[str]], list[str]]:
    """The compile command per source (in ``src``) and the link command."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    gencode.append(f"-gencode=arch=compute_{max(archs)},code=compute_{max(archs)}")  # PTX for newer GPUs
    cuda_include = f"-I{tc.cuda_home / 'include'}"
    compile_cmds = {
        "multi_tensor_copy.cu": [
            tc.nvcc, "-c", str(src / "multi_tensor_copy.cu"), "-o", str(out / "multi_tensor_copy.o"),
            "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "--expt-relaxed-constexpr", *gencode,
        ],
        "runtime.cpp": [
            tc.cxx, "-c", str(src / "runtime.cpp"), "-o", str(out / "runtime.o"),
            "-O2", "-std=c++17", "-fPIC", "-Wall", cuda_include,
        ],
        "bindings.cpp": [
            tc.cxx, "-c", str(src / "bindings.cpp"), "-o", str(out / "bindings.o"),
            "-O2", "-std=c++20", "-fPIC", "-w",
            *(f"-I{p}" for p in tc.torch_includes), f"-I{tc.python_include}", cuda_include,
            f"-DTORCH_EXTENSION_NAME={MODULE_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            f"-D_GLIBCXX_USE_CXX11_ABI={tc.cxx11_abi}",
        ],
    }  # fmt: skip
    cuda_lib = _cuda_lib_dir(tc.cuda_home)
    link = [
        tc.cxx, "-shared", "-o", str(out / module_filename()),
        *(str(out / Path(source).with_suffix(".o").name) for source in SOURCES),
        f"-L{tc.torch_lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
        f"-L{cuda_lib}", "-lcudart", f"-Wl,-rpath,{cuda_lib}", f"-Wl,-rpath,{tc.torch_lib}",
    ]  # fmt: skip
    return compile_cmds, link


def module_filename() -> str:
    return MODULE_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def source_hash(archs: list[str], src: Path | None = None) -> str:
    """Identifies a build: sources, headers, this build script, archs and torch version."""
    src = src or source_dir()
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update((src / name).read_bytes())
    digest.update(Path(__file__).read_bytes())
    digest.update(";".join(archs).encode())
    try:
        import torch

        digest.update(torch.__version__.encode())
    except ImportError:
        pass
    return digest.hexdigest()[:16]


def _run(name: str, argv: list[str], quiet: bool) -> float:
    return _run_all({name: argv}, quiet)[name]


def _run_all(cmds: dict[str, list[str]], quiet: bool) -> dict[str, float]:
    """Run the commands in parallel; the first failure stops the others and raises :class:`BuildError`."""
    t0 = time.perf_counter()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: tempfile.TemporaryFile() for name in cmds}  # files, not pipes: long error logs cannot block
    times: dict[str, float] = {}
    try:
        for name, argv in cmds.items():
            log.debug("+ %s", " ".join(argv))
            procs[name] = subprocess.Popen(argv, stdout=logs[name], stderr=subprocess.STDOUT)
        while len(times) < len(procs):
            for name, proc in procs.items():
                if name in times or proc.poll() is None:
                    continue
                logs[name].seek(0)
                output = logs[name].read().decode(errors="replace")
                if proc.returncode != 0:
                    raise BuildError(f"{name} failed (exit {proc.returncode}):\n{output}")
                if output.strip() and not quiet:
                    log.info("%s:\n%s", name, output)
                times[name] = time.perf_counter() - t0
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log_file in logs.values():
            log_file.close()
    return times


def read_stamp(out: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What the build in ``out`` was made from (``key``, ``archs``, ``torch``), or None."""
    try:
        return json.loads((Path(out) / "build.stamp").read_text())
    except (OSError, ValueError):
        return None


def is_current(out: str | os.PathLike[str]) -> bool:
    """Whether ``out`` holds a linked module built from this package's sources for this torch."""
    stamp = read_stamp(out)
    if stamp is None or not (Path(out) / module_filename()).exists():
        return False
    return stamp.get("key") == source_hash(list(stamp.get("archs") or []))


@contextlib.contextmanager
def _locked(out_dir: Path) -> Iterator[None]:
    """One build per directory at a time (several workers of one host may ask at once)."""
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build(
    out: str | os.PathLike[str] | None = None,
    archs: list[str] | None = None,
    *,
    src: str | os.PathLike[str] | None = None,
    objects_only: bool = False,
    quiet: bool = True,
) -> Path:
    """Compile the sources in ``src`` (default :func:`source_dir`) and link, unless ``objects_only``, into ``out``
    (default :func:`default_out_dir`); returns the module path (or ``out``).

    Reuses a previous build in ``out`` with the same :func:`source_hash`. Raises :class:`BuildError`.
    """
    archs = archs or default_archs()
    out_dir = Path(out) if out is not None else default_out_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir):
        return _build_locked(Path(src) if src is not None else source_dir(), out_dir, archs, objects_only, quiet)


def _build_locked(src: Path, out_dir: Path, archs: list[str], objects_only: bool, quiet: bool) -> Path:
    target = out_dir / module_filename()
    key = source_hash(archs, src)
    stamp = read_stamp(out_dir)
    if not objects_only and target.exists() and stamp is not None and stamp.get("key") == key:
        return target
    tc = toolchain()
    compile_cmds, link = commands(tc, src, out_dir, archs)
    t0 = time.perf_counter()
    times = _run_all(compile_cmds, quiet)
    log.info("compiled in %.1f s (%s)", time.perf_counter() - t0, ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    if objects_only:
        return out_dir
    _run("link", link, quiet)
    (out_dir / "build.stamp").write_text(json.dumps({"key": key, "archs": archs, "torch": _torch_version()}) + "\n")
    return target


def _torch_version() -> str | None:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help=f"output directory (default ${ENV_CUDA_EXT_DIR}, else {CACHE_DIR})")
    parser.add_argument("--src", default=None, help="source directory (default: the sources in this package)")
    parser.add_argument("--arch", action="append", help="SM architecture, e.g. 90 (repeatable)")
    parser.add_argument("--objects-only", action="store_true", help="compile, do not link")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    t0 = time.perf_counter()
    try:
        path = build(
            args.out,
            [a.replace(".", "") for a in args.arch] if args.arch else None,
            src=args.src,
            objects_only=args.objects_only,
            quiet=args.quiet,
        )
    except BuildError as error:
        log.error("build failed: %s", error)
        return 1
    log.info("built %s in %.1f s", path, time.perf_counter() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
