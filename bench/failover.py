"""AM fail-over and the cost of keeping state (and the rendezvous store) in etcd: ``python -m bench.failover``.

* **Fail-over**: a throw-away etcd and two ``elan am --store etcd://… --lease-ttl T`` processes of one job. Each trial
  SIGKILLs the leader and times SIGKILL → the first ``status`` answered by the new leader (a client listing both
  addresses, as ``elan worker --am A1,A2`` does); the killed AM is restarted as the new standby.
* **Coordination round trip**: ``status`` (read-only) and ``register`` (a state write: one file write + fsync, or one
  etcd compare-and-swap) from a client, against an AM on the file store and one on etcd.
* **Rendezvous**: gloo generations of 2 and 3 processes formed through a TCPStore and through the etcd rendezvous
  store (``bench/rendezvous_worker.py``: ``ElasticProcessGroup.configure`` + one all-reduce per generation).

Writes ``OUT/results.json`` and ``OUT/results.md`` (default ``bench/results/failover``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.etcd import EtcdServer
from bench.procs import LOOPBACK, free_port
from lightning_elan.master.etcd_store import parse_etcd_url
from lightning_elan.master.leadership import current_leader
from lightning_elan.protocol.client import AMClient
from lightning_elan.protocol.contract import RegisterRequest

log = logging.getLogger("bench.failover")

JOB = "failover"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "bench" / "results" / "failover"


class AMProc:
    """One ``elan am`` process (its log in ``work``), restartable on the same address."""

    def __init__(self, work: Path, name: str, store: str, ttl_s: float | None) -> None:
        self.work, self.name, self.store, self.ttl_s = work, name, store, ttl_s
        self.address = f"tcp://{LOOPBACK}:{free_port()}"
        self.log_path = work / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> AMProc:
        command = [sys.executable, "-m", "lightning_elan.cli", "am", "--job", JOB, "--bind", self.address,
                   "--store", self.store, "--state-dir", str(self.work / f"state-{self.name}")]
        if self.ttl_s is not None:
            command += ["--lease-ttl", str(self.ttl_s)]
        env = {**os.environ, "ELAN_HOME": str(self.work / f"home-{self.name}"), "PYTHONWARNINGS": "ignore"}
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True, cwd=REPO)
        return self

    def log_count(self, text: str) -> int:
        return self.log_path.read_text(errors="replace").count(text) if self.log_path.exists() else 0

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(predicate: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def summary(values: list[float], scale: float = 1.0) -> dict[str, float]:
    scaled = [value * scale for value in values]
    return {"median": statistics.median(scaled), "min": min(scaled), "max": max(scaled), "n": len(scaled)}


# ---- fail-over ---------------------------------------------------------------------------------------------------


def failover_trials(work: Path, store: str, trials: int, ttl_s: float) -> list[float]:
    ams = [AMProc(work, f"am{index}", store, ttl_s) for index in range(2)]
    locator = parse_etcd_url(store)
    try:
        ams[0].start()
        wait_for(lambda: current_leader(locator, JOB) == ams[0].address, "the first AM leading")
        ams[1].start()
        wait_for(lambda: ams[1].log_count("standing by") > 0, "the second AM standing by")
        addresses = ",".join(am.address for am in ams)
        with AMClient(addresses, JOB, timeout_s=2.0, retries=20) as client:
            client.request("start_job", {"nproc": 2})
        return [one_failover(ams, locator, addresses, trial) for trial in range(trials)]
    finally:
        for am in ams:
            am.stop()


def one_failover(ams: list[AMProc], locator: Any, addresses: str, trial: int) -> float:
    leader = next(am for am in ams if am.address == current_leader(locator, JOB))
    standby = next(am for am in ams if am is not leader)
    assert standby.proc is not None
    leader.kill()
    killed = time.monotonic()
    with AMClient(addresses, JOB, timeout_s=0.1, retries=1000) as client:
        while client.status()["am"]["pid"] != standby.proc.pid:
            time.sleep(0.01)
    elapsed = time.monotonic() - killed
    log.info("trial %d: %s → %s in %.2f s", trial, leader.name, standby.name, elapsed)
    waiting = leader.log_count("standing by")
    leader.start()
    wait_for(lambda: leader.log_count("standing by") > waiting, f"{leader.name} standing by again")
    return elapsed


# ---- round trips -------------------------------------------------------------------------------------------------


def round_trips(work: Path, store: str, requests: int, ttl_s: float | None) -> dict[str, dict[str, float]]:
    am = AMProc(work, f"rtt-{'etcd' if store.startswith('etcd://') else 'file'}", store, ttl_s).start()
    try:
        with AMClient(am.address, JOB, timeout_s=5.0, retries=10) as client:
            client.request("start_job", {"nproc": 2})
            times: dict[str, list[float]] = {"status": [], "register": []}
            for index in range(requests):
                started = time.perf_counter()
                client.status()
                times["status"].append(time.perf_counter() - started)
                started = time.perf_counter()
                client.register(RegisterRequest("w0", host=LOOPBACK, pid=10_000 + index))  # a new pid: a write
                times["register"].append(time.perf_counter() - started)
        return {kind: summary(values, 1e3) for kind, values in times.items()}
    finally:
        am.stop()


# ---- rendezvous ------------------------------------------------------------------------------------------------


def rendezvous(work: Path, etcd_endpoint: str, world: int, generations: int) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    results = {}
    server = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    for kind, address in (("tcpstore", f"{LOOPBACK}:{server.port}"),
                          ("etcd", f"etcd://{etcd_endpoint}/bench?job=rdzv{world}")):
        outs = [work / f"rdzv-{kind}-{world}-{rank}.json" for rank in range(world)]
        procs = [subprocess.Popen([sys.executable, "-m", "bench.rendezvous_worker", address, str(rank), str(world),
                                   str(generations), str(outs[rank])], cwd=REPO) for rank in range(world)]
        if any(proc.wait(300) != 0 for proc in procs):
            raise RuntimeError(f"a rendezvous worker failed ({kind}, world {world})")
        per_generation = [max(values) for values in
                          zip(*(json.loads(out.read_text())["formation_s"] for out in outs), strict=True)]
        results[kind] = summary(per_generation[1:], 1e3)  # generation 0 includes connecting
    return results


# ---- report ------------------------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    fail = results["failover_s"]
    lines = [
        "# AM fail-over and the etcd store",
        "",
        f"Command: `{results['command']}` (2-core machine, etcd {results['etcd']} on loopback).",
        "",
        f"**Fail-over** (lease TTL {results['ttl_s']:g} s, {fail['n']} trials): SIGKILL of the leading `elan am` → "
        f"first `status` answered by the new leader: median {fail['median']:.2f} s (min {fail['min']:.2f}, "
        f"max {fail['max']:.2f}).",
        "",
        f"**Round trip** from a client ({results['requests']} requests each; ms, median (min–max)):",
        "",
        "| AM store | `status` (read) | `register` (a state write) |",
        "|---|---|---|",
    ]
    for store, rtt in results["round_trip_ms"].items():
        lines.append(f"| {store} | {_cell(rtt['status'])} | {_cell(rtt['register'])} |")
    lines += ["", f"**Rendezvous**: forming a gloo generation through the store "
                  f"(`ElasticProcessGroup.configure` + one all-reduce, slowest rank; {results['generations'] - 1} "
                  "generations after the first; ms, median (min–max)):", "",
              "| world | TCPStore | etcd |", "|---|---|---|"]
    for world, row in results["rendezvous_ms"].items():
        lines.append(f"| {world} | {_cell(row['tcpstore'])} | {_cell(row['etcd'])} |")
    return "\n".join(lines) + "\n"


def _cell(values: dict[str, float]) -> str:
    return f"{values['median']:.2f} ({values['min']:.2f}–{values['max']:.2f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--ttl", type=float, default=2.0, help="the AMs' --lease-ttl (default 2)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--generations", type=int, default=21)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="elan-failover-") as tmp:
        work = Path(tmp)
        with EtcdServer(work / "etcd" / "data") as etcd:
            store = f"etcd://{etcd.client_endpoint}/bench"
            failover = failover_trials(work, store, args.trials, args.ttl)
            round_trip = {"file": round_trips(work, str(work / "file-state.json"), args.requests, None),
                          "etcd": round_trips(work, f"etcd://{etcd.client_endpoint}/rtt", args.requests, args.ttl)}
            rdzv = {str(world): rendezvous(work, etcd.client_endpoint, world, args.generations) for world in (2, 3)}
            version = subprocess.run([etcd.command()[0], "--version"], capture_output=True, text=True).stdout
    results = {
        "command": "python -m bench.failover " + " ".join(argv if argv is not None else sys.argv[1:]),
        "etcd": version.split("\n")[0].split()[-1] if version else "?",
        "ttl_s": args.ttl, "trials": failover, "failover_s": summary(failover), "requests": args.requests,
        "round_trip_ms": round_trip, "generations": args.generations, "rendezvous_ms": rdzv,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(markdown(results))
    log.info("wrote %s", args.out / "results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
