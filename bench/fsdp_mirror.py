"""What elan_fsdp's shard mirror costs per step: ``python -m bench.fsdp_mirror [--size 25m] [--steps 12] [--world 2]``.

``--world`` processes on one TCPStore, gloo on the CPU, the bench MLP (float32, Adam) sharded with FSDP2
``fully_shard``; each step is timed as the training step (forward, backward with its reduce-scatter, Adam) and, apart,
the mirror's own work (``ShardMirror``: the reduced gradient rows sent to the mirror holder, the ward's received, then
the committed step replayed on the mirror: ``exchange_ms`` and ``replay_ms``; by default the replay runs on a background
thread, so ``replay_ms`` is its launch and ``exchange_ms`` includes waiting for the previous one; ``--foreground``
replays on the training thread, its own cost). The first steps (warm-up) are left out. Prints one JSON line per rank:
medians and min-max in ms, the seed (the one full copy at a generation's first step) and the bytes a step sends.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WARM_UP = 2
BATCH = 32


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1e3


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1), "max": round(max(values), 1)}


def worker(rank: int, world: int, port: int, size: str, steps: int, foreground: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.sizes import CLASSES, IN_FEATURES, MODEL_SIZES
    from bench.workload import build_mlp
    from lightning_elan.replication.shard_mirror import ShardMirror

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_mlp(MODEL_SIZES[size])
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    group = dist.distributed_c10d._get_default_group()
    mirror = ShardMirror()
    x, y = torch.randn(BATCH, IN_FEATURES), torch.randint(CLASSES, (BATCH,))
    step_ms, mirror_ms, exchange_ms, replay_ms, seed_ms = [], [], [], [], 0.0
    for step in range(steps + WARM_UP):
        dist.barrier()
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        backward_done = time.perf_counter()
        if not mirror.seeded:
            seeded = time.perf_counter()
            mirror.seed(model, [optimizer], group)
            seed_ms = _ms(seeded)
        mirrored = time.perf_counter()
        mirror.exchange_gradients(model, group)
        mirror.capture_hyperparameters([optimizer])
        exchange = _ms(mirrored)
        stepped = time.perf_counter()
        optimizer.step()
        own_step = _ms(stepped)
        advanced = time.perf_counter()
        mirror.advance(0, background=not foreground)
        replay = _ms(advanced)
        if step >= WARM_UP:
            mirror_ms.append(exchange + replay)
            exchange_ms.append(exchange)
            replay_ms.append(replay)
            step_ms.append((backward_done - started) * 1e3 + own_step)
    sent = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    mirror.settle()
    print(json.dumps({"rank": rank, "world": world, "size": size, "steps": steps, "foreground": foreground,
                      "train_step_ms": _summary(step_ms),
                      "mirror_ms": _summary(mirror_ms), "exchange_ms": _summary(exchange_ms),
                      "replay_ms": _summary(replay_ms), "seed_ms": round(seed_ms, 1),
                      "mirror_share": round(statistics.median(mirror_ms) / statistics.median(step_ms), 3),
                      "gradient_bytes_sent_per_step": sent}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="25m")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--foreground", action="store_true", help="replay on the training thread (its own cost)")
    args = parser.parse_args()
    if args.rank is not None:
        worker(args.rank, args.world, args.port, args.size, args.steps, args.foreground)
        return
    port = 29000 + os.getpid() % 1000
    command = [sys.executable, "-m", "bench.fsdp_mirror", "--size", args.size, "--steps", str(args.steps),
               "--world", str(args.world), "--port", str(port), *(["--foreground"] if args.foreground else [])]
    processes = [subprocess.Popen([*command, "--rank", str(rank)]) for rank in range(args.world)]
    codes = [process.wait() for process in processes]
    if any(codes):
        raise SystemExit(f"bench.fsdp_mirror: workers exited with {codes}")


if __name__ == "__main__":
    main()
