"""``python csrc/build.py [--out DIR] [--arch 90] ...`` in a source checkout: runs
``python -m lightning_elan.replication.cuda.build`` (the sources live in ``lightning_elan/replication/cuda/csrc/``,
shipped in the wheel)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_elan.replication.cuda.build import main

if __name__ == "__main__":
    sys.exit(main())
