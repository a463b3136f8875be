"""The full AM-crash harness: ``python -m tests.integration.am_kill_trials --trials 50``.

Runs probe jobs under `elan run`, each with ``--kills-per-job`` SIGKILLs of its AM at seeded random moments (see
``am_kills.py``), until at least ``--trials`` kills were delivered; a trial *held* when its job ended with the exact
static result. Prints one line per job and ``held: H of T trials`` at the end; exit 0 only if every trial held.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tests.integration.am_kills import run_killed_job
from tests.integration.elastic_runs import PROBE_ARGS, check_static_run, elan_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=50, help="AM kills to deliver in all (default 50)")
    parser.add_argument("--kills-per-job", type=int, default=5, help="external SIGKILLs per job (default 5)")
    parser.add_argument("--save-kills-per-job", type=int, default=2,
                        help="self-SIGKILLs right before/after a state write per job (default 2)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=None, help="keep the jobs' files here (default: a temp dir)")
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="am-kill-trials-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"files in {root}", flush=True)
    static = check_static_run(elan_run(root / "static", "static", 2, PROBE_ARGS))
    held = delivered = jobs = 0
    while delivered < args.trials:
        seed = args.seed + jobs
        jobs += 1
        ok, kills = _one_job(root, seed, args.kills_per_job, args.save_kills_per_job, static)
        delivered += kills
        held += kills if ok else 0
    planned = f"{args.kills_per_job} + {args.save_kills_per_job} kills planned per job"
    print(f"held: {held} of {delivered} trials ({jobs} jobs, {planned})", flush=True)
    return 0 if held == delivered else 1


def _one_job(root: Path, seed: int, kills: int, save_kills: int, static) -> tuple[bool, int]:
    """Run and check one job; returns (every invariant held, kills delivered)."""
    directory = root / f"job{seed}"
    directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    job = run_killed_job(directory, f"amkill{seed}", seed, kills, save_kills)
    try:
        applied = job.check(static)
        ok, detail = True, f"held ({applied} of {len(job.sizes)} requests applied)"
    except Exception as error:  # report it and go on with the next job
        ok, detail = False, f"FAILED: {type(error).__name__}: {str(error)[:500]}"
        traceback.print_exc(file=sys.stderr)
    count, phases = len(job.delivered), ",".join(job.delivered)
    print(f"job seed {seed}: {count} kill(s) [{phases}] in {time.monotonic() - started:.0f} s: {detail}", flush=True)
    return ok, count


if __name__ == "__main__":
    sys.exit(main())
