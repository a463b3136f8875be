"""Markdown tables and the PNG timeline from ``results.json`` (medians with min–max)."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.analysis import Spread, load_steps

log = logging.getLogger(__name__)

ACTIONS = {"add": "scale out 2→3", "remove": "scale in 3→2", "migrate": "migrate 1 worker"}
TORCHRUN = ("torchrun-c10d", "torchrun-etcd-v2")
FLOOR_FACTOR, FLOOR_SLACK_S = 1.5, 0.1
RATIO_TARGET = 30.0
OVERHEAD_TARGETS = {1: 0.03, 10: 0.01}


# ---------------------------------------------------------------------- figures


def actions_run(entry: dict[str, Any]) -> list[str]:
    """The kinds of adjustment the elan job of ``entry`` made, in the report's order."""
    done = {a["action"] for a in entry["elan"]["adjustments"]} if "elan" in entry else set()
    return [action for action in ACTIONS if action in done]


def pauses(job: dict[str, Any] | None, action: str) -> list[float]:
    if not job:
        return []
    return [a["pause"]["pause_s"] for a in job["adjustments"] if a["action"] == action and a.get("pause")]


def gaps(job: dict[str, Any] | None, action: str) -> list[float]:
    if not job:
        return []
    return [a["pause"]["gap_s"] for a in job["adjustments"] if a["action"] == action and a.get("pause")]


def joiner_startups(elan: dict[str, Any], action: str) -> list[float]:
    return [s for a in elan["adjustments"] if a["action"] == action for s in a["joiner_startup_s"]]


def bandwidth_for(section: dict[str, Any], size: int) -> float | None:
    """Bytes/s of the broadcast of ``size`` bytes (median of the repeats)."""
    for result in section["bandwidth"]["results"]:
        if result["bytes"] == size:
            return size / statistics.median(result["seconds"])
    return None


def copy_floor_s(section: dict[str, Any], model: str, action: str) -> float | None:
    """State a joiner needs ÷ broadcast bandwidth (0 for a scale-in: nothing is copied)."""
    entry = section["models"][model]
    if action == "remove":
        return 0.0
    replicated = [a["bytes_replicated"] for a in entry["elan"]["adjustments"] if a["action"] == action]
    state = statistics.median(replicated) if replicated else entry["state_bytes"]
    bandwidth = bandwidth_for(section, entry["state_bytes"])
    return None if not bandwidth else state / bandwidth


def figures(results: dict[str, Any]) -> dict[str, float | None]:
    """Every figure the report shows, flattened (medians); None where a figure is missing."""
    out: dict[str, float | None] = {}
    for device, section in results["devices"].items():
        for model, entry in section.get("models", {}).items():
            if "elan" not in entry:
                out[f"{device}/{model}/elan_job"] = None
                out.update(fault_figures(f"{device}/{model}", entry))
                continue
            key = f"{device}/{model}"
            out[f"{key}/bandwidth_Bps"] = bandwidth_for(section, entry["state_bytes"])
            for action in actions_run(entry):
                out[f"{key}/{action}/elan_pause_s"] = _median(pauses(entry["elan"], action))
                out[f"{key}/{action}/elan_gap_s"] = _median(gaps(entry["elan"], action))
                if action != "remove":
                    out[f"{key}/{action}/copy_floor_s"] = copy_floor_s(section, model, action)
                    out[f"{key}/{action}/joiner_startup_s"] = _median(joiner_startups(entry["elan"], action))
                if "restart" in entry:
                    out[f"{key}/{action}/restart_pause_s"] = _median(pauses(entry["restart"], action))
                for name in TORCHRUN:
                    if name in entry and action != "migrate":
                        out[f"{key}/{action}/{name}_pause_s"] = _median(pauses(entry[name], action))
            out.update(fault_figures(f"{device}/{model}", entry))
        for config, spread in overhead_rates(section).items():
            out[f"{device}/overhead/{config}/steps_per_s"] = spread.median if spread else None
    return out


def fault_figures(key: str, entry: dict[str, Any]) -> dict[str, float | None]:
    """Medians of the crash-recovery runs of one model (``faults`` section), None where nothing was measured."""
    from bench.faults import recovery_values

    out: dict[str, float | None] = {}
    for launcher, run in entry.get("faults", {}).items():
        for name in ("recovery_s", "progress_s"):
            out[f"{key}/faults/{launcher}/{name}"] = _median(recovery_values(run, name))
        if launcher == "elan":
            out[f"{key}/faults/elan/planned_removal_pause_s"] = _median(planned_removal(run, "pause_s"))
    return out


