"""Multi-process tests of the collective transport (``CollectiveTransport``) over a real TCPStore and Gloo.

The test process hosts the TCPStore (127.0.0.1, a free port chosen by the OS); the workers are
separate Python processes running this file as a script. Each worker writes its result (full
state, digest, timings, whether a default process group exists) to a file under ``tmp_path``;
destinations also publish their digest in the store.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import os
import pickle
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # when run as a worker script
    sys.path.insert(0, str(REPO_ROOT))

from lightning_elan.replication import packing  # noqa: E402
from lightning_elan.replication.packing import join_tensors, split_tensors  # noqa: E402
from lightning_elan.replication.transports import Channel, CollectiveTransport  # noqa: E402
from lightning_elan.replication.transports import collective as collective_module  # noqa: E402

pytestmark = pytest.mark.integration

STORE_TIMEOUT = datetime.timedelta(seconds=60)
JOIN_TIMEOUT_S = 180.0


# ---------------------------------------------------------------------------------------------
# state shared by the source and the tests
# ---------------------------------------------------------------------------------------------


def build_trained(seed: int, steps: int = 3) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        train_step(model, optimizer, torch.Generator().manual_seed(seed + 1000))
    return model, optimizer


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, gen: torch.Generator) -> None:
    optimizer.zero_grad()
    x = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    model(x).pow(2).mean().backward()
    optimizer.step()


def make_state(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, payload_numel: int) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": 2,
        "global_step": 3,
        "seed": seed,
        "name": f"source-{seed}",
        "nothing": None,
        "shape": (6, 16, 4),
        "positions": [0, 64, 128],
        "sampler": {"epoch": 2, "position": 192, "rng": torch.Generator().manual_seed(seed).get_state()},
        "payload": torch.randn(payload_numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64),
    }


def state_digest(state: Any) -> str:
    """sha256 over the skeleton and every tensor's dtype, shape and bytes."""
    skeleton, tensors = split_tensors(state)
    h = hashlib.sha256(pickle.dumps(skeleton, protocol=4))
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8), b.reshape(-1).contiguous().view(torch.uint8))


