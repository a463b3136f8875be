"""The benchmark's workload as one torchft 0.2.0 replica group (one process, CPU, gloo), after torchft's train_ddp.py.

    python -m bench.torchft_train --replica-group 0 --num-replica-groups 3 --lighthouse http://127.0.0.1:PORT \
        --model 1m --batch 24 --steps-dir DIR --samples-dir DIR --stop-file FILE

The training loop is torchft's own recipe: a per-group ``TCPStore``, ``Manager`` with ``ProcessGroupGloo`` and
``PGTransport`` (as train_ddp.py), ``torchft.DistributedDataParallel``, ``torchft.Optimizer`` (``zero_grad`` starts
the quorum, ``step`` steps Adam only if ``should_commit()``) and ``torchft.DistributedSampler`` sharding the data over
``--num-replica-groups`` slots. The model, data and Adam are bench/workload.py's (the MLP and ``RepeatedDataset`` are
rebuilt here without importing Lightning; tests/integration/test_bench_torchft.py checks they are the same).

Every *committed* step appends ``{"s": step, "t": time.time(), "w": participants, "r": replica group}`` to this
process's step file (bench/workload.py's format, read by bench/analysis.py), plus ``q`` (quorum id), ``n`` (replica
groups in the quorum, healing ones included) and ``p`` (1 if this group's gradient was in the step). Every *attempted*
step appends the sampler epoch, the dataset indices of the batch, whether the step committed and whether this group
participated to a samples file: the sample accounting.

``--tolerant-comm-hook`` replaces torchft 0.2.0's DDP communication hook by one that survives a failed all-reduce. Found
here: when a peer group dies mid-step, ``_ManagedWork.wait()`` catches gloo's error and reports it to the Manager (so
``should_commit()`` fails and the step is redone, as designed), but the hook then asserts ``fut._fut``, which is only
set on success: every surviving group dies with an ``AssertionError`` in ``torchft/ddp.py`` ``_comm_hook`` (an
all-reduce refused up front returns a ``_DummyWork``, whose plain future has no ``_fut``: the same crash; cf. the open
torchft PR #294). The replacement returns the upstream future when there is one and otherwise a completed future of
the bucket, leaving the error with the Manager: torchft's intended behaviour.

SIGTERM is the graceful leave: torchft has no leave request, so the worker finishes the step it is in (after
``should_commit``), shuts its Manager down and exits. The stop file ends training after the step it names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from bench.sizes import CLASSES, IN_FEATURES, MODEL_SIZES, ModelSize

LOOPBACK = "127.0.0.1"
BASE_SAMPLES = 1024  # bench/workload.py's RepeatedDataset
LR = 1e-4  # bench/workload.py's BenchModel default

log = logging.getLogger("bench.torchft_train")


def build_mlp(size: ModelSize) -> nn.Sequential:
    """bench/workload.py's ``build_mlp`` (same layers, same order)."""
    layers: list[nn.Module] = [nn.Linear(IN_FEATURES, size.width), nn.ReLU()]
    for _ in range(size.depth - 1):
        layers += [nn.Linear(size.width, size.width), nn.ReLU()]
    layers.append(nn.Linear(size.width, CLASSES))
    return nn.Sequential(*layers)


class IndexedRepeatedDataset(Dataset):
    """bench/workload.py's ``RepeatedDataset`` (same seed, same samples) that also returns each sample's index."""

    def __init__(self, length: int, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(BASE_SAMPLES, IN_FEATURES, generator=generator)
        self.y = torch.randint(CLASSES, (BASE_SAMPLES,), generator=generator)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index % BASE_SAMPLES], self.y[index % BASE_SAMPLES], index


class Lines:
    """One JSON line per record, flushed at once (the harness follows the files while the job runs)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.flush()
        self._file.close()


def loopback_manager_server() -> None:
    """torchft 0.2.0's Manager binds its gRPC server to ``[::]:port`` with no option; bind it to 127.0.0.1."""
    import torchft.manager as manager_module

    server_class = manager_module.ManagerServer

    def on_loopback(*args: Any, bind: str, **kwargs: Any) -> Any:
        return server_class(*args, bind=f"{LOOPBACK}:{bind.rsplit(':', 1)[1]}", **kwargs)

    manager_module.ManagerServer = on_loopback