def planned_removal(run: dict[str, Any] | None, name: str) -> list[float]:
    """``pause_s`` or ``gap_s`` of the elan fault run's planned removals."""
    if not run:
        return []
    return [a["pause"][name] for a in run.get("planned_removals", []) if a.get("pause")]


def _median(values: Iterable[float]) -> float | None:
    data = list(values)
    return statistics.median(data) if data else None


def overhead_rates(section: dict[str, Any]) -> dict[str, Spread | None]:
    runs = section.get("overhead", {}).get("runs", [])
    configs = dict.fromkeys(run["config"] for run in runs)
    return {config: Spread.of(run["steps_per_s"] for run in runs if run["config"] == config) for config in configs}


def overhead_ratios(section: dict[str, Any]) -> dict[str, Spread | None]:
    """Per round, 1 − elan/ddp (paired: both ran back to back in the same round)."""
    runs = section.get("overhead", {}).get("runs", [])
    ddp = {run["round"]: run["steps_per_s"] for run in runs if run["config"] == "ddp"}
    configs = dict.fromkeys(run["config"] for run in runs if run["config"] != "ddp")
    return {
        config: Spread.of(1 - run["steps_per_s"] / ddp[run["round"]] for run in runs
                          if run["config"] == config and run["round"] in ddp)
        for config in configs
    }


# ---------------------------------------------------------------------- markdown


def fmt(spread: Spread | None, digits: int = 2) -> str:
    if spread is None:
        return "—"
    if spread.count == 1:
        return f"{spread.median:.{digits}f}"
    return f"{spread.median:.{digits}f} ({spread.low:.{digits}f}–{spread.high:.{digits}f})"


def ratio(numerator: Spread | None, denominator: Spread | None) -> str:
    if numerator is None or denominator is None:
        return "—"
    if denominator.median <= 0:
        return "∞"
    return f"{numerator.median / denominator.median:.0f}×"


