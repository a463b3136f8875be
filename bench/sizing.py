"""A job that sizes itself: ``python -m bench.sizing`` (see docs/autoscaling.md, *Measured*).

Three measurements, each on ``elan run`` jobs of the benchmark's Lightning workload (``bench.train``):

* **profile** — ``elan profile --min 1 --max 3 --steps S`` on a running 3-worker job (coordinate every step), against
  *stop-resume profiling* as EDL measures it (§6, Fig. 13a): a fresh job started at each size runs the same S measured
  steps (plus the one warm-up step the live profile also skips), timed from launch to exit. Reported: the live
  profile's time from the request to its last size measured and to its end (back at 3 workers), the stop-resume
  total, and both profiles' samples/s per size.
* **straggler** — a 2-worker job whose worker w1 computes 3× as long per step (``--slow-worker w1:3``) under
  ``--stragglers replace``: the time from the job's first step to the AM flagging w1, to the replacement joining,
  and to w1's removal (the AM's decision and adjustment records, the workers' step files).
* **autoscale** — ``--autoscale throughput`` from 1 worker on two workloads: the model as it is on this 2-core box,
  and the same with a step that takes ``C/k + B·k`` s more (a job that stops scaling). Reported: the sizes the
  autoscaler chose, its rates and scaling efficiencies, and where it settled.

Writes ``results.json`` and ``results.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.procs import Children, bench_env, train_command
from lightning_elan.protocol.client import AMClient

log = logging.getLogger("bench.sizing")
GLOBAL_BATCH = 48
TIMEOUT_S = 600.0


def elan_job(out: Path, job: str, nproc: int, model: str, run_options: list[str], train_options: list[str],
             coordinate_every: int = 1, max_steps: int = 10**7) -> tuple[list[str], dict[str, str]]:
    command = [
        sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", str(nproc), "--job", job,
        "--coordinate-every", str(coordinate_every), "--state-dir", str(out / "state"), *run_options, "--",
        *train_command("--launcher", "elan", "--model", model, "--global-batch", str(GLOBAL_BATCH),
                       "--max-steps", str(max_steps), "--steps-dir", str(out / "steps"), "--label", "elan",
                       "--stop-file", str(out / "stop"), *train_options),
    ]
    return command, bench_env({"ELAN_HOME": str(out / "elan-home")})


def client_of(out: Path, job: str) -> AMClient:
    path = out / "elan-home" / "jobs" / f"{job}.json"
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no registry file {path}")
        time.sleep(0.1)
    return AMClient(json.loads(path.read_text())["address"], job, timeout_s=5.0)


def wait_for(predicate: Any, what: str, timeout_s: float = TIMEOUT_S, poll_s: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(poll_s)


def stop_job(out: Path, client: AMClient, children: Children, proc: Any) -> dict[str, Any]:
    """Stop the job a few steps ahead and return its last status."""
    status = client.status()
    (out / "stop").write_text(str((status.get("step") or 0) + 5))
    proc.wait(TIMEOUT_S)
    return status


def first_step_time(steps_dir: Path) -> float:
    times = []
    for path in steps_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "s" in record:
                times.append(record["t"])
                break
    return min(times)


def adjustments(out: Path) -> list[dict[str, Any]]:
    path = out / "state" / "adjustments.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- profile -------------------------------------------------------------------------------------------------------


def live_profile(out: Path, model: str, steps: int, children: Children) -> dict[str, Any]:
    job = "profile"
    command, env = elan_job(out, job, 3, model, [], [])
    proc = children.start(command, env, out / "elan-run.log")
    client = client_of(out, job)
    wait_for(lambda: (client.status().get("step") or 0) >= 3, "the job training")
    requested = time.time()
    client.request("profile", {"min": 1, "max": 3, "steps": steps})
    sizing = wait_for(lambda: (s := client.status().get("sizing") or {}).get("profile_result") and s,
                      "the profile finishing")
    stop_job(out, client, children, proc)
    result = sizing["profile_result"]
    last_measured = next(d["at"] for d in reversed(sizing["decisions"]) if d["decision"] == "to 3")
    return {"rates": result["rates"], "to_last_size_measured_s": last_measured - requested,
            "total_s": result["finished_at"] - requested,
            "pauses_s": [max(a["pause_s"].values()) for a in adjustments(out) if a.get("pause_s")]}


def stop_resume_profile(out: Path, model: str, steps: int, children: Children) -> dict[str, Any]:
    """A fresh job per size, each S + 1 steps (the first is skipped as the live profile skips it)."""
    seconds, rates = {}, {}
    for size in (3, 2, 1):
        run_dir = out / f"size{size}"
        command, env = elan_job(run_dir, f"sr{size}", size, model, [], [], max_steps=steps + 1)
        started = time.time()
        proc = children.start(command, env, run_dir / "elan-run.log")
        proc.wait(TIMEOUT_S)
        seconds[size] = time.time() - started
        rates[size] = step_rate(run_dir / "steps")
    return {"seconds": seconds, "total_s": sum(seconds.values()), "rates": rates}


def step_rate(steps_dir: Path) -> float:
    """Samples/s of a job from rank 0's step file, after its first step."""
    times = []
    for path in steps_dir.glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        steps = [r for r in records if "s" in r and r.get("r") == 0]
        if len(steps) > len(times):
            times = [r["t"] for r in steps]
    return GLOBAL_BATCH * (len(times) - 1) / (times[-1] - times[0])


