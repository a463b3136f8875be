"""Checkpoints of ``strategy="elan_fsdp"`` (issue 24 item 5) with an ordinary user script
(``user_scripts/fsdp_checkpoint_user.py``), through the real ``elan run`` and Lightning's own multi-process launcher.

An ``elan_fsdp`` job of 2 workers writes sharded checkpoints (``state_dict_type="sharded"``: a DCP directory per
checkpoint, Lightning ``ModelParallelStrategy``'s layout); a 3-worker ``elan_fsdp`` job and a 1-worker ``"elan"`` job
resume from one and end where an uninterrupted 2-worker run ends (within 1e-9), each sample once per epoch; Lightning's
``ModelParallelStrategy`` (2 CPU processes, gloo; its ``FSDPStrategy`` refuses the CPU) loads our sharded directory and
our full file; a directory ``ModelParallelStrategy`` wrote loads into an ``elan_fsdp`` job of 3.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.procs import free_port
from tests.integration import fsdp_runs
from tests.integration.fsdp_runs import FsdpRun as Run
from tests.integration.fsdp_runs import assert_ok, elan_command, run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.extended]  # sharded training beyond its CI-tier checks

SCRIPT = Path(__file__).parent / "user_scripts" / "fsdp_checkpoint_user.py"
SAMPLES, TOLERANCE = 96, 1e-9
RUN_TIMEOUT_S = 300.0
"""A run takes under a minute on 2 busy cores; one still going after this long is hung (killed, and it fails)."""
EPOCH_CHECKPOINTS = ["epoch=0-step=8.ckpt", "epoch=1-step=16.ckpt"]


def run_elan(home: Path, strategy: str, nproc: int, batch_size: int, max_epochs: int, resume: Path | None = None,
             schedule: str | None = None, classic: bool = False) -> Run:
    """``elan run`` of the user script to its end."""
    command = [*elan_command(home, home.name, nproc, schedule), "--",
               *_script(home, strategy, batch_size, max_epochs, resume), *(["--classic"] if classic else [])]
    return run_to_end(command, home, RUN_TIMEOUT_S)


def run_plain(home: Path, devices: int, batch_size: int, max_epochs: int, resume: Path | None = None,
              strategy: str = "model_parallel") -> Run:
    """Lightning's own ``ModelParallelStrategy`` over ``devices`` CPU processes (its launcher starts the others)."""
    command = [*_script(home, strategy, batch_size, max_epochs, resume), "--devices", str(devices)]
    env = {**os.environ, "MASTER_PORT": str(free_port()), "ELAN_TEST_HOME": str(home)}
    return run_to_end(command, home, RUN_TIMEOUT_S, env)


def _script(home: Path, strategy: str, batch_size: int, max_epochs: int, resume: Path | None) -> list[str]:
    command = [sys.executable, str(SCRIPT), str(home / "out"), "--strategy", strategy, "--batch-size",
               str(batch_size), "--max-epochs", str(max_epochs)]
    return command + (["--resume", str(resume)] if resume else [])


def assert_each_sample_once(run: Run, epochs: list[int]) -> None:
    fsdp_runs.assert_each_sample_once(run, epochs, SAMPLES)


# ---------------------------------------------------------------------------------------------- reading checkpoints

