"""The elastic engine without a Trainer: a real AM, a real TCPStore and real worker processes on one gloo group.

The workers run ``engine_worker.py`` (a plain torch loop as the front-end). Two members start, a joiner is added and
then rank 0 is removed while they train; every sample is used once per epoch, all workers hold bit-identical
parameters and optimizer state at every step, the result equals a static one-process run, and the store keeps no key
of a finished adjustment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_elan.master import ApplicationMaster, FileStore
from lightning_elan.protocol.client import AMClient
from lightning_elan.protocol.contract import WorkerEnvironment

sys.path.insert(0, str(Path(__file__).parent))
import engine_worker

WORKER_SCRIPT = Path(__file__).with_name("engine_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def job(tmp_path):
    am = ApplicationMaster("engine", FileStore(tmp_path / "state.json"), state_dir=tmp_path, register=False).start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = AMClient(am.address, "engine", timeout_s=5.0)
    yield am, store, client
    client.close()
    am.stop()


def _spawn(tmp_path: Path, environment: WorkerEnvironment) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / f"{environment.worker_id}.json"
    env = {**os.environ, **environment.to_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    log = open(tmp_path / f"{environment.worker_id}.log", "w")
    return subprocess.Popen([sys.executable, str(WORKER_SCRIPT), str(out)], env=env, stdout=log, stderr=log), out


def _environment(am: ApplicationMaster, store: dist.TCPStore, worker_id: str, role: str, rank: int = -1,
                 world_size: int = 0) -> WorkerEnvironment:
    return WorkerEnvironment.launched(job="engine", worker_id=worker_id, role=role, am_address=am.address,
                                      store_address=f"127.0.0.1:{store.port}", coordinate_every=1, rank=rank,
                                      world_size=world_size)


def _static_run() -> list[list[float]]:
    """The same training in one process: each global batch of the epoch order, one mean loss, one SGD step."""
    x, y = engine_worker.dataset()
    model, optimizer = engine_worker.new_model()
    steps_per_epoch = engine_worker.SAMPLES // engine_worker.GLOBAL_BATCH
    for step in range(engine_worker.STEPS):
        epoch, position = divmod(step, steps_per_epoch)
        start = position * engine_worker.GLOBAL_BATCH
        indices = engine_worker.epoch_order(epoch)[start : start + engine_worker.GLOBAL_BATCH]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x[indices]).squeeze(1), y[indices]).backward()
        optimizer.step()
    return [p.detach().flatten().tolist() for p in model.parameters()]


@pytest.mark.integration  # real processes: kept out of the fast `-m "not integration"` run
def test_members_grow_and_lose_rank0_without_a_trainer(job, tmp_path):
    am, store, client = job
    client.request("start_job", {"nproc": 2, "coordinate_every": 1})
    joiner = client.scale("add", count=1, at_step=3)["new_workers"][0]
    client.scale("remove", ranks=[0], at_step=20)
    processes = [
        _spawn(tmp_path, _environment(am, store, "w0", "member", 0, 2)),
        _spawn(tmp_path, _environment(am, store, "w1", "member", 1, 2)),
        _spawn(tmp_path, _environment(am, store, joiner, "joiner")),
    ]
    for process, _ in processes:
        assert process.wait(timeout=180) == 0, (tmp_path / "w0.log").read_text()[-3000:]
    results = {r["worker"]: r for r in (json.loads(out.read_text()) for _, out in processes)}

    assert {w: r["outcome"] for w, r in results.items()} == {"w0": "left", "w1": "finished", joiner: "finished"}
    assert results["w1"]["resizes"] == [[1, 1, 3], [1, 0, 2]]
    assert results[joiner]["resizes"] == [[None, 2, 3], [2, 1, 2]]
    _assert_exactly_once_per_epoch(results.values())
    _assert_bit_identical_at_every_step(results.values())
    static = _static_run()
    for worker in ("w1", joiner):
        for mine, reference in zip(results[worker]["params"], static, strict=True):
            assert max(abs(a - b) for a, b in zip(mine, reference, strict=True)) < 1e-9
    leftovers = [key for key in store.list_keys() if key.startswith(("elan/gen0/", "elan/gen1/"))]
    assert leftovers == []


def _assert_exactly_once_per_epoch(results) -> None:
    epochs = engine_worker.STEPS * engine_worker.GLOBAL_BATCH // engine_worker.SAMPLES
    for epoch in range(epochs):
        used = sorted(i for r in results for i in r["consumed"].get(str(epoch), []))
        assert used == list(range(engine_worker.SAMPLES)), f"epoch {epoch}"


def _assert_bit_identical_at_every_step(results) -> None:
    by_step: dict[int, set[str]] = {}
    for r in results:
        for step, digest in r["digests"]:
            by_step.setdefault(step, set()).add(digest)
    assert sorted(by_step) == list(range(1, engine_worker.STEPS + 1))
    assert all(len(digests) == 1 for digests in by_step.values())


def test_the_engine_imports_no_training_framework():
    code = "import sys, lightning_elan.elastic; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('lightning', 'pytorch_lightning', 'accelerate')))"
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert output.stdout.strip() == "[]"
