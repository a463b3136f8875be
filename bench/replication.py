"""Replication alone, between real processes: how long joiners take to receive a state, per transport and joiner count.

``python -m bench.replication [--device cpu|cuda] [--sizes-mb 50,200] [--repeat 5] [--out results.json]``

Each case starts fresh processes (sources and joiners) on one host around a TCPStore, gives every source the same
deterministic state (``--tensors`` float32 tensors adding up to the size), and carries out a plan through
:mod:`lightning_elan.replication.exchange`, exactly as an adjustment does: each source publishes / broadcasts, each
joiner receives. Measured on every process against one start signal (``time.time()``, one host):

* ``receive_s``: until the last joiner holds the whole state (on its device: CUDA work synchronised);
* ``source_busy_s``: until the slowest source may train again (``send_replica`` returned);
* ``release_s``: until the slowest source has freed its shared buffers (``finish``).

Cases: 1 joiner from 1 source; 2 joiners from 2 distinct sources (the planner's concurrent copies); 2 joiners from 1
source. Joiners check the bytes (a checksum against the source's) so a fast wrong copy cannot pass.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

TIMEOUT = datetime.timedelta(seconds=300)
CASES = {"1 joiner": (1, 1), "2 joiners from 2 sources": (2, 2), "2 joiners from 1 source": (2, 1)}


def make_state(size_mb: float, tensors: int, device: str) -> list[Any]:
    import torch

    numel = int(size_mb * 1e6 / 4)
    per = max(1, numel // tensors)
    g = torch.Generator().manual_seed(0)
    if device == "meta":
        return [torch.empty(per, device="meta") for _ in range(tensors)]
    return [torch.randn(per, generator=g).to(device) for _ in range(tensors)]


def checksum(tensors: list[Any]) -> float:
    return float(sum(t.double().sum().item() for t in tensors))


def _connect(port: int, log_level: str) -> Any:
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=log_level, format="%(asctime)s %(process)d %(name)s: %(message)s")

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)


def _context(store: Any, device: str) -> Any:
    import torch

    from lightning_elan.replication.exchange import ReplicationContext

    return ReplicationContext(store, "bench/transfer", "gloo", TIMEOUT, torch.device(device))


def _ready_then_go(store: Any) -> float:
    store.add("ready", 1)
    store.wait(["go"], TIMEOUT)
    return float(store.get("go").decode())


def source_main(port: int, name: str, plan: Any, size_mb: float, tensors: int, device: str, out: Any,
                log_level: str) -> None:
    from lightning_elan.replication.exchange import send_replica

    store = _connect(port, log_level)
    state = make_state(size_mb, tensors, device)
    _sync(device)
    start = _ready_then_go(store)
    outgoing = send_replica(_context(store, device), plan, name, {"source": name}, state)
    busy = time.time() - start
    outgoing.finish(TIMEOUT)
    out.put({"role": "source", "name": name, "busy": busy, "release": time.time() - start})


def joiner_main(port: int, name: str, plan: Any, size_mb: float, device: str, expected: float, out: Any,
                log_level: str, into_own: bool = False, tensors: int = 160) -> None:
    import torch

    from lightning_elan.replication.exchange import receive_replica

    store = _connect(port, log_level)
    _warm_up(size_mb, device)
    into = _own_memory(size_mb, tensors, device) if into_own else None
    start = _ready_then_go(store)
    context = _context(store, device)
    got, transport = receive_replica(context, plan, name, lambda _: torch.device(device), into)
    received, nbytes = got.tensors, got.nbytes
    _sync(device)
    elapsed = time.time() - start
    ok = abs(checksum(received) - expected) <= 1e-6 * max(1.0, abs(expected))
    out.put({"role": "joiner", "name": name, "receive": elapsed, "bytes": nbytes, "transport": transport, "ok": ok})


def _own_memory(size_mb: float, tensors: int, device: str) -> Any:
    """What a warmed-up joiner offers (like a model with Adam): its own tensors for the first third of the state
    (the parameters, built and touched), memory faulted in ahead for the other two thirds (the moments)."""
    from lightning_elan.replication.reception import PrefaultedMemory, ReceiveInto

    shapes = [t.shape for t in make_state(size_mb, tensors, "meta")]
    own_count = len(shapes) // 3
    own = {i: torch_zeros(shape, device) for i, shape in enumerate(shapes[:own_count])}
    rest = sum(shape.numel() * 4 for shape in shapes[own_count:])
    spare = PrefaultedMemory.fault_in(rest)
    spare.wait()
    return ReceiveInto(lambda cpu_state: own, spare)


def torch_zeros(shape: Any, device: str) -> Any:
    import torch

    return torch.zeros(shape, device=device)


def _warm_up(size_mb: float, device: str) -> None:
    """What a real joiner has done before it receives: CUDA context, copy kernels loaded, model-sized memory cached."""
    import torch

    scratch = torch.empty(int(size_mb * 1e6), dtype=torch.uint8, device=device)
    scratch.copy_(torch.zeros_like(scratch))
    del scratch
    _sync(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def plan_for(joiners: int, sources: int, transport: str) -> Any:
    """An ``AdjustmentPlan`` growing ``sources`` workers by ``joiners``, every copy over ``transport``."""
    from lightning_elan.master.state import AdjustmentPlan
    from lightning_elan.replication.planner import Transfer

    level = {"cuda_ipc": 0, "shm": 2, "collective": 4}[transport]
    pairs = [(f"s{i % sources}", f"j{i}") for i in range(joiners)]
    old = [f"s{i}" for i in range(sources)]
    new = [j for _, j in pairs]
    return AdjustmentPlan(
        request_id="bench", action="add", generation=1, previous_generation=0, step=0, members=old + new,
        previous_members=old, joiners=new, leavers=[], sources={j: s for s, j in pairs}, hosts={},
        transfers=[Transfer(source=s, joiner=j, level=level, transport=transport) for s, j in pairs],
    )  # fmt: skip


def run_case(joiners: int, sources: int, transport: str, size_mb: float, tensors: int, device: str,
             log_level: str = "WARNING", into_own: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    from bench.procs import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")  # what `elan run` gives its workers (spawned children inherit it)
    ctx = mp.get_context("spawn")
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    plan = plan_for(joiners, sources, transport)
    expected = checksum(make_state(size_mb, tensors, "cpu"))
    out = ctx.Queue()
    procs = [ctx.Process(target=source_main, args=(port, f"s{i}", plan, size_mb, tensors, device, out,
                                                    log_level))
             for i in range(sources)]  # fmt: skip
    procs += [ctx.Process(target=joiner_main, args=(port, f"j{i}", plan, size_mb, device, expected, out,
                                                    log_level, into_own, tensors))
              for i in range(joiners)]  # fmt: skip
    for proc in procs:
        proc.start()
    while store.add("ready", 0) < len(procs):
        time.sleep(0.01)
    store.set("go", repr(time.time()))
    results = [out.get(timeout=TIMEOUT.total_seconds()) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    joined = [r for r in results if r["role"] == "joiner"]
    sent = [r for r in results if r["role"] == "source"]
    if not all(r["ok"] for r in joined):
        raise RuntimeError(f"a joiner received wrong bytes: {joined}")
    return {"receive_s": max(r["receive"] for r in joined), "source_busy_s": max(r["busy"] for r in sent),
            "release_s": max(r["release"] for r in sent), "transports": sorted({r["transport"] for r in joined})}


def summarise(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (all processes on cuda:0)")
    parser.add_argument("--transports", default=None, help="default: collective,shm (cpu); collective,cuda_ipc (cuda)")
    parser.add_argument("--sizes-mb", default="50,200")
    parser.add_argument("--tensors", type=int, default=160)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG shows each transfer's phases")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--into", default="new", choices=("new", "own", "both"),
                        help="joiners receive into new memory, or into their own tensors (a third) and memory faulted "
                             "in ahead (the rest), as an elan joiner does; both: each case twice, interleaved")
    args = parser.parse_args(argv)
    default = "collective,cuda_ipc" if args.device.startswith("cuda") else "collective,shm"
    rows = []
    for size in (float(s) for s in args.sizes_mb.split(",")):
        for transport in (args.transports or default).split(","):
            for case in args.cases.split(","):
                joiners, sources = CASES[case]
                intos = ("new", "own") if args.into == "both" else (args.into,)
                runs: dict[str, list[dict[str, Any]]] = {into: [] for into in intos}
                for _ in range(args.repeat):
                    for into in intos:
                        runs[into].append(run_case(joiners, sources, transport, size, args.tensors, args.device,
                                                   args.log_level, into == "own"))
                for into, done in runs.items():
                    row = {"device": args.device, "size_mb": size, "transport": transport, "case": case,
                           "into": into, "used": done[0]["transports"],
                           **{key: summarise([r[key] for r in done]) for key in ("receive_s", "source_busy_s",
                                                                                 "release_s")}}  # fmt: skip
                    rows.append(row)
                    print(_line(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


def _line(row: dict[str, Any]) -> str:
    def fmt(key: str) -> str:
        s = row[key]
        return f"{s['median'] * 1e3:8.1f} ms ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f})"

    return (f"{row['device']:5} {row['size_mb']:6.0f} MB {row['transport']:10} {row['case']:22} into {row['into']:3} "
            f"receive {fmt('receive_s')}  source busy {fmt('source_busy_s')}  released {fmt('release_s')}")


if __name__ == "__main__":
    main()
