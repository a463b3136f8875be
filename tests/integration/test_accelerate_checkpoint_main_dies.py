"""The main process SIGKILLed right before its ``save_state`` after an epoch (user loop
``accelerate_checkpoint_main_dies_loop.py``, the real `elan run --nproc 2`): the survivor, which made the same call as
process 1, wrote only its RNG state, and recovered at its next collective as the new main process. Before, that epoch's
checkpoint directory held nothing else (no model.safetensors, optimizer.bin, elan_state.json: ``load_state`` of it
fails), with exit 0 and no word of it (probe round 6). Now the new main process writes the checkpoint again in its
recovery (no step was applied since), equal to the static run's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.integration.elastic_runs import RunResult, elan_env

pytestmark = pytest.mark.integration

LOOP = Path(__file__).with_name("accelerate_checkpoint_main_dies_loop.py")


def elan_run(tmp: Path, name: str, *loop_args: str) -> RunResult:
    command = [sys.executable, "-m", "lightning_elan.cli", "run", "--nproc", "2", "--job", name,
               "--coordinate-every", "1", "--state-dir", str(tmp / f"{name}-state"), "--", sys.executable, str(LOOP),
               str(tmp / name), *loop_args]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=420, env=elan_env(tmp))
    output = proc.stdout + proc.stderr
    (tmp / f"{name}.log").write_text(output)
    return RunResult(tmp / name, tmp / f"{name}-state", proc.returncode, output)


def test_the_new_main_process_writes_the_checkpoint_the_dead_one_did_not(tmp_path: Path) -> None:
    static = elan_run(tmp_path, "static")
    assert static.returncode == 0, static.excerpt()
    run = elan_run(tmp_path, "died", "1")
    assert run.returncode == 0, run.excerpt()
    assert "w0 (pid" in run.output and "killed by SIGKILL" in run.output, run.excerpt()
    assert "the main process died before it wrote save_state's checkpoint" in run.output, run.excerpt()
    for epoch in range(3):
        expected, actual = static.out / f"state-{epoch}", run.out / f"state-{epoch}"
        for name in ("model.safetensors", "optimizer.bin", "elan_state.json"):
            assert (actual / name).exists(), (epoch, sorted(path.name for path in actual.iterdir()))
        assert json.loads((actual / "elan_state.json").read_text())["data"] == json.loads(
            (expected / "elan_state.json").read_text())["data"]
        weights, reference = load_file(actual / "model.safetensors"), load_file(expected / "model.safetensors")
        for key, value in reference.items():
            assert torch.allclose(weights[key], value, rtol=0, atol=1e-9), (epoch, key)
        state = torch.load(actual / "optimizer.bin", weights_only=False)["state"]
        reference_state = torch.load(expected / "optimizer.bin", weights_only=False)["state"]
        for index, moments in reference_state.items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.allclose(state[index][key], moments[key], rtol=0, atol=1e-9), (epoch, index, key)
