"""The Accelerate corpus harness: run a user script of this folder through the real ``elan run`` (static, or elastic:
the schedule, then a worker SIGKILLed with ``os.kill`` under ``--replace-failed``), read what the script, the
observer and the AM left behind, and compare runs.

What the harness sees of a worker comes from ``observer/sitecustomize.py`` (on the jobs' ``PYTHONPATH``, never
imported by the scripts): ``observe/observe-<pid>.jsonl`` (a digest of the state at every micro-batch) and
``observe/victim.json``. What the user sees comes from the script's own outputs under ``out/``: the tracker's
``metrics.jsonl``, the ``trained-<pid>.jsonl`` sample logs, the ``save_state`` folders and ``final/``
(``save_pretrained``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tests.integration.elastic_runs import elan_env

HERE = Path(__file__).parent
OBSERVER = HERE / "observer"
TOLERANCE = 1e-9
RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Job:
    """One ``elan run`` of ``script`` (a file of this folder) with ``args``; ``--output_dir`` is added. An elastic job
    runs ``schedule`` and offers the process that is rank 1 at optimizer step ``kill_step`` to the harness's
    SIGKILL, with ``--replace-failed``."""

    name: str
    script: str
    args: tuple[str, ...] = ()
    nproc: int = 2
    schedule: str | None = None
    kill_step: int | None = None
    env: tuple[tuple[str, str], ...] = ()
    """More of the observer's settings (``observer/sitecustomize.py``)."""
    replace_failed: bool = False
    """``--replace-failed`` without a kill of the observer's (the test kills at a moment of its own)."""


@dataclass
class Run:
    job: Job
    home: Path
    returncode: int
    output: str

    @property
    def out(self) -> Path:
        return self.home / "out"

    @property
    def state_dir(self) -> Path:
        return self.home / "state"

    def excerpt(self) -> str:
        """The first traceback and the end of the output (for assertion messages)."""
        start = self.output.find("Traceback")
        head = self.output[start : start + 5000] if start >= 0 else ""
        return f"{head}\n...\n{self.output[-3000:]}"

    def trained(self) -> list[dict[str, Any]]:
        """The scripts' ``trained-<pid>.jsonl`` lines (one per applied step and process), each with its ``pid``."""
        return [{**line, "pid": int(path.stem.split("-")[1])} for path in sorted(self.out.glob("trained-*.jsonl"))
                for line in _json_lines(path)]

    def observed(self) -> list[dict[str, Any]]:
        return [line for path in sorted((self.home / "observe").glob("observe-*.jsonl")) for line in _json_lines(path)]

    def victim(self) -> dict[str, Any] | None:
        path = self.home / "observe" / "victim.json"
        return json.loads(path.read_text()) if path.exists() else None

    def metrics(self) -> list[dict[str, Any]]:
        return _json_lines(self.out / "metrics.jsonl")

    def adjustments(self) -> list[dict[str, Any]]:
        return _json_lines(self.state_dir / "adjustments.jsonl")


def _json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------------------------- running a job


def job_env(home: Path, job: Job) -> dict[str, str]:
    env = elan_env(home)
    env["USERS_OBSERVE"] = str(home / "observe")
    env["PYTHONPATH"] = os.pathsep.join([str(OBSERVER), *filter(None, [env.get("PYTHONPATH")])])
    env["ELAN_PRELOAD_SITECUSTOMIZE"] = "worker"  # it may run in each worker after the fork
    if job.schedule or job.kill_step is not None:
        env["USERS_HOLD"] = "1"
    if job.kill_step is not None:
        env["USERS_KILL"] = str(job.kill_step)
    env.update(job.env)
    return env


def elan_command(home: Path, job: Job) -> list[str]:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(job.nproc), "--job", job.name,
               "--coordinate-every", "1", "--state-dir", str(home / "state")]
    if job.schedule:
        command += ["--schedule", job.schedule]
    if job.kill_step is not None or job.replace_failed:
        command += ["--replace-failed"]
    return [*command, "--", sys.executable, str(HERE / job.script), "--output_dir", str(home / "out"), *job.args]


