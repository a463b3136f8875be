"""One command for the whole benchmark: ``python -m bench.run`` (see docs/benchmarks.md).

Per device (CPU with gloo always; CUDA with NCCL too when at least 3 GPUs are visible), in this order:
  1. broadcast bandwidth between two processes for each model's state size (the copy floor);
  2. per model: an elan job scaled live (``cycles`` × scale out 2→3, scale in 3→2, migrate one worker), the same
     schedule replayed by stop-and-restart, then torchrun elastic with c10d and with etcd-v2 (add/remove a node);
  3. per model, crash recovery (``faults``, bench/faults.py): ``--fault-kills`` SIGKILLs of one of 3 workers under
     torchrun elastic and under elan, the time from each kill to the next completed step, and elan's planned-removal
     pause in the same job;
  4. runtime overhead without adjustments: ddp vs elan at coordinate_every 1, 10, 50, interleaved rounds;
  5. CPU only, goodput under failures (``goodput``, bench/goodput.py): per model and system (elan, torchrun elastic,
     torchft, stop-and-restart) the time to N steps without failures and with a SIGKILL every T seconds
     (also written to ``goodput.md``).
Writes ``results.json``, ``results.md`` (the tables) and ``timeline.png`` to ``--out``; worker logs and step files
go to ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.common import Scenario
from bench.procs import LOOPBACK, Children, bench_env, free_port, wait_all
from bench.sizes import MODEL_SIZES

log = logging.getLogger("bench")

STATE_BYTES_PER_PARAMETER = 12  # float32 weights + Adam's exp_avg and exp_avg_sq
ELAN_ATTEMPTS = 2
SECTIONS = ("elan", "restart", "torchrun-c10d", "torchrun-etcd-v2", "faults", "faults-torchrun", "faults-elan",
            "goodput")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="results.json/.md, timeline.png")
    parser.add_argument("--work-dir", type=Path, default=None, help="step files and logs (default: a temp dir)")
    parser.add_argument("--models", default="1m,11m,25m", help=f"comma-separated, of {', '.join(MODEL_SIZES)}")
    parser.add_argument("--cycles", type=int, default=2, help="(scale out, scale in, migrate) cycles per model")
    parser.add_argument("--torchrun-cycles", type=int, default=1, help="(add a node, remove it) per backend")
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=10, help="steps before the first request")
    parser.add_argument("--skip", default="", help=f"comma-separated sections to leave out: {', '.join(SECTIONS)}")
    parser.add_argument("--actions", default="add,remove,migrate", help="one elan cycle (stop-and-restart replays "
                        "it; torchrun does add and remove)")
    parser.add_argument("--fault-kills", type=int, default=10, help="faults: SIGKILLs per model and launcher")
    parser.add_argument("--fault-launchers", default="torchrun,elan", help="faults: torchrun and/or elan")
    parser.add_argument("--fault-planned-removals", type=int, default=2,
                        help="faults: elan's (remove 1, add 1) cycles before the kills")
    parser.add_argument("--replace-failed", action=argparse.BooleanOptionalAction, default=True,
                        help="faults: run elan with `elan run --replace-failed` (else the harness adds a worker "
                             "after each kill)")
    parser.add_argument("--goodput-models", default="1m,25m", help="goodput: models")
    parser.add_argument("--goodput-systems", default="elan,torchrun,torchft,restart", help="goodput: systems")
    parser.add_argument("--goodput-periods", default="20,60", help="goodput: seconds between SIGKILLs")
    parser.add_argument("--goodput-steps", default="", help="goodput: N, or model:N pairs (bench.goodput's default)")
    parser.add_argument("--goodput-repeats", type=int, default=1, help="goodput: repeats of each run")
    parser.add_argument("--overhead-configs", default="ddp,1,10,50", help="ddp and/or elan coordinate_every values")
    parser.add_argument("--overhead-model", default="1m")
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--overhead-steps", type=int, default=300)
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: CPU, plus GPU when >= 3 CUDA devices are visible")
    parser.add_argument("--timeline-model", default=None, help="model of the PNG (default: the largest run)")
    parser.add_argument("--keep-work-dir", action="store_true")
    parser.add_argument("--parallel-baselines", action="store_true",
                        help="run the overhead runs, stop-and-restart and torchrun concurrently (CI smoke test only: "
                             "timings are then not representative)")
    return parser.parse_args(argv)


def environment() -> dict[str, Any]:
    """The machine and versions (read from package metadata: the harness itself never imports torch on CPU)."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": platform.python_version(),
        "torch": metadata.version("torch"),
        "lightning": metadata.version("lightning"),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def devices(choice: str) -> list[str]:
    if choice == "cpu":
        return ["cpu"]
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "gpu" and gpus < 3:
        raise SystemExit(f"--device gpu needs >= 3 CUDA devices (2 workers + 1 joiner), found {gpus}")
    if choice == "gpu":
        return ["gpu"]
    if gpus < 3:
        log.info("GPU section skipped: %d CUDA device(s) visible, 3 needed", gpus)
        return ["cpu"]
    return ["cpu", "gpu"]


