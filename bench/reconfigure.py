"""What moving the worker's process group to a new generation costs: ``python -m bench.reconfigure [--generations N]``.

Two processes on one long-lived TCPStore, gloo: (1) ``ElasticProcessGroup.configure`` split into dropping the old
generation's backend and building the new one, (2) the previous design, ``destroy_process_group`` +
``init_process_group`` on a ``PrefixStore``, (3) dropping a gloo backend inline vs handing it to a background thread.
Prints medians in ms from rank 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def elastic_group(store: dist.Store, rank: int, generations: int) -> dict[str, float]:
    from lightning_elan.elastic.process_group import ElasticProcessGroup

    group = ElasticProcessGroup(store, "gloo", TIMEOUT, torch.device("cpu"))
    drop, build = [], []
    for generation in range(generations):
        t0 = time.perf_counter()
        group.shutdown()
        t1 = time.perf_counter()
        group.configure(f"bench/elastic{generation}/", rank, 2)
        drop.append((t1 - t0) * 1e3)
        build.append(_ms(t1))
        group.allreduce([torch.ones(1)]).wait()
    return {"elastic: drop old backend": statistics.median(drop), "elastic: build new": statistics.median(build),
            "elastic: total": statistics.median(d + b for d, b in zip(drop, build, strict=True))}


def default_group(store: dist.Store, rank: int, generations: int) -> dict[str, float]:
    times = []
    for generation in range(generations):
        t0 = time.perf_counter()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"bench/default{generation}/", store), rank=rank,
                                world_size=2, timeout=TIMEOUT)
        times.append(_ms(t0))
        dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return {"destroy + init_process_group": statistics.median(times)}


def release(store: dist.Store, rank: int, generations: int) -> dict[str, float]:
    results = {}
    for mode in ("inline", "background thread"):
        times = []
        for generation in range(generations):
            backend = dist.ProcessGroupGloo(dist.PrefixStore(f"bench/{mode}{generation}/", store), rank, 2, TIMEOUT)
            backend.allreduce([torch.ones(1)]).wait()
            holder = [backend]
            del backend
            t0 = time.perf_counter()
            if mode == "inline":
                holder.clear()
            else:
                threading.Thread(target=holder.clear).start()
            times.append(_ms(t0))
        results[f"drop a gloo backend, {mode}"] = statistics.median(times)
    return results


def worker(rank: int, port: int, generations: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=TIMEOUT)
    results = {**elastic_group(store, rank, generations), **default_group(store, rank, generations),
               **release(store, rank, generations)}
    if rank == 0:
        print(json.dumps({name: round(ms, 2) for name, ms in results.items()}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--generations", type=int, default=30)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.port, args.generations)
        return
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    command = [sys.executable, "-m", "bench.reconfigure", "--generations", str(args.generations), "--port",
               str(store.port), "--rank"]
    processes = [subprocess.Popen([*command, str(rank)]) for rank in range(2)]
    sys.exit(max(process.wait() for process in processes))


if __name__ == "__main__":
    main()
