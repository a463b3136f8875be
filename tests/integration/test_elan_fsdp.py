"""``strategy="elan_fsdp"`` (issue 24) as a user runs it: ``user_scripts/fsdp_mlp.py`` (a float64 MLP of Linear
blocks, Adam, a dataset returning indices, ``ModelCheckpoint`` every 3 steps) through the real ``elan run``.

The static 2-worker ``elan_fsdp`` run, with the whole model one FSDP2 unit and with each block a unit, equals the static
``elan`` (DDP) run within 1e-9: the final parameters and Adam's states, and every checkpoint's (a full state written by
rank 0), with each sample trained once per epoch.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration import fsdp_runs
from tests.integration.fsdp_runs import FsdpRun, assert_ok, elan_command, run_to_end

__all__ = ["FsdpRun", "assert_each_sample_once", "assert_ok", "assert_states_close", "run_fsdp_job"]

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "user_scripts" / "fsdp_mlp.py"
SAMPLES, EPOCHS = 96, 2
TOLERANCE = 1e-9
RUN_TIMEOUT_S = 240.0
"""A run takes about 50 s on 2 busy cores; one still going after this long is hung (killed, and it fails)."""


def run_fsdp_job(home: Path, name: str, *script_args: str, nproc: int = 2, schedule: str | None = None,
                 launcher: tuple[str, ...] = ()) -> FsdpRun:
    """``elan run`` of the script to its end (killed with everything it started after ``RUN_TIMEOUT_S``);
    ``launcher``: more options of ``elan run``."""
    command = elan_command(home, name, nproc, schedule, launcher)
    return run_to_end([*command, "--", sys.executable, str(SCRIPT), str(home / "out"), *script_args], home,
                      RUN_TIMEOUT_S)


def assert_each_sample_once(run: FsdpRun) -> None:
    fsdp_runs.assert_each_sample_once(run, list(range(EPOCHS)), SAMPLES)


def assert_states_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys(), sorted(actual.keys() ^ expected.keys())
    for key, value in expected.items():
        difference = (torch.as_tensor(actual[key]).double() - torch.as_tensor(value).double()).abs().max().item()
        assert difference <= TOLERANCE, f"{key}: max difference {difference:.3e}"


def assert_checkpoints_alike(run: FsdpRun, static: FsdpRun) -> None:
    """The same files, each a full model state equal to the static run's (within 1e-9), and its step."""
    mine, theirs = run.checkpoints(), static.checkpoints()
    assert sorted(mine) == sorted(theirs) == ["step=12.ckpt", "step=15.ckpt", "step=3.ckpt", "step=6.ckpt",
                                              "step=9.ckpt"]
    for name, checkpoint in mine.items():
        assert checkpoint["global_step"] == theirs[name]["global_step"]
        assert all(isinstance(value, torch.Tensor) and type(value) is torch.Tensor
                   for value in checkpoint["state_dict"].values()), f"{name}: not a plain full state"
        assert_states_close(checkpoint["state_dict"], theirs[name]["state_dict"])


@pytest.fixture(scope="module")
def static_ddp(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    run = run_fsdp_job(tmp_path_factory.mktemp("static-elan"), "fsdpddp", "--strategy", "elan")
    assert_ok(run)
    assert_each_sample_once(run)
    return run


@pytest.mark.parametrize("units", ["whole", "blocks"])
def test_static_elan_fsdp_equals_static_elan(tmp_path: Path, static_ddp: FsdpRun, units: str) -> None:
    """2 workers, no resize: FSDP2 (one unit, or each block a unit) computes what the elastic DDP computes."""
    run = run_fsdp_job(tmp_path, f"fsdp{units}", *(["--shard-blocks"] if units == "blocks" else []))

    assert_ok(run)
    assert not run.adjustments()
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_ddp.final_state())
    assert_checkpoints_alike(run, static_ddp)


SCHEDULE = "3:add=1,6:remove=rank:0,9:migrate=1"


def static_fsdp_run(tmp_path_factory: pytest.TempPathFactory, name: str) -> FsdpRun:
    """The static 2-worker ``elan_fsdp`` run every elastic run of the script must equal (each file's fixture)."""
    run = run_fsdp_job(tmp_path_factory.mktemp("static-fsdp"), name)
    assert_ok(run)
    assert_each_sample_once(run)
    return run


