"""Test-only (on PYTHONPATH of the AM-crash jobs): an ``elan am`` process SIGKILLs itself right before or right after
its Nth write of ``state.json`` (counted over every AM process of the job), as planned in the JSON file named by
``$ELAN_TEST_AM_SAVE_KILLS``: ``{"kills": [[N, "before" | "after"], ...]}``. Each kill is logged to ``<plan>.log``
first. A real signal at an exact point: between receiving a request and persisting it, or between persisting it and
sending the reply. Any other process (the launcher, workers) is left alone."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def _install(plan_path: Path) -> None:
    from lightning_elan.master import store

    kills = {(int(n), str(when)) for n, when in json.loads(plan_path.read_text())["kills"]}
    counter = plan_path.with_suffix(".count")
    original = store.FileStore.save

    def save(self: store.FileStore, state: dict) -> None:
        if self.path.name != "state.json":
            return original(self, state)
        count = int(counter.read_text()) + 1 if counter.exists() else 1
        scratch = counter.with_suffix(f".{os.getpid()}.tmp")  # atomic: a kill between truncate and write would
        scratch.write_text(str(count))  # leave an empty counter that every later AM fails to parse
        os.replace(scratch, counter)
        _maybe_kill(plan_path, kills, count, "before")
        original(self, state)
        _maybe_kill(plan_path, kills, count, "after")

    store.FileStore.save = save


def _maybe_kill(plan_path: Path, kills: set, count: int, when: str) -> None:
    if (count, when) in kills:
        with open(plan_path.with_suffix(".log"), "a") as log:
            log.write(f"{count} {when} {os.getpid()}\n")
        os.kill(os.getpid(), signal.SIGKILL)


def _is_am(argv: list[str]) -> bool:
    return "lightning_elan.cli" in argv and "am" in argv


_plan = os.environ.get("ELAN_TEST_AM_SAVE_KILLS")
if _plan and _is_am(getattr(sys, "orig_argv", [])):
    _install(Path(_plan))
