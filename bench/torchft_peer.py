"""torchft 0.2.0 on the benchmark's workload: a replica group joins, one leaves, one is SIGKILLed (issue 13, item 4).

    python -m bench.torchft_peer --models 1m,25m --trials 3 --out bench/results/torchft \
        [--elan-results DIR/results.json]    # elan's figures from `python -m bench.run`, for the side-by-side table

One trial: a torchft lighthouse (the Rust server in the wheel, ``torchft.coordination.LighthouseServer``) on
127.0.0.1, replica groups 0 and 1 (one process each, bench/torchft_train.py); after ``--warmup-steps`` the harness

  1. starts group 2 (scale out 2→3: a joiner that heals from a stayer);
  2. sends it SIGTERM, its graceful leave: it finishes its step, shuts its Manager down and exits (scale in 3→2);
  3. starts group 2 again (a restarted replica group: the rejoin, same sampler slot);
  4. SIGKILLs it in the middle of a step (failure 3→2),

each after the stayers (groups 0 and 1) trained ``--settle-steps`` steps in the quorum formed by the previous one.

Figures, from the workers' step files only (bench/analysis.py, as for elan): the adjustment is the stayers' last step
in the old quorum (the quorum id changes with the next one); its pause is ``pause_around(stayers, stayers, step)``:
the gap to the first new step minus the median of the following steps, elan's definition. For the kill also
bench/faults.py's ``kill → next completed step``. For a joiner, process launch → its first committed step (the one in
which it heals and contributes no gradient) and → its first step with its own gradient. Sample accounting from the
workers' sample files: every batch drawn, whether its step committed and whether its group's gradient was in it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.analysis import ProcessSteps, Spread, load_steps, pause_around
from bench.common import Follower, stop_margin, write_stop_file
from bench.faults import KillEvent, analyse_kill, survivors_of
from bench.procs import LOOPBACK, Children, bench_env, free_port
from bench.sizes import MODEL_SIZES

log = logging.getLogger("bench.torchft")

TRAIN_MODULE = "bench.torchft_train"
STAYERS = (0, 1)  # replica groups that train from start to end
JOINER = 2  # the slot of the group that joins, leaves, rejoins and is killed
ACTIONS = {"add": "scale out 2→3 (join)", "rejoin": "scale out 2→3 (rejoin, same slot)",
           "remove": "scale in 3→2 (SIGTERM, graceful)", "kill": "failure 3→2 (SIGKILL mid-step)"}
POLL_S = 0.02


@dataclass(frozen=True)
class Settings:
    model: str = "tiny"
    batch: int = 24  # per replica group: bench.train's per-worker batch at launch (global 48 over 2)
    warmup_steps: int = 10
    settle_steps: int = 10
    min_replicas: int = 2  # lighthouse: the job starts with both groups
    quorum_tick_ms: int = 100  # torchft's README
    join_timeout_ms: int = 500  # README: 10000; torchft's default 60000
    heartbeat_timeout_ms: int = 1000  # torchft's default 5000
    gloo_timeout_s: float = 5.0  # torchft's train_ddp.py on CPU
    comm_hook: str = "tolerant"  # "torchft": 0.2.0's own DDP hook (its survivors crash on a peer's death)
    timeout_s: float = 300.0


# ---------------------------------------------------------------------- processes


def serve_lighthouse(bind: str, settings: dict[str, int]) -> None:
    """The lighthouse process: torchft's Rust server, until SIGTERM."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind=bind, **settings)
    print(f"lighthouse {server.address()} bound to {bind}", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.shutdown()


def start_lighthouse(settings: Settings, out: Path, children: Children) -> tuple[subprocess.Popen, str]:
    port = free_port()
    knobs = {"min_replicas": settings.min_replicas, "quorum_tick_ms": settings.quorum_tick_ms,
             "join_timeout_ms": settings.join_timeout_ms, "heartbeat_timeout_ms": settings.heartbeat_timeout_ms}
    command = [sys.executable, "-m", "bench.torchft_peer", "--serve-lighthouse", f"{LOOPBACK}:{port}",
               "--lighthouse-settings", json.dumps(knobs)]
    proc = children.start(command, torchft_env(), out / "logs" / "lighthouse.log")
    wait_until(lambda: _port_open(port), 60, lambda: proc.poll() is None, "the lighthouse to listen")
    return proc, f"http://{LOOPBACK}:{port}"


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        return sock.connect_ex((LOOPBACK, port)) == 0


def torchft_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """bench_env (loopback gloo, OMP_NUM_THREADS=1) with torchft's Rust logs at WARN (elan's workers log WARNING)."""
    return bench_env({"RUST_LOG": os.environ.get("BENCH_TORCHFT_RUST_LOG", "warn"), **(extra or {})})


def start_group(group: int, lighthouse: str, settings: Settings, out: Path, children: Children,
                tag: str) -> subprocess.Popen:
    command = [sys.executable, "-m", TRAIN_MODULE, "--replica-group", str(group), "--num-replica-groups", "3",
               "--lighthouse", lighthouse, "--model", settings.model, "--batch", str(settings.batch),
               "--steps-dir", str(out / "steps"), "--samples-dir", str(out / "samples"),
               "--stop-file", str(out / "stop"), "--gloo-timeout-s", str(settings.gloo_timeout_s)]
    if settings.comm_hook == "tolerant":
        command.append("--tolerant-comm-hook")
    env = torchft_env({"BENCH_SPAWN_TIME": repr(time.time())})
    return children.start(command, env, out / "logs" / f"group{group}-{tag}.log")


def wait_until(condition: Callable[[], bool], timeout_s: float, alive: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if not alive():
            raise RuntimeError(f"a process exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(POLL_S)


def read_records(steps_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """pid → its step records with every key (bench.analysis.load_steps keeps s, t, w, r only)."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(steps_dir.glob("*.jsonl")) if steps_dir.exists() else []:
        lines = path.read_text().splitlines()
        if not lines:
            continue
        try:
            head = json.loads(lines[0])
        except json.JSONDecodeError:
            continue
        records = []
        for line in lines[1:]:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        out[int(head["pid"])] = records
    return out


def is_worker(pid: int) -> bool:
    try:
        return TRAIN_MODULE in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False


# ---------------------------------------------------------------------- one trial


def run_trial(settings: Settings, out: Path, children: Children) -> dict[str, Any]:
    """Lighthouse, groups 0 and 1, then join, graceful leave, rejoin, SIGKILL; returns the trial's analysis."""
    out.mkdir(parents=True, exist_ok=True)
    steps_dir = out / "steps"
    lighthouse, address = start_lighthouse(settings, out, children)
    stayers = [start_group(group, address, settings, out, children, "stayer") for group in STAYERS]
    procs = list(stayers)
    events: list[dict[str, Any]] = []
    stayer_pids = {proc.pid for proc in stayers}
    follower = Follower(steps_dir)

    def stayers_alive() -> bool:
        return all(proc.poll() is None for proc in stayers) and lighthouse.poll() is None

    def stayer_records() -> list[dict[str, Any]]:
        records = read_records(steps_dir)
        return [record for pid in stayer_pids for record in records.get(pid, [])]

    def settle(after: float, what: str) -> None:
        """Until the stayers trained settle_steps steps in a quorum other than the one they were in at ``after``."""
        before = [r for r in stayer_records() if r["t"] <= after]
        quorum = max(before, key=lambda r: r["t"])["q"] if before else None
        wait_until(lambda: len({r["s"] for r in stayer_records() if r["t"] > after and r["q"] != quorum})
                   >= settings.settle_steps, settings.timeout_s, stayers_alive, what)

    try:
        wait_until(lambda: follower.max_step() >= settings.warmup_steps, settings.timeout_s, stayers_alive,
                   f"warm-up ({settings.warmup_steps} steps)")
        for action in ("add", "remove", "rejoin", "kill"):
            if action in ("add", "rejoin"):
                joiner = start_group(JOINER, address, settings, out, children, action)
                procs.append(joiner)
                events.append({"action": action, "t": time.time(), "pid": joiner.pid})
                wait_until(lambda joiner=joiner: bool(read_records(steps_dir).get(joiner.pid)), settings.timeout_s,
                           lambda joiner=joiner: stayers_alive() and joiner.poll() is None, f"{action}: first step")
            elif action == "remove":
                events.append({"action": action, "t": time.time(), "pid": joiner.pid})
                os.kill(joiner.pid, signal.SIGTERM)
                joiner.wait(settings.timeout_s)
                events[-1]["exited_after_s"] = time.time() - events[-1]["t"]
            else:
                events.append(kill_mid_step(joiner, steps_dir))
                joiner.wait(settings.timeout_s)
            try:
                settle(events[-1]["t"], f"{action}: {settings.settle_steps} steps in the new quorum")
            except RuntimeError:
                if action != "kill" or all(proc.poll() is None for proc in stayers):
                    raise
                time.sleep(1.0)  # the other stayer may still be on its way down
                events[-1]["stayers_crashed"] = crash_report(stayers, out)
                log.warning("the stayers did not survive the kill: %s", events[-1]["stayers_crashed"])
        if "stayers_crashed" not in events[-1]:
            write_stop_file(out / "stop", follower.max_step() + stop_margin(follower, 5))
            for proc in stayers:
                proc.wait(settings.timeout_s)
            codes = [proc.returncode for proc in stayers]
            if any(codes):
                raise RuntimeError(f"stayers exited with {codes} (logs in {out / 'logs'})")
    finally:
        for proc in procs:
            children.stop(proc, grace_s=5.0)
        children.stop(lighthouse, grace_s=5.0)
    return analyse_trial(out, events, stayer_pids)


def crash_report(stayers: Sequence[subprocess.Popen], out: Path) -> list[dict[str, Any]]:
    """Exit code and the last exception line of each stayer's log."""
    report = []
    for group, proc in zip(STAYERS, stayers, strict=True):
        lines = (out / "logs" / f"group{group}-stayer.log").read_text(errors="replace").splitlines()
        errors = [line for line in lines if line and not line.startswith(" ") and "Error" in line]
        report.append({"group": group, "returncode": proc.poll(), "last_error": errors[-1][:300] if errors else None})
    return report


def kill_mid_step(joiner: subprocess.Popen, steps_dir: Path) -> dict[str, Any]:
    """SIGKILL the joiner half a typical step after one of its steps completed (inside the next step)."""
    records = read_records(steps_dir).get(joiner.pid, [])
    seen = len(records)
    wait_until(lambda: len(read_records(steps_dir).get(joiner.pid, [])) > seen, 60, lambda: joiner.poll() is None,
               "a fresh step of the group to kill")
    records = read_records(steps_dir)[joiner.pid]
    times = [r["t"] for r in records[-9:]]
    intervals = [b - a for a, b in itertools.pairwise(times)]
    typical = statistics.median(intervals) if intervals else 0.05
    time.sleep(max(0.0, records[-1]["t"] + typical / 2 - time.time()))
    if not is_worker(joiner.pid):
        raise RuntimeError(f"pid {joiner.pid} is not a {TRAIN_MODULE} process: not killed")
    killed_at = time.time()
    os.kill(joiner.pid, signal.SIGKILL)
    return {"action": "kill", "t": killed_at, "pid": joiner.pid, "last_step_seen": records[-1]["s"],
            "typical_step_s": typical}


# ---------------------------------------------------------------------- analysis (pure, from the files)


def adjustment_step(stayer_records: Sequence[dict[str, Any]], at: float) -> int | None:
    """The stayers' last step in the quorum they were in at ``at``: the step before the first one in another."""
    before = [r for r in stayer_records if r["t"] <= at]
    if not before:
        return None
    quorum = max(before, key=lambda r: r["t"])["q"]
    changed = [r["s"] for r in stayer_records if r["t"] > at and r["q"] != quorum]
    return min(changed) - 1 if changed else None


def analyse_trial(out: Path, events: Sequence[dict[str, Any]], stayer_pids: set[int]) -> dict[str, Any]:
    processes = load_steps(out / "steps")
    records = read_records(out / "steps")
    stayers = [p for p in processes if p.pid in stayer_pids]
    stayer_records = [r for pid in stayer_pids for r in records.get(pid, [])]
    by_pid = {p.pid: p for p in processes}
    adjustments = []
    for event in events:
        entry: dict[str, Any] = {**event}
        step = adjustment_step(stayer_records, event["t"])
        entry["step"] = step
        pause = pause_around(stayers, stayers, step) if step is not None else None
        entry["pause"] = pause.as_dict() if pause else None
        if event["action"] in ("add", "rejoin") and event["pid"] in by_pid:
            entry.update(joiner_figures(by_pid[event["pid"]], records.get(event["pid"], []), event["t"]))
        if event["action"] == "kill":
            entry["recovery"] = kill_recovery(processes, event)
        adjustments.append(entry)
    return {"adjustments": adjustments, "samples": sample_accounting(out / "samples", events, stayer_pids),
            "steps_dir": str(out / "steps")}


def joiner_figures(process: ProcessSteps, records: Sequence[dict[str, Any]], launched: float) -> dict[str, Any]:
    first = records[0]["t"] if records else None
    own = next((r["t"] for r in records if r.get("p")), None)
    return {"joiner_startup_s": None if first is None else first - process.spawn,
            "joiner_first_own_gradient_s": None if own is None else own - process.spawn,
            "joiner_first_step": records[0]["s"] if records else None,
            "launch_to_spawn_s": process.spawn - launched}


def kill_recovery(processes: Sequence[ProcessSteps], event: dict[str, Any]) -> dict[str, Any]:
    """bench/faults.py's figures for the kill: kill → next completed step of the survivors, → first new step."""
    dead = next((p for p in processes if p.pid == event["pid"]), None)
    kill = KillEvent(0, event["pid"], f"g{JOINER}", JOINER, 3, event["t"])
    recovery = analyse_kill(processes, kill, survivors_of(kill, dead.max_step if dead else -1))
    return {key: value for key, value in recovery.as_dict().items()
            if key in ("last_step", "next_step", "recovery_s", "progress_s", "redone_steps", "typical_step_s")}


def sample_accounting(samples_dir: Path, events: Sequence[dict[str, Any]], stayer_pids: set[int]) -> dict[str, Any]:
    """Per sampler epoch: how often each dataset index entered a committed update (a committed step in which its
    group participated); batches drawn but dropped (step not committed, or the group not participating), by the event
    they follow; duplicates (an index used more than once in one epoch: a group restarted in the same slot)."""
    used: Counter[tuple[int, int]] = Counter()
    drawn: Counter[tuple[int, int]] = Counter()
    dropped_batches: dict[str, Counter[str]] = defaultdict(Counter)
    per_group_used: Counter[str] = Counter()
    batches = 0
    for path in sorted(samples_dir.glob("*.jsonl")):
        pid = int(path.stem.rsplit("-", 1)[1])
        role = "stayer" if pid in stayer_pids else "joiner"
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            batches += 1
            keys = [(record["e"], index) for index in record["i"]]
            drawn.update(keys)
            if record["c"] and record["p"]:
                used.update(keys)
                per_group_used[role] += len(keys)
                continue
            after = [e["action"] for e in events if e["t"] <= record["t"]]
            cause = "not committed" if not record["c"] else "not participating"
            dropped_batches[after[-1] if after else "start"][f"{role}: {cause}"] += 1
    epochs = sorted({epoch for epoch, _ in drawn})
    per_epoch = {}
    for epoch in epochs:
        counts = Counter(count for (e, _), count in used.items() if e == epoch)
        lost = sum(1 for key, count in drawn.items() if key[0] == epoch and used[key] == 0)
        per_epoch[str(epoch)] = {
            "distinct_used": sum(counts.values()),
            "uses": sum(n * c for n, c in counts.items()),
            "used_once": counts.get(1, 0),
            "duplicated": sum(c for n, c in counts.items() if n > 1),
            "use_count_histogram": {str(n): c for n, c in sorted(counts.items())},
            "drawn_never_used": lost,
        }
    return {"batches_drawn": batches, "epochs": per_epoch, "uses_by_role": dict(per_group_used),
            "dropped_batches_by_event": {k: dict(v) for k, v in dropped_batches.items()}}


# ---------------------------------------------------------------------- summary and report


def values(trials: Sequence[dict[str, Any]], action: str, get: Callable[[dict[str, Any]], Any]) -> list[float]:
    out = []
    for trial in trials:
        for adjustment in trial.get("adjustments", []):
            if adjustment["action"] == action:
                try:
                    value = get(adjustment)
                except (KeyError, TypeError):
                    value = None
                if value is not None:
                    out.append(float(value))
    return out


def summary(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for action in ACTIONS:
        row = {
            "pause_s": Spread.of(values(trials, action, lambda a: a["pause"]["pause_s"])),
            "gap_s": Spread.of(values(trials, action, lambda a: a["pause"]["gap_s"])),
            "typical_step_s": Spread.of(values(trials, action, lambda a: a["pause"]["typical_step_s"])),
        }
        if action in ("add", "rejoin"):
            row["joiner_startup_s"] = Spread.of(values(trials, action, lambda a: a["joiner_startup_s"]))
            row["joiner_first_own_gradient_s"] = Spread.of(
                values(trials, action, lambda a: a["joiner_first_own_gradient_s"]))
        if action == "kill":
            row["recovery_s"] = Spread.of(values(trials, action, lambda a: a["recovery"]["recovery_s"]))
        if action == "remove":
            row["leaver_exit_s"] = Spread.of(values(trials, action, lambda a: a["exited_after_s"]))
        figures[action] = {key: spread.__dict__ if spread else None for key, spread in row.items()}
    dropped: Counter[str] = Counter()
    duplicated, lost = [], []
    for trial in trials:
        accounting = trial.get("samples") or {}
        for event, causes in accounting.get("dropped_batches_by_event", {}).items():
            for cause, count in causes.items():
                dropped[f"{event} / {cause}"] += count
        duplicated.append(sum(e["duplicated"] for e in accounting.get("epochs", {}).values()))
        lost.append(sum(e["drawn_never_used"] for e in accounting.get("epochs", {}).values()))
    figures["samples"] = {"dropped_batches_total": dict(dropped), "duplicated_per_trial": duplicated,
                          "drawn_never_used_per_trial": lost}
    return figures


def elan_figures(path: Path | None) -> dict[str, dict[str, Any]]:
    """model → elan's pauses (add, remove), joiner start-up and kill → next step from a bench.run results.json."""
    if path is None or not path.exists():
        return {}
    results = json.loads(path.read_text())
    out: dict[str, dict[str, Any]] = {}
    for model, entry in results.get("devices", {}).get("cpu", {}).get("models", {}).items():
        adjustments = (entry.get("elan") or {}).get("adjustments", [])
        kills = ((entry.get("faults") or {}).get("elan") or {}).get("kills", [])

        def pick(action: str, key: str, adjustments: list[dict[str, Any]] = adjustments) -> Spread | None:
            return Spread.of(a["pause"][key] for a in adjustments if a["action"] == action and a.get("pause"))

        out[model] = {
            "add": pick("add", "pause_s"), "remove": pick("remove", "pause_s"),
            "joiner_startup_s": Spread.of(s for a in adjustments if a["action"] == "add"
                                          for s in a["joiner_startup_s"]),
            "kill_recovery_s": Spread.of(k["recovery_s"] for k in kills if k.get("recovery_s") is not None),
        }
    return out


def fmt(spread: dict[str, Any] | Spread | None, digits: int = 2) -> str:
    if spread is None:
        return "—"
    data = spread if isinstance(spread, dict) else spread.__dict__
    return f"{data['median']:.{digits}f} ({data['low']:.{digits}f}–{data['high']:.{digits}f}), n={data['count']}"


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# torchft 0.2.0 on the benchmark's workload, next to elan",
        "",
        f"{env['date']}; torch {env['torch']}, torchft {env['torchft']}, {env['cores']} cores ({env['cpu']}); "
        f"load average {env['loadavg_start'][0]:.1f} at the start, {env.get('loadavg_end', [float('nan')])[0]:.1f} "
        f"at the end; {env.get('wall_s', 0) / 60:.1f} min. Lighthouse: {results['settings']['lighthouse']}; "
        f"ProcessGroupGloo timeout {results['settings']['gloo_timeout_s']:g} s; DDP comm hook: "
        f"{results['settings']['comm_hook']}; {results['settings']['batch_per_group']} samples per group and step.",
        "",
        "Seconds, median (min–max), n adjustments. Pause: the stayers' gap around the adjustment minus the median of "
        "the following steps (bench/analysis.py, the same function as elan's).",
        "",
        "| model | adjustment | torchft pause (s) | elan pause (s) | torchft gap (s) | torchft joiner launch → "
        "first step (s) | → first own gradient (s) | elan joiner start-up (s) | kill → next step (s), torchft | "
        "elan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, entry in results["models"].items():
        figures = entry["summary"]
        elan = results.get("elan", {}).get(model, {})
        for action, title in ACTIONS.items():
            row = figures[action]
            elan_pause = elan.get("add") if action in ("add", "rejoin") else elan.get("remove") \
                if action == "remove" else None
            lines.append(
                f"| {model} | {title} | {fmt(row['pause_s'])} | {fmt(elan_pause)} | {fmt(row['gap_s'])} | "
                f"{fmt(row.get('joiner_startup_s'), 1)} | {fmt(row.get('joiner_first_own_gradient_s'), 1)} | "
                f"{fmt(elan.get('joiner_startup_s'), 1) if action in ('add', 'rejoin') else '—'} | "
                f"{fmt(row.get('recovery_s'))} | {fmt(elan.get('kill_recovery_s')) if action == 'kill' else '—'} |")
    lines += ["", "## Sample accounting (per trial, all epochs the samplers reached)", "",
              "| model | trial | batches drawn | samples used once | used twice or more | drawn, never used "
              "| dropped batches (after event / group: cause) |", "|---|---|---|---|---|---|---|"]
    for model, entry in results["models"].items():
        for index, trial in enumerate(entry["trials"], 1):
            accounting = trial.get("samples")
            if not accounting:
                lines.append(f"| {model} | {index} | — | — | — | — | {trial.get('error', '')} |")
                continue
            epochs = accounting["epochs"].values()
            drops = "; ".join(f"{event} / {cause}: {count}" for event, causes in
                              accounting["dropped_batches_by_event"].items() for cause, count in causes.items())
            lines.append(f"| {model} | {index} | {accounting['batches_drawn']} | "
                         f"{sum(e['used_once'] for e in epochs)} | {sum(e['duplicated'] for e in epochs)} | "
                         f"{sum(e['drawn_never_used'] for e in epochs)} | {drops or 'none'} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="1m,25m", help=f"comma-separated, of {', '.join(MODEL_SIZES)}")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/torchft"))
    parser.add_argument("--work-dir", type=Path, default=None, help="step/sample files and logs (default: temp)")
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--join-timeout-ms", type=int, default=Settings.join_timeout_ms)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=Settings.heartbeat_timeout_ms)
    parser.add_argument("--quorum-tick-ms", type=int, default=Settings.quorum_tick_ms)
    parser.add_argument("--gloo-timeout-s", type=float, default=Settings.gloo_timeout_s)
    parser.add_argument("--comm-hook", choices=("tolerant", "torchft"), default="tolerant",
                        help="tolerant: bench/torchft_train.py's hook that survives a failed all-reduce; torchft: "
                             "0.2.0's own (the survivors of a SIGKILL crash)")
    parser.add_argument("--elan-results", type=Path, default=None, help="a bench.run results.json (elan's side)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per wait inside a trial")
    parser.add_argument("--serve-lighthouse", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse-settings", default="{}", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def environment() -> dict[str, Any]:
    from bench.run import _cpu_model

    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "python": platform.python_version(),
            "torch": metadata.version("torch"), "torchft": metadata.version("torchft"), "cpu": _cpu_model(),
            "cores": os.cpu_count(), "loadavg_start": os.getloadavg(), "argv": sys.argv[1:]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_lighthouse:
        serve_lighthouse(args.serve_lighthouse, json.loads(args.lighthouse_settings))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="torchft-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    base = Settings(warmup_steps=args.warmup_steps, settle_steps=args.settle_steps, timeout_s=args.timeout_s,
                    join_timeout_ms=args.join_timeout_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                    quorum_tick_ms=args.quorum_tick_ms, comm_hook=args.comm_hook, gloo_timeout_s=args.gloo_timeout_s)
    results: dict[str, Any] = {
        "environment": environment(),
        "settings": {"lighthouse": f"min_replicas={base.min_replicas}, quorum_tick_ms={base.quorum_tick_ms}, "
                                   f"join_timeout_ms={base.join_timeout_ms}, "
                                   f"heartbeat_timeout_ms={base.heartbeat_timeout_ms}",
                     "comm_hook": base.comm_hook, "gloo_timeout_s": base.gloo_timeout_s,
                     "batch_per_group": base.batch, "warmup_steps": base.warmup_steps,
                     "settle_steps": base.settle_steps},
        "models": {},
    }
    started = time.monotonic()
    children = Children()

    def save() -> None:
        results["environment"]["loadavg_end"] = os.getloadavg()
        results["environment"]["wall_s"] = time.monotonic() - started
        results["elan"] = {m: {k: v.__dict__ if v else None for k, v in f.items()}
                           for m, f in elan_figures(args.elan_results).items()}
        if args.elan_results:
            results["elan_results"] = str(args.elan_results)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "results.md").write_text(markdown(results))

    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for model in models:
            entry = results["models"][model] = {"trials": [], "summary": {}}
            for trial in range(1, args.trials + 1):
                log.info("%s: trial %d of %d", model, trial, args.trials)
                settings = Settings(**{**base.__dict__, "model": model})
                where = work / model / f"trial{trial}"
                try:
                    entry["trials"].append(run_trial(settings, where, children))
                except Exception as exc:
                    log.exception("%s trial %d failed (logs in %s)", model, trial, where)
                    entry["trials"].append({"error": f"{type(exc).__name__}: {exc}", "logs": str(where)})
                entry["summary"] = summary(entry["trials"])
                save()
    finally:
        children.stop_all()
        save()
    log.info("done in %.0f s: %s", results["environment"]["wall_s"], args.out / "results.md")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
