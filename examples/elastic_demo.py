"""Demo: train on this machine, grow 2→3, migrate a worker, shrink back, and print every adjustment.

    python examples/elastic_demo.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEDULE = "30:add=1,90:migrate=1,150:remove=rank:0,210:to=3"


def run_job(state_dir: Path) -> int:
    command = [
        sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", "elan-demo",
        "--coordinate-every", "10", "--state-dir", str(state_dir), "--schedule", SCHEDULE,
        "--", sys.executable, str(HERE / "train.py"), "--epochs", "4",
    ]
    print("$", " ".join(command[2:]), flush=True)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(command, env=env).returncode


def describe(record: dict) -> str:
    before = len(record["members"]) - len(record["joiners"]) + len(record["leavers"])
    pauses = record["pause_s"].values()
    pause = f"stayers paused {min(pauses) * 1e3:.0f}–{max(pauses) * 1e3:.0f} ms" if pauses else "no stayer"
    startups = ", ".join(f"{w} {s:.1f} s" for w, s in record["joiner_startup_s"].items()) or "-"
    return (
        f"step {record['step']:>4}  {record['action']:<8} {before}→{len(record['members'])} workers  "
        f"gen {record['generation']}  joined {record['joiners'] or '-'} left {record['leavers'] or '-'}  "
        f"replicated {record['bytes_replicated'] / 1e6:.2f} MB  {pause}  joiner start-up (hidden): {startups}"
    )


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="elan-demo-") as tmp:
        os.environ.setdefault("ELAN_HOME", str(Path(tmp) / "home"))
        state_dir = Path(tmp) / "state"
        returncode = run_job(state_dir)
        journal = state_dir / "adjustments.jsonl"
        records = [json.loads(line) for line in journal.read_text().splitlines()] if journal.exists() else []
        print(f"\n{len(records)} adjustments (job exit code {returncode}):")
        for record in records:
            print("  " + describe(record))
    return returncode


if __name__ == "__main__":
    sys.exit(main())