def measure_bandwidth(sizes: list[int], accelerator: str, work: Path, children: Children) -> dict[str, Any]:
    """Two processes broadcast buffers of each size (5 timed repeats); rank 0 writes the JSON."""
    out = work / f"bcast-{accelerator}.json"
    command = [sys.executable, "-m", "bench.bcast", "--port", str(free_port()), "--sizes", ",".join(map(str, sizes)),
               "--accelerator", accelerator, "--out", str(out)]
    procs = [children.start([*command, "--rank", str(rank)], bench_env(), work / "logs" / f"bcast-r{rank}.log")
             for rank in range(2)]
    try:
        codes = wait_all(procs, 600, poll_s=0.05)
    finally:
        for proc in procs:
            children.stop(proc)
    if any(codes):
        raise RuntimeError(f"bandwidth measurement failed: {codes} (logs in {work / 'logs'})")
    return json.loads(out.read_text())


def run_device(args: argparse.Namespace, accelerator: str, work: Path, children: Children,
               section: dict[str, Any], save: Callable[[], None]) -> None:
    """Fill ``section`` for one device; ``save`` is called after every part (a failure keeps what was measured)."""
    from bench.overhead import parse_configs, run_overhead

    models = [model.strip() for model in args.models.split(",") if model.strip()]
    section.update({"accelerator": accelerator, "models": {}, "failures": []})
    sizes = [MODEL_SIZES[model].parameters() * STATE_BYTES_PER_PARAMETER for model in models]
    log.info("[%s] broadcast bandwidth for %s bytes", accelerator, sizes)
    section["bandwidth"] = measure_bandwidth(sizes, accelerator, work, children)

    def overhead() -> None:
        if args.overhead_rounds <= 0:
            return
        log.info("[%s] runtime overhead: %s, %d rounds", accelerator, args.overhead_model, args.overhead_rounds)
        runs = run_overhead(args.overhead_model, args.overhead_rounds, args.overhead_steps,
                            work / accelerator / "overhead", children, accelerator,
                            configs=parse_configs(args.overhead_configs))
        section["overhead"] = {"model": args.overhead_model, "steps": args.overhead_steps,
                               "runs": [run.as_dict() for run in runs]}
        save()

    with ThreadPoolExecutor(1) as pool:
        concurrent = pool.submit(overhead) if args.parallel_baselines else None
        for model in models:
            scenario = Scenario(model, cycles=args.cycles, torchrun_cycles=args.torchrun_cycles,
                                settle_steps=args.settle_steps, warmup_steps=args.warmup_steps,
                                accelerator=accelerator,
                                actions=tuple(a.strip() for a in args.actions.split(",") if a.strip()))
            entry: dict[str, Any] = {"parameters": MODEL_SIZES[model].parameters(),
                                     "state_bytes": MODEL_SIZES[model].parameters() * STATE_BYTES_PER_PARAMETER}
            section["models"][model] = entry
            run_model(args, scenario, work / accelerator / model, children, entry, section["failures"], save)
            run_fault_runs(args, model, accelerator, work / accelerator / model / "faults", children, entry,
                           section["failures"], save)
        if concurrent is not None:
            concurrent.result()
        else:
            overhead()
    run_goodput_section(args, accelerator, work / accelerator / "goodput", children, section, save)


