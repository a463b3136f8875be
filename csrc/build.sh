#!/usr/bin/env bash
# Compile the CUDA extension (nvcc for the kernel, the host compiler for the runtime and the torch bindings) and link
# the lightning_elan_cuda module. Needs nvcc and torch, not a GPU. Arguments go to
# `python -m lightning_elan.replication.cuda.build` (--out, --src, --arch, --objects-only, --quiet).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$here/build.py" "$@"
