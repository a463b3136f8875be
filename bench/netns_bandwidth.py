"""Replication bandwidth between two hosts on this machine (network namespaces on a bridge) vs a plain gloo broadcast.

``python -m bench.netns_bandwidth [--sizes-mb 10,100,300] [--repeat 7] [--out-dir bench/results/netns]`` (root: it
makes two fake hosts with ``tests/multihost/hosts.py``; every address is on their private bridge or loopback).

Four series, two processes each, the sender on ``host0``:

* ``replication`` — the code path a joiner uses: an adjustment plan with one ``collective`` transfer (the level the
  planner gives two hosts, L4), carried out by ``replication.exchange`` (``send_replica`` / ``receive_replica``: the
  header with the CPU state and layout in the TCPStore, a transfer group of its own built for each transfer, the
  packed buffers broadcast, the joiner's buffers freshly allocated). Timed from one start signal until the joiner holds
  the state; the ``DEBUG`` log of the transport gives its broadcast phase alone.
* ``broadcast`` — ``torch.distributed.broadcast`` of the same bytes on a process group built once, into a buffer the
  receiver already touched (``bench.bcast``: after a barrier, until the slower rank has the data): the floor.

each ``cross-host`` (receiver on ``host1``, over the veth pair and the bridge, ``GLOO_SOCKET_IFNAME=eth0``) and
``same host`` (receiver on ``host0`` too, over its loopback). Both processes choose the interface the way a worker
does (``replication.iface.bind_transfer_interface`` with the sender as the AM). Every timed run follows one untimed
run; medians and min–max over ``--repeat``. Writes ``results.json`` and ``results.md`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = datetime.timedelta(seconds=300)
PORT = 29611
MODES = ("replication", "broadcast")
PLACEMENTS = {"cross-host": 1, "same host": 0}  # placement -> the receiver's host
_PHASE = re.compile(r"transfer (\S+): (pack|broadcast) ([0-9.]+) ms")
_GROUP = re.compile(r"transfer group (\S+) rank \d+/\d+ \(\w+\) ready in ([0-9.]+) ms")


# ---------------------------------------------------------------------------------------------
# inside a fake host
# ---------------------------------------------------------------------------------------------


class PhaseLog(logging.Handler):
    """Collects the collective transport's phase times (its DEBUG log) per transfer: ``pack`` (source), ``group``
    (building the transfer group), ``broadcast``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.phases: dict[tuple[str, str], float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        match = _PHASE.match(message)
        if match:
            self.phases[(match.group(1), match.group(2))] = float(match.group(3)) / 1e3
        match = _GROUP.match(message)
        if match:
            self.phases[(match.group(1), "group")] = float(match.group(2)) / 1e3


def make_state(nbytes: int, tensors: int) -> list[Any]:
    import torch

    per = max(1, nbytes // 4 // tensors)
    g = torch.Generator().manual_seed(0)
    return [torch.randn(per, generator=g) for _ in range(tensors)]


def checksum(tensors: list[Any]) -> int:
    """Exact: the sum of every 32-bit word."""
    import torch

    return sum(int(t.view(torch.int32).sum(dtype=torch.int64)) for t in tensors)


def _plan() -> Any:
    from lightning_elan.protocol.contract import AdjustmentPlan
    from lightning_elan.replication.planner import TRANSPORT_COLLECTIVE, Transfer
    from lightning_elan.replication.topology import L4_NETWORK

    transfer = Transfer(source="w0", joiner="w1", level=L4_NETWORK, transport=TRANSPORT_COLLECTIVE)
    return AdjustmentPlan(
        request_id="bench", action="add", generation=1, previous_generation=0, step=0, members=["w0", "w1"],
        previous_members=["w0"], joiners=["w1"], leavers=[], sources={"w1": "w0"}, hosts={}, transfers=[transfer],
    )  # fmt: skip


def replication_series(store: Any, rank: int, nbytes: int, runs: int, tensors: int, phases: PhaseLog) -> list[dict]:
    """``runs`` transfers of one state from rank 0 to rank 1 through ``replication.exchange``; rank 1's timings."""
    import torch

    from lightning_elan.replication.exchange import ReplicationContext, receive_replica, send_replica

    state = make_state(nbytes, tensors) if rank == 0 else []
    expected = checksum(state) if rank == 0 else 0
    plan, out = _plan(), []
    for run in range(runs):
        prefix = f"bench/{nbytes}/{run}"
        context = ReplicationContext(store, prefix, "gloo", TIMEOUT, torch.device("cpu"))
        if rank == 0:
            store.wait([f"{prefix}/ready"], TIMEOUT)
            store.set(f"{prefix}/go", repr(time.time()))
            send_replica(context, plan, "w0", {"checksum": expected}, state).finish(TIMEOUT)
            store.set(f"{prefix}/pack", repr(phases.phases.get((f"{prefix}/w0/collective", "pack"), 0.0)))
            continue
        store.set(f"{prefix}/ready", b"1")
        store.wait([f"{prefix}/go"], TIMEOUT)
        got, route = receive_replica(context, plan, "w1", lambda _: torch.device("cpu"))
        cpu_state, received = got.cpu_state, got.tensors
        seconds = time.time() - float(store.get(f"{prefix}/go").decode())
        if route != "collective" or checksum(received) != cpu_state["checksum"]:
            raise RuntimeError(f"transfer {prefix}: wrong route {route} or wrong bytes")
        channel = f"{prefix}/w0/collective"
        out.append({"seconds": seconds, "broadcast_s": phases.phases.get((channel, "broadcast")),
                    "group_s": phases.phases.get((channel, "group")),
                    "pack_s": float(store.get(f"{prefix}/pack").decode())})
        del received
    return out


def broadcast_series(store: Any, rank: int, nbytes: int, runs: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from bench.bcast import timed_broadcast

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.PrefixStore("bench/pg", store), rank=rank, world_size=2,
                                timeout=TIMEOUT)
    buffer = torch.ones(nbytes, dtype=torch.uint8)  # touched: no page faults in the timing
    return [{"seconds": timed_broadcast(buffer, torch.device("cpu"))} for _ in range(runs)]


def worker_main(args: dict[str, Any]) -> None:
    import torch.distributed as dist

    from lightning_elan.replication.iface import bind_transfer_interface

    phases = PhaseLog()
    transport_log = logging.getLogger("lightning_elan.replication.transports.collective")
    transport_log.addHandler(phases)
    transport_log.setLevel(logging.DEBUG)
    ifname = bind_transfer_interface()  # ELAN_AM_ADDRESS is the sender's address: eth0 across hosts, lo on one
    rank = args["rank"]
    store = dist.TCPStore(args["address"], args["port"], is_master=rank == 0, world_size=2, timeout=TIMEOUT)
    results = []
    for nbytes in args["sizes"]:
        runs = args["repeat"] + 1
        if args["mode"] == "replication":
            series = replication_series(store, rank, nbytes, runs, args["tensors"], phases)
        else:
            series = broadcast_series(store, rank, nbytes, runs)
        results.append({"bytes": nbytes, "runs": series[1:]})  # the first run warms up
    if dist.is_initialized():
        dist.destroy_process_group()
    if rank == 1:
        Path(args["out"]).write_text(json.dumps({"ifname": ifname, "results": results}))
        store.set("done", b"1")
    else:
        store.wait(["done"], TIMEOUT)  # the store's host (rank 0) stays until the other is done with it


# ---------------------------------------------------------------------------------------------
# the driver (root namespace)
# ---------------------------------------------------------------------------------------------


def _env(address: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELAN_", "GLOO_", "NCCL_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", ELAN_AM_ADDRESS=f"tcp://{address}:{PORT}")
    return env


def run_pair(hosts: Any, mode: str, receiver_host: int, port: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Both processes of one series; the receiver's result."""
    address = hosts[0].address if receiver_host != 0 else "127.0.0.1"
    out = tmp / f"{mode}-{receiver_host}.json"
    common = {"mode": mode, "address": address, "port": port, "sizes": [int(mb * 1e6) for mb in args.sizes_mb],
              "repeat": args.repeat, "tensors": args.tensors, "out": str(out)}
    processes = []
    for rank, host in enumerate((hosts[0], hosts[receiver_host])):
        argv = [sys.executable, "-m", "bench.netns_bandwidth", "--worker", json.dumps({**common, "rank": rank})]
        processes.append(host.popen(argv, _env(address), cwd=REPO_ROOT))
    for process in processes:
        if process.wait(timeout=TIMEOUT.total_seconds()) != 0:
            raise RuntimeError(f"{mode} worker exited {process.returncode}")
    return json.loads(out.read_text())


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(raw: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for (placement, mode), series in raw.items():
        for entry in series["results"]:
            nbytes, runs = entry["bytes"], entry["runs"]
            seconds = [r["seconds"] for r in runs]
            row = {"placement": placement, "mode": mode, "bytes": nbytes, "interface": series["ifname"],
                   "seconds": spread(seconds), "gb_per_s": spread([nbytes / s / 1e9 for s in seconds]),
                   "repeats": len(runs)}
            for key in ("broadcast", "group", "pack"):
                phase = [r[f"{key}_s"] for r in runs if r.get(f"{key}_s")]
                if phase:
                    row[f"{key}_phase_s"] = spread(phase)
            rows.append(row)
    return rows


def _cell(row: dict[str, Any]) -> str:
    g, s = row["gb_per_s"], row["seconds"]
    return f"{g['median']:.2f} GB/s ({g['min']:.2f}–{g['max']:.2f}), {s['median'] * 1e3:.0f} ms"


def _phase_lines(nbytes: int, by_key: dict, meta: dict[str, Any]) -> list[str]:
    rows = [by_key.get((nbytes, "replication", p), {}) for p in meta["interfaces"]]
    broadcast = [row.get("broadcast_phase_s") for row in rows]
    group = [row.get("group_phase_s") for row in rows]
    pack = [row.get("pack_phase_s") for row in rows]
    lines = []
    if any(pack):
        cells = [f"{x['median'] * 1e3:.0f} ms" if x else "" for x in pack]
        lines.append(f"| {nbytes / 1e6:g} MB | replication: packing on the source | " + " | ".join(cells) + " |")
    if any(broadcast):
        cells = [f"{nbytes / x['median'] / 1e9:.2f} GB/s, {x['median'] * 1e3:.0f} ms" if x else "" for x in broadcast]
        lines.append(f"| {nbytes / 1e6:g} MB | replication: its broadcast phase | " + " | ".join(cells) + " |")
    if any(group):
        cells = [f"{x['median'] * 1e3:.1f} ms ({x['min'] * 1e3:.1f}–{x['max'] * 1e3:.1f})" if x else "" for x in group]
        label = "replication: building its transfer group"
        lines.append(f"| {nbytes / 1e6:g} MB | {label} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [f"# Replication between fake hosts vs a plain gloo broadcast ({meta['date']})", "",
             f"`{meta['command']}` — {meta['repeat']} timed runs each (after one untimed), median (min–max); "
             "GB = 10^9 bytes. Replication: `replication.exchange`, one collective transfer, a new transfer group "
             "each time; broadcast: `dist.broadcast` on a group built once.", "",
             "| state | series | " + " | ".join(f"{p} ({i})" for p, i in meta["interfaces"].items()) + " |",
             "|---|---|" + "---|" * len(meta["interfaces"])]
    by_key = {(r["bytes"], r["mode"], r["placement"]): r for r in rows}
    for nbytes in sorted({r["bytes"] for r in rows}):
        for mode in MODES:
            cells = [_cell(by_key[nbytes, mode, p]) if (nbytes, mode, p) in by_key else "" for p in meta["interfaces"]]
            lines.append(f"| {nbytes / 1e6:g} MB | {mode} | " + " | ".join(cells) + " |")
        lines.extend(_phase_lines(nbytes, by_key, meta))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes-mb", type=lambda s: [float(x) for x in s.split(",")], default=[10.0, 100.0, 300.0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--tensors", type=int, default=16, help="float32 tensors the state is split into")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "bench" / "results" / "netns")
    args = parser.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    sys.path.insert(0, str(REPO_ROOT))
    from tests.multihost.hosts import FakeHosts

    raw: dict[tuple[str, str], Any] = {}
    with FakeHosts(2) as hosts, tempfile.TemporaryDirectory() as tmp:
        for i, (placement, receiver_host) in enumerate(PLACEMENTS.items()):
            for j, mode in enumerate(MODES):
                log.info("%s %s ...", placement, mode)
                raw[placement, mode] = run_pair(hosts, mode, receiver_host, PORT + 2 * i + j, args, Path(tmp))
    rows = summarise(raw)
    command = "python -m bench.netns_bandwidth " + " ".join(sys.argv[1:])
    meta = {"date": time.strftime("%Y-%m-%d"), "command": command.strip(), "repeat": args.repeat,
            "interfaces": {p: raw[p, "broadcast"]["ifname"] for p in PLACEMENTS}, "cpus": os.cpu_count()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out_dir / "results.md").write_text(markdown(rows, meta))
    sys.stdout.write(markdown(rows, meta))


if __name__ == "__main__":
    main()