def run_goodput_section(args: argparse.Namespace, accelerator: str, base: Path, children: Children,
                        section: dict[str, Any], save: Callable[[], None]) -> None:
    """The ``goodput`` section (CPU only): bench/goodput.py's matrix into ``section['goodput']`` and goodput.md."""
    from bench import goodput

    skip = {item.strip() for item in args.skip.split(",") if item.strip()}
    if "goodput" in skip or accelerator != "cpu":
        return
    models = [m.strip() for m in args.goodput_models.split(",") if m.strip()]
    entry: dict[str, Any] = {"steps": goodput.parse_per_model(args.goodput_steps, models, goodput.DEFAULT_STEPS),
                             "ckpt_every": goodput.parse_per_model("", models, goodput.DEFAULT_CKPT_EVERY)}
    section["goodput"] = entry

    def save_goodput() -> None:
        entry["summary"] = goodput.summarise(entry.get("runs", []))
        save()

    log.info("[%s] goodput under failures: %s", accelerator, ", ".join(models))
    env, started = goodput.environment(), time.monotonic()
    try:
        goodput.run_matrix(models, [s.strip() for s in args.goodput_systems.split(",") if s.strip()],
                           [float(p) for p in args.goodput_periods.split(",") if p.strip()], entry["steps"],
                           entry["ckpt_every"], args.goodput_repeats, base, children, entry, save_goodput)
    except Exception as exc:
        _record_failure(section["failures"], ",".join(models), "goodput", exc, base)
    save_goodput()
    env.update(loadavg_end=os.getloadavg(), wall_s=time.monotonic() - started)
    markdown_results = {"environment": env, "command": "python -m bench.run (goodput section)", **entry}
    (args.out / "goodput.md").write_text(goodput.markdown(markdown_results))