# ---- stragglers ----------------------------------------------------------------------------------------------------


def straggler_run(out: Path, model: str, children: Children) -> dict[str, Any]:
    job = "straggler"
    command, env = elan_job(out, job, 2, model, ["--stragglers", "replace"], ["--slow-worker", "w1:3"])
    proc = children.start(command, env, out / "elan-run.log")
    client = client_of(out, job)
    wait_for(lambda: len(adjustments(out)) >= 2, "the straggler replaced and removed")
    status = stop_job(out, client, children, proc)
    started = first_step_time(out / "steps")
    flagged = next(d for d in status["sizing"]["decisions"] if d["kind"] == "straggler")
    added, removed = adjustments(out)[:2]
    return {"flagged_after_s": flagged["at"] - started, "score": flagged["inputs"]["score"],
            "replacement_joined_after_s": added["completed_at"] - flagged["at"],
            "removed_after_s": removed["completed_at"] - flagged["at"], "removed": removed["leavers"]}


# ---- autoscaler ----------------------------------------------------------------------------------------------------


def autoscale_run(out: Path, model: str, train_options: list[str], children: Children) -> dict[str, Any]:
    job = "autoscale"
    options = ["--autoscale", "throughput", "--autoscale-every", "20", "--autoscale-max", "4"]
    command, env = elan_job(out, job, 1, model, options, train_options)
    proc = children.start(command, env, out / "elan-run.log")
    client = client_of(out, job)

    def settled() -> dict[str, Any] | None:
        status = client.status()
        decisions = (status.get("sizing") or {}).get("decisions") or []
        return status if decisions and decisions[-1]["decision"] == "hold" else None

    status = wait_for(settled, "the autoscaler settling")
    stop_job(out, client, children, proc)
    decisions = [d for d in status["sizing"]["decisions"] if d["kind"] == "autoscale"]
    return {"sizes": [len(a["members"]) for a in adjustments(out)], "settled_at": len(status["members"]),
            "rates": status["sizing"]["measured"]["samples_per_s"],
            "decisions": [{"decision": d["decision"], "reason": d["reason"]} for d in decisions]}


# ---- report --------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"


def report(results: dict[str, Any]) -> str:
    lines = ["# Sizing: profile, stragglers, autoscaler", "", f"`python -m bench.sizing {results['argv']}`", ""]
    live, stop_resume = results["profile"]["live"], results["profile"]["stop_resume"]
    lines += ["## Profile 1..3 (seconds, median (min–max))", "",
              "| | live `elan profile` | stop-resume |", "|---|---|---|",
              f"| to the last size measured | {spread([r['to_last_size_measured_s'] for r in live])} | "
              f"{spread([r['total_s'] for r in stop_resume])} |",
              f"| whole profile (back at 3 workers) | {spread([r['total_s'] for r in live])} | |", ""]
    for size in ("1", "2", "3"):
        lines.append(f"- {size} worker(s): live {spread([r['rates'][size] for r in live])} samples/s, stop-resume "
                     f"{spread([r['rates'][int(size)] for r in stop_resume])} samples/s")
    runs = results["straggler"]
    lines += ["", "## A 3× straggler (seconds, median (min–max))", "",
              f"- flagged after the job's first step: {spread([r['flagged_after_s'] for r in runs])}",
              f"- replacement joined after the flag: {spread([r['replacement_joined_after_s'] for r in runs])}",
              f"- straggler removed after the flag: {spread([r['removed_after_s'] for r in runs])}", ""]
    for name, run in results["autoscale"].items():
        lines += [f"## Autoscaler on {name}", "", f"sizes {run['sizes']}, rates {run['rates']}", ""]
        lines += [f"- {d['decision']}: {d['reason']}" for d in run["decisions"]]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1m")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--sleep-model", default="0.6,0.1", help="C,B of the workload that stops scaling")
    parser.add_argument("--out", type=Path, default=Path("bench/results/sizing"))
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-sizing-"))
    children = Children()
    results: dict[str, Any] = {"argv": " ".join(sys.argv[1:] if argv is None else argv), "model": args.model,
                               "profile": {"live": [], "stop_resume": []}, "straggler": [], "autoscale": {}}
    try:
        for index in range(args.repeat):
            results["profile"]["live"].append(live_profile(work / f"live{index}", args.model, args.profile_steps,
                                                           children))
            results["profile"]["stop_resume"].append(stop_resume_profile(work / f"sr{index}", args.model,
                                                                         args.profile_steps, children))
            results["straggler"].append(straggler_run(work / f"straggler{index}", args.model, children))
            log.info("repeat %d: %s", index, json.dumps(results)[-400:])
        results["autoscale"][f"the {args.model} model"] = autoscale_run(work / "auto-model", args.model, [], children)
        results["autoscale"][f"the {args.model} model + {args.sleep_model} sleep model"] = autoscale_run(
            work / "auto-sleep", args.model, ["--sleep-model", args.sleep_model], children)
    finally:
        children.stop_all()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    (args.out / "results.md").write_text(report(results))
    shutil.rmtree(work, ignore_errors=True)
    print(report(results))


if __name__ == "__main__":
    main()