def run_job(home: Path, job: Job) -> Run:
    """Run ``job`` to its end in ``home``; SIGKILL the victim the observer names (``victim.json``) when it does."""
    (home / "observe").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(elan_command(home, job), cwd=home, env=job_env(home, job), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output, note = _supervise(proc, home / "observe" / "victim.json")
    (home / "output.log").write_text(output + note)
    return Run(job, home, proc.returncode, output + note)


def _supervise(proc: subprocess.Popen, victim_file: Path) -> tuple[str, str]:
    """Wait for the job; kill its victim when it offers itself. Returns the job's output and the harness's note."""
    chunks: list[str] = []
    reader = _drain(proc, chunks)
    deadline, killed = time.monotonic() + RUN_TIMEOUT_S, False
    while proc.poll() is None:
        if not killed and victim_file.exists():
            killed = _kill_victim(victim_file)
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher, its AM and workers: one session
            proc.wait()
            reader.join()
            return "".join(chunks), f"\n[harness] killed after {RUN_TIMEOUT_S} s"
        time.sleep(0.05)
    reader.join()
    return "".join(chunks), ""


def _drain(proc: subprocess.Popen, chunks: list[str]) -> Any:
    import threading

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            chunks.append(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _kill_victim(victim_file: Path) -> bool:
    try:
        victim = json.loads(victim_file.read_text())
    except json.JSONDecodeError:  # being written
        return False
    os.kill(victim["pid"], signal.SIGKILL)
    return True


# ---------------------------------------------------------------------- what every run must keep


def assert_ok(run: Run) -> None:
    assert run.returncode == 0, f"{run.job.name} exited with {run.returncode}:\n{run.excerpt()}"


def samples_per_epoch(lines: list[dict[str, Any]]) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for line in lines:
        epochs.setdefault(line["epoch"], Counter()).update(line["ids"])
    return epochs


def assert_each_sample_once(lines: list[dict[str, Any]], num_samples: int, epochs: int) -> None:
    """Every sample of every epoch trained exactly once by the applied steps."""
    seen = samples_per_epoch(lines)
    assert sorted(seen) == list(range(epochs)), f"epochs trained: {sorted(seen)}"
    for epoch, counts in seen.items():
        duplicated = sorted(sample for sample, count in counts.items() if count > 1)
        missing = sorted(set(range(num_samples)) - set(counts))
        assert not duplicated and not missing, f"epoch {epoch}: duplicated {duplicated}, missing {missing}"


def assert_steps_applied_once(lines: list[dict[str, Any]], steps: range) -> None:
    """Each step is applied by one world: its lines come from ranks 0..world-1, once each."""
    by_step: dict[int, list[tuple[int, int]]] = {}
    for line in lines:
        by_step.setdefault(line["step"], []).append((line["rank"], line["world"]))
    assert sorted(by_step) == list(steps), f"steps applied: {sorted(by_step)}"
    for step, ranks in by_step.items():
        world = ranks[0][1]
        assert sorted(ranks) == [(rank, world) for rank in range(world)], f"step {step}: {sorted(ranks)}"


def assert_members_agree(run: Run) -> list[int]:
    """At every backward all members held bit-identical parameters, buffers and optimizer states (the n-th backward
    of a step at a world size: an optimizer that evaluates its closure several times in a step updates the
    parameters between its backwards). Returns the optimizer steps seen."""
    by_backward: dict[tuple[int, int, int], set[str]] = {}
    for line in run.observed():
        by_backward.setdefault((line["step"], line["world"], line["backward"]), set()).add(line["digest"])
    diverged = sorted({key[0] for key, digests in by_backward.items() if len(digests) > 1})
    assert not diverged, f"members diverged at steps {diverged}"
    return sorted({key[0] for key in by_backward})


def assert_adjustments(run: Run, expected: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """The AM's records are ``expected`` ((action, world size after it), in order); a failure names the victim."""
    adjustments = run.adjustments()
    assert [(a["action"], len(a["members"])) for a in adjustments] == expected, adjustments
    victim = run.victim()
    failures = [a for a in adjustments if a["action"] == "failure"]
    assert [a["failure"]["dead"] for a in failures] == ([[victim["worker"]]] if victim else [])
    return adjustments


# ---------------------------------------------------------------------- the users' own outputs


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                        atol: float = TOLERANCE, where: str = "") -> None:
    assert actual.keys() == expected.keys(), f"{where}: {sorted(actual.keys() ^ expected.keys())}"
    for key, value in expected.items():
        difference = (actual[key].double() - value.double()).abs().max().item() if value.numel() else 0.0
        assert difference <= atol, f"{where} {key}: max difference {difference:.3e} > {atol:.0e}"


def assert_states_finite(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str = "") -> None:
    """Same entries and shapes as ``expected``, every value finite (what holds when the maths differs)."""
    assert actual.keys() == expected.keys(), f"{where}: {sorted(actual.keys() ^ expected.keys())}"
    for key, value in actual.items():
        assert value.shape == expected[key].shape, f"{where} {key}: {value.shape} != {expected[key].shape}"
        if value.is_floating_point():
            assert torch.isfinite(value).all(), f"{where} {key} is not finite"


def flat_optimizer_state(path: Path) -> dict[str, torch.Tensor]:
    """An ``optimizer.bin`` of ``save_state``: every per-parameter state and each group's LR, flat."""
    state = torch.load(path, weights_only=False)
    flat = {f"{slot}.{key}": torch.as_tensor(value) for slot, values in state["state"].items()
            for key, value in values.items()}
    flat.update({f"lr.{i}": torch.tensor(group["lr"]) for i, group in enumerate(state["param_groups"])})
    return flat


def checkpoint_files(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def assert_checkpoint_whole(folder: Path, world: int) -> None:
    """A ``save_state`` folder of a job of ``world`` processes: model, optimizer, scheduler, the registered progress,
    one RNG state per process, the elastic data position — and nothing else."""
    expected = {"model.safetensors", "optimizer.bin", "scheduler.bin", "custom_checkpoint_0.pkl", "elan_state.json",
                *(f"random_states_{rank}.pkl" for rank in range(world))}
    assert checkpoint_files(folder) == expected, f"{folder.name}: {sorted(checkpoint_files(folder) ^ expected)}"
    load_file(folder / "model.safetensors")
    torch.load(folder / "optimizer.bin", weights_only=False)
    torch.load(folder / "scheduler.bin", weights_only=False)


def assert_checkpoint_alike(folder: Path, reference: Path, exact: bool) -> None:
    """The model and optimizer of a ``save_state`` folder equal the static run's within ``TOLERANCE`` (``exact``), or
    have its entries and shapes and are finite; the LR schedule's position is the same."""
    check = assert_states_close if exact else assert_states_finite
    check(load_file(folder / "model.safetensors"), load_file(reference / "model.safetensors"), where=folder.name)
    check(flat_optimizer_state(folder / "optimizer.bin"), flat_optimizer_state(reference / "optimizer.bin"),
          where=folder.name)
    scheduler = torch.load(folder / "scheduler.bin", weights_only=False)
    expected = torch.load(reference / "scheduler.bin", weights_only=False)
    assert scheduler["last_epoch"] == expected["last_epoch"], folder.name


def final_model(run: Run) -> dict[str, torch.Tensor]:
    return load_file(run.out / "final" / "model.safetensors")


def logged_steps(metrics: list[dict[str, Any]], key: str) -> dict[int, dict[str, Any]]:
    """``{step: line}`` of the tracker lines holding ``key``; a step logged twice fails."""
    lines: dict[int, dict[str, Any]] = {}
    for line in metrics:
        if key in line:
            assert line["step"] not in lines, f"{key} logged twice at step {line['step']}"
            lines[line["step"]] = line
    return lines
