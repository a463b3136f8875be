"""One finished run of an ``elan_fsdp`` user script (``elan run`` or a plain Lightning launcher) and what the tests
read from it: its output, the samples each process trained (``OUT/trained-<pid>.jsonl``), the job's adjustments, its
final state and checkpoints. Shared by the ``test_elan_fsdp*.py`` files."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.integration.elastic_runs import elan_env
from tests.users.corpus import end_every_process_of, shm_dir


@dataclass
class FsdpRun:
    home: Path
    returncode: int
    output: str

    @property
    def out(self) -> Path:
        return self.home / "out"

    def excerpt(self) -> str:
        start = self.output.find("Traceback")
        return f"{self.output[start : start + 5000] if start >= 0 else ''}\n...\n{self.output[-3000:]}"

    def final_state(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "final.pt")

    def checkpoints(self) -> dict[str, dict]:
        return {path.name: torch.load(path, weights_only=False) for path in (self.out / "checkpoints").glob("*.ckpt")}

    def samples_per_epoch(self) -> dict[int, Counter]:
        epochs: dict[int, Counter] = {}
        for path in self.out.glob("trained-*.jsonl"):
            for line in path.read_text().splitlines():
                record = json.loads(line)
                epochs.setdefault(record["epoch"], Counter()).update(record["samples"])
        return epochs

    def adjustments(self) -> list[dict]:
        path = self.home / "state" / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def elan_command(home: Path, name: str, nproc: int, schedule: str | None = None,
                 launcher: tuple[str, ...] = ()) -> list[str]:
    """``elan run`` with the job's state in ``home/state``; the script's command follows it after ``--``."""
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", "1", "--state-dir", str(home / "state")]
    return command + (["--schedule", schedule] if schedule else []) + list(launcher)


def run_to_end(command: list[str], home: Path, timeout_s: float, env: dict[str, str] | None = None) -> FsdpRun:
    """Run ``command`` in ``home`` to its end, an ``elan run`` with its own shared-memory directory unless ``env`` is
    given; after ``timeout_s`` it is hung: killed with everything it started (the run then fails)."""
    home.mkdir(parents=True, exist_ok=True)
    shm = None
    if env is None:
        shm = shm_dir(home)
        env = {**elan_env(home), "ELAN_SHM_DIR": str(shm)}
    proc = subprocess.Popen(command, cwd=home, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\n[test] still running after {timeout_s:.0f} s: killed\n"
    finally:
        end_every_process_of(home)
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    (home / "output.log").write_text(output)
    return FsdpRun(home, proc.returncode, output)


def assert_ok(run: FsdpRun) -> None:
    assert run.returncode == 0, f"exit {run.returncode}:\n{run.excerpt()}"


def assert_each_sample_once(run: FsdpRun, epochs: list[int], samples: int) -> None:
    """Exactly the ``epochs`` trained, each sample of ``range(samples)`` once in each."""
    seen = run.samples_per_epoch()
    assert sorted(seen) == epochs, f"epochs trained: {sorted(seen)}"
    for epoch, counts in seen.items():
        assert counts == Counter(range(samples)), f"epoch {epoch}: {sorted((s, c) for s, c in counts.items() if c > 1)}"
