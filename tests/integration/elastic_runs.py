"""Helpers to run the probe script through `elan run` and check what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

PROBE = Path(__file__).with_name("probe_train.py")


@dataclass
class RunResult:
    out: Path
    returncode: int
    output: str

    def excerpt(self) -> str:
        """The first traceback (where a failure starts) and the end of the output."""
        start = self.output.find("Traceback")
        head = self.output[start : start + 6000] if start >= 0 else ""
        return f"{head}\n...\n{self.output[-3000:]}"

    def records(self) -> list[dict]:
        return [json.loads(path.read_text()) for path in sorted(self.out.glob("record-*.json"))]

    def final_state(self) -> dict[str, torch.Tensor]:
        return torch.load(self.out / "final.pt")

    def adjustments(self, state_dir: Path) -> list[dict]:
        path = state_dir / "adjustments.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def elan_run(tmp: Path, name: str, nproc: int, probe_args: list[str], schedule: str | None = None,
             coordinate_every: int = 1, timeout: float = 300) -> RunResult:
    out = tmp / name
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", name,
               "--coordinate-every", str(coordinate_every), "--state-dir", str(tmp / f"{name}-state")]
    if schedule:
        command += ["--schedule", schedule]
    command += ["--", sys.executable, str(PROBE), "--out", str(out), *probe_args]
    env = {**os.environ, "ELAN_HOME": str(tmp / "elan-home"), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(out, proc.returncode, output)


def consumed_per_epoch(records: list[dict]) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for record in records:
        for epoch, indices in record["consumed"].items():
            epochs.setdefault(int(epoch), Counter()).update(indices)
    return epochs


def assert_each_sample_once(records: list[dict], num_samples: int, epochs: int) -> None:
    per_epoch = consumed_per_epoch(records)
    assert sorted(per_epoch) == list(range(epochs)), f"epochs seen: {sorted(per_epoch)}"
    for epoch, counts in per_epoch.items():
        duplicated = sorted(index for index, count in counts.items() if count > 1)
        missing = sorted(set(range(num_samples)) - set(counts))
        assert not duplicated and not missing, f"epoch {epoch}: duplicated {duplicated}, missing {missing}"


def assert_ranks_agree(records: list[dict]) -> int:
    """Every worker that trained step s held bit-identical parameters and optimizer state; returns steps checked."""
    by_step: dict[int, set[str]] = {}
    for record in records:
        for step, _world, _rank, digest in record["digests"]:
            by_step.setdefault(step, set()).add(digest)
    diverged = {step: len(digests) for step, digests in by_step.items() if len(digests) > 1}
    assert not diverged, f"ranks diverged at steps {sorted(diverged)}"
    return len(by_step)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        difference = (actual[key] - expected[key]).abs().max().item()
        assert difference <= atol, f"{key}: max difference {difference:.3e} > {atol:.0e}"