def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint as ``{"global_step", "model": {name: tensor}, "optimizer": {"<name>/<key>": tensor}}``, whether a
    file or a sharded directory (read whole with torch's public ``dcp_to_torch_save``)."""
    if path.is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = path.parent / f".{path.name}.whole.pt"
        dcp_to_torch_save(path, whole)
        shards = torch.load(whole, weights_only=False)
        whole.unlink()
        checkpoint = {**torch.load(path / "meta.pt", weights_only=False),
                      "state_dict": shards.get("state_dict", shards.get("model")),
                      "optimizer_states": [shards[key] for key in sorted(k for k in shards if k.startswith("optim"))]}
    else:
        checkpoint = torch.load(path, weights_only=False)
    model = {name: value.double() for name, value in checkpoint["state_dict"].items()}
    return {"global_step": checkpoint["global_step"], "model": model,
            "optimizer": _flat_optimizer(checkpoint["optimizer_states"][0], list(model))}


def _flat_optimizer(state: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Adam's state by parameter name (a state keyed by position, as a plain optimizer's, named in model order)."""
    flat = {}
    for key, values in state["state"].items():
        name = names[key] if isinstance(key, int) else key
        flat.update({f"{name}/{field}": torch.as_tensor(value).double() for field, value in values.items()})
    return flat


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    for key, value in expected.items():
        difference = (actual[key] - value).abs().max().item()
        assert difference <= TOLERANCE, f"{key}: max difference {difference:.3e}"


def assert_same_checkpoint(actual: Path, expected: Path) -> None:
    mine, theirs = read_checkpoint(actual), read_checkpoint(expected)
    assert mine["global_step"] == theirs["global_step"]
    assert_close(mine["model"], theirs["model"])
    assert_close(mine["optimizer"], theirs["optimizer"])


def is_sharded_directory(path: Path) -> bool:
    return path.is_dir() and (path / "meta.pt").is_file() and (path / ".metadata").is_file()


# ---------------------------------------------------------------------------------------------- the runs

@pytest.fixture(scope="module")
def static(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The uninterrupted reference: elan_fsdp, 2 workers of batch 6 (global batch 12), 4 epochs, full checkpoints."""
    run = run_elan(tmp_path_factory.mktemp("static"), "elan_fsdp", 2, 6, 4)
    assert_ok(run)
    assert_each_sample_once(run, [0, 1, 2, 3])
    return run


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """2 epochs of the same job written as sharded checkpoints."""
    run = run_elan(tmp_path_factory.mktemp("sharded"), "elan_fsdp_sharded", 2, 6, 2)
    assert_ok(run)
    assert_each_sample_once(run, [0, 1])
    return run


def test_sharded_checkpoints_are_lightning_directories_equal_to_full_ones(static: Run, sharded: Run) -> None:
    """Each epoch's checkpoint is a DCP directory with Lightning's ``meta.pt``, holding the state the full checkpoint
    of the static run holds; ``save_top_k=1`` with ``save_last`` keeps two directories (the best and ``last.ckpt``)."""
    for name in EPOCH_CHECKPOINTS:
        assert is_sharded_directory(sharded.out / "checkpoints" / name), name
        assert (static.out / "checkpoints" / name).is_file()
        assert_same_checkpoint(sharded.out / "checkpoints" / name, static.out / "checkpoints" / name)
    kept = sorted(path.name for path in (sharded.out / "top").iterdir())
    assert len(kept) == 2 and "last.ckpt" in kept, kept
    assert all(is_sharded_directory(sharded.out / "top" / name) for name in kept), kept
    assert read_checkpoint(sharded.out / "top" / "last.ckpt")["global_step"] == 15


@pytest.mark.parametrize(("written", "strategy", "nproc", "batch_size", "classic"),
                         [("sharded", "elan_fsdp_sharded", 3, 4, False), ("sharded", "elan", 1, 12, False),
                          ("sharded", "elan_fsdp_sharded", 3, 4, True), ("full", "elan_fsdp", 3, 4, False)])
def test_resuming_from_a_checkpoint_at_another_world_size(tmp_path: Path, static: Run, sharded: Run, written: str,
                                                          strategy: str, nproc: int, batch_size: int,
                                                          classic: bool) -> None:
    """An elan_fsdp job of 3 workers (``lightning.pytorch`` or ``pytorch_lightning``), or an "elan" job of 1, resumes
    from the 2-worker checkpoint of epoch 1 (sharded, or the default full file; same global batch): epochs 2 and 3
    train each sample once and the job ends where the uninterrupted run ends, its checkpoints equal to that run's."""
    checkpoint = (sharded if written == "sharded" else static).out / "checkpoints" / EPOCH_CHECKPOINTS[1]
    run = run_elan(tmp_path, strategy, nproc, batch_size, 4, resume=checkpoint, classic=classic)

    assert_ok(run)
    assert_each_sample_once(run, [2, 3])
    assert_same_checkpoint(run.out / "final.ckpt", static.out / "final.ckpt")
    for name in ["epoch=2-step=24.ckpt", "epoch=3-step=32.ckpt"]:
        assert_same_checkpoint(run.out / "checkpoints" / name, static.out / "checkpoints" / name)


@pytest.mark.parametrize("written", ["sharded", "full"])
def test_lightning_model_parallel_loads_an_elan_fsdp_checkpoint(tmp_path: Path, static: Run, sharded: Run,
                                                                written: str) -> None:
    """Lightning's ``ModelParallelStrategy`` on 2 processes resumes from our epoch-1 checkpoint (a sharded directory or
    a full file) with nothing left to train: the state it then saves is the checkpoint's, parameters and Adam's."""
    checkpoint = (sharded if written == "sharded" else static).out / "checkpoints" / EPOCH_CHECKPOINTS[1]
    run = run_plain(tmp_path, 2, 6, 2, resume=checkpoint)

    assert_ok(run)
    assert is_sharded_directory(run.out / "final.ckpt")
    assert_same_checkpoint(run.out / "final.ckpt", checkpoint)


def test_a_lightning_model_parallel_checkpoint_loads_into_elan_fsdp(tmp_path: Path) -> None:
    """A sharded directory Lightning's ``ModelParallelStrategy`` wrote on 2 processes: an elan_fsdp job of 3 loads it
    (its state saved untouched when nothing is left to train) and resumes from it exactly as a 2-worker "elan" job does
    (each sample once per epoch, final states within 1e-9)."""
    plain = run_plain(tmp_path / "plain", 2, 6, 2)
    assert_ok(plain)
    written = plain.out / "checkpoints" / EPOCH_CHECKPOINTS[1]
    assert is_sharded_directory(written)

    loaded = run_elan(tmp_path / "loaded", "elan_fsdp", 3, 4, 2, resume=written)
    assert_ok(loaded)
    assert_same_checkpoint(loaded.out / "final.ckpt", written)

    fsdp = run_elan(tmp_path / "fsdp", "elan_fsdp", 3, 4, 4, resume=written)
    ddp = run_elan(tmp_path / "ddp", "elan", 2, 6, 4, resume=written)
    for run in (fsdp, ddp):
        assert_ok(run)
        assert_each_sample_once(run, [2, 3])
    assert_same_checkpoint(fsdp.out / "final.ckpt", ddp.out / "final.ckpt")


def trained_at(run: Run, step: int) -> Counter:
    """The samples the run trained in the batch that made ``step`` (recorded after the step)."""
    counts: Counter = Counter()
    for path in run.out.glob("trained-*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["step"] == step:
                counts.update(record["samples"])
    return counts


def test_sharded_checkpoints_written_across_resizes_and_rank_0_leaving(tmp_path: Path, static: Run) -> None:
    """A sharded 2-worker job grows to 3 after step 3, loses rank 0 after step 9 and migrates a worker after step 12,
    each at a step whose checkpoint (every 3 steps) is written just before the resize, by the members about to change:
    rank 0 writes its part of step 9's and leaves. Every checkpoint is a whole directory equal to the static run's."""
    run = run_elan(tmp_path, "elan_fsdp_sharded", 2, 6, 2, schedule="3:add=1,9:remove=rank:0,12:migrate=1")

    assert_ok(run)
    assert [(a["action"], a["step"], len(a["members"])) for a in run.adjustments()] == [
        ("add", 3, 3), ("remove", 9, 2), ("migrate", 12, 2)], run.adjustments()
    assert_each_sample_once(run, [0, 1])
    steps = sorted(path.name for path in (run.out / "steps").iterdir())
    assert steps == ["step=12.ckpt", "step=15.ckpt", "step=3.ckpt", "step=6.ckpt", "step=9.ckpt"], steps
    for name in [*steps, *EPOCH_CHECKPOINTS]:
        written = run.out / ("steps" if name.startswith("step") else "checkpoints") / name
        assert is_sharded_directory(written), name
        assert_same_checkpoint(written, static.out / written.parent.name / name)
    assert_same_checkpoint(run.out / "final.ckpt", static.out / "checkpoints" / EPOCH_CHECKPOINTS[1])
    assert read_checkpoint(run.out / "top" / "last.ckpt")["global_step"] == 15


def test_resuming_mid_epoch_from_a_sharded_checkpoint_at_another_world_size(tmp_path: Path, static: Run,
                                                                           sharded: Run) -> None:
    """``last.ckpt`` of the sharded 2-worker job (step 15, one batch before the end of epoch 1) resumed by 3 workers:
    the rest of epoch 1 is exactly the uninterrupted run's last batch, epochs 2 and 3 train each sample once, and
    the job ends where the uninterrupted run ends."""
    run = run_elan(tmp_path, "elan_fsdp_sharded", 3, 4, 4, resume=sharded.out / "top" / "last.ckpt")

    assert_ok(run)
    seen = run.samples_per_epoch()
    assert sorted(seen) == [1, 2, 3], sorted(seen)
    assert seen[1] == trained_at(static, 16)
    assert seen[2] == seen[3] == Counter(range(SAMPLES))
    assert_same_checkpoint(run.out / "final.ckpt", static.out / "final.ckpt")


def test_a_lightning_model_parallel_full_file_loads_into_elan_fsdp_and_elan(tmp_path: Path) -> None:
    """``ModelParallelStrategy(save_distributed_checkpoint=False)`` writes one file whose optimizer state is keyed by
    parameter position: an elan_fsdp job of 3 and an "elan" job of 1 load it (parameters and Adam's states)."""
    plain = run_plain(tmp_path / "plain", 2, 6, 2, strategy="model_parallel_full")
    assert_ok(plain)
    written = plain.out / "checkpoints" / EPOCH_CHECKPOINTS[1]
    assert written.is_file()
    assert isinstance(next(iter(torch.load(written, weights_only=False)["optimizer_states"][0]["state"])), int)

    for strategy, nproc, batch_size in [("elan_fsdp", 3, 4), ("elan", 1, 12)]:
        loaded = run_elan(tmp_path / strategy, strategy, nproc, batch_size, 2, resume=written)
        assert_ok(loaded)
        assert_same_checkpoint(loaded.out / "final.ckpt", written)


def test_sharded_checkpoints_of_an_hsdp_job_and_resuming_one_as_hsdp(tmp_path: Path, static: Run, sharded: Run) -> None:
    """``hsdp_group_size=2``: a sharded 2-worker job grows to 4 after step 3 (HSDP: each shard on two replicas) and
    shrinks to 2 after step 9; the checkpoints of steps 6 and 9, written in the HSDP layout (DCP keeps one copy of a
    replicated shard), are whole directories equal to the static run's. Then the FSDP job's ``last.ckpt`` (step 15)
    resumed by 4 workers in the HSDP layout ends where the uninterrupted run ends."""
    run = run_elan(tmp_path / "grown", "elan_hsdp_sharded", 2, 6, 2, schedule="3:add=2,9:remove=2")

    assert_ok(run)
    assert [(a["action"], a["step"], len(a["members"])) for a in run.adjustments()] == [
        ("add", 3, 4), ("remove", 9, 2)], run.adjustments()
    assert_each_sample_once(run, [0, 1])
    for name in ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt", "step=12.ckpt"]:
        assert is_sharded_directory(run.out / "steps" / name), name
        assert_same_checkpoint(run.out / "steps" / name, static.out / "steps" / name)

    resumed = run_elan(tmp_path / "resumed", "elan_hsdp_sharded", 4, 3, 4, resume=sharded.out / "top" / "last.ckpt")
    assert_ok(resumed)
    assert resumed.samples_per_epoch()[2] == Counter(range(SAMPLES))
    assert_same_checkpoint(resumed.out / "final.ckpt", static.out / "final.ckpt")