def run_model(args: argparse.Namespace, scenario: Scenario, base: Path, children: Children, entry: dict[str, Any],
              failures: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """elan (retried once if a job fails or hangs), then the baselines on its schedule; failures are recorded."""
    from bench.elan_runs import run_elan_job
    from bench.restart_runs import run_restart_job
    from bench.torchrun_runs import run_torchrun_job

    skip = {item.strip() for item in args.skip.split(",") if item.strip()}
    model, where = scenario.model, scenario.accelerator
    elan = None
    for attempt in range(1, ELAN_ATTEMPTS + 1):
        log.info("[%s] %s: elan job (attempt %d)", where, model, attempt)
        try:
            elan = run_elan_job(scenario, base / f"elan-{attempt}", children)
            entry["elan"] = elan.as_dict()
            break
        except Exception as exc:
            _record_failure(failures, model, f"elan attempt {attempt}", exc, base / f"elan-{attempt}")
    save()
    if elan is None:
        return
    parts: list[tuple[str, Callable[[], Any]]] = []
    if "restart" not in skip:
        schedule = [(a.action, step, world) for a, (step, world) in zip(elan.adjustments, elan.schedule(),
                                                                         strict=True)]
        parts.append(("restart", lambda: run_restart_job(scenario, schedule, elan.final_step(), base / "restart",
                                                          children)))
    for backend in ("c10d", "etcd-v2"):
        if f"torchrun-{backend}" not in skip:
            parts.append((f"torchrun-{backend}", lambda backend=backend: run_torchrun_job(
                scenario, backend, base / f"torchrun-{backend}", children)))
    def run_part(name: str, run: Callable[[], Any]) -> None:
        log.info("[%s] %s: %s", where, model, name)
        try:
            entry[name] = run().as_dict()
        except Exception as exc:
            _record_failure(failures, model, name, exc, base / name)
        save()

    if args.parallel_baselines:
        with ThreadPoolExecutor(len(parts) or 1) as pool:
            list(pool.map(lambda part: run_part(*part), parts))
    else:
        for part in parts:
            run_part(*part)


def run_fault_runs(args: argparse.Namespace, model: str, accelerator: str, base: Path, children: Children,
                   entry: dict[str, Any], failures: list[dict[str, Any]], save: Callable[[], None]) -> None:
    """The ``faults`` section for one model: each launcher's kills; a run that stopped early is recorded."""
    from bench.faults import run_faults, scenario_for

    skip = {item.strip() for item in args.skip.split(",") if item.strip()}
    launchers = [name.strip() for name in args.fault_launchers.split(",")
                 if name.strip() and f"faults-{name.strip()}" not in skip]
    if "faults" in skip or not launchers:
        return
    runs = entry.setdefault("faults", {})
    for launcher in launchers:
        try:
            runs.update(run_faults(scenario_for(args, model, accelerator), [launcher], base, children))
            if runs[launcher].get("error"):
                failures.append({"model": model, "part": f"faults-{launcher}", "error": runs[launcher]["error"],
                                 "logs": str(base / launcher)})
        except Exception as exc:
            _record_failure(failures, model, f"faults-{launcher}", exc, base / launcher)
        save()


def _record_failure(failures: list[dict[str, Any]], model: str, part: str, exc: Exception, where: Path) -> None:
    log.error("%s %s failed: %s (logs in %s)", model, part, exc, where)
    failures.append({"model": model, "part": part, "error": f"{type(exc).__name__}: {exc}", "logs": str(where)})


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="elan-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log.info("work dir %s; results to %s (bound to %s)", work, args.out, LOOPBACK)
    results: dict[str, Any] = {"environment": environment(), "arguments": _arguments(args), "devices": {},
                               "global_batch": Scenario("tiny").global_batch}
    started = time.monotonic()
    children = Children()

    def save() -> None:
        results["environment"]["loadavg_end"] = os.getloadavg()
        results["environment"]["wall_s"] = time.monotonic() - started
        (args.out / "results.json").write_text(json.dumps(results, indent=1))

    _interrupt_on_sigterm()
    try:
        for accelerator in devices(args.device):
            section = results["devices"][accelerator] = {}
            try:
                run_device(args, accelerator, work, children, section, save)
            except Exception as exc:
                if accelerator == "cpu":
                    raise
                log.exception("GPU section failed; CPU results are kept")  # untested path: keep it from costing CPU
                section["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        children.stop_all()
        save()
    from bench.report import write_report

    write_report(results, args.out, work, args.timeline_model)
    log.info("done in %.0f s: %s", results["environment"]["wall_s"], args.out / "results.md")
    if not args.keep_work_dir and args.work_dir is None:
        _keep_outlier_logs(results, work, args.out)
        shutil.rmtree(work, ignore_errors=True)
    return 0


OUTLIER_RECOVERY_S = 10.0
"""A crash recovery this long (elan: normally under a second) keeps its job's logs past the temporary work dir."""


def _keep_outlier_logs(results: dict[str, Any], work: Path, out: Path) -> None:
    """Copy the work dir of every faults job with a kill that took over ``OUTLIER_RECOVERY_S`` to the next step to
    ``out/outliers/``: the evidence would otherwise go with the temporary directory."""
    for device, section in results["devices"].items():
        for model, figures in (section.get("models") or {}).items():
            for launcher, job in (figures.get("faults") or {}).items():
                slow = [kill for kill in job.get("kills") or [] if (kill.get("recovery_s") or 0) > OUTLIER_RECOVERY_S]
                source = work / device / model / "faults" / launcher
                if launcher == "elan" and slow and source.exists():
                    target = out / "outliers" / f"{device}-{model}-faults-{launcher}"
                    shutil.copytree(source, target, dirs_exist_ok=True)
                    log.warning("%d slow recovery(ies) in %s %s faults: logs kept in %s", len(slow), model, launcher,
                                target)


def _interrupt_on_sigterm() -> None:
    """SIGTERM and SIGINT (even when the shell started us with SIGINT ignored) unwind through ``finally`` blocks,
    so every child is stopped."""

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


def _arguments(args: argparse.Namespace) -> dict[str, Any]:
    return {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}


if __name__ == "__main__":
    raise SystemExit(main())