@pytest.fixture(scope="module")
def static_fsdp(tmp_path_factory: pytest.TempPathFactory) -> FsdpRun:
    return static_fsdp_run(tmp_path_factory, "fsdpstatic")


@pytest.mark.parametrize("units", ["whole", "blocks"])
def test_elastic_elan_fsdp_equals_the_static_run(tmp_path: Path, static_fsdp: FsdpRun, units: str) -> None:
    """2 workers grow to 3 at step 3, rank 0 leaves at 6, one worker migrates at 9: each resize reshards live (the
    joiners receive only their shards), and the job computes what the static 2-worker elan_fsdp run computes.

    ``blocks``: each block a unit, and the steps call the network itself (``self.net(x)``, as most modules do) rather
    than ``self(x)``: before ea5c1b1 the first training step failed with ``aten.addmm.default got mixed torch.Tensor
    and DTensor`` (the step ran outside the root unit's call, the root's parameters still sharded); after the fit the
    members validate, test and predict (``--evaluate``)."""
    options = ["--shard-blocks", "--net-in-step", "--evaluate"] if units == "blocks" else []
    run = run_fsdp_job(tmp_path, f"fsdpel{units}", *options, schedule=SCHEDULE)

    assert_ok(run)
    assert [(a["action"], len(a["members"])) for a in run.adjustments()] == [("add", 3), ("remove", 2),
                                                                            ("migrate", 2)], run.adjustments()
    # every participant of each resize resharded: w0, w1, w2 at the add and the removal, w1, w2, w3 at the migration
    assert run.output.count("resharded live") == 9, run.excerpt()
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static_fsdp.final_state())
    assert_checkpoints_alike(run, static_fsdp)
    if units == "blocks":
        assert_evaluated_with(run, static_fsdp.final_state())


def assert_evaluated_with(run: FsdpRun, final: dict[str, torch.Tensor]) -> None:
    """``--evaluate``'s validate, test and predict ran on the members after the resizes: the logged MSEs and every
    sample's prediction (each predicted once) are the static run's final model's, within 1e-9."""
    user = _user_script()
    net = user.network()
    net.load_state_dict({name.removeprefix("net."): value for name, value in final.items() if name.startswith("net.")})
    data = user.Indexed()
    with torch.no_grad():
        expected = net(data.x)
    mse = torch.nn.functional.mse_loss(expected, data.y).item()
    logged = json.loads((run.out / "evaluation.json").read_text())
    assert abs(logged["val_mse"] - mse) <= TOLERANCE and abs(logged["test_mse"] - mse) <= TOLERANCE, (logged, mse)
    parts = [torch.load(path) for path in run.out.glob("predicted-*.pt")]
    indices = torch.cat([part["indices"] for part in parts])
    assert sorted(indices.tolist()) == list(range(SAMPLES)), sorted(indices.tolist())
    outputs = torch.cat([part["outputs"] for part in parts])
    assert (outputs - expected[indices]).abs().max().item() <= TOLERANCE


def _user_script() -> Any:
    spec = importlib.util.spec_from_file_location("fsdp_mlp_user", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_joiner_builds_its_module_on_the_meta_device(tmp_path: Path) -> None:
    """The network built in ``configure_model``: on the launch workers whole, on each joiner on the meta device (it
    holds nothing but the shard it receives); the elastic run equals the static one within 1e-9."""
    static = run_fsdp_job(tmp_path / "static", "fsdpcmstatic", "--configure-model")
    run = run_fsdp_job(tmp_path / "elastic", "fsdpcm", "--configure-model", schedule=SCHEDULE)

    assert_ok(static)
    assert_ok(run)
    built = [json.loads(path.read_text())["meta"] for path in run.out.glob("built-*.json")]
    assert sorted(built) == [False, False, True, True], built  # 2 launch workers, 2 joiners
    assert_each_sample_once(run)
    assert_states_close(run.final_state(), static.final_state())
    assert_checkpoints_alike(run, static)
