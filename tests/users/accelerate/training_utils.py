"""What the scripts of this folder share, as a user keeps it next to their scripts: a tracker without a server, a
step counter that travels with the checkpoint, and a per-process log of the samples each applied step trained."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from accelerate.tracking import GeneralTracker


class JsonLinesTracker(GeneralTracker):
    """An experiment tracker without a server (``Accelerator(log_with=[JsonLinesTracker(path)])``): one JSON line per
    ``log`` call and one for the configuration, each with the writing process's pid."""

    name = "jsonl"
    requires_logging_directory = False

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    @property
    def tracker(self) -> JsonLinesTracker:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self._write({"config": values})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self._write({"step": step, **values})

    def _write(self, line: dict[str, Any]) -> None:
        with open(self.path, "a") as file:
            file.write(json.dumps({"pid": os.getpid(), **line}) + "\n")


class TrainingProgress:
    """Optimizer steps applied so far, registered with ``accelerator.register_for_checkpointing``: a resumed run
    continues the count (and so, under ``elan run``, does a worker that joins the running job: a local variable would
    start at 0 there)."""

    def __init__(self) -> None:
        self.completed_steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"completed_steps": self.completed_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.completed_steps = state["completed_steps"]


class SampleLog:
    """``OUT/trained-<pid>.jsonl``: one flushed line per applied optimizer step — the epoch, the step, this
    process's rank and world size, and the ids of the samples it trained in the step."""

    def __init__(self, output_dir: Path) -> None:
        self.file = open(output_dir / f"trained-{os.getpid()}.jsonl", "a")
        self.pending: list[int] = []

    def add(self, ids: list[int]) -> None:
        """Samples of a micro-batch of the step being trained."""
        self.pending += ids

    def step_applied(self, epoch: int, step: int, rank: int, world: int) -> None:
        line = {"epoch": epoch, "step": step, "rank": rank, "world": world, "ids": self.pending}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()
        self.pending = []

    def step_skipped(self) -> None:
        """The step was not applied (its samples are trained again)."""
        self.pending = []