def tolerant_ddp_class() -> type:
    """torchft's DistributedDataParallel with a communication hook that does not assert after a failed all-reduce."""
    from torchft import DistributedDataParallel

    class TolerantDistributedDataParallel(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
            work = state.allreduce(bucket.buffer())
            if work.wait() is not False:  # _ManagedWork.wait() returns False once it reported an error
                fut = work.get_future()
                inner = getattr(fut, "_fut", fut)  # a _ManagedFuture's torch future, or _DummyWork's own
                if inner is not None:
                    return inner
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())  # the Manager holds the error: should_commit() is False
            return done

    return TolerantDistributedDataParallel


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replica-group", type=int, required=True, help="this group's slot (REPLICA_GROUP_ID)")
    parser.add_argument("--num-replica-groups", type=int, default=3, help="the most groups the job will have")
    parser.add_argument("--lighthouse", required=True, help="http://127.0.0.1:PORT")
    parser.add_argument("--model", default="tiny", help="tiny, 1m, 11m or 25m")
    parser.add_argument("--batch", type=int, default=24, help="samples per step of this group")
    parser.add_argument("--epoch-samples", type=int, default=48 * 1000, help="dataset length (bench.train's)")
    parser.add_argument("--steps-dir", type=Path, required=True)
    parser.add_argument("--samples-dir", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, required=True)
    parser.add_argument("--min-replica-size", type=int, default=1, help="Manager(min_replica_size) (train_ddp: 1)")
    parser.add_argument("--label", default="torchft")
    parser.add_argument("--gloo-timeout-s", type=float, default=5.0, help="ProcessGroupGloo(timeout) (train_ddp: 5)")
    parser.add_argument("--tolerant-comm-hook", action="store_true",
                        help="survive a peer's death mid-all-reduce (torchft 0.2.0's hook asserts; see above)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(process)d %(name)s: %(message)s")
    args = parse_args(argv)
    leave = {"asked": False}
    signal.signal(signal.SIGTERM, lambda signum, frame: leave.__setitem__("asked", True))

    from torchft import DistributedDataParallel, DistributedSampler, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    loopback_manager_server()
    torch.manual_seed(0)  # every group builds the same initial model (Manager's init_sync also syncs step 0)
    spawn = float(os.environ.get("BENCH_SPAWN_TIME") or time.time())
    pid = os.getpid()
    steps = Lines(args.steps_dir / f"{args.label}-g{args.replica_group}-{pid}.jsonl")
    samples = Lines(args.samples_dir / f"{args.label}-g{args.replica_group}-{pid}.jsonl")
    steps.write({"event": "start", "pid": pid, "worker": f"g{args.replica_group}", "spawn": spawn, "t": time.time()})

    dataset = IndexedRepeatedDataset(args.epoch_samples)
    sampler = DistributedSampler(dataset, replica_rank=args.replica_group, num_replica_groups=args.num_replica_groups,
                                 group_rank=0, num_replicas=1, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    model = build_mlp(MODEL_SIZES[args.model])

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        ddp.load_state_dict(state_dict["model"])
        optimizer.load_state_dict(state_dict["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": ddp.state_dict(), "optim": optimizer.state_dict()}

    store = torch.distributed.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False)  # this group's store
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.gloo_timeout_s))  # train_ddp.py's CPU setting: 5 s
    manager = Manager(
        pg=pg, min_replica_size=args.min_replica_size, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"bench_{args.replica_group}", timeout=timedelta(seconds=30),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
        store_addr=LOOPBACK, store_port=store.port, rank=0, world_size=1, lighthouse_addr=args.lighthouse,
        hostname=LOOPBACK,
    )
    ddp = (tolerant_ddp_class() if args.tolerant_comm_hook else DistributedDataParallel)(manager, model)
    optimizer = Optimizer(manager, torch.optim.Adam(ddp.parameters(), lr=LR))
    criterion = nn.CrossEntropyLoss()
    stop_at: int | None = None
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for x, y, index in loader:
            optimizer.zero_grad()  # starts the quorum
            loss = criterion(ddp(x), y)
            loss.backward()  # gradients all-reduced through the Manager (the quorum is waited for here)
            before = manager.current_step()  # a healing group has the source's step by now
            optimizer.step()  # Adam steps only if should_commit()
            step = manager.current_step()
            committed = step > before
            participating = manager.is_participating()
            now = time.time()
            if committed:
                steps.write({"s": step, "t": now, "w": manager.num_participants(), "r": args.replica_group,
                             "q": manager._quorum_id, "n": pg.size(), "p": int(participating)})
            samples.write({"e": epoch, "s": step, "c": int(committed), "p": int(participating), "t": now,
                           "i": index.tolist()})
            if stop_at is None and args.stop_file.exists():
                text = args.stop_file.read_text().strip()
                stop_at = int(text) if text else None
            if leave["asked"] or (stop_at is not None and step >= stop_at):
                steps.close()
                samples.close()
                manager.shutdown(wait=False)
                logging.shutdown()
                os._exit(0)  # skip destructors (bench/workload.py's skip_teardown: gloo teardown can hang)
        epoch += 1


if __name__ == "__main__":
    main()