def assert_same_state(expected: Any, actual: Any, path: str = "root") -> None:
    assert type(actual) is type(expected), f"{path}: {type(actual)} != {type(expected)}"
    if isinstance(expected, torch.Tensor):
        assert bit_equal(expected, actual), f"{path}: tensors differ"
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), f"{path}: keys differ"
        for key in expected:
            assert_same_state(expected[key], actual[key], f"{path}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length differs"
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            assert_same_state(e, a, f"{path}[{i}]")
    else:
        assert actual == expected, f"{path}: {actual!r} != {expected!r}"


# ---------------------------------------------------------------------------------------------
# worker side (this file run as a script)
# ---------------------------------------------------------------------------------------------


def _store_arrive(store: dist.Store, name: str, count: int) -> None:
    if store.add(f"{name}/count", 1) == count:
        store.set(f"{name}/go", b"1")


def _store_barrier(store: dist.Store, name: str, count: int) -> None:
    _store_arrive(store, name, count)
    store.wait([f"{name}/go"])


def _poison_receive_buffers() -> None:
    """Receive buffers start as 0xFF bytes (NaN / -1 / True), so any byte not received shows."""
    real = packing.empty_buffers

    def poisoned(layout: packing.PackedLayout, device_for: Any) -> dict[str, torch.Tensor]:
        buffers = real(layout, device_for)
        for buf in buffers.values():
            buf.view(torch.uint8).fill_(0xFF)
        return buffers

    collective_module.empty_buffers = poisoned


def _run_source(store: dist.Store, args: dict[str, Any]) -> dict[str, Any]:
    model, optimizer = build_trained(args["seed"])
    state = make_state(model, optimizer, args["seed"], args["payload_numel"])
    skeleton, tensors = split_tensors(state)
    _store_barrier(store, args["barrier"], args["n_procs"])
    t0 = time.time()
    source = CollectiveTransport(Channel(store, args["prefix"], STORE_TIMEOUT))
    nbytes = source.send(skeleton, tensors, readers=args["size"] - 1)
    t1 = time.time()
    source.disallow()  # every destination has its copy
    source.shutdown()  # the channel's keys are deleted
    sent = copy.deepcopy(state)  # before the next step changes the live tensors
    train_step(model, optimizer, torch.Generator().manual_seed(7))
    return {
        "state": sent,
        "digest": state_digest(sent),
        "nbytes": nbytes,
        "after": model.state_dict(),
        "seconds": t1 - t0,
    }


def _run_destination(store: dist.Store, args: dict[str, Any]) -> dict[str, Any]:
    _poison_receive_buffers()
    _store_barrier(store, args["barrier"], args["n_procs"])
    t0 = time.time()
    channel = Channel(store, args["prefix"], STORE_TIMEOUT)
    got = CollectiveTransport(channel).receive(args["rank"] - 1, lambda _: torch.device("cpu"))
    cpu_state, tensors, nbytes = got.cpu_state, got.tensors, got.nbytes
    t1 = time.time()
    state = join_tensors(cpu_state, tensors)
    digest = state_digest(state)
    store.set(f"results/{args['prefix']}/{args['rank']}", digest)
    result = {"state": copy.deepcopy(state), "digest": digest, "nbytes": nbytes, "seconds": t1 - t0}
    try:  # reported, not raised: the test compares digests first, which says more
        result["after"] = _next_step_from(state, args["seed"])
    except Exception:
        result["after_error"] = traceback.format_exc()
    return result


def _next_step_from(state: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Load the received state into fresh objects and take the step the source takes."""
    model, optimizer = build_trained(seed=seed + 99, steps=1)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    train_step(model, optimizer, torch.Generator().manual_seed(7))
    return model.state_dict()


def worker_main(args: dict[str, Any]) -> None:
    out = Path(args["out"])
    end_barrier = args["barrier"] + "/end"
    store = dist.TCPStore("127.0.0.1", args["port"], is_master=False, timeout=STORE_TIMEOUT)
    try:
        run = _run_source if args["rank"] == 0 else _run_destination
        result = run(store, args)
    except BaseException:
        out.with_suffix(".err").write_text(traceback.format_exc())
        _store_arrive(store, end_barrier, args["n_procs"])  # do not keep the others waiting
        raise
    _store_barrier(store, end_barrier, args["n_procs"])  # all groups alive at the same time
    result["default_pg_initialized"] = dist.is_initialized()
    result["pid"] = os.getpid()
    torch.save(result, out)


# ---------------------------------------------------------------------------------------------
# test side
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def tcp_store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def _spawn(args: dict[str, Any], tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the store is on 127.0.0.1: keep Gloo there too
    env["OMP_NUM_THREADS"] = "1"
    with open(tmp_path / f"{Path(args['out']).stem}.log", "wb") as log:  # the child keeps its own fd
        return subprocess.Popen(
            [sys.executable, __file__, json.dumps(args)], stdout=log, stderr=subprocess.STDOUT, env=env
        )


def _run_transfers(
    store: dist.TCPStore, tmp_path: Path, transfers: list[tuple[str, int, int]], payload_numel: int
) -> dict[tuple[str, int], dict[str, Any]]:
    """Start every (prefix, seed, size) transfer at once; return results keyed by (prefix, rank)."""
    n_procs = sum(size for _, _, size in transfers)
    procs: dict[tuple[str, int], tuple[subprocess.Popen, Path]] = {}
    for prefix, seed, size in transfers:
        for rank in range(size):
            out = tmp_path / f"{prefix.replace('/', '_')}_rank{rank}.pt"
            args = {
                "port": store.port,
                "prefix": prefix,
                "rank": rank,
                "size": size,
                "seed": seed,
                "payload_numel": payload_numel,
                "n_procs": n_procs,
                "barrier": "test/barrier",
                "out": str(out),
            }
            procs[(prefix, rank)] = (_spawn(args, tmp_path), out)
    _wait_all(procs, tmp_path)
    return {key: torch.load(out, weights_only=False) for key, (_, out) in procs.items()}


def _wait_all(procs: dict[tuple[str, int], tuple[subprocess.Popen, Path]], tmp_path: Path) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    failures = []
    for key, (proc, out) in procs.items():
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            err = out.with_suffix(".err")
            detail = err.read_text() if err.exists() else (tmp_path / f"{out.stem}.log").read_text()
            failures.append(f"{key} exited {proc.returncode}:\n{detail}")
    for proc, _ in procs.values():  # never leave a worker behind
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not failures, "\n".join(failures)


def _check_transfer(store: dist.TCPStore, results: dict, prefix: str, size: int) -> None:
    source = results[(prefix, 0)]
    assert source["nbytes"] > 0
    for rank in range(1, size):
        dest = results[(prefix, rank)]
        assert dest["nbytes"] == source["nbytes"]
        assert dest["digest"] == source["digest"]
        assert store.get(f"results/{prefix}/{rank}").decode() == source["digest"]
        assert_same_state(source["state"], dest["state"])
        assert "after_error" not in dest, dest.get("after_error")
        assert_same_state(source["after"], dest["after"])  # same next step from the received state
    for result in (results[(prefix, r)] for r in range(size)):
        assert result["default_pg_initialized"] is False
    assert [key for key in store.list_keys() if key.startswith(f"{prefix}/")] == []  # the source deleted them


def test_one_source_two_destinations(tcp_store: dist.TCPStore, tmp_path: Path) -> None:
    results = _run_transfers(tcp_store, tmp_path, [("job/gen1/transfer0", 11, 3)], payload_numel=1000)
    _check_transfer(tcp_store, results, "job/gen1/transfer0", 3)

    source_state = results[("job/gen1/transfer0", 0)]["state"]
    assert source_state["model"]["1.running_mean"].dtype == torch.float64
    assert source_state["model"]["1.num_batches_tracked"].item() == 3
    assert source_state["optimizer"]["state"][0]["exp_avg"].abs().sum() > 0
    dest_state = results[("job/gen1/transfer0", 1)]["state"]
    assert dest_state["name"] == "source-11" and dest_state["nothing"] is None
    assert dest_state["shape"] == (6, 16, 4) and dest_state["positions"] == [0, 64, 128]
    assert not torch.isnan(dest_state["payload"]).any()


def test_two_concurrent_transfers_from_two_sources(tcp_store: dist.TCPStore, tmp_path: Path) -> None:
    transfers = [("job/gen2/transfer0", 21, 2), ("job/gen2/transfer1", 22, 2)]
    results = _run_transfers(tcp_store, tmp_path, transfers, payload_numel=1_000_000)  # 8 MB each
    for prefix, _, size in transfers:
        _check_transfer(tcp_store, results, prefix, size)

    a, b = (results[(prefix, 1)] for prefix, _, _ in transfers)
    assert a["state"]["seed"] == 21 and b["state"]["seed"] == 22  # no cross-talk between groups
    assert a["digest"] != b["digest"]
    # four processes; both groups were built after a common start barrier and were kept alive
    # until a common end barrier, so the two groups existed (and transferred) at the same time
    assert len({r["pid"] for r in results.values()}) == 4


if __name__ == "__main__":
    worker_main(json.loads(sys.argv[1]))
