"""What a job hit by faults must still show: the invariants of a storm or a fault-matrix trial.

Samples are counted from the probe's flushed logs, not its end-of-run records (a SIGKILLed worker writes none):
``completed-<worker>.jsonl`` has every batch whose step was applied, ``training-<worker>.jsonl`` every batch a worker
started. A worker killed after its commit vote and before it logged the batch as completed trained a batch that
counts; its samples are missing from the completed logs and are exactly its last started batch. Such a batch is
counted only if all of its samples are missing (all or nothing), never to cover a gap elsewhere.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.integration.elastic_runs import TOLERANCE, RunResult, assert_ranks_agree, assert_states_close


@dataclass
class StormCheck:
    """A summary of a run that held."""

    last_step: int
    steps_checked: int
    dead: int
    recoveries: int
    adjustments: int
    counted_after_vote: int

    def __str__(self) -> str:
        return (f"step {self.last_step}, {self.dead} killed, {self.recoveries} recoveries, "
                f"{self.adjustments} adjustments, {self.counted_after_vote} batch(es) of killed workers committed")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def worker_of(path: Path, prefix: str) -> str:
    return path.name[len(prefix):].split(".")[0]


def dead_workers(out: Path) -> list[str]:
    """Workers that started a batch but wrote no end-of-run record: killed."""
    started = {worker_of(path, "training-") for path in out.glob("training-*.jsonl")}
    ended = {worker_of(path, "record-") for path in out.glob("record-*.json")}
    return sorted(started - ended)


def unfinished_batch(out: Path, worker: str) -> dict | None:
    """The batch a killed worker started and did not log as completed, if any. A started batch is logged with the
    steps done before it (``global_step`` as it starts), a completed one with the steps done after it (storm seed
    1011: comparing the two as equal took the batch before the last as the unfinished one)."""
    training = read_jsonl(out / f"training-{worker}.jsonl")
    completed = {(e["epoch"], e["step"]) for e in read_jsonl(out / f"completed-{worker}.jsonl")}
    left = [entry for entry in training if (entry["epoch"], entry["step"] + 1) not in completed]
    return left[-1] if left else None


def completed_counts(out: Path) -> dict[int, Counter]:
    epochs: dict[int, Counter] = {}
    for path in sorted(out.glob("completed-*.jsonl")):
        for entry in read_jsonl(path):
            epochs.setdefault(entry["epoch"], Counter()).update(entry["indices"])
    return epochs


def assert_each_sample_once(out: Path, samples: int, epochs: int) -> int:
    """Every sample exactly once per epoch; returns how many killed workers' batches were counted as committed."""
    counts = completed_counts(out)
    counted = 0
    for worker in dead_workers(out):
        batch = unfinished_batch(out, worker)
        if batch is None or not batch["indices"]:
            continue
        seen = counts.setdefault(batch["epoch"], Counter())
        if all(seen[index] == 0 for index in batch["indices"]):
            seen.update(batch["indices"])
            counted += 1
    assert sorted(counts) == list(range(epochs)), f"epochs seen: {sorted(counts)}"
    for epoch, seen in counts.items():
        twice = sorted(index for index, count in seen.items() if count > 1)
        missing = sorted(set(range(samples)) - set(seen))
        assert not twice and not missing, f"epoch {epoch}: trained twice {twice}, missing {missing}"
    return counted


def last_step(run: RunResult) -> int:
    return max(record["global_step"] for record in run.records() if not record["left"])


def check_storm(run: RunResult, static: RunResult, samples: int, epochs: int, sharded: bool = False) -> StormCheck:
    """Exit 0, the static run's last step, each sample once per epoch, members bit-identical at every step, final
    parameters and optimizer state within ``TOLERANCE`` of the static run. ``sharded`` (``elan_fsdp``): the members
    hold different shards, so only the full state they gathered at the end (``final*.pt``) is compared."""
    assert run.returncode == 0, run.excerpt()
    assert last_step(run) == last_step(static), f"last step {last_step(run)}, static {last_step(static)}"
    counted = assert_each_sample_once(run.out, samples, epochs)
    steps = 0 if sharded else assert_ranks_agree(run.records())
    assert_states_close(run.final_state(), static.final_state(), TOLERANCE)
    assert_states_close(torch.load(run.out / "final-optimizer.pt"), torch.load(static.out / "final-optimizer.pt"),
                        TOLERANCE)
    adjustments = run.adjustments()
    recoveries = sum(1 for a in adjustments if a.get("action") == "failure")
    return StormCheck(last_step(run), steps, len(dead_workers(run.out)), recoveries, len(adjustments) - recoveries,
                      counted)
