"""Broadcast bandwidth between two processes (gloo on CPU, NCCL on GPUs): the copy floor's denominator.

Run as ``python -m bench.bcast --rank R --world 2 --port P --sizes N,… --out FILE`` (the harness starts both ranks);
rank 0 writes ``{"backend", "device", "results": [{"bytes", "seconds": [...]}]}``. Each timed broadcast starts after
a barrier and ends when the slowest rank has the data.
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from bench.procs import LOOPBACK


def timed_broadcast(buffer: torch.Tensor, device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    dist.broadcast(buffer, src=0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def measure(sizes: list[int], repeats: int, device: torch.device) -> list[dict]:
    results = []
    for size in sizes:
        buffer = torch.ones(size, dtype=torch.uint8, device=device)  # touched: no page faults in the timing
        timed_broadcast(buffer, device)  # warm-up (connections, allocator)
        results.append({"bytes": size, "seconds": [timed_broadcast(buffer, device) for _ in range(repeats)]})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sizes", required=True, help="comma-separated byte counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gpu = args.accelerator == "gpu"
    device = torch.device("cuda", args.rank) if gpu else torch.device("cpu")
    backend = "nccl" if gpu else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{args.port}", rank=args.rank,
                            world_size=args.world, timeout=timedelta(minutes=5),
                            device_id=device if gpu else None)
    results = measure([int(size) for size in args.sizes.split(",")], args.repeats, device)
    if args.rank == 0:
        name = torch.cuda.get_device_name(device) if gpu else "cpu"
        args.out.write_text(json.dumps({"backend": backend, "device": name, "results": results}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