def adjustment_table(section: dict[str, Any]) -> list[str]:
    lines = [
        "| model | adjustment | elan pause (s) | copy floor (s) | target ≤ 1.5×floor+0.1 (s) | stop-and-restart (s) "
        "| torchrun c10d (s) | torchrun etcd-v2 (s) | restart ÷ elan | torchrun ÷ elan (c10d / etcd-v2) "
        "| joiner start-up, hidden (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, entry in section["models"].items():
        label = f"{model} ({entry['parameters'] / 1e6:.1f} M, {entry['state_bytes'] / 1e6:.0f} MB)"
        for action in actions_run(entry):
            name = ACTIONS[action]
            elan = Spread.of(pauses(entry["elan"], action))
            floor = copy_floor_s(section, model, action)
            target = None if floor is None else FLOOR_FACTOR * floor + FLOOR_SLACK_S
            restart = Spread.of(pauses(entry.get("restart"), action))
            torchrun = [Spread.of(pauses(entry.get(job), action)) if action != "migrate" else None for job in TORCHRUN]
            verdict = "" if elan is None or target is None else (" ✓" if elan.median <= target else " ✗")
            startup = Spread.of(joiner_startups(entry["elan"], action)) if action != "remove" else None
            lines.append(
                f"| {label} | {name} | {fmt(elan)}{verdict} | {_num(floor, 3)} | {_num(target)} | {fmt(restart, 1)} "
                f"| {fmt(torchrun[0], 1)} | {fmt(torchrun[1], 1)} | {ratio(restart, elan)} "
                f"| {ratio(torchrun[0], elan)} / {ratio(torchrun[1], elan)} | {fmt(startup, 1)} |"
            )
    return lines


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def bandwidth_table(section: dict[str, Any]) -> list[str]:
    backend, device = section["bandwidth"]["backend"], section["bandwidth"]["device"]
    lines = [f"| model | parameters | state a joiner needs | {backend} broadcast, 2 processes ({device}) |",
             "|---|---|---|---|"]
    for model, entry in section["models"].items():
        seconds = next((r["seconds"] for r in section["bandwidth"]["results"] if r["bytes"] == entry["state_bytes"]),
                       [])
        speed = Spread.of(entry["state_bytes"] / s / 1e9 for s in seconds)
        lines.append(f"| {model} | {entry['parameters']:,} | {entry['state_bytes'] / 1e6:.1f} MB "
                     f"| {fmt(speed)} GB/s, {fmt(Spread.of(seconds), 3)} s |")
    return lines


def overhead_table(section: dict[str, Any], baseline: str = "Lightning `ddp`", subject: str = "`elan`") -> list[str]:
    """``baseline``: what the ``ddp`` runs are; ``subject``: what the elastic runs are."""
    if "overhead" not in section:
        return []
    rates, ratios = overhead_rates(section), overhead_ratios(section)
    info = section["overhead"]
    rounds = rates["ddp"].count if rates.get("ddp") else 0
    lines = [
        f"Model `{info['model']}`, 2 workers, {info['steps']} steps per run (rate after the first 30 steps, slowest "
        f"rank), {rounds} interleaved rounds; overhead = 1 − elastic/baseline within each round.",
        "",
        "| configuration | steps/s | overhead vs baseline | target |",
        "|---|---|---|---|",
    ]
    for config, spread in rates.items():
        every = None if config == "ddp" else int(config.split("/")[1])
        share = ratios.get(config)
        target = OVERHEAD_TARGETS.get(every) if every else None
        overhead = "—" if share is None else (f"{share.median * 100:+.1f} % ({share.low * 100:+.1f} to "
                                              f"{share.high * 100:+.1f} %)")
        verdict = "" if target is None or share is None else (
            f"≤ {target * 100:.0f} % {'✓' if share.median <= target else '✗'}")
        name = baseline if config == "ddp" else f"{subject}, coordinate_every {every}"
        lines.append(f"| {name} | {fmt(spread, 1)} | {overhead} | {verdict} |")
    return lines


def verdicts(section: dict[str, Any]) -> list[str]:
    """One line per target, as measured."""
    lines = []
    for model, entry in section["models"].items():
        for action in actions_run(entry):
            name = ACTIONS[action]
            elan = Spread.of(pauses(entry["elan"], action))
            floor = copy_floor_s(section, model, action)
            if elan is None or floor is None:
                continue
            target = FLOOR_FACTOR * floor + FLOOR_SLACK_S
            state = "met" if elan.median <= target else f"missed by {elan.median - target:.2f} s " \
                                                          f"({elan.median / target:.1f}× the target)"
            lines.append(f"- {model}, {name}: pause {elan.median:.2f} s vs target {target:.2f} s — {state}")
    ran = [m for m, e in section["models"].items() if "elan" in e]
    big = max(ran, key=lambda m: section["models"][m]["parameters"], default=None)
    if big is not None:
        entry = section["models"][big]
        for action in actions_run(entry):
            elan = Spread.of(pauses(entry["elan"], action))
            for job in ("restart", *TORCHRUN):
                other = Spread.of(pauses(entry.get(job), action))
                if elan is None or other is None:
                    continue
                factor = other.median / elan.median if elan.median > 0 else float("inf")
                state = "met" if factor >= RATIO_TARGET else f"missed ({factor:.0f}× < {RATIO_TARGET:.0f}×)"
                lines.append(f"- {big}, {ACTIONS[action]}: {job} pause is {factor:.0f}× elan's — {state}")
    return lines


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    parts = [
        "# lightning_elan benchmark results", "",
        f"{env['date']} · {env['cpu']}, {env['cores']} cores · python {env['python']}, torch {env['torch']}, "
        f"lightning {env['lightning']} · load average at start {_load(env.get('loadavg_start'))}, at end "
        f"{_load(env.get('loadavg_end'))} · whole run {env.get('wall_s', 0) / 60:.1f} min", "",
        "Medians with (min–max) over every adjustment of that kind; pauses are measured from the workers' own step "
        "timestamps (gap around the adjustment minus a typical step of the new configuration).", "",
    ]
    for device, section in results["devices"].items():
        if "bandwidth" not in section:
            parts += [f"## {device}: no results ({section.get('error', 'not run')})", ""]
            continue
        title = "CPU (gloo)" if device == "cpu" else f"GPU (NCCL, {section['bandwidth']['device']})"
        parts += [f"## {title}", "", "### Adjustment pause", "", *adjustment_table(section), "",
                  "### Targets", "", *verdicts(section), "",
                  "### Copy floor: broadcast bandwidth measured in this run", "", *bandwidth_table(section), ""]
        faults = faults_table(section, notes=False)
        if faults:
            parts += ["### Crash recovery: time from SIGKILL to the next step", "", *faults, ""]
        overhead = overhead_table(section)
        if overhead:
            parts += ["### Runtime overhead without adjustments", "", *overhead, ""]
        if section.get("failures"):
            parts += ["### Failed runs (retried or left out of the tables)", ""]
            parts += [f"- {f['model']} {f['part']}: {f['error']}" for f in section["failures"]]
            parts.append("")
    return "\n".join(parts)


FAULT_EVENTS = {
    "torchrun": "torchrun elastic (c10d), SIGKILL of 1 of {world} workers: all restart from the last checkpoint",
    "elan": "elan, SIGKILL of 1 of {world} workers: the survivors go on",
}


def faults_table(section: dict[str, Any], notes: bool = True) -> list[str]:
    """Crash recovery per model: kill → next completed step, kill → first new step, and elan's planned removal;
    ``notes``: list the runs that stopped early under it (bench.run lists them with every failure instead)."""
    from bench.faults import recovery_values

    rows, errors = [], []
    for model, entry in section.get("models", {}).items():
        for launcher, run in entry.get("faults", {}).items():
            world = max((kill["world"] for kill in run.get("kills", [])), default=3)
            recovery = Spread.of(recovery_values(run, "recovery_s"))
            rows.append(
                f"| {model} | {FAULT_EVENTS.get(launcher, launcher).format(world=world)} "
                f"| {recovery.count if recovery else 0} | {fmt(recovery)} "
                f"| {fmt(Spread.of(recovery_values(run, 'progress_s')))} "
                f"| {fmt(Spread.of(recovery_values(run, 'redone_steps')), 0)} "
                f"| {fmt(Spread.of(recovery_values(run, 'typical_step_s')), 3)} | — |"
            )
            if launcher == "elan" and run.get("planned_removals"):
                gap, pause = Spread.of(planned_removal(run, "gap_s")), Spread.of(planned_removal(run, "pause_s"))
                rows.append(f"| {model} | elan, planned removal {world}→{world - 1} (`remove 1`), same job "
                            f"| {pause.count if pause else 0} | {fmt(gap)} (from the last step before it) | — | 0 "
                            f"| — | {fmt(pause)} |")
            if run.get("error"):
                errors.append(f"- {model}, {launcher}: {run['error']}")
    if not rows:
        return []
    lines = [
        "| model | event | n | → next completed step (s) | → first new step (s) | steps redone | typical step "
        "before (s) | planned-removal pause (s) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    if notes and errors:
        lines += ["", "Runs that stopped early (their measured kills are in the table):", "", *errors]
    return lines


def faults_markdown(results: dict[str, Any]) -> str:
    """``python -m bench.faults``'s faults.md."""
    env = results["environment"]
    parts = [
        "# Crash recovery: time from SIGKILL to the next step", "",
        f"{env['date']} · {env['cpu']}, {env['cores']} cores · python {env['python']}, torch {env['torch']}, "
        f"lightning {env['lightning']} · load average at start {_load(env.get('loadavg_start'))}, at end "
        f"{_load(env.get('loadavg_end'))} · whole run {env.get('wall_s', 0) / 60:.1f} min", "",
        f"`{results.get('command', 'python -m bench.faults')}`", "",
        "Medians with (min–max) over the kills, from the workers' step files (bench/faults.py).", "",
    ]
    for device, section in results["devices"].items():
        parts += [f"## {device}", "", *faults_table(section), ""]
    return "\n".join(parts)


def _load(values: Any) -> str:
    return "?" if not values else " / ".join(f"{v:.1f}" for v in values)


# ---------------------------------------------------------------------- timeline


def plot_timeline(results: dict[str, Any], path: Path, model: str | None = None) -> bool:
    """samples/s and world size over wall time, elan vs stop-and-restart (CPU section); False if not drawable."""
    section = results["devices"].get("cpu") or next(iter(results["devices"].values()), None)
    if not section:
        return False
    candidates = [m for m, e in section.get("models", {}).items() if "restart" in e and "elan" in e]
    if model is None and candidates:
        model = max(candidates, key=lambda m: section["models"][m]["parameters"])
    if model not in candidates:
        log.warning("no timeline: no model with both elan and stop-and-restart runs")
        return False
    entry = section["models"][model]
    batch = int(results.get("global_batch", 48))
    series = {}
    for name, job in (("elan", entry["elan"]), ("stop-and-restart", entry["restart"])):
        steps_dir = Path(job["steps_dir"])
        if not steps_dir.exists():
            log.warning("no timeline: %s is gone", steps_dir)
            return False
        processes, origin = load_steps(steps_dir), job["launched_at"]
        series[name] = (*sliding_rate(processes, batch, origin), *world_sizes(processes, origin))
    _draw(series, path, f"{model} ({entry['parameters'] / 1e6:.1f} M parameters, Adam, float32, "
                        f"{section['accelerator'].upper()}): the same adjustments at the same steps")
    return True


def first_completions(processes: list[Any]) -> dict[int, tuple[float, int, set[int]]]:
    """step → (job completion time, world size, pids that completed it); only first completions count."""
    steps: dict[int, tuple[float, int, set[int]]] = {}
    for process in processes:
        for record in process.steps:
            when, world, pids = steps.get(record.step, (record.time, record.world, set()))
            pids.add(process.pid)
            steps[record.step] = (max(when, record.time), world, pids)
    return steps


def sliding_rate(processes: list[Any], batch: int, origin: float, window_s: float = 3.0,
                 every_s: float = 0.25) -> tuple[list[float], list[float]]:
    """Samples/s over the last ``window_s`` seconds, evaluated every ``every_s`` seconds of wall time."""
    times = sorted(when - origin for when, _, _ in first_completions(processes).values())
    if not times:
        return [], []
    grid = [index * every_s for index in range(int((times[-1] + window_s) / every_s) + 1)]
    rates, low, high = [], 0, 0
    for t in grid:
        while high < len(times) and times[high] <= t:
            high += 1
        while low < high and times[low] <= t - window_s:
            low += 1
        rates.append((high - low) * batch / window_s)
    return grid, rates


def world_sizes(processes: list[Any], origin: float) -> tuple[list[float], list[int]]:
    """The world size of every step, and 0 between two steps that no process both completed (a restart)."""
    steps = first_completions(processes)
    times, worlds = [0.0], [0]
    previous: tuple[float, int, set[int]] | None = None
    for step in sorted(steps):
        when, world, pids = steps[step]
        if previous is not None and not (previous[2] & pids):
            times.append(previous[0] - origin)
            worlds.append(0)
        times.append(when - origin)
        worlds.append(world)
        previous = steps[step]
    if previous is not None:
        times.append(previous[0] - origin)
        worlds.append(0)
    return times, worlds


def _draw(series: dict[str, tuple], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"elan": "tab:blue", "stop-and-restart": "tab:orange"}
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True, height_ratios=(3, 1.3))
    for name, (grid, rates, times, worlds) in series.items():
        top.plot(grid, rates, color=colours[name], label=name, linewidth=1.4)
        bottom.step(times, worlds, where="post", color=colours[name], label=name, linewidth=1.4)
    top.set_ylabel("samples / s (3 s window)")
    top.set_title(title, fontsize=10)
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    bottom.set_ylabel("world size\n(0: restarting)")
    bottom.set_xlabel("wall time since launch (s)")
    bottom.set_yticks([0, 1, 2, 3])
    bottom.set_ylim(-0.2, 3.4)
    bottom.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_report(results: dict[str, Any], out: Path, work: Path, timeline_model: str | None = None) -> None:
    (out / "results.md").write_text(markdown(results))
    try:
        drawn = plot_timeline(results, out / "timeline.png", timeline_model)
    except ImportError:
        log.warning("matplotlib is not installed (pip install -e '.[bench]'): no timeline.png")
        drawn = False
    if drawn:
        log.info("timeline: %s", out / "timeline.png")


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.report RESULTS.json``: re-render results.md (and the PNG while the step files exist)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("results", type=Path)
    parser.add_argument("--timeline-model", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    results = json.loads(args.results.read_text())
    write_report(results, args.results.parent, args.results.parent, args.timeline_model)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
