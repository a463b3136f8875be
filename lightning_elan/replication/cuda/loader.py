"""Finding, building on request and importing the optional CUDA extension; owns why it is (not) used.

:func:`load` returns the ``lightning_elan_cuda`` module or None: a build in ``$ELAN_CUDA_EXT_DIR`` or
``~/.cache/lightning_elan/cuda_ext`` that matches this package's sources, this torch and this GPU's architecture, or
an importable ``lightning_elan_cuda``; with ``ELAN_BUILD_CUDA_EXT=1`` (or ``load(build=True)``) it compiles
one first (:mod:`lightning_elan.replication.cuda.build`, about a minute). Without a GPU, a CUDA toolkit or a build it
logs why, once, and callers use the pure-torch path. ``ELAN_NO_CUDA_EXT=1`` disables the extension.

``python -m lightning_elan.replication.cuda.loader [--build]`` builds if asked, then logs the status.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from lightning_elan.protocol.contract import ENV_BUILD_CUDA_EXT, ENV_CUDA_EXT_DIR, ENV_NO_CUDA_EXT
from lightning_elan.replication.cuda import build as builder
from lightning_elan.replication.cuda.build import MODULE_NAME

log = logging.getLogger(__name__)

__all__ = ["MODULE_NAME", "available", "load", "status"]



@dataclass(frozen=True)
class _Attempt:
    """The outcome of looking for the extension: the module, or why there is none; ``built``: a build was allowed."""

    module: ModuleType | None
    reason: str | None
    built: bool


_lock = threading.Lock()
_attempt: _Attempt | None = None  # tests reset it with monkeypatch.setattr(loader, "_attempt", None)


def load(build: bool | None = None) -> ModuleType | None:
    """The extension module, or None (the reason is in :func:`status`).

    Looked for once per process; a later call with ``build=True`` after a look without building tries again, building.
    """
    global _attempt
    allow_build = _env_flag(ENV_BUILD_CUDA_EXT) if build is None else build
    with _lock:
        if _attempt is None or (_attempt.module is None and allow_build and not _attempt.built):
            module, reason = _find(allow_build)
            _attempt = _Attempt(module, reason, allow_build)
            _log_outcome(_attempt)
        return _attempt.module


def available() -> bool:
    return load() is not None


def status() -> str:
    """One line: where the extension was loaded from, or why it is not used."""
    module = load()
    if module is not None:
        return f"loaded from {getattr(module, '__file__', MODULE_NAME)}"
    assert _attempt is not None
    return str(_attempt.reason)


def _log_outcome(attempt: _Attempt) -> None:
    if attempt.module is None:
        log.info("CUDA extension not used (%s); replication uses the pure-torch path", attempt.reason)
    else:
        log.info("CUDA extension loaded from %s", getattr(attempt.module, "__file__", MODULE_NAME))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _find(build: bool) -> tuple[ModuleType | None, str | None]:
    if _env_flag(ENV_NO_CUDA_EXT):
        return None, f"disabled by {ENV_NO_CUDA_EXT}"
    if torch.version.cuda is None:
        return None, "this torch is a CPU-only build"
    if not torch.cuda.is_available():
        return None, "no CUDA device visible (torch.cuda.is_available() is False)"
    for directory in _search_dirs():
        module = _import_built(directory)
        if module is not None:
            return module, None
    try:
        return importlib.import_module(MODULE_NAME), None
    except ImportError:
        pass
    if not build:
        return None, f"not built: run `python -m {builder.__name__}` or set {ENV_BUILD_CUDA_EXT}=1"
    return _build_and_import()


def _search_dirs() -> list[Path]:
    dirs = [Path(os.environ[ENV_CUDA_EXT_DIR])] if os.environ.get(ENV_CUDA_EXT_DIR) else []
    return [*dirs, builder.CACHE_DIR]


def _import_built(directory: Path) -> ModuleType | None:
    """The module built in ``directory`` if it matches the sources, this torch and this GPU's architecture."""
    if not builder.is_current(directory):
        return None
    stamp = builder.read_stamp(directory) or {}
    if not _arch_runs_here(stamp.get("archs") or []):
        log.info("the build in %s is for SM %s, not this GPU; ignored", directory, stamp.get("archs"))
        return None
    return import_file(directory / builder.module_filename())


def _arch_runs_here(archs: list[str]) -> bool:
    """SASS for this GPU's capability, or PTX (built for the highest arch) that it can JIT-compile."""
    major, minor = torch.cuda.get_device_capability()
    capability = major * 10 + minor
    numbers = [int(arch) for arch in archs if str(arch).isdigit()]
    return capability in numbers or (bool(numbers) and max(numbers) <= capability)


def import_file(path: Path) -> ModuleType | None:
    """Import the extension module file at ``path`` as ``lightning_elan_cuda`` (None, logged, if it cannot be)."""
    try:
        loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(path))
        spec = importlib.util.spec_from_file_location(MODULE_NAME, path, loader=loader)
        if spec is None:
            raise ImportError(f"no module spec for {path}")
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError) as error:
        log.warning("could not import the CUDA extension at %s: %s", path, error)
        return None
    sys.modules[MODULE_NAME] = module
    return module


def _build_and_import() -> tuple[ModuleType | None, str | None]:
    out = builder.default_out_dir()
    log.info("building the CUDA extension from %s into %s (about a minute, once)", builder.source_dir(), out)
    try:
        path = builder.build(out)
    except builder.BuildError as error:
        return None, f"build failed: {str(error).splitlines()[0]}"
    module = import_file(path)
    return (module, None) if module is not None else (None, f"built {path} but could not import it")


def main(argv: list[str] | None = None) -> int:
    """``python -m lightning_elan.replication.cuda.loader [--build]``: build if asked, then log the status."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    module = load(build="--build" in args)
    log.info("CUDA extension: %s", status())
    return 0 if module is not None or "--build" not in args else 1


if __name__ == "__main__":
    sys.exit(main())
