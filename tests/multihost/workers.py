"""What the multi-host tests run inside a fake host: ``python -m tests.multihost.workers ROLE JSON_ARGS``.

Each role writes one JSON document (its result) to ``args["out"]``, or the traceback to ``args["out"] + ".err"``.
Roles: ``topology`` (``replication.topology.detect()``, no torch), ``allreduce`` (a plain torch.distributed gloo
all-reduce, ``GLOO_SOCKET_IFNAME`` from ``interface_towards`` the first host), ``source`` / ``joiner`` (one adjustment
plan's replication through ``replication.exchange``, the code path a joiner uses; the interface from
``bind_transfer_interface``, as a worker's start-up sets it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

TIMEOUT = datetime.timedelta(seconds=30)


def run_topology(args: dict[str, Any]) -> dict[str, Any]:
    from lightning_elan.replication.topology import detect

    return detect().to_dict()


def run_allreduce(args: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from lightning_elan.replication.iface import interface_towards

    ifname = interface_towards(args["master"])
    if ifname is None:
        raise RuntimeError(f"no interface towards {args['master']}")
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    rank, world = args["rank"], args["world_size"]
    dist.init_process_group("gloo", init_method=f"tcp://{args['master']}:{args['port']}", rank=rank,
                            world_size=world, timeout=TIMEOUT)
    try:
        value = torch.full((4,), float(rank + 1), dtype=torch.float64)
        dist.all_reduce(value)
        return {"sum": value.tolist(), "ifname": ifname, "hostname": socket.gethostname()}
    finally:
        dist.destroy_process_group()


def payload(seed: int, numel: int) -> tuple[dict[str, Any], list[Any]]:
    """The state a source sends: float64 tensors (one with NaN, infinities and a negative zero), an int tensor and
    CPU-side values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 5e-324], dtype=torch.float64)
    tensors = [torch.randn(numel, generator=g, dtype=torch.float64), special,
               torch.randn(7, 3, generator=g, dtype=torch.float64), torch.randint(-9, 9, (11,), generator=g)]
    return {"step": seed, "position": 64 * seed, "name": f"state-{seed}"}, tensors


def digest(cpu_state: Any, tensors: list[Any]) -> str:
    """sha256 over the CPU state's JSON and every tensor's dtype, shape and raw bytes (bit-exact)."""
    import torch

    h = hashlib.sha256(json.dumps(cpu_state, sort_keys=True).encode())
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _context(args: dict[str, Any], is_master: bool) -> Any:
    import torch
    import torch.distributed as dist

    from lightning_elan.replication.exchange import ReplicationContext

    store = dist.TCPStore(args["store_host"], args["store_port"], is_master=is_master, timeout=TIMEOUT,
                          wait_for_workers=False)
    return ReplicationContext(store, "elan/gen1/transfer", "gloo", TIMEOUT, torch.device("cpu"))


def _bind() -> str | None:
    from lightning_elan.replication.iface import bind_transfer_interface

    return bind_transfer_interface()


def run_source(args: dict[str, Any]) -> dict[str, Any]:
    from lightning_elan.protocol.contract import AdjustmentPlan
    from lightning_elan.replication.exchange import send_replica

    ifname = _bind()
    context = _context(args, is_master=True)
    plan = AdjustmentPlan.from_dict(args["plan"])
    cpu_state, tensors = payload(args["seed"], args["numel"])
    outgoing = send_replica(context, plan, args["worker"], cpu_state, tensors)
    outgoing.finish(TIMEOUT)  # every joiner acknowledged; the channel's keys are deleted
    context.store.wait(["test/done"], TIMEOUT)  # keep the store up until the joiner has read what it needs
    return {"digest": digest(cpu_state, tensors), "bytes_sent": outgoing.bytes_sent, "ifname": ifname,
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "hostname": socket.gethostname()}


def run_joiner(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    from lightning_elan.protocol.contract import AdjustmentPlan
    from lightning_elan.replication.exchange import receive_replica

    ifname = _bind()
    context = _context(args, is_master=False)
    plan = AdjustmentPlan.from_dict(args["plan"])
    received, route = receive_replica(context, plan, args["worker"], lambda _: torch.device("cpu"))
    cpu_state, tensors, nbytes = received.cpu_state, received.tensors, received.nbytes
    context.store.set("test/done", b"1")
    return {"digest": digest(cpu_state, tensors), "bytes_received": nbytes, "route": route, "ifname": ifname,
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "hostname": socket.gethostname()}


ROLES = {"topology": run_topology, "allreduce": run_allreduce, "source": run_source, "joiner": run_joiner}


def main(argv: list[str]) -> int:
    role, args = argv[0], json.loads(argv[1])
    out = Path(args["out"])
    try:
        result = ROLES[role](args)
    except BaseException:
        out.with_name(out.name + ".err").write_text(traceback.format_exc())
        return 1
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
