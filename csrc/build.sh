#!/usr/bin/env bash
# Compile csrc/ (nvcc for the kernel, the host compiler for the runtime and the torch bindings) and link the
# lightning_elan_cuda module. Needs nvcc and torch, not a GPU. Arguments go to build.py (--out, --arch, --objects-only).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "${PYTHON:-python3}" "$here/build.py" "$@"
