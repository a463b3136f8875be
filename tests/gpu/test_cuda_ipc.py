"""Two processes on one GPU replicate a state through CUDA IPC (and through shared memory), bit-equal."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from state_gen import mixed_state

from lightning_elan.protocol.contract import ENV_NO_CUDA_EXT
from lightning_elan.replication.cuda import loader
from lightning_elan.replication.transports import Channel, transport_for

pytestmark = pytest.mark.gpu
TIMEOUT = datetime.timedelta(seconds=120)
CTX = mp.get_context("spawn")
NAMES = {"ipc": "cuda_ipc", "shm": "shm"}


def cpu_state() -> dict:
    return {"step": 42, "rng": torch.Generator().manual_seed(3).get_state(), "sampler": {"position": 96}}


def _source(port: int, prefix: str, transport: str, seed: int, receivers: int, no_ext: bool, out: str) -> None:
    if no_ext:
        os.environ[ENV_NO_CUDA_EXT] = "1"
    torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=TIMEOUT)
    tensors = mixed_state(seed)
    source = transport_for(NAMES[transport], Channel(store, prefix, TIMEOUT, torch.device("cuda", 0)))
    sent = source.send(cpu_state(), tensors, receivers)
    source.disallow()
    source.shutdown()
    Path(out).write_bytes(pickle.dumps({"sent": sent, "kind": loader.status()}))


def on_gpu(_: str) -> torch.device:
    return torch.device("cuda", 0)


def receive(store: dist.TCPStore, prefix: str, transport: str) -> tuple[dict, list[torch.Tensor], int]:
    channel = Channel(store, prefix, TIMEOUT, torch.device("cuda", 0))
    got = transport_for(NAMES[transport], channel).receive(0, on_gpu)
    return got.cpu_state, got.tensors, got.nbytes


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)


@pytest.mark.parametrize("transport", ["ipc", "shm"])
@pytest.mark.parametrize("no_ext", [True, False], ids=["torch", "ext"])
def test_two_processes_on_one_gpu_end_bit_equal(
    store: dist.TCPStore, tmp_path: Path, transport: str, no_ext: bool, request: pytest.FixtureRequest
) -> None:
    if not no_ext:
        request.getfixturevalue("ext")  # built and loadable here, so the child finds it too
    seed = 5 + no_ext
    source = CTX.Process(target=_source, args=(store.port, "x", transport, seed, 1, no_ext, str(tmp_path / "src")))
    source.start()
    try:
        state, tensors, received = receive(store, "x", transport)
    finally:
        source.join(120)
    assert source.exitcode == 0

    want = mixed_state(seed)
    assert len(tensors) == len(want)
    for got, expected in zip(tensors, want, strict=True):
        assert got.is_cuda and (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape))
        assert torch.equal(raw(got), raw(expected))
    assert state["step"] == 42 and torch.equal(state["rng"], cpu_state()["rng"])
    assert received == pickle.loads((tmp_path / "src").read_bytes())["sent"]
